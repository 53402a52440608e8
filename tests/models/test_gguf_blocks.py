"""GGUF quantized blocks kept quantized (quantization="gguf"): each type taken apart into values,
group scales and zeros equals gguf-py's dequantize bit for bit, and a tiny Llama whose linears are
stored in K-quants and 4/5/8-bit types gives the logits of the same file loaded dequantized.

gguf-py quantizes only Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1; the K-quant tensors are random blocks with
finite float16 scales, so their dequantized values are whatever those bytes say, as they would be
for a real file.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from jaxengine.models import gguf_blocks
from jaxengine.models.checkpoint import open_checkpoint
from jaxengine.models.config import ModelConfig
from jaxengine.models.loader import load_params
from jaxengine.models.quant_formats import gguf_kept_linears, resolve_quantization
from jaxengine.models.quantization import PackedWeight
from tests.model_harness import PagedRunner

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 256, 512, 4, 2, 48
# where each type's float16 scale fields sit in its block (bytes), for random blocks
_F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2),
               "Q5_K": (0, 2), "Q6_K": (208,), "Q3_K": (108,), "Q2_K": (80, 82)}


def _random_blocks(rng: np.random.Generator, qtype: Q, rows: int, cols: int, scale: float = 0.05) -> np.ndarray:
    """[rows, bytes per row] of random blocks whose float16 fields are finite, |field| <= scale."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    for at in _F16_FIELDS[qtype.name]:
        field = rng.uniform(-scale, scale, size=(rows, cols // block, 1)).astype(np.float16)
        raw[..., at:at + 2] = field.view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("name", gguf_blocks.KEPT_TYPES)
def test_blocks_dequantize_bit_for_bit(name):
    rng = np.random.default_rng(len(name))
    rows, cols = 5, 512
    raw = _random_blocks(rng, Q[name], rows, cols)
    b = gguf_blocks.unpack(name, raw, rows, cols)
    want = dequantize(raw, Q[name]).reshape(rows, cols)
    np.testing.assert_array_equal(b.dequantize(), want)
    used = {"Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6, "Q3_K": 3, "Q2_K": 2}.get(name, b.bits)
    assert b.values.max() == (1 << used) - 1  # random blocks use every value
    assert b.scales.shape == b.zeros.shape == (rows, cols // b.group_size)
    assert gguf_blocks.form(name) == (b.bits, b.group_size, b.float_min) and gguf_blocks.form("IQ2_XS") is None


def test_unpack_refuses_other_types_and_sizes():
    with pytest.raises(ValueError, match="IQ2_XS cannot be kept quantized"):
        gguf_blocks.unpack("IQ2_XS", np.zeros(74, np.uint8), 1, 256)
    with pytest.raises(ValueError, match="do not hold"):
        gguf_blocks.unpack("Q4_K", np.zeros(100, np.uint8), 1, 256)


def _write(path: Path, types: dict[str, str]) -> None:
    """A one-layer Llama with HIDDEN 256 (K-quant blocks need inputs in multiples of 256); the
    linears in `types` (GGUF names without ".weight"), the rest float32."""
    rng = np.random.default_rng(0)
    kv = KV_HEADS * (HIDDEN // HEADS)
    shapes = {"blk.0.attn_q": (HIDDEN, HIDDEN), "blk.0.attn_k": (kv, HIDDEN), "blk.0.attn_v": (kv, HIDDEN),
              "blk.0.attn_output": (HIDDEN, HIDDEN), "blk.0.ffn_gate": (FFN, HIDDEN),
              "blk.0.ffn_up": (FFN, HIDDEN), "blk.0.ffn_down": (HIDDEN, FFN)}
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("add_block_count", 1), ("add_embedding_length", HIDDEN), ("add_feed_forward_length", FFN),
                       ("add_head_count", HEADS), ("add_head_count_kv", KV_HEADS), ("add_context_length", 256),
                       ("add_rope_freq_base", 10000.0), ("add_layer_norm_rms_eps", 1e-5),
                       ("add_tokenizer_model", "gpt2"), ("add_token_list", [f"t{i}" for i in range(VOCAB)]),
                       ("add_bos_token_id", 1), ("add_eos_token_id", 2)):
        getattr(w, key)(value)
    w.add_tensor("token_embd.weight", rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32))
    for name in ("blk.0.attn_norm", "blk.0.ffn_norm", "output_norm"):
        w.add_tensor(name + ".weight", np.ones(HIDDEN, np.float32))
    for name, shape in shapes.items():
        qtype = Q[types.get(name, "F32")]
        if qtype is Q.F32:
            w.add_tensor(name + ".weight", (0.05 * rng.standard_normal(shape)).astype(np.float32))
        elif qtype.name.endswith("_K"):  # random blocks, the spread of a trained layer's weights
            w.add_tensor(name + ".weight", _random_blocks(rng, qtype, *shape, scale=0.002), raw_dtype=qtype)
        else:
            w.add_tensor(name + ".weight", quantize((0.05 * rng.standard_normal(shape)).astype(np.float32), qtype),
                         raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("types,split,forms", [
    # Q4_K everywhere but o (Q6_K) and down (Q5_K): fused q/k/v and gate/up keep one form each
    ({"blk.0.attn_q": "Q4_K", "blk.0.attn_k": "Q4_K", "blk.0.attn_v": "Q4_K", "blk.0.attn_output": "Q6_K",
      "blk.0.ffn_gate": "Q4_K", "blk.0.ffn_up": "Q4_K", "blk.0.ffn_down": "Q5_K"}, False,
     {"qkv_proj": (4, 32, True), "o_proj": (8, 16, False), "gate_up_proj": (4, 32, True),
      "down_proj": (8, 32, True)}),
    # a Q4_K_M-like mix: v in Q6_K beside Q4_K q/k, gate Q4_1 beside up Q8_0, o left float:
    # separate projections, each in its own form
    ({"blk.0.attn_q": "Q4_K", "blk.0.attn_k": "Q4_K", "blk.0.attn_v": "Q6_K", "blk.0.ffn_gate": "Q4_1",
      "blk.0.ffn_up": "Q8_0", "blk.0.ffn_down": "Q4_0"}, True,
     {"q_proj": (4, 32, True), "k_proj": (4, 32, True), "v_proj": (8, 16, False), "o_proj": None,
      "gate_proj": (4, 32, True), "up_proj": (8, 32, False), "down_proj": (4, 32, False)}),
    # a Q2_K / Q3_K mix (Q2_K_S-like): 2- and 3-bit values in 4-bit words, groups of 16
    ({"blk.0.attn_q": "Q2_K", "blk.0.attn_k": "Q2_K", "blk.0.attn_v": "Q3_K", "blk.0.attn_output": "Q3_K",
      "blk.0.ffn_gate": "Q2_K", "blk.0.ffn_up": "Q2_K", "blk.0.ffn_down": "Q3_K"}, True,
     {"q_proj": (4, 16, True), "k_proj": (4, 16, True), "v_proj": (4, 16, False), "o_proj": (4, 16, False),
      "gate_proj": (4, 16, True), "up_proj": (4, 16, True), "down_proj": (4, 16, False)}),
])
def test_tiny_llama_kept_quantized_equals_dequantized(tmp_path, types, split, forms):
    """quantization="gguf" keeps every linear of a kept type as a PackedWeight in its type's form
    (q/k rows back in HF's rotary order), and the logits equal the same file loaded dequantized."""
    path = tmp_path / "kept.gguf"
    _write(path, types)
    ckpt = open_checkpoint(path)
    kept, must_split = gguf_kept_linears(ckpt)
    assert must_split == split and len(kept) == len(types)
    cfg = ModelConfig.from_hf_dict(ckpt.hf_config)
    cfg = cfg.with_split_projections() if must_split else cfg  # what the engine's loading does
    scheme = resolve_quantization("gguf", ckpt.hf_config, gguf=True)
    graphdef, state = load_params(ckpt, cfg, jnp.float32, quantization=scheme)
    layer = state["model"]["layers"][0]
    got_forms = {}
    for part in ("self_attn", "mlp"):
        for name, v in layer[part].items():
            if name in forms:
                w = v.get_value()
                got_forms[name] = (w.bits, w.group_size, w.float_min) if isinstance(w, PackedWeight) else None
    assert got_forms == forms
    g2, s2 = load_params(open_checkpoint(path), cfg, jnp.float32)
    toks = [3, 9, 27, 1, 30, 4, 4, 12, 40, 7]
    got = PagedRunner(graphdef, state, cfg).step([(0, toks, 0)])[0]
    want = PagedRunner(g2, s2, cfg).step([(0, toks, 0)])[0]
    assert np.isfinite(want).all() and np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)


def test_dummy_gguf_weights_take_the_q4_k_form(tmp_path):
    """load_format="dummy" with quantization="gguf" (benchmarks without a file): random linears in
    Q4_K's form, 4-bit in groups of 32 with float minimums, and a step that runs."""
    from jaxengine.models.loader import dummy_params

    _write(tmp_path / "shape.gguf", {})
    cfg = ModelConfig.from_hf_dict(open_checkpoint(tmp_path / "shape.gguf").hf_config)
    scheme = resolve_quantization("gguf", None, dummy=True)
    assert "Q4_K's form" in scheme.label
    graphdef, state = dummy_params(cfg, jnp.float32, quantization=scheme)
    w = state["model"]["layers"][0]["mlp"]["down_proj"].get_value()
    assert isinstance(w, PackedWeight) and (w.bits, w.group_size, w.float_min) == (4, 32, True)
    assert w.zeros.dtype == jnp.float32
    logits = PagedRunner(graphdef, state, cfg).step([(0, [3, 9, 27], 0)])[0]
    assert np.isfinite(logits).all()
