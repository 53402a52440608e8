"""Quantized linear weights: packing against a plain numpy reference for every format, and a tiny
Llama loaded from hand-made quantized checkpoints (compressed-tensors FP8 and W4A16 / W8A16, GPTQ
with and without act-order, AWQ) or quantized to fp8 at load time, against the same model with
the dequantized weights in float32.

Tolerances: the weight-only formats dequantize inside the step to the very float32 weights the
reference holds, so logits agree to float32 summation order (ATOL) and greedy tokens are equal.
The fp8 schemes also quantize activations per token (3 mantissa bits), so their logits stay within a
relative root-mean-square error of FP8_RTOL of the reference (whose weights are the dequantized e4m3 values) on these tiny models.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxengine.models.checkpoint import open_checkpoint
from jaxengine.models.config import ModelConfig
from jaxengine.models.loader import load_params
from jaxengine.models.quant_formats import AWQ_ORDER, resolve_quantization
from jaxengine.models.quantization import (Fp8Weight, PackedWeight, dequantize_packed, fp8_matmul, pack_cols,
                                           pack_rows, packed_from_groups, unpack_cols, unpack_rows,
                                           unpack_rows_np, weight_only_matmul)
from tests.model_harness import PagedRunner
from tests.tiny_checkpoints import make_checkpoint

ATOL = 1e-3
# Root-mean-square logit error over the logits' root-mean-square; measured on this model: 0.042
# (fp8 checkpoint against its dequantized weights), 0.063 (fp8 at load time against float32).
FP8_RTOL = 0.15
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 32


# -- numpy references, written element-wise from the formats' definitions ---------------------
def ref_pack(vals: np.ndarray, bits: int, axis: int, order=None) -> np.ndarray:
    """Packs unsigned `vals` into int32 along `axis`: value j of word w is entry w*per + order[j]."""
    per = 32 // bits
    order = order or tuple(range(per))
    v = np.moveaxis(vals.astype(np.uint64), axis, 0)
    out = np.zeros((v.shape[0] // per,) + v.shape[1:], np.uint64)
    for w in range(out.shape[0]):
        for j in range(per):
            out[w] |= v[w * per + order[j]] << np.uint64(bits * j)
    return np.ascontiguousarray(np.moveaxis(out.astype(np.uint32).view(np.int32), 0, axis))


def quant_groups(w: np.ndarray, bits: int, group: int, sym: bool, g_idx: np.ndarray | None = None):
    """HF weight [out, in] -> unsigned values [out, in], scales [out, G], unsigned zeros [out, G] and
    the dequantized weight; input row i belongs to group g_idx[i] (default i // group)."""
    out, inp = w.shape
    g_idx = np.arange(inp) // group if g_idx is None else g_idx
    groups = inp // group
    top = (1 << bits) - 1
    scales, zeros = np.zeros((out, groups), np.float32), np.zeros((out, groups), np.int64)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if sym:
            scales[:, g] = np.abs(cols).max(1) / ((1 << (bits - 1)) - 1)
            zeros[:, g] = 1 << (bits - 1)
        else:
            lo, hi = np.minimum(cols.min(1), 0), np.maximum(cols.max(1), 0)
            scales[:, g] = (hi - lo) / top
            zeros[:, g] = np.clip(np.round(-lo / scales[:, g]), 0, top)
    s, z = scales[:, g_idx], zeros[:, g_idx]
    vals = np.clip(np.round(w / s) + z, 0, top).astype(np.int64)
    deq = ((vals - z) * s).astype(np.float32)
    return vals, scales, zeros, deq


# -- packing round trips ------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [4, 8])
def test_pack_rows_and_cols_match_reference(bits):
    rng = np.random.default_rng(bits)
    vals = rng.integers(0, 1 << bits, size=(64, 48)).astype(np.uint8)
    assert np.array_equal(pack_rows(vals, bits), ref_pack(vals, bits, 0))
    assert np.array_equal(pack_cols(vals, bits), ref_pack(vals, bits, 1))
    assert np.array_equal(unpack_rows_np(ref_pack(vals, bits, 0), bits), vals)
    assert np.array_equal(unpack_cols(ref_pack(vals, bits, 1), bits), vals)
    assert np.array_equal(np.asarray(unpack_rows(jnp.asarray(ref_pack(vals, bits, 0)), bits)), vals)


def test_awq_order_round_trip():
    rng = np.random.default_rng(0)
    vals = rng.integers(0, 16, size=(16, 32)).astype(np.uint8)
    packed = ref_pack(vals, 4, 1, AWQ_ORDER)
    assert np.array_equal(unpack_cols(packed, 4, AWQ_ORDER), vals)
    assert np.array_equal(pack_cols(vals, 4, AWQ_ORDER), packed)
    assert not np.array_equal(unpack_cols(packed, 4), vals)  # the order matters
    # first word of row 0: nibble j holds column AWQ_ORDER[j]
    word = int(packed[0, 0].view(np.uint32))
    assert [(word >> (4 * j)) & 15 for j in range(8)] == [int(vals[0, c]) for c in AWQ_ORDER]


@pytest.mark.parametrize("bits,sym", [(4, True), (4, False), (8, True)])
def test_weight_only_matmul_matches_numpy(bits, sym):
    rng = np.random.default_rng(1)
    w = rng.normal(size=(48, 128)).astype(np.float32)  # HF [out, in]
    vals, scales, zeros, deq = quant_groups(w, bits, GROUP, sym)
    pw = packed_from_groups(vals.T, scales.T, zeros.T, bits, GROUP)
    x = rng.normal(size=(5, 128)).astype(np.float32)
    got = weight_only_matmul(jnp.asarray(x), jnp.asarray(pw.packed), jnp.asarray(pw.scales), jnp.asarray(pw.zeros),
                             bits, GROUP)
    np.testing.assert_allclose(np.asarray(got), x @ deq.T, atol=1e-4, rtol=1e-5)


def test_act_order_rows_sorted_and_input_gathered():
    rng = np.random.default_rng(2)
    k, n = 128, 16
    perm = rng.permutation(k)
    g_idx = np.empty(k, np.int64)
    g_idx[perm] = np.arange(k) // GROUP  # GPTQ act-order: rows quantized in `perm` order
    w = rng.normal(size=(n, k)).astype(np.float32)
    vals, scales, zeros, deq = quant_groups(w, 4, GROUP, True, g_idx)
    pw = packed_from_groups(vals.T, scales.T, zeros.T, 4, GROUP, g_idx)
    assert pw.act_order and np.array_equal(np.sort(pw.perm), np.arange(k))
    w_dev = jax.tree.map(jnp.asarray, pw)
    x = rng.normal(size=(3, k)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(w_dev.matmul(jnp.asarray(x))), x @ deq.T, atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="g_idx"):
        packed_from_groups(vals.T, scales.T, zeros.T, 4, GROUP, np.zeros(k, np.int64))


def test_fp8_matmul_close_to_float():
    rng = np.random.default_rng(3)
    w = rng.normal(size=(64, 96)).astype(np.float32)  # [N, K]
    x = rng.normal(size=(4, 96)).astype(np.float32)
    scale = np.abs(w).max(1) / 448.0
    q = (w / scale[:, None]).astype(ml_dtypes.float8_e4m3fn)
    got = np.asarray(fp8_matmul(jnp.asarray(x), jnp.asarray(q), jnp.asarray(scale), None))
    want = x @ (q.astype(np.float32) * scale[:, None]).T
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()


def test_fp8_static_input_scale_and_fused_parts():
    """A checkpoint's static input_scale quantizes the activations instead of per-token scales; a
    fused weight takes its parts' largest static scale."""
    from jaxengine.models.quantization import concat_outputs

    rng = np.random.default_rng(4)
    q = rng.normal(size=(32, 64)).astype(ml_dtypes.float8_e4m3fn)  # [N, K]
    scale = np.full(32, 0.01, np.float32)
    parts = [Fp8Weight(q, scale, np.float32(s), (64, 32), 1, True) for s in (0.02, 0.05)]
    fused = concat_outputs(parts)
    assert fused.shape == (64, 64) and float(fused.input_scale) == pytest.approx(0.05)
    x = rng.normal(size=(3, 64)).astype(np.float32)
    got = np.asarray(jax.tree.map(jnp.asarray, parts[1]).matmul(jnp.asarray(x)))
    xq = np.clip(x / 0.05, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * 0.05
    np.testing.assert_allclose(got, xq @ (q.astype(np.float32) * 0.01).T, rtol=1e-5, atol=1e-5)


# -- tiny Llama from hand-made checkpoints --------------------------------------------------------
@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = make_checkpoint("llama", str(tmp_path_factory.mktemp("qbase")), vocab_size=512, num_layers=1)
    return path, load_file(os.path.join(path, "model.safetensors"))


def _linear_names(tensors: dict) -> list[str]:
    return [n for n in tensors if n.endswith(".weight") and n.rsplit(".", 2)[-2] in LINEARS]


def _write(src: str, dst, tensors: dict, qc: dict | None) -> str:
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if f != "model.safetensors":
            shutil.copy(os.path.join(src, f), dst)
    cfg = json.load(open(os.path.join(src, "config.json")))
    if qc is not None:
        cfg["quantization_config"] = qc
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(dst, "model.safetensors"),
              metadata={"format": "pt"})
    return str(dst)


def _make(fmt: str, base, tmp_path, **kw) -> tuple[str, str]:
    """(quantized checkpoint, float checkpoint holding its dequantized weights)."""
    src, tensors = base
    quant, deq = dict(tensors), dict(tensors)
    bits, sym, act_order = kw.get("bits", 4), kw.get("sym", True), kw.get("act_order", False)
    rng = np.random.default_rng(0)
    for name in _linear_names(tensors):
        prefix, w = name[: -len(".weight")], tensors[name]
        del quant[name]
        out, inp = w.shape
        if fmt == "ct-fp8":
            scale = np.abs(w).max(1, keepdims=True) / 448.0
            q = (w / scale).astype(ml_dtypes.float8_e4m3fn)
            quant[prefix + ".weight"], quant[prefix + ".weight_scale"] = q, scale.astype(np.float32)
            if name.endswith("k_proj.weight"):  # a KV-cache scale: not a weight (models/kv_scales.py)
                quant[prefix.replace("k_proj", "k_scale")] = np.ones((), np.float32)
            deq[name] = q.astype(np.float32) * scale
            continue
        if fmt in ("fp8-block", "ct-fp8-block"):  # one scale a block (Qwen3's FP8 form; compressed-tensors' FP8_BLOCK)
            bn, bk = FP8_BLOCK
            nb, kb = -(-out // bn), -(-inp // bk)
            padded = np.zeros((nb * bn, kb * bk), np.float32)
            padded[:out, :inp] = w
            amax = np.abs(padded.reshape(nb, bn, kb, bk)).max(axis=(1, 3))
            s = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
            full = np.repeat(np.repeat(s, bn, 0), bk, 1)[:out, :inp]
            q = (w / full).astype(ml_dtypes.float8_e4m3fn)
            quant[prefix + ".weight"] = q
            quant[prefix + (".weight_scale_inv" if fmt == "fp8-block" else ".weight_scale")] = s
            deq[name] = q.astype(np.float32) * full
            continue
        g_idx = None
        if act_order:
            g_idx = np.empty(inp, np.int64)
            g_idx[rng.permutation(inp)] = np.arange(inp) // GROUP
        vals, scales, zeros, deq[name] = quant_groups(w, bits, GROUP, sym, g_idx)
        if fmt == "ct":
            quant[prefix + ".weight_packed"] = ref_pack(vals, bits, 1)
            quant[prefix + ".weight_scale"] = scales.astype(np.float16).astype(np.float32)
            quant[prefix + ".weight_shape"] = np.array([out, inp], np.int64)
            if not sym:
                quant[prefix + ".weight_zero_point"] = ref_pack(zeros, bits, 0)
            deq[name] = ((vals - zeros[:, np.arange(inp) // GROUP]) *
                         scales.astype(np.float16).astype(np.float32)[:, np.arange(inp) // GROUP]).astype(np.float32)
        elif fmt == "gptq":
            quant[prefix + ".bias"] = np.zeros(out, np.float32)  # as GPTQ exporters write for bias-free layers
            quant[prefix + ".qweight"] = ref_pack(vals.T, bits, 0)
            quant[prefix + ".qzeros"] = ref_pack(zeros.T - 1, bits, 1)  # GPTQ's stored zero - 1
            quant[prefix + ".scales"] = scales.T.astype(np.float32)
            quant[prefix + ".g_idx"] = (np.arange(inp) // GROUP if g_idx is None else g_idx).astype(np.int32)
        elif fmt == "awq":
            quant[prefix + ".qweight"] = ref_pack(vals.T, 4, 1, AWQ_ORDER)
            quant[prefix + ".qzeros"] = ref_pack(zeros.T, 4, 1, AWQ_ORDER)
            quant[prefix + ".scales"] = scales.T.astype(np.float32)
    qc = {
        "ct-fp8": {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
            "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}},
            "ignore": ["lm_head"]},
        "ct": {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
            "targets": ["Linear"], "weights": {"num_bits": bits, "type": "int", "strategy": "group",
                                               "group_size": GROUP, "symmetric": sym, "actorder": None},
            "input_activations": None}}, "ignore": ["lm_head"]},
        "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                      "weight_block_size": list(FP8_BLOCK)},
        "ct-fp8-block": {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                                           "block_structure": list(FP8_BLOCK), "symmetric": True},
                        "input_activations": {"num_bits": 8, "type": "float", "strategy": "group",
                                              "group_size": 128, "dynamic": True}}}, "ignore": ["lm_head"]},
        "gptq": {"quant_method": "gptq", "bits": bits, "group_size": GROUP, "desc_act": act_order, "sym": sym},
        "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": not sym, "version": "gemm"},
    }[fmt]
    return _write(src, tmp_path / "q", quant, qc), _write(src, tmp_path / "ref", deq, None)


def _load(path: str, quantization: str | None = None):
    ckpt = open_checkpoint(path)
    cfg = ModelConfig.from_hf_dict(ckpt.hf_config)
    scheme = resolve_quantization(quantization, ckpt.hf_config)
    if scheme is not None and scheme.act_order:
        cfg = cfg.with_split_projections()
    graphdef, state = load_params(ckpt, cfg, jnp.float32, quantization=scheme)
    return cfg, graphdef, state


def _logits(path: str, quantization: str | None = None) -> np.ndarray:
    cfg, graphdef, state = _load(path, quantization)
    toks = [int(t) for t in np.random.default_rng(5).integers(0, cfg.vocab_size, size=24)]
    return PagedRunner(graphdef, state, cfg).step([(0, toks, 0)])[0]


def _fp8_error(got: np.ndarray, want: np.ndarray) -> float:
    """Root-mean-square logit error relative to the logits' own root-mean-square."""
    return float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want ** 2)))


def _leaf_types(path: str) -> set[type]:
    _, _, state = _load(path)
    layer = state["model"]["layers"][0]
    return {type(v.get_value()) for part in ("self_attn", "mlp") for v in layer[part].values()
            if not hasattr(v, "keys")}


@pytest.mark.parametrize("fmt,kw", [
    ("ct", dict(bits=4, sym=True)), ("ct", dict(bits=4, sym=False)), ("gptq", dict(bits=8, sym=True)),
    ("gptq", dict(bits=4, sym=False, act_order=True)), ("awq", dict(sym=False)),
], ids=["ct-w4a16", "ct-w4a16-asym", "gptq-8bit", "gptq-4bit-act-order", "awq"])
def test_weight_only_checkpoint_matches_dequantized(base, tmp_path, fmt, kw):
    qpath, refpath = _make(fmt, base, tmp_path, **kw)
    assert PackedWeight in _leaf_types(qpath)
    got, want = _logits(qpath), _logits(refpath)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    assert np.array_equal(got.argmax(-1), want.argmax(-1))


def test_fp8_checkpoint_close_to_dequantized(base, tmp_path):
    qpath, refpath = _make("ct-fp8", base, tmp_path)
    assert Fp8Weight in _leaf_types(qpath)
    got, want = _logits(qpath), _logits(refpath)
    assert _fp8_error(got, want) < FP8_RTOL
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.8


FP8_BLOCK = (48, 32)  # (outputs, inputs) a scale: the tiny model's 64-wide layers end in partial blocks


@pytest.mark.parametrize("fmt, label", [("fp8-block", "fp8 fp8"), ("ct-fp8-block", "compressed-tensors fp8")])
def test_block_fp8_checkpoint_close_to_dequantized(base, tmp_path, fmt, label):
    """quant_method "fp8" with weight_block_size (Qwen3's FP8 checkpoints, weight_scale_inv) and
    compressed-tensors' FP8_BLOCK (weight_scale): each block's e4m3 values times its scale,
    requantized to one scale a channel at load time; logits within the fp8 tolerance of the
    exactly dequantized model."""
    qpath, refpath = _make(fmt, base, tmp_path)
    assert Fp8Weight in _leaf_types(qpath)
    scheme = resolve_quantization(None, json.load(open(os.path.join(qpath, "config.json"))))
    assert (scheme.block, scheme.label) == (FP8_BLOCK, f"{label}, 48x32 blocks (requantized per channel)")
    got, want = _logits(qpath), _logits(refpath)
    print(f"block fp8: relative logit error {_fp8_error(got, want):.4f}, "
          f"top-1 agreement {np.mean(got.argmax(-1) == want.argmax(-1)):.2f}")
    assert _fp8_error(got, want) < FP8_RTOL
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.8


@pytest.mark.parametrize("qc, message", [
    ({"weight_block_size": [128]}, r"weight_block_size must be two positive integers, got \[128\]"),
    ({"weight_block_size": [128, 0]}, "must be two positive integers"),
    ({"weight_block_size": [128, 128], "activation_scheme": "static"}, "activation_scheme must be 'dynamic'"),
])
def test_bad_block_fp8_configs_refused(qc, message):
    with pytest.raises(ValueError, match=message):
        resolve_quantization(None, {"quantization_config": {"quant_method": "fp8", **qc}})


def test_fp8_at_load_time_close_to_float(base):
    path, _ = base
    got, want = _logits(path, "fp8"), _logits(path)
    assert _fp8_error(got, want) < FP8_RTOL
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.8


def test_fused_norm_quant_equals_norm_then_quantize():
    """rmsnorm_fp8_rows makes the e4m3 rows and scales that RMSNorm followed by the per-row
    quantization makes (float32: the same arithmetic, up to the order of two products)."""
    from jaxengine.models import quantization as qz
    from jaxengine.models.layers import RMSNorm
    from flax import nnx

    rng = np.random.default_rng(6)
    h = jnp.asarray(rng.normal(size=(7, 64)) * rng.uniform(0.1, 10, size=(7, 1)), jnp.float32)
    norm = RMSNorm(64, 1e-5, jnp.float32)
    norm.weight = nnx.Param(jnp.asarray(rng.uniform(0.5, 2.0, size=64), jnp.float32))
    rows = qz.rmsnorm_fp8_rows(h, norm.weight[...], norm.eps)
    wq, ws = qz.fp8_quantize_rows(norm(h), None)
    assert rows.q.dtype == jnp.float8_e4m3fn and rows.shape == (7, 64) and rows.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(rows.scale), np.asarray(ws), rtol=1e-5)
    got, want = np.asarray(rows.q.astype(jnp.float32)), np.asarray(wq.astype(jnp.float32))
    assert np.mean(got == want) > 0.97  # a value on an e4m3 rounding boundary may go either way
    np.testing.assert_allclose(got, want, rtol=0.07, atol=2.0 ** -9)  # and then by one e4m3 step


def test_fused_norm_quant_applies_only_to_dynamic_fp8_linears(monkeypatch):
    from jaxengine.models import quantization as qz

    q = np.zeros((8, 16), ml_dtypes.float8_e4m3fn)
    dyn = Fp8Weight(q, np.ones(8, np.float32), np.float32(1), (16, 8), 1, False)
    static = Fp8Weight(q, np.ones(8, np.float32), np.float32(1), (16, 8), 1, True)
    assert qz.FP8_FUSED_NORM_QUANT  # on by default
    monkeypatch.setattr(qz, "FP8_FUSED_NORM_QUANT", False)
    assert not qz.fp8_rows_apply(32, [dyn])
    monkeypatch.setattr(qz, "FP8_FUSED_NORM_QUANT", True)
    assert qz.fp8_rows_apply(32, [dyn, dyn])
    assert not qz.fp8_rows_apply(32, [dyn, static])
    assert not qz.fp8_rows_apply(32, [dyn, np.zeros((16, 8), np.float32)])
    assert not qz.fp8_rows_apply(32, [])
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # a GPU's decode calls stay W8A16
    assert not qz.fp8_rows_apply(qz.FP8_KERNEL_MAX_ROWS, [dyn])
    assert qz.fp8_rows_apply(qz.FP8_KERNEL_MAX_ROWS + 1, [dyn])


def test_fused_norm_quant_model_close_to_unfused(base, monkeypatch):
    """With FP8_FUSED_NORM_QUANT the fp8 model's two norms a layer feed its W8A8 linears e4m3 rows
    directly (the norm's 16-bit output is never made): the logits stay those of the unfused path."""
    from jaxengine.models import layers
    from jaxengine.models import quantization as qz

    path, _ = base
    jax.clear_caches()  # the switch is read while tracing: no program traced before may be reused
    monkeypatch.setattr(qz, "FP8_FUSED_NORM_QUANT", False)
    want = _logits(path, "fp8")
    jax.clear_caches()
    calls = []
    real = layers.rmsnorm_fp8_rows
    monkeypatch.setattr(layers, "rmsnorm_fp8_rows", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(qz, "FP8_FUSED_NORM_QUANT", True)
    got = _logits(path, "fp8")
    jax.clear_caches()
    assert len(calls) == 2  # one layer: before attention and before the MLP
    assert _fp8_error(got, want) < 0.01
    assert np.array_equal(got.argmax(-1), want.argmax(-1))


# -- errors ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,tensor,cut,message", [
    ("gptq", "model.layers.0.mlp.down_proj.qweight", 0,
     r"gptq 4-bit.*model\.layers\.0\.mlp\.down_proj\.qweight has shape \(15, 64\), expected \(16, 64\)"),
    ("ct", "model.layers.0.self_attn.k_proj.weight_scale", 1,
     r"compressed-tensors 4-bit.*k_proj\.weight_scale has shape \(32, 1\), expected \(32, 2\)"),
    ("awq", "model.layers.0.mlp.up_proj.qzeros", 1,
     r"awq 4-bit.*up_proj\.qzeros has shape \(2, 15\), expected \(2, 16\)"),
    ("fp8-block", "model.layers.0.self_attn.q_proj.weight_scale_inv", 1,
     r"fp8 fp8, 48x32 blocks.*q_proj\.weight_scale_inv has shape \(2, 1\), expected \(2, 2\)"),
])
def test_bad_packed_shape_names_scheme_tensor_and_shapes(base, tmp_path, fmt, tensor, cut, message):
    qpath, _ = _make(fmt, base, tmp_path)
    f = os.path.join(qpath, "model.safetensors")
    ckpt = open_checkpoint(qpath)  # safetensors' numpy reader has no e4m3
    t = {n: np.array(ckpt.get_tensor(n)) for n in ckpt.tensor_names()}  # copies: the file is rewritten
    t[tensor] = np.ascontiguousarray(t[tensor][:-1] if cut == 0 else t[tensor][:, :-1])
    save_file(t, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message):
        _load(qpath)


@pytest.mark.parametrize("method", ["bitsandbytes", "exl2", "marlin"])
def test_unsupported_method_refused_by_name(method):
    with pytest.raises(ValueError, match=f"'{method}' is not supported; supported: compressed-tensors, fp8, gptq, awq"):
        resolve_quantization(None, {"quantization_config": {"quant_method": method}})
    with pytest.raises(ValueError, match=f"quantization '{method}' is not supported; supported: fp8"):
        resolve_quantization(method, {})


def test_method_disagreeing_with_checkpoint_refused():
    with pytest.raises(ValueError, match="checkpoint is quantized with 'awq'"):
        resolve_quantization("gptq", {"quantization_config": {"quant_method": "awq"}})
    assert resolve_quantization("awq_marlin", {"quantization_config": {"quant_method": "awq"}}).method == "awq"
    with pytest.raises(ValueError, match="needs a checkpoint quantized with it"):
        resolve_quantization("gptq", {})


# -- GGUF Q8_0 kept packed ------------------------------------------------------------------------
def test_gguf_q8_0_kept_as_8_bit_weight_only(tmp_path):
    """quantization="gguf": Q8_0 linears load as 8-bit weight-only in groups of 32 (q/k with the
    rotary order undone); a fused pair with a part of a type not kept quantized (F16) makes the
    model hold separate projections, that part float; the logits equal the fully dequantized
    model's. (tests/models/test_gguf_blocks.py: the other kept types.)"""
    from gguf import GGMLQuantizationType as Q

    from tests.models.test_gguf_reader import FFN, HEADS, HIDDEN, KV_HEADS, _permute, _write_tiny

    rng = np.random.default_rng(0)
    kv = KV_HEADS * (HIDDEN // HEADS)
    shapes = {"token_embd": (32, HIDDEN), "blk.0.attn_q": (HIDDEN, HIDDEN), "blk.0.attn_k": (kv, HIDDEN),
              "blk.0.attn_v": (kv, HIDDEN), "blk.0.attn_output": (HIDDEN, HIDDEN), "blk.0.ffn_gate": (FFN, HIDDEN),
              "blk.0.ffn_up": (FFN, HIDDEN), "blk.0.ffn_down": (HIDDEN, FFN)}
    types = {"token_embd": Q.F32, "blk.0.ffn_gate": Q.F16}  # gate: not kept quantized
    tensors = {}
    for name, shape in shapes.items():
        w = (0.2 * rng.standard_normal(shape)).astype(np.float32)
        w = _permute(w, HEADS) if name == "blk.0.attn_q" else _permute(w, KV_HEADS) if name == "blk.0.attn_k" else w
        tensors[name + ".weight"] = (w, types.get(name, Q.Q8_0))
    for name in ("blk.0.attn_norm", "blk.0.ffn_norm", "output_norm"):
        tensors[name + ".weight"] = (np.ones(HIDDEN, np.float32), Q.F32)
    path = tmp_path / "q8.gguf"
    _write_tiny(path, "llama", tensors)
    ckpt = open_checkpoint(path)
    from jaxengine.models.quant_formats import gguf_kept_linears

    assert gguf_kept_linears(ckpt)[1]  # gate F16 beside up Q8_0: separate projections
    cfg = ModelConfig.from_hf_dict(ckpt.hf_config).with_split_projections()
    scheme = resolve_quantization("gguf", ckpt.hf_config, gguf=True)
    graphdef, state = load_params(ckpt, cfg, jnp.float32, quantization=scheme)
    layer = state["model"]["layers"][0]
    kinds = {name: type(v.get_value()).__name__ for part in ("self_attn", "mlp") for name, v in layer[part].items()
             if not hasattr(v, "keys")}
    packed = "PackedWeight"
    assert kinds == {"q_proj": packed, "k_proj": packed, "v_proj": packed, "o_proj": packed,
                     "gate_proj": "ArrayImpl", "up_proj": packed, "down_proj": packed}, kinds
    assert layer["mlp"]["down_proj"].get_value().group_size == 32
    g2, s2 = load_params(open_checkpoint(path), cfg, jnp.float32)
    toks = [3, 9, 27, 1, 30, 4, 4, 12]
    got = PagedRunner(graphdef, state, cfg).step([(0, toks, 0)])[0]
    want = PagedRunner(g2, s2, cfg).step([(0, toks, 0)])[0]
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="needs a .gguf checkpoint"):
        resolve_quantization("gguf", {})


def test_quantization_scope_checked():
    from jaxengine.models.quant_formats import check_model

    scheme = resolve_quantization("fp8", {})
    check_model(scheme, "Qwen2ForCausalLM", 1)
    with pytest.raises(ValueError, match="supported for Llama, Mistral, Qwen2 and Qwen3 models, not GPT2LMHeadModel"):
        check_model(scheme, "GPT2LMHeadModel", 1)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 is not supported"):
        check_model(scheme, "LlamaForCausalLM", 2)


def test_weight_only_kernel_only_for_few_rows(monkeypatch):
    """On GPU the Pallas kernel takes calls of up to KERNEL_MAX_ROWS rows; larger calls (prefill)
    dequantize in the graph, which measured faster there."""
    from jaxengine.models import quantization as q

    calls = []
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(q.kernel, "weight_only_matmul",
                        lambda x, *a, **k: calls.append(x.shape[0]) or q.weight_only_matmul(x, *a, k["bits"], k["group_size"]))
    packed = jnp.zeros((256 // 8, 128), jnp.int32)
    scales, zeros = jnp.ones((2, 128), jnp.float32), jnp.zeros((2, 128), jnp.uint8)
    for rows in (1, q.KERNEL_MAX_ROWS, q.KERNEL_MAX_ROWS + 1):
        q.weight_only_linear(jnp.ones((rows, 256), jnp.float32), packed, scales, zeros, 4, 128)
    assert calls == [1, q.KERNEL_MAX_ROWS]


def test_weight_only_swapped_form_for_decode_rows(monkeypatch):
    """On GPU, bf16 calls of up to SWAPPED_MAX_ROWS rows with 4-bit groups of 128 run the kernel's
    swapped form, float32 calls the kernel's slab form; SWAPPED=False turns the swapped form off."""
    from jaxengine.models import quantization as q

    calls = []
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(q.kernel, "weight_only_matmul_swapped",
                        lambda x, *a: calls.append(("swapped", x.shape[0])) or q.weight_only_matmul(x, *a, 4, 128))
    monkeypatch.setattr(q.kernel, "weight_only_matmul",
                        lambda x, *a, **k: calls.append(("slabs", x.shape[0])) or q.weight_only_matmul(x, *a, 4, 128))
    packed = jnp.zeros((256 // 8, 128), jnp.int32)
    scales, zeros = jnp.ones((2, 128), jnp.bfloat16), jnp.zeros((2, 128), jnp.uint8)
    for rows in (1, q.SWAPPED_MAX_ROWS):
        q.weight_only_linear(jnp.ones((rows, 256), jnp.bfloat16), packed, scales, zeros, 4, 128)
    q.weight_only_linear(jnp.ones((3, 256), jnp.float32), packed, scales.astype(jnp.float32), zeros, 4, 128)
    monkeypatch.setattr(q, "SWAPPED", False)
    q.weight_only_linear(jnp.ones((1, 256), jnp.bfloat16), packed, scales, zeros, 4, 128)
    assert calls == [("swapped", 1), ("swapped", q.SWAPPED_MAX_ROWS), ("slabs", 3), ("slabs", 1)]
