"""Quantized linear weights: the device-side pytrees, their matmuls, and host-side packing.

A linear parameter of the model (attention q/k/v/o, MLP gate/up/down) is either a plain array in
the model's layout, or one of the two pytrees below, stored under the same `nnx.Param` so the
model's structure does not change:

- `Fp8Weight`: float8_e4m3fn weights `[N, K]` (output-major, the layout the FP8 GEMM wants) with a
  float32 scale per output channel; activations are quantized per token (or with a static scale
  from the checkpoint) and the matmul is an e4m3 x e4m3 `dot_general` accumulating in float32;
  on GPU, calls of a decode step's few rows keep bf16 activations and meet the weight converted
  inside the graph (or the fp8-weight kernel, pallas_kernels/fp8_matmul_gpu.py), and a gated
  MLP's activation is quantized by the kernel that computes it (pallas_kernels/act_quant_gpu.py,
  `gated_mlp_fp8`).
- `PackedWeight`: weight-only 4- or 8-bit integers packed into int32 along the input axis
  (`[K / (32 / bits), N]`, value j of word i is input row i * (32 / bits) + j, lowest bits first),
  per-group scales and zeros `[K / group, N]`: unsigned integer zero points, weight = (value -
  zero) * scale, or (`float_min`, GGUF's Q4_1 and K-quants) float minimums in the scales' dtype,
  weight = value * scale - zero; dequantized inside the compiled step
  by `weight_only_matmul` (the reference, kept beside the kernel in
  pallas_kernels/weight_only_matmul_gpu.py), or on GPU by the Pallas kernel with the same
  signature (`weight_only_linear` picks per call site).

Every checkpoint format (models/quant_formats.py) is converted to these layouts at load time, so
the forward has one path per kind. K is the flattened input features, N the flattened outputs:
the parameter's model shape (`shape`) is `shape[:in_ndim]` inputs then outputs (o_proj: [N, H] in,
[D] out), and a fused q/k/v or gate/up weight is the concatenation of its parts along N.

Legend: T tokens, K input features, N output features, G groups.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.pallas_kernels import act_quant_gpu as act_quant_kernel
from jaxengine.pallas_kernels import fp8_matmul_gpu as fp8_kernel
from jaxengine.pallas_kernels import weight_only_matmul_gpu as kernel
from jaxengine.pallas_kernels.weight_only_matmul_gpu import dequantize_packed, unpack_rows  # noqa: F401
# the reference path: unpack, dequantize in float32, float matmul (it lives beside the kernel)
from jaxengine.pallas_kernels.weight_only_matmul_gpu import weight_only_matmul_reference as weight_only_matmul

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8 = jnp.float8_e4m3fn

# Linear parameters (by name) and how many leading axes of their model shape are inputs.
LINEAR_IN_NDIM: dict[str, int] = {
    "q_proj": 1, "k_proj": 1, "v_proj": 1, "qkv_proj": 1, "o_proj": 2,
    "gate_proj": 1, "up_proj": 1, "gate_up_proj": 1, "down_proj": 1,
}


def _static(default=dataclasses.MISSING):
    return dataclasses.field(default=default, metadata=dict(static=True))


class _QuantizedBase:
    """What the model's call sites see: a `shape` like the plain parameter's, and `matmul`."""

    shape: tuple[int, ...]
    in_ndim: int

    def __getitem__(self, index):
        # `param[...]` on an nnx.Param holding this pytree returns the pytree itself.
        if index is not Ellipsis:
            raise TypeError(f"{type(self).__name__} supports only [...] indexing")
        return self

    @property
    def in_features(self) -> int:
        return math.prod(self.shape[:self.in_ndim])

    @property
    def out_features(self) -> int:
        return math.prod(self.shape[self.in_ndim:])

    def matmul(self, x: jax.Array) -> jax.Array:
        raise NotImplementedError


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Weight(_QuantizedBase):
    qweight: jax.Array  # [N, K] float8_e4m3fn
    scale: jax.Array  # [N] float32: weight = qweight * scale
    input_scale: jax.Array  # [] float32: the checkpoint's static activation scale (1.0 when dynamic)
    shape: tuple[int, ...] = _static()  # the plain parameter's model shape
    in_ndim: int = _static(1)
    static_input: bool = _static(False)  # True: activations use input_scale, else per-token absmax

    def matmul(self, x: jax.Array) -> jax.Array:
        """x [T, K] -> [T, N] in x's dtype."""
        return fp8_matmul(x, self.qweight, self.scale, self.input_scale if self.static_input else None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight(_QuantizedBase):
    packed: jax.Array  # [K / (32 / bits), N] int32
    scales: jax.Array  # [G, N] in the activations' dtype
    zeros: jax.Array  # [G, N] uint8 zero points: weight = (value - zero) * scale; float_min: see below
    perm: jax.Array  # [K] int32: input rows sorted by group (act-order); arange(K) otherwise
    shape: tuple[int, ...] = _static()
    in_ndim: int = _static(1)
    bits: int = _static(4)
    group_size: int = _static(128)
    act_order: bool = _static(False)  # True: x's columns are gathered by `perm` first
    float_min: bool = _static(False)  # True: zeros are float minimums, weight = value * scale - zero

    def matmul(self, x: jax.Array) -> jax.Array:
        """x [T, K] -> [T, N] in x's dtype."""
        if self.act_order:
            x = jnp.take(x, self.perm, axis=1)
        return weight_only_linear(x, self.packed, self.scales, self.zeros, self.bits, self.group_size,
                                  self.float_min)


QuantizedWeight = Fp8Weight | PackedWeight


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedRows:
    """A linear's input already quantized per row to e4m3 (`rmsnorm_fp8_rows`), for the W8A8
    GEMMs of dynamic-scale fp8 weights: what `fp8_quantize_rows` would have made of it."""

    q: jax.Array  # [T, K] float8_e4m3fn
    scale: jax.Array  # [T, 1] float32: x = q * scale
    dtype: jnp.dtype = _static()  # the activations' own dtype (the GEMMs' outputs)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape


def is_quantized(w: object) -> bool:
    return isinstance(w, _QuantizedBase)


# -- the forward's entry points -----------------------------------------------------------------
def qeinsum(spec: str, x: jax.Array | QuantizedRows, w: jax.Array | QuantizedWeight) -> jax.Array:
    """`jnp.einsum(spec, x, w)` for a plain weight; for a quantized one, the same contraction
    (x [T, K...] against the weight's input axes) through its matmul, reshaped to [T, outputs];
    x already quantized (QuantizedRows, [T, K]) goes straight into the W8A8 GEMM."""
    t = x.shape[0]
    if isinstance(x, QuantizedRows):  # only for dynamic-scale fp8 weights (fp8_rows_apply)
        y = fp8_gemm(x.q, x.scale, w.qweight, w.scale, x.dtype)
        return y.reshape((t,) + tuple(w.shape[w.in_ndim:]))
    if not is_quantized(w):
        return jnp.einsum(spec, x, w)
    y = w.matmul(x.reshape(t, w.in_features))
    return y.reshape((t,) + tuple(w.shape[w.in_ndim:]))


# Rows up to which fp8 weights meet the activations unquantized on GPU (W8A16: the weight converted
# to x's dtype on its way into the dot); above, the activations are quantized too and XLA's FP8
# GEMM runs (W8A8). On the H100 at 16 rows W8A16 took Llama-3-8B's four linears in 202 us against
# 255 for W8A8; at 64 rows it lost up to 2.3x (benchmarks/results/quant_h100.md).
FP8_KERNEL_MAX_ROWS = 16
# How those calls run: "xla", the e4m3 weight converted inside the graph, where XLA fuses the
# convert into a Triton GEMM it tiles and autotunes itself (`xla_options.program_options` keeps
# Triton GEMMs on for such programs); "kernel", the fp8-weight Pallas kernel
# (pallas_kernels/fp8_matmul_gpu.py). In the engine's batch-1 decode step of the Llama-3-8B shape
# on the H100 the linears took 3.26 ms of device time with "xla" against 3.73 with "kernel"
# (benchmarks/results/quant_h100.md).
FP8_DECODE = "xla"


def _w8a16_call(rows: int) -> bool:
    """Whether an fp8 weight meets a call of `rows` rows unquantized (W8A16; GPU decode calls)."""
    return jax.default_backend() == "gpu" and rows <= FP8_KERNEL_MAX_ROWS


def _dynamic_fp8(w: object) -> bool:
    """Whether `w` is an fp8 weight whose activations take per-row scales (no static input scale)."""
    return isinstance(w, Fp8Weight) and not w.static_input


def fp8_matmul(x: jax.Array, qweight: jax.Array, scale: jax.Array, input_scale: jax.Array | None) -> jax.Array:
    """x [T, K] (any float) @ dequant(qweight [N, K] e4m3, scale [N]).T -> [T, N] in x's dtype:
    on GPU, for at most FP8_KERNEL_MAX_ROWS rows, the weight converted to x's dtype (the
    activations stay in theirs) by XLA's fused convert or the fp8-weight kernel (FP8_DECODE), else
    `fp8_matmul_w8a8`."""
    if _w8a16_call(x.shape[0]):
        if FP8_DECODE == "xla":
            y = jax.lax.dot_general(x, qweight.astype(x.dtype), (((1,), (1,)), ((), ())),
                                    precision=jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None,
                                    preferred_element_type=jnp.float32)
            return (y * scale[None, :].astype(jnp.float32)).astype(x.dtype)
        if fp8_kernel.supported(x.shape[0], x.shape[1], qweight.shape[0]):
            # narrow outputs (o_proj, down_proj): 8 warps measured 7-15% faster at 16 rows
            return fp8_kernel.fp8_weight_matmul(x, qweight, scale, num_warps=8 if qweight.shape[0] <= 4096 else 4)
    return fp8_matmul_w8a8(x, qweight, scale, input_scale)


# The type the W8A8 GEMM writes on GPU before the two scales are applied: "input", x's own type
# when it is 16-bit (cuBLASLt accumulates in float32 and rounds once on the way out), or
# "float32". A per-row activation scale and a per-channel weight scale cannot ride in cuBLASLt's
# scalar scales, so the [T, N] product is written, then read by the fusion that scales it: in
# float32 that pass doubles the traffic of the product (at 2,048 tokens the Llama-3-8B shape's
# gate/up product is 235 MB a layer).
FP8_GEMM_OUT = "input"
# Whether x is written once before its dynamic per-row scale is taken (GPU only): the row maximum
# and the e4m3 convert are two passes over x, and without a barrier XLA fuses x's producer into
# both, so a producer that reads more than it writes (the MLP's activation, reading the
# [T, 2 x intermediate] gate/up product to make [T, intermediate]) runs twice.
FP8_MATERIALIZE_INPUT = True


def fp8_matmul_w8a8(x: jax.Array, qweight: jax.Array, scale: jax.Array, input_scale: jax.Array | None) -> jax.Array:
    """x [T, K] (any float) @ dequant(qweight [N, K] e4m3, scale [N]).T -> [T, N] in x's dtype.

    Activations are quantized to e4m3 per row (absmax / 448), or with the static `input_scale`
    (`fp8_quantize_rows`), then meet the weight in `fp8_gemm`.
    """
    xq, xs = fp8_quantize_rows(x, input_scale)
    return fp8_gemm(xq, xs, qweight, scale, x.dtype)


def fp8_quantize_rows(x: jax.Array, input_scale: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """x [T, K] -> (e4m3 [T, K], float32 scale [T, 1] or [1, 1]): per-row absmax / 448, or the
    static `input_scale`."""
    if input_scale is None and FP8_MATERIALIZE_INPUT and jax.default_backend() == "gpu":
        x = jax.lax.optimization_barrier(x)
    xf = x.astype(jnp.float32)
    if input_scale is None:
        xs = jnp.maximum(jnp.max(jnp.abs(xf), axis=1, keepdims=True) / FP8_MAX, 1e-12)  # [T, 1]
    else:
        xs = jnp.broadcast_to(input_scale.astype(jnp.float32), (1, 1))
    return jnp.clip(xf / xs, -FP8_MAX, FP8_MAX).astype(FP8), xs


def fp8_gemm(xq: jax.Array, xs: jax.Array, qweight: jax.Array, scale: jax.Array, out_dtype: jnp.dtype) -> jax.Array:
    """e4m3 xq [T, K] with row scales xs [T, 1] (or [1, 1]) @ (qweight [N, K] * scale [N]).T ->
    [T, N] in out_dtype. The product accumulates in float32 (on Hopper XLA emits cuBLASLt's FP8
    GEMM; on CPU it converts the operands and runs a float32 dot), is written in float32 or, on
    GPU, in a 16-bit out_dtype (FP8_GEMM_OUT), then both scales are applied in float32."""
    y = jax.lax.dot_general(xq, qweight, (((1,), (1,)), ((), ())), preferred_element_type=_gemm_out(out_dtype))
    return (y.astype(jnp.float32) * xs * scale[None, :]).astype(out_dtype)


def _gemm_out(dtype: jnp.dtype) -> jnp.dtype:
    """The type an FP8 GEMM writes for activations of `dtype` (FP8_GEMM_OUT)."""
    narrow = FP8_GEMM_OUT == "input" and jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16,
                                                                                                 jnp.float16)
    return dtype if narrow else jnp.float32


# Whether a decoder layer's RMSNorm and the e4m3 quantization of its output run as one step
# (`rmsnorm_fp8_rows`) where every linear reading the norm's output is W8A8 with dynamic scales:
# the norm's mean square and the absmax of the normed row are taken in one pass over the residual
# row, and the row is read once more to write e4m3, instead of the norm's output being written in
# 16 bits, read for its maximum and read again to convert. On by default since its A/B on one
# H100 (Llama-3-8B shape, 256/256 x 1000): the 2048-token steps' small fusions 8.13 -> 7.54 ms,
# 17,196 -> 17,296 output tok/s (benchmarks/results/quant_h100.md).
FP8_FUSED_NORM_QUANT = True


def fp8_rows_apply(t: int, weights: list) -> bool:
    """Whether a norm's output for `t` rows may reach `weights` (the linears reading it) as
    QuantizedRows: FP8_FUSED_NORM_QUANT, each weight dynamic-scale fp8, and not a call that fp8
    serves as W8A16 (at most FP8_KERNEL_MAX_ROWS rows on GPU)."""
    return FP8_FUSED_NORM_QUANT and bool(weights) and all(map(_dynamic_fp8, weights)) and not _w8a16_call(t)


def rmsnorm_fp8_rows(h: jax.Array, weight: jax.Array, eps: float) -> QuantizedRows:
    """RMSNorm(h) (weight [D], `eps`) quantized per row to e4m3 with absmax / 448 scales, in
    float32 from h [T, D] (the 16-bit rounding of the normed row that the unfused path makes is
    skipped): both row reductions read h once, the quantized row a second time."""
    if jax.default_backend() == "gpu":
        h = jax.lax.optimization_barrier(h)  # the residual row written once, not recomputed per read
    hf, wf = h.astype(jnp.float32), weight.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(hf * hf, axis=1, keepdims=True) + eps)
    amax = jnp.max(jnp.abs(hf * wf), axis=1, keepdims=True)
    xs = jnp.maximum(amax * r / FP8_MAX, 1e-12)  # [T, 1]
    return QuantizedRows(jnp.clip(hf * wf * (r / xs), -FP8_MAX, FP8_MAX).astype(FP8), xs, h.dtype)


# Whether, on GPU, the gated MLP's SiLU, its product with up and the e4m3 quantization of the
# result run as one Pallas kernel (pallas_kernels/act_quant_gpu.py) where the down projection is
# W8A8 with dynamic activation scales; otherwise XLA makes three passes over the activation.
FP8_FUSED_ACT_QUANT = True
# Which form of that kernel runs: one pass holding each row in registers (False), or two passes
# over the row one tile at a time (True: fewer registers a program, so more programs an SM; the
# same outputs). On the H100 the two-pass form lost in the engine (16,371 against 16,976 output
# tok/s, benchmarks/results/quant_h100.md).
ACT_QUANT_TWO_PASS = False


def gated_mlp_fp8(x: jax.Array | QuantizedRows, gate_up: object, down: object, act_name: str) -> jax.Array | None:
    """down(silu(gate(x)) * up(x)) with the fused gate/up weight [2F, D] and the down weight
    through the fused activation kernel: x quantized per row, the gate/up FP8 GEMM's unscaled
    product handed to the kernel with both scales, its e4m3 output and row scales into the down
    GEMM. None where that path does not apply (not a GPU, another activation, weights that are
    not dynamic-scale fp8, a decode call of at most FP8_KERNEL_MAX_ROWS rows, a shape the kernel
    does not take): the caller then computes the MLP unfused."""
    t = x.shape[0]
    if not (FP8_FUSED_ACT_QUANT and jax.default_backend() == "gpu" and act_name in ("silu", "swish")
            and not _w8a16_call(t) and _dynamic_fp8(gate_up) and _dynamic_fp8(down)):
        return None
    f2 = gate_up.qweight.shape[0]
    if down.qweight.shape[1] * 2 != f2 or not act_quant_kernel.supported(t, f2 // 2):
        return None
    xq, xs = (x.q, x.scale) if isinstance(x, QuantizedRows) else fp8_quantize_rows(x, None)
    y = jax.lax.dot_general(xq, gate_up.qweight, (((1,), (1,)), ((), ())), preferred_element_type=_gemm_out(x.dtype))
    hq, hs = act_quant_kernel.silu_mul_quant(y, xs[:, 0], gate_up.scale, two_pass=ACT_QUANT_TWO_PASS)
    return fp8_gemm(hq, hs[:, None], down.qweight, down.scale, x.dtype)


# Rows up to which the weight-only kernel runs; above, the weight is dequantized in the graph and
# meets x in a plain dot. On the H100 the kernel beat that path about 3x at 16 rows and lost to
# it about 2.8x at 256 (benchmarks/results/quant_h100.md).
KERNEL_MAX_ROWS = 64
# Whether the kernel meets x in one dot per value position of the packed words (`slabs`) rather
# than one dot over the block's reshaped values; it then reads 128-row blocks for groups of 16-64
# rows too. On the H100: 5-25% faster on most linear shapes, the same batch-1 decode. (The kernel's
# `post_scale` form was no faster than the default and is not used: weight_only_h100.md.)
SLABS = True
# Whether calls of at most SWAPPED_MAX_ROWS rows with 4-bit values in groups of 128 (integer zero
# points, bf16 x) run the kernel's swapped form (`weight_only_matmul_swapped`: the weight as the
# dot's first operand, values converted a pair per lop3). On the H100 it beat the slab form on
# every Llama-3-8B linear at 16, 32 and 64 rows (benchmarks/results/weight_only_h100.md).
SWAPPED = True
SWAPPED_MAX_ROWS = 64


def weight_only_linear(x: jax.Array, packed: jax.Array, scales: jax.Array, zeros: jax.Array,
                       bits: int, group_size: int, float_min: bool = False) -> jax.Array:
    """One call site's weight-only matmul: on GPU the Pallas kernel
    (pallas_kernels/weight_only_matmul_gpu.py) for calls of at most KERNEL_MAX_ROWS rows where it
    takes the shape (groups of 16-64 rows or multiples of 128, N a multiple of 128), in its
    swapped form where `SWAPPED` and that form takes the call; else `weight_only_matmul`."""
    t, k, n = x.shape[0], x.shape[1], packed.shape[1]
    gpu = jax.default_backend() == "gpu"
    if gpu and SWAPPED and t <= SWAPPED_MAX_ROWS and kernel.swapped_supported(t, k, n, bits, group_size, x.dtype,
                                                                              float_min):
        return kernel.weight_only_matmul_swapped(x, packed, scales, zeros)
    if gpu and t <= KERNEL_MAX_ROWS and kernel.supported(t, k, n, bits, group_size):
        return kernel.weight_only_matmul(x, packed, scales, zeros, bits=bits, group_size=group_size,
                                         float_min=float_min, slabs=SLABS)
    return weight_only_matmul(x, packed, scales, zeros, bits, group_size, float_min)


# -- building weights ---------------------------------------------------------------------------
def quantize_fp8(w: jax.Array | np.ndarray, in_ndim: int) -> Fp8Weight:
    """A plain weight in the model's layout (inputs first) -> Fp8Weight with per-output-channel
    scales (absmax / 448). Runs on device for jax arrays, on the host for numpy arrays."""
    xp = np if isinstance(w, np.ndarray) else jnp
    shape = tuple(w.shape)
    k = math.prod(shape[:in_ndim])
    w2 = xp.asarray(w, dtype=xp.float32).reshape(k, -1).T  # [N, K]
    scale = xp.maximum(xp.max(xp.abs(w2), axis=1) / FP8_MAX, 1e-12)
    q = xp.clip(w2 / scale[:, None], -FP8_MAX, FP8_MAX).astype(FP8)
    return Fp8Weight(q, scale.astype(xp.float32), xp.ones((), xp.float32), shape, in_ndim, False)


def with_model_shape(w: QuantizedWeight, name: str, shape: tuple[int, ...], dtype: jnp.dtype) -> QuantizedWeight:
    """A host-side quantized weight (K and N flat) given the parameter's model shape; ValueError
    when the sizes disagree. Scales of packed weights take the activations' dtype."""
    in_ndim = LINEAR_IN_NDIM[name]
    k, n = math.prod(shape[:in_ndim]), math.prod(shape[in_ndim:])
    if (w.in_features, w.out_features) != (k, n):
        raise ValueError(f"quantized {name}: {w.out_features} outputs x {w.in_features} inputs do not fit "
                         f"parameter {tuple(shape)}")
    if isinstance(w, PackedWeight):
        zeros = np.asarray(w.zeros).astype(dtype) if w.float_min else w.zeros
        w = dataclasses.replace(w, scales=np.asarray(w.scales).astype(dtype), zeros=zeros)
    return dataclasses.replace(w, shape=tuple(shape), in_ndim=in_ndim)


def concat_outputs(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Fused q/k/v or gate/up: the parts (host side, flat K x N) concatenated along N."""
    first = parts[0]
    if any(type(p) is not type(first) for p in parts):
        raise ValueError("fused projection parts are quantized differently")
    k = first.in_features
    n = sum(p.out_features for p in parts)
    if isinstance(first, Fp8Weight):
        if len({p.static_input for p in parts}) > 1:
            raise ValueError("fused projection parts mix static and dynamic activation scales")
        # One static activation scale for the fused matmul: the largest part's (vLLM does the same).
        return Fp8Weight(np.concatenate([p.qweight for p in parts], 0), np.concatenate([p.scale for p in parts]),
                         np.max(np.stack([np.asarray(p.input_scale) for p in parts])).astype(np.float32),
                         (k, n), 1, first.static_input)
    if len({(p.bits, p.group_size, p.act_order, p.float_min) for p in parts}) > 1:
        raise ValueError("fused projection parts use different bits, group sizes, act-order or zero forms")
    if first.act_order and any(not np.array_equal(p.perm, first.perm) for p in parts[1:]):
        raise ValueError("fused projection parts have different act-order permutations")
    cat = lambda f: np.concatenate([getattr(p, f) for p in parts], 1)  # noqa: E731
    return PackedWeight(cat("packed"), cat("scales"), cat("zeros"), first.perm, (k, n), 1,
                        first.bits, first.group_size, first.act_order, first.float_min)


# -- host-side packing (numpy; used by the checkpoint converters and the tests) ----------------
def pack_rows(vals: np.ndarray, bits: int) -> np.ndarray:
    """[K, N] unsigned values < 2**bits -> [K / (32 / bits), N] int32, packed along K."""
    per = 32 // bits
    k, n = vals.shape
    if k % per:
        raise ValueError(f"{k} rows do not pack into int32 words of {per} {bits}-bit values")
    v = vals.astype(np.uint32).reshape(k // per, per, n)
    out = np.zeros((k // per, n), np.uint32)
    for j in range(per):
        out |= v[:, j, :] << np.uint32(bits * j)
    return out.view(np.int32)


def unpack_rows_np(packed: np.ndarray, bits: int) -> np.ndarray:
    """numpy twin of `unpack_rows`: [K / per, N] int32 -> [K, N] uint8 (bits <= 8)."""
    per = 32 // bits
    p = packed.view(np.uint32)
    vals = np.stack([(p >> np.uint32(bits * j)) & np.uint32((1 << bits) - 1) for j in range(per)], 1)
    return vals.reshape(p.shape[0] * per, p.shape[1]).astype(np.uint8)


def pack_cols(vals: np.ndarray, bits: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    """[R, C] unsigned values -> [R, C / per] int32 packed along the columns; value j of a word
    holds column `order[j]` of its run of `per` columns (default: j)."""
    return pack_rows(_reorder_cols(vals, 32 // bits, order).T, bits).T.copy()


def unpack_cols(packed: np.ndarray, bits: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    """Inverse of `pack_cols`: [R, C / per] int32 -> [R, C] uint8."""
    per = 32 // bits
    vals = unpack_rows_np(np.ascontiguousarray(packed.T), bits).T  # word-position order
    if order is None:
        return np.ascontiguousarray(vals)
    r, c = vals.shape
    out = np.empty_like(vals).reshape(r, c // per, per)
    out[:, :, list(order)] = vals.reshape(r, c // per, per)
    return out.reshape(r, c)


def _reorder_cols(vals: np.ndarray, per: int, order: tuple[int, ...] | None) -> np.ndarray:
    if order is None:
        return vals
    r, c = vals.shape
    return vals.reshape(r, c // per, per)[:, :, list(order)].reshape(r, c)


def packed_from_groups(vals: np.ndarray, scales: np.ndarray, zeros: np.ndarray, bits: int, group_size: int,
                       g_idx: np.ndarray | None = None, float_min: bool = False) -> PackedWeight:
    """Host PackedWeight (flat K x N) from unsigned values [K, N], per-group scales and zero points
    [G, N] (float minimums with `float_min`), and optionally each input row's group `g_idx` [K]
    (act-order): rows are then sorted by group so groups are contiguous, and the permutation is
    kept to gather x's columns."""
    k, n = vals.shape
    g = scales.shape[0]
    perm = np.arange(k, dtype=np.int32)
    act_order = False
    if g_idx is not None:
        g_idx = np.asarray(g_idx).astype(np.int64)
        if not np.array_equal(g_idx, np.arange(k) // group_size):
            if g_idx.min() < 0 or g_idx.max() >= g or np.any(np.bincount(g_idx, minlength=g) != group_size):
                raise ValueError(f"g_idx does not assign {group_size} input rows to each of {g} groups")
            perm = np.argsort(g_idx, kind="stable").astype(np.int32)
            vals = vals[perm]
            act_order = True
    zeros = np.asarray(zeros, np.float32) if float_min else np.asarray(zeros).astype(np.uint8)
    return PackedWeight(pack_rows(vals, bits), np.asarray(scales, np.float32), zeros,
                        perm, (k, n), 1, bits, group_size, act_order, float_min)
