"""The MoE layer's parts: config parsing (sparse and dense layers), the two routing rules, the
expert computation against a per-token loop (also split into expert shards and F shards, as
expert and tensor parallelism run it), and the loader's expert stacking and its errors."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.models.checkpoint import open_checkpoint
from jaxengine.models.config import ModelConfig
from jaxengine.models.loader import load_params
from jaxengine.models.moe import expert_ffn, route
from jaxengine.models.presets import PRESETS
from tests.tiny_checkpoints import make_checkpoint


def test_config_sparse_layers():
    base = dict(PRESETS["qwen3-30b-a3b"], num_hidden_layers=4)
    cfg = ModelConfig.from_hf_dict(dict(base, mlp_only_layers=[0], decoder_sparse_step=2))
    assert cfg.sparse_layers == (False, True, False, True)
    cfg = ModelConfig.from_hf_dict({k: v for k, v in base.items() if k not in ("num_experts", "norm_topk_prob")}
                                   | {"num_local_experts": 16})  # transformers 5's spelling
    assert (cfg.num_experts, cfg.norm_topk_prob, cfg.sparse_layers) == (16, False, (True,) * 4)
    mix = ModelConfig.from_hf_dict(dict(PRESETS["mixtral-8x7b"], sliding_window=4096))
    assert (mix.num_experts, mix.num_experts_per_tok, mix.moe_intermediate_size) == (8, 2, 14336)
    assert mix.sliding_window == 4096 and all(mix.sparse_layers) and not mix.qk_norm
    assert round(mix.num_params() / 1e9, 1) == 46.7  # Mixtral-8x7B: 46.7B, 12.9B active
    assert round(ModelConfig.from_hf_dict(PRESETS["qwen3-30b-a3b"]).num_params() / 1e9, 1) == 30.5
    with pytest.raises(ValueError, match="num_experts_per_tok=9 must be in"):
        ModelConfig.from_hf_dict(dict(PRESETS["mixtral-8x7b"], num_experts_per_tok=9))


def test_routing_rules():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((5, 8)), jnp.float32)
    w_mix, ids_mix = route(logits, 2, True, softmax_of_topk=True)
    w_norm, ids_norm = route(logits, 2, True, softmax_of_topk=False)
    w_raw, _ = route(logits, 2, False, softmax_of_topk=False)
    np.testing.assert_array_equal(ids_mix, ids_norm)
    np.testing.assert_allclose(w_mix, w_norm, rtol=1e-6)  # the same weights, stated two ways
    np.testing.assert_allclose(np.sum(w_mix, -1), 1.0, rtol=1e-6)
    p = np.asarray(jax.nn.softmax(logits, -1))
    np.testing.assert_allclose(w_raw, np.take_along_axis(p, np.asarray(ids_norm), -1), rtol=1e-6)


def _loop(x, weights, ids, gate, up, down):
    out = np.zeros_like(x, np.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            h = jax.nn.silu(x[t] @ gate[e]) * (x[t] @ up[e])
            out[t] += weights[t, j] * np.asarray(h @ down[e])
    return out


def test_expert_ffn_matches_per_token_loop_and_its_shards():
    rng = np.random.default_rng(1)
    t, d, f, e, k = 7, 16, 24, 4, 2
    x = rng.standard_normal((t, d)).astype(np.float32)
    gate, up = (rng.standard_normal((e, d, f)).astype(np.float32) * 0.3 for _ in range(2))
    down = rng.standard_normal((e, f, d)).astype(np.float32) * 0.3
    ids = np.array([[0, 1], [1, 0], [0, 3], [3, 0], [1, 0], [0, 1], [3, 1]], np.int32)  # expert 2 unused
    weights = rng.uniform(0.1, 0.9, (t, k)).astype(np.float32)
    want = _loop(x, weights, ids, gate, up, down)
    got = expert_ffn(x, weights, ids, gate, up, down, 0, jax.nn.silu)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    # expert parallelism: two devices of two experts each; tensor parallelism: two halves of F
    ep = sum(expert_ffn(x, weights, ids, gate[s:s + 2], up[s:s + 2], down[s:s + 2], s, jax.nn.silu) for s in (0, 2))
    tp = sum(expert_ffn(x, weights, ids, gate[..., h], up[..., h], down[:, h], 0, jax.nn.silu)
             for h in (slice(0, 12), slice(12, 24)))
    np.testing.assert_allclose(ep, want, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(tp, want, atol=1e-4, rtol=1e-4)
    # the bucket's padding rows (from num_tokens on) are left out of the experts
    part = np.asarray(expert_ffn(x, weights, ids, gate, up, down, 0, jax.nn.silu, jnp.int32(4)))
    np.testing.assert_allclose(part[:4], want[:4], atol=1e-4, rtol=1e-4)
    assert not part[4:].any()


def test_experts_stacked_and_missing_or_misshapen_ones_reported(tmp_path):
    from safetensors.numpy import load_file, save_file

    path = make_checkpoint("mixtral", str(tmp_path / "m"), num_layers=1, vocab_size=128)
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    ckpt = open_checkpoint(path)
    _, state = load_params(ckpt, ModelConfig.from_hf_dict(ckpt.hf_config), jnp.bfloat16)  # stacked in bf16
    moe = state["model"]["layers"][0]["mlp"]
    gate_up = np.asarray(moe["experts_gate_up"][...], np.float32)
    down = np.asarray(moe["experts_down"][...], np.float32)
    ff = down.shape[1]  # gate and up fused on one device: [E, D, 2F], gate columns first
    for e in range(4):
        for got, name in ((gate_up[e, :, :ff], "w1"), (gate_up[e, :, ff:], "w3"), (down[e], "w2")):
            want = tensors[f"model.layers.0.block_sparse_moe.experts.{e}.{name}.weight"].T
            np.testing.assert_array_equal(got, np.asarray(jnp.asarray(want, jnp.bfloat16), np.float32))
    del tensors["model.layers.0.block_sparse_moe.experts.3.w1.weight"]
    tensors["model.layers.0.block_sparse_moe.experts.1.w2.weight"] = np.zeros((64, 5), np.float32)
    save_file(tensors, f, metadata={"format": "pt"})
    ckpt = open_checkpoint(path)
    with pytest.raises(ValueError) as e:
        load_params(ckpt, ModelConfig.from_hf_dict(ckpt.hf_config), jnp.float32)
    msg = str(e.value)
    assert "model.layers.0.mlp.experts_gate[expert 3]" in msg
    assert "model.layers.0.block_sparse_moe.experts.1.w2.weight: checkpoint shape (64, 5)" in msg
