"""Quantized checkpoint formats: which scheme a model uses, and each linear layer's tensors
converted to the layouts of models/quantization.py.

`resolve_quantization` reads `quantization_config` from config.json (and the user's
`quantization=`) into a `QuantScheme`; `QuantizedCheckpoint` wraps a checkpoint so that the
loader sees one `<module>.weight` per quantized linear layer, whose value is a host-side
`Fp8Weight` or `PackedWeight` (flat K x N), built from the format's own tensors with every shape
checked against the model config:

- compressed-tensors FP8 (`format` float-quantized / naive-quantized) and vLLM's `fp8` method:
  `weight` e4m3 [N, K], `weight_scale` per tensor ([] or [1]) or per channel ([N, 1]), optional
  static `input_scale`;
- compressed-tensors pack-quantized W4A16 / W8A16: `weight_packed` int32 [N, K / per] (packed
  along K), `weight_scale` [N, K / group], optional `weight_zero_point` int32 [N / per, K / group]
  (packed along N), `weight_shape` [2], optional `weight_g_idx` [K]; values stored with an offset
  of 2**(bits-1) (unsigned), as are the zero points;
- GPTQ: `qweight` int32 [K / per, N], `qzeros` int32 [G, N / per], `scales` [G, N], `g_idx` [K].
  Checkpoints in the original GPTQ format store each zero point minus one; like vLLM's GPTQ
  kernels, 1 is added back unless `checkpoint_format` is "gptq_v2";
- AWQ: `qweight` int32 [K, N / 8] (packed along N in the order 0, 2, 4, 6, 1, 3, 5, 7), `qzeros`
  the same way [G, N / 8], `scales` [G, N]; 4-bit only.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import re
from typing import Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxengine.config import QUANTIZATION_METHODS
from jaxengine.models import gguf_blocks
from jaxengine.models.config import ModelConfig
from jaxengine.models.quantization import (LINEAR_IN_NDIM, Fp8Weight, PackedWeight, packed_from_groups,
                                           quantize_fp8, unpack_cols, unpack_rows_np)

logger = logging.getLogger(__name__)

# Methods a checkpoint's quantization_config may name, and vLLM's aliases a user may pass.
CHECKPOINT_METHODS = ("compressed-tensors", "fp8", "gptq", "awq")
_ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq"}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # value j of an AWQ word holds column AWQ_ORDER[j] of its 8


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """How the linear weights are quantized."""

    method: str  # "fp8", "compressed-tensors", "gptq", "awq"
    kind: str  # "fp8" (e4m3 weights and activations) or "weight_only" (packed integers)
    from_checkpoint: bool  # False: fp8 computed at load time from a float checkpoint
    bits: int = 8
    group_size: int = -1  # -1: one group over the whole input (per channel)
    symmetric: bool = True
    act_order: bool = False  # input rows permuted by g_idx (the model is built with split projections)
    zero_plus_one: bool = False  # GPTQ v1: stored zero points are one less than the true ones
    static_input: bool = False  # fp8: activations use the checkpoint's input_scale
    # fp8: the checkpoint's weight scales are per block of (outputs, inputs) (fp8's
    # `weight_block_size`, compressed-tensors' `block_structure`); converted to one scale per
    # output channel at load time
    block: tuple[int, int] | None = None

    @property
    def fields_key(self) -> str:
        """Which of _FIELDS names this scheme's tensors of one linear layer."""
        if self.kind != "fp8":
            return self.method
        if self.block is None:
            return "fp8"
        return "fp8-block" if self.method == "fp8" else "compressed-tensors-block"

    @property
    def label(self) -> str:
        if self.kind == "fp8":
            if self.block is not None:
                return f"{self.method} fp8, {self.block[0]}x{self.block[1]} blocks (requantized per channel)"
            return f"{self.method} fp8" + ("" if self.from_checkpoint else " (quantized at load time)")
        if self.method == "gguf":
            return "gguf weight-only, each linear in its file's type" if self.from_checkpoint else \
                "gguf weight-only, dummy weights in Q4_K's form (4-bit, groups of 32, float minimums)"
        return f"{self.method} {self.bits}-bit weight-only, group {self.group_size}"


def resolve_quantization(requested: str | None, hf_config: Mapping | None, *, dummy: bool = False,
                         gguf: bool = False) -> QuantScheme | None:
    """The scheme from config.json's quantization_config and the user's `quantization` (vLLM's
    names); ValueError when they disagree or the method is not supported. `dummy`
    (load_format="dummy"): a weight-only method with no quantization_config gives random 4-bit
    weights in groups of 128 ("gguf": Q4_K's form). `gguf`: the checkpoint is a GGUF file, where
    "gguf" keeps the linear weights of the types models/gguf_blocks.py takes quantized (each
    in its own type's form) and every other tensor loads dequantized."""
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization {requested!r} is not supported; supported: {', '.join(QUANTIZATION_METHODS)}")
    if gguf and requested == "gguf" and not dummy:
        return QuantScheme("gguf", "weight_only", True, 8, 32)
    if requested == "gguf" and not dummy:
        raise ValueError("quantization='gguf' needs a .gguf checkpoint")
    if requested == "gguf":
        return QuantScheme("gguf", "weight_only", False, 4, 32)
    qc = (hf_config or {}).get("quantization_config")
    if not qc:
        if requested is None:
            return None
        if dummy and requested != "fp8":
            return QuantScheme(_ALIASES.get(requested, requested), "weight_only", False, 4, 128)
        if requested != "fp8":
            raise ValueError(f"quantization={requested!r} needs a checkpoint quantized with it (config.json has no "
                             "quantization_config); only 'fp8' quantizes a float checkpoint at load time")
        return QuantScheme("fp8", "fp8", from_checkpoint=False)
    method = str(qc.get("quant_method", "")).lower()
    if method not in CHECKPOINT_METHODS:
        raise ValueError(f"checkpoint quantization method {method!r} is not supported; supported: "
                         f"{', '.join(CHECKPOINT_METHODS)}")
    wanted = _ALIASES.get(requested, requested)
    if wanted is not None and wanted != method:
        raise ValueError(f"quantization={requested!r} but the checkpoint is quantized with {method!r}")
    if method == "gptq":
        return _gptq_scheme(qc)
    if method == "awq":
        return _awq_scheme(qc)
    if method == "fp8":
        static = qc.get("activation_scheme", "dynamic") == "static"
        block = qc.get("weight_block_size")
        if not block:
            return QuantScheme("fp8", "fp8", True, static_input=static)
        if static:
            raise ValueError("fp8 checkpoints with block-wise weight scales and static activation scales are not "
                             "supported (activation_scheme must be 'dynamic')")
        return QuantScheme("fp8", "fp8", True, block=_block(block, "fp8: weight_block_size"))
    return _compressed_tensors_scheme(qc)


def _block(value, what: str) -> tuple[int, int]:
    """A weight-scale block (outputs, inputs) from a checkpoint's config; ValueError naming `what`."""
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(b, int) and b > 0 for b in value)):
        raise ValueError(f"{what} must be two positive integers, got {value!r}")
    return int(value[0]), int(value[1])


def _compressed_tensors_scheme(qc: Mapping) -> QuantScheme | None:
    """None for a checkpoint that quantizes its KV cache only (a `kv_cache_scheme`, no weight
    group): its linears are plain, its KV scales read by models/kv_scales.py."""
    if not any(g.get("weights") for g in (qc.get("config_groups") or {}).values()) and qc.get("kv_cache_scheme"):
        return None
    return _compressed_tensors_weight_scheme(qc)


def _group(value, what: str) -> int:
    g = int(value if value is not None else -1)
    if g != -1 and g <= 0:
        raise ValueError(f"{what}: group_size must be positive or -1, got {g}")
    return g


def _gptq_scheme(qc: Mapping) -> QuantScheme:
    bits = int(qc.get("bits", 4))
    if bits not in (4, 8):
        raise ValueError(f"gptq: {bits}-bit weights are not supported; supported: 4, 8")
    fmt = qc.get("checkpoint_format", "gptq")
    return QuantScheme("gptq", "weight_only", True, bits, _group(qc.get("group_size", 128), "gptq"),
                       bool(qc.get("sym", True)), bool(qc.get("desc_act", False)), zero_plus_one=fmt != "gptq_v2")


def _awq_scheme(qc: Mapping) -> QuantScheme:
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if bits != 4:
        raise ValueError(f"awq: {bits}-bit weights are not supported; supported: 4")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"awq: version {version!r} is not supported; supported: gemm")
    return QuantScheme("awq", "weight_only", True, 4, _group(qc.get("group_size", qc.get("q_group_size", 128)), "awq"),
                       not bool(qc.get("zero_point", True)))


def _compressed_tensors_weight_scheme(qc: Mapping) -> QuantScheme:
    groups = [g for g in (qc.get("config_groups") or {}).values() if g.get("weights")]
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors: exactly one config group with weights is supported, found {len(groups)}")
    wq, aq = groups[0]["weights"], groups[0].get("input_activations")
    fmt = qc.get("format", "")
    bits, kind, strategy = int(wq.get("num_bits", 8)), wq.get("type", "int"), wq.get("strategy", "tensor")
    if kind == "float":
        if bits != 8 or strategy not in ("tensor", "channel", "block"):
            raise ValueError(f"compressed-tensors: float weights of {bits} bits with strategy {strategy!r} are not "
                             "supported; supported: 8-bit (e4m3) per tensor, per channel or per block")
        if aq and (aq.get("type", "float") != "float" or int(aq.get("num_bits", 8)) != 8):
            raise ValueError("compressed-tensors fp8: activations must be 8-bit floats")
        if strategy == "block":  # FP8_BLOCK: dynamic activations, one weight_scale a block
            if aq and not aq.get("dynamic", True):
                raise ValueError("compressed-tensors fp8 with block-wise weight scales needs dynamic activation scales")
            return QuantScheme("compressed-tensors", "fp8", True,
                               block=_block(wq.get("block_structure"), "compressed-tensors fp8: block_structure"))
        return QuantScheme("compressed-tensors", "fp8", True, static_input=bool(aq) and not aq.get("dynamic", True))
    if fmt != "pack-quantized" or aq:
        raise ValueError(f"compressed-tensors: format {fmt!r} with {'quantized' if aq else 'float'} activations is "
                         "not supported; supported: float-quantized fp8, pack-quantized weight-only (W4A16, W8A16)")
    if bits not in (4, 8) or strategy not in ("group", "channel"):
        raise ValueError(f"compressed-tensors: {bits}-bit {strategy!r} weights are not supported; supported: "
                         "4 or 8 bits per group or per channel")
    group = _group(wq.get("group_size") if strategy == "group" else -1, "compressed-tensors")
    return QuantScheme("compressed-tensors", "weight_only", True, bits, group, bool(wq.get("symmetric", True)),
                       act_order=wq.get("actorder") not in (None, False, "static"))


def check_model(scheme: QuantScheme, architecture: str, tensor_parallel_size: int) -> None:
    """Quantized linears run in the Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) on one device."""
    from jaxengine.models import llama
    from jaxengine.models.registry import get_family

    if get_family(architecture).model is not llama.ForCausalLM:
        raise ValueError(f"quantization ({scheme.label}) is supported for Llama, Mistral, Qwen2 and Qwen3 models, "
                         f"not {architecture}")
    if tensor_parallel_size > 1:
        raise ValueError(f"quantization ({scheme.label}) runs on one device; tensor_parallel_size="
                         f"{tensor_parallel_size} is not supported with it yet")


# -- the checkpoint view ------------------------------------------------------------------------
_MODULE = re.compile(r"^(.*\.(?:self_attn|mlp)\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj))\.(\w+)$")
_GGUF_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def gguf_kept_linears(ckpt) -> tuple[set[str], bool]:
    """The linear weights of a GGUF file that quantization='gguf' keeps quantized (every linear
    stored in a type models/gguf_blocks.py takes), and whether the model must hold q/k/v and
    gate/up as separate projections: where the parts of one fused projection are stored in
    different forms (Q4_K_M files keep some v_proj in Q6_K beside Q4_K q/k), one fused weight
    cannot hold them."""
    names = {n for n in ckpt.tensor_names() if _MODULE.match(n) and n.endswith(".weight")}
    forms = {n: gguf_blocks.form(ckpt.gguf_type(n)) for n in names}
    split = False
    for n in names:
        module = n.rsplit(".", 2)[-2]
        for group in _GGUF_FUSED:
            if module in group:
                siblings = {n.replace(f".{module}.", f".{m}.") for m in group} & names
                split |= len({forms[s] for s in siblings}) > 1
    return {n for n, f in forms.items() if f is not None}, split


# Each format's tensors of one linear layer (the first marks a quantized layer), by "fp8" or method.
_FIELDS = {
    "fp8": ("weight_scale", "weight", "input_scale"),
    "fp8-block": ("weight_scale_inv", "weight"),  # vLLM's fp8 form
    "compressed-tensors-block": ("weight_scale", "weight"),  # compressed-tensors' FP8_BLOCK
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
}


@functools.partial(jax.jit, static_argnames=("bn", "bk"))
def requantize_blocks(w: jax.Array, s: jax.Array, bn: int, bk: int) -> tuple[jax.Array, jax.Array]:
    """A block-scaled e4m3 weight w [N, K] (s [cdiv(N, bn), cdiv(K, bk)]: the weight is w times its
    block's s) as e4m3 values [N, K] with one float32 scale per row [N]: dequantized exactly in
    float32, the row's largest magnitude mapped to e4m3's 448 (an all-zero row gets scale 1)."""
    top = float(jnp.finfo(jnp.float8_e4m3fn).max)
    n, k = w.shape
    full = jnp.repeat(jnp.repeat(s, bn, axis=0), bk, axis=1)[:n, :k]
    wf = w.astype(jnp.float32) * full
    amax = jnp.max(jnp.abs(wf), axis=1)
    scale = jnp.where(amax > 0, amax / top, 1.0).astype(jnp.float32)
    return jnp.clip(wf / scale[:, None], -top, top).astype(jnp.float8_e4m3fn), scale


def linear_out_in(module: str, cfg: ModelConfig) -> tuple[int, int]:
    """(outputs, inputs) of a Llama-family linear layer in the checkpoint."""
    h, d, f = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    kv = cfg.checkpoint_kv_heads * h
    return {"q_proj": (cfg.num_heads * h, d), "k_proj": (kv, d), "v_proj": (kv, d), "o_proj": (d, cfg.num_heads * h),
            "gate_proj": (f, d), "up_proj": (f, d), "down_proj": (d, f)}[module]


class QuantizedCheckpoint:
    """A checkpoint seen with each quantized linear as one `<module>.weight` tensor whose value is
    a host-side quantized weight; every other tensor passes through."""

    def __init__(self, ckpt, scheme: QuantScheme, cfg: ModelConfig):
        self._ckpt, self.scheme, self.cfg = ckpt, scheme, cfg
        self.path = getattr(ckpt, "path", "?")
        self.hf_config = ckpt.hf_config
        names = ckpt.tensor_names()
        present = set(names)
        self._quantized: dict[str, str] = {}  # "<module>.weight" -> module prefix
        if scheme.method == "gguf":
            self._quantized = {n: n[: -len(".weight")] for n in sorted(gguf_kept_linears(ckpt)[0])}
            self._names = names
            return
        fields = _FIELDS[scheme.fields_key]
        marker = fields[0]
        hidden: set[str] = set()
        for name in names:
            m = _MODULE.match(name)
            if m and m.group(3) == marker:
                self._quantized[m.group(1) + ".weight"] = m.group(1)
                hidden |= {f"{m.group(1)}.{f}" for f in fields} & present
                bias = m.group(1) + ".bias"
                if bias in present and not np.any(np.asarray(ckpt.get_tensor(bias))):
                    hidden.add(bias)  # GPTQ exporters store zero biases for layers that have none
        self._names = [n for n in names if n not in hidden] + list(self._quantized)
        if not self._quantized:
            raise ValueError(f"checkpoint {self.path} says {scheme.label} but holds no quantized linear layers "
                             f"(no tensor named '*_proj.{marker}')")

    def tensor_names(self) -> list[str]:
        return list(self._names)

    def get_tensor(self, name: str):
        prefix = self._quantized.get(name)
        if prefix is None:
            return self._ckpt.get_tensor(name)
        out, inp = linear_out_in(prefix.rsplit(".", 1)[1], self.cfg)
        if self.scheme.kind == "fp8":
            return self._fp8(prefix, out, inp)
        return {"compressed-tensors": self._ct_packed, "gptq": self._gptq, "awq": self._awq,
                "gguf": self._gguf}[self.scheme.method](prefix, out, inp)

    # each reader returns a host weight with flat shape (inputs, outputs)
    def _read(self, name: str, shapes: list[tuple[int, ...]], dtypes: tuple[np.dtype, ...] | None = None,
              optional: bool = False) -> np.ndarray | None:
        """One tensor of a quantized layer, its shape one of `shapes`; ValueError naming the
        scheme, the tensor, what was expected and what was found."""
        if name not in self._ckpt:
            if optional:
                return None
            raise ValueError(f"{self.scheme.label}: tensor {name} is missing (expected shape {shapes[0]})")
        found = tuple(self._ckpt.tensor_shape(name))
        if found not in shapes:
            want = " or ".join(str(s) for s in shapes)
            raise ValueError(f"{self.scheme.label}: tensor {name} has shape {found}, expected {want}")
        arr = np.asarray(self._ckpt.get_tensor(name))
        if dtypes is not None and arr.dtype not in dtypes:
            raise ValueError(f"{self.scheme.label}: tensor {name} has dtype {arr.dtype}, expected "
                             f"{' or '.join(str(d) for d in dtypes)}")
        return arr

    def _groups(self, inp: int, prefix: str) -> tuple[int, int]:
        group = inp if self.scheme.group_size == -1 else self.scheme.group_size
        if inp % group:
            raise ValueError(f"{self.scheme.label}: {prefix} has {inp} inputs, not a multiple of the group size {group}")
        return group, inp // group

    def _per(self, n: int, what: str) -> int:
        per = 32 // self.scheme.bits
        if n % per:
            raise ValueError(f"{self.scheme.label}: {what} has {n} features, not a multiple of {per} (values per int32)")
        return n // per

    def _fp8(self, prefix: str, out: int, inp: int) -> Fp8Weight:
        if self.scheme.block is not None:
            return self._fp8_blocks(prefix, out, inp)
        w = self._read(prefix + ".weight", [(out, inp)], (np.dtype(ml_dtypes.float8_e4m3fn),))
        s = self._read(prefix + ".weight_scale", [(), (1,), (out,), (out, 1)]).astype(np.float32)
        xs = self._read(prefix + ".input_scale", [(), (1,)], optional=not self.scheme.static_input)
        scale = np.broadcast_to(s.reshape(-1), (out,)).copy()
        input_scale = np.float32(1.0) if xs is None or not self.scheme.static_input else xs.astype(np.float32).reshape(())
        return Fp8Weight(w, scale, np.asarray(input_scale, np.float32), (inp, out), 1, self.scheme.static_input)

    def _fp8_blocks(self, prefix: str, out: int, inp: int) -> Fp8Weight:
        """A block-scaled e4m3 weight (one `weight_scale_inv` a block of bn x bk) as the engine's
        per-channel form: dequantized exactly in float32, then each output row quantized to e4m3
        again with its own scale (a second e4m3 rounding; the engine's fp8 GEMMs take one scale a
        channel)."""
        bn, bk = self.scheme.block
        w = self._read(prefix + ".weight", [(out, inp)], (np.dtype(ml_dtypes.float8_e4m3fn),))
        scale_name = _FIELDS[self.scheme.fields_key][0]  # weight_scale_inv (fp8) or weight_scale (compressed-tensors)
        s = self._read(f"{prefix}.{scale_name}", [(-(-out // bn), -(-inp // bk))]).astype(np.float32)
        q, scale = requantize_blocks(w, s, bn, bk)  # on the device: numpy would take minutes for 8B weights
        return Fp8Weight(np.asarray(q), np.asarray(scale), np.asarray(1.0, np.float32), (inp, out), 1, False)

    def _ct_packed(self, prefix: str, out: int, inp: int) -> PackedWeight:
        bits = self.scheme.bits
        group, g = self._groups(inp, prefix)
        packed = self._read(prefix + ".weight_packed", [(out, self._per(inp, prefix))], (np.dtype(np.int32),))
        scale = self._read(prefix + ".weight_scale", [(out, g)])
        shape = self._read(prefix + ".weight_shape", [(2,)], optional=True)
        if shape is not None and tuple(int(x) for x in shape) != (out, inp):
            raise ValueError(f"{self.scheme.label}: tensor {prefix}.weight_shape says {tuple(int(x) for x in shape)}, "
                             f"expected {(out, inp)}")
        vals = unpack_cols(packed, bits).T  # [K, N], unsigned (offset 2**(bits-1))
        if self.scheme.symmetric:
            zeros = np.full((g, out), 1 << (bits - 1), np.uint8)
        else:
            zp = self._read(prefix + ".weight_zero_point", [(self._per(out, prefix), g)], (np.dtype(np.int32),))
            zeros = unpack_rows_np(zp, bits).T.copy()  # [G, N], stored with the same offset
        g_idx = self._read(prefix + ".weight_g_idx", [(inp,)], optional=True)
        return self._checked(prefix, packed_from_groups(vals, scale.T.astype(np.float32), zeros, bits, group, g_idx))

    def _gptq(self, prefix: str, out: int, inp: int) -> PackedWeight:
        bits = self.scheme.bits
        group, g = self._groups(inp, prefix)
        qweight = self._read(prefix + ".qweight", [(self._per(inp, prefix), out)], (np.dtype(np.int32),))
        qzeros = self._read(prefix + ".qzeros", [(g, self._per(out, prefix))], (np.dtype(np.int32),))
        scales = self._read(prefix + ".scales", [(g, out)])
        g_idx = self._read(prefix + ".g_idx", [(inp,)], optional=True)
        zeros = unpack_cols(qzeros, bits).astype(np.int32) + int(self.scheme.zero_plus_one)
        if zeros.max() >= 1 << bits:
            raise ValueError(f"{self.scheme.label}: {prefix}.qzeros holds zero points above {(1 << bits) - 1} "
                             "after adding 1 (a gptq_v2 checkpoint? set checkpoint_format)")
        return self._checked(prefix, packed_from_groups(unpack_rows_np(qweight, bits), scales.astype(np.float32),
                                                        zeros.astype(np.uint8), bits, group, g_idx))

    def _checked(self, prefix: str, w: PackedWeight) -> PackedWeight:
        """An act-order g_idx in a checkpoint whose config does not declare act-order (desc_act,
        actorder): the model was built with fused projections that cannot hold it."""
        if w.act_order and not self.scheme.act_order:
            raise ValueError(f"{self.scheme.label}: {prefix} has an act-order g_idx but quantization_config does "
                             "not declare act-order (desc_act / actorder)")
        return w

    def _gguf(self, prefix: str, out: int, inp: int) -> PackedWeight:
        name = prefix + ".weight"
        found = tuple(self._ckpt.tensor_shape(name))
        if found != (out, inp):
            raise ValueError(f"{self.scheme.label}: tensor {name} has shape {found}, expected {(out, inp)}")
        b = self._ckpt.blocks(name)
        return packed_from_groups(b.values.T, b.scales.T.copy(), b.zeros.T.copy(), b.bits, b.group_size,
                                  float_min=b.float_min)

    def _awq(self, prefix: str, out: int, inp: int) -> PackedWeight:
        group, g = self._groups(inp, prefix)
        qweight = self._read(prefix + ".qweight", [(inp, self._per(out, prefix))], (np.dtype(np.int32),))
        qzeros = self._read(prefix + ".qzeros", [(g, self._per(out, prefix))], (np.dtype(np.int32),))
        scales = self._read(prefix + ".scales", [(g, out)])
        vals = unpack_cols(qweight, 4, AWQ_ORDER)
        zeros = unpack_cols(qzeros, 4, AWQ_ORDER) if not self.scheme.symmetric else np.full((g, out), 8, np.uint8)
        return packed_from_groups(vals, scales.astype(np.float32), zeros, 4, group)


# -- load-time quantization and dummy weights ---------------------------------------------------
_quantize_fp8_jit = jax.jit(quantize_fp8, static_argnums=1)


def quantize_on_device(path: tuple, w: jax.Array, scheme: QuantScheme | None):
    """The placed parameter, quantized to fp8 when the scheme quantizes at load time and it is a
    linear weight; anything else is returned as it is."""
    name = str(path[-1])
    if scheme is None or scheme.from_checkpoint or name not in LINEAR_IN_NDIM:
        return w
    return _quantize_fp8_jit(w, LINEAR_IN_NDIM[name])


def dummy_quantized(path: tuple, w: jax.Array, scheme: QuantScheme | None, key: jax.Array):
    """`load_format="dummy"`: a linear weight in the scheme's form; weight-only schemes get random
    packed values (4-bit, groups of 128, or the scheme's size, or the largest of 64 and 32 that
    divides the inputs) with scales that give the float dummy's spread; "gguf" gives Q4_K's form
    (groups of 32, float minimums)."""
    name = str(path[-1])
    if scheme is None or name not in LINEAR_IN_NDIM:
        return w
    in_ndim = LINEAR_IN_NDIM[name]
    if scheme.kind == "fp8":
        return _quantize_fp8_jit(w, in_ndim)
    shape = tuple(w.shape)
    k, n = math.prod(shape[:in_ndim]), math.prod(shape[in_ndim:])
    bits = scheme.bits if scheme.from_checkpoint else 4
    group = next((g for g in (scheme.group_size, 128, 64, 32) if g > 0 and k % g == 0), k)
    return _dummy_packed(k, n, bits, group, shape, in_ndim, jnp.dtype(w.dtype), scheme.method == "gguf", key)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5, 6, 7))
def _dummy_packed(k: int, n: int, bits: int, group: int, shape: tuple, in_ndim: int, dtype, float_min: bool,
                  key) -> PackedWeight:
    packed = jax.lax.bitcast_convert_type(jax.random.bits(key, (k * bits // 32, n), jnp.uint32), jnp.int32)
    levels = (1 << bits) - 1
    scale = 0.04 / levels * 2  # about the float dummy's 0.02 spread
    scales = jnp.full((k // group, n), scale, dtype)
    zeros = jnp.full((k // group, n), scale * (1 << (bits - 1)), dtype) if float_min else \
        jnp.full((k // group, n), 1 << (bits - 1), jnp.uint8)
    return PackedWeight(packed, scales, zeros, jnp.arange(k, dtype=jnp.int32), shape, in_ndim, bits, group, False,
                        float_min)
