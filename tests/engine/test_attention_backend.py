"""The attention backend: what each config name runs (on the CPU, and on a stand-in Hopper GPU),
and `attend` = the KV write followed by the chosen function, the same under a mesh."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxengine.attention_backend import AttentionBackend, select_attention_backend
from jaxengine.config import ATTENTION_BACKENDS
from jaxengine.models.attention import AttentionMetadata
from jaxengine.models.config import ModelConfig
from jaxengine.models.presets import PRESETS
from jaxengine.pallas_kernels import gpu_backend
from jaxengine.pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention_cpu, ragged_paged_attention_reference, write_kv)
from tests.kernels.batch_factory import make_batch

LLAMA3_8B = ModelConfig.from_hf_dict(PRESETS["llama-3-8b"])
SMOLLM2 = ModelConfig.from_hf_dict(PRESETS["smollm2-135m"])


def test_names_on_the_cpu():
    """On the CPU "auto" runs the CPU path; the Pallas names find no GPU kernel and run the
    reference, as "reference" does. The description says what runs."""
    if jax.default_backend() != "cpu":
        pytest.skip("CPU choices only")
    want = {"auto": (ragged_paged_attention_cpu, "ragged_paged_attention_cpu"),
            "pallas": (ragged_paged_attention_reference, "jnp reference"),
            "pallas-mosaic": (ragged_paged_attention_reference, "jnp reference"),
            "reference": (ragged_paged_attention_reference, "jnp reference")}
    assert set(want) == set(ATTENTION_BACKENDS)
    for name, (fn, description) in want.items():
        backend = select_attention_backend(name, SMOLLM2, jnp.float32, 16)
        assert (backend.name, backend.fn, backend.description, backend.mesh) == (name, fn, description, None)
        assert hash(backend) == hash(select_attention_backend(name, SMOLLM2, jnp.float32, 16))


def _on_a_hopper(monkeypatch) -> None:
    """JAX answers as on one H100 (the kernels themselves are not run)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda: [types.SimpleNamespace(
        compute_capability="9.0", core_count=132, device_kind="H100")])


def test_unknown_name_is_an_error():
    with pytest.raises(ValueError, match="attention backend must be one of auto, pallas"):
        select_attention_backend("mosaic", SMOLLM2, jnp.float32, 16)


def test_names_pick_the_mosaic_prefill_on_hopper(monkeypatch):
    """On a (stand-in) Hopper GPU, "auto" and "pallas-mosaic" take the Mosaic prefill kernel for
    large enough calls and "pallas" the Triton kernels only; the description says whether the
    model's shape gets the Mosaic kernel at all."""
    from jaxengine.pallas_kernels import ragged_paged_attention_gpu as rpa_gpu

    calls = []

    def ragged_paged_attention_gpu(q, *args, **kwargs):  # stands in for the kernel, by its name
        calls.append(kwargs.get("prefill", "triton"))

    _on_a_hopper(monkeypatch)
    monkeypatch.setattr(rpa_gpu, "ragged_paged_attention_gpu", ragged_paged_attention_gpu)
    q = jax.ShapeDtypeStruct((gpu_backend.MOSAIC_PREFILL_MIN_TOKENS, 32, 128), jnp.bfloat16)
    described = {}
    for name in ("auto", "pallas-mosaic", "pallas"):
        backend = select_attention_backend(name, LLAMA3_8B, jnp.bfloat16, 16)
        backend.fn(q, None, None, None, None, None, None, sm_scale=0.1)
        described[name] = backend.description
    assert calls == ["auto", "auto", "triton"]
    assert described == {"auto": "ragged_paged_attention_gpu_mosaic_prefill",
                         "pallas-mosaic": "ragged_paged_attention_gpu_mosaic_prefill",
                         "pallas": "ragged_paged_attention_gpu"}
    assert select_attention_backend("auto", SMOLLM2, jnp.bfloat16, 16).description == (
        "ragged_paged_attention_gpu (the Mosaic prefill kernel does not apply)")  # G = 3
    assert select_attention_backend("reference", LLAMA3_8B, jnp.bfloat16, 16).description == "jnp reference"


def test_gemma_never_gets_the_mosaic_prefill(monkeypatch):
    """A window on some layers only (Gemma 3's local layers) or a soft cap (Gemma 2's) keeps every
    layer of the model on the Triton kernels, even with a head size and group size the Mosaic
    prefill kernel serves (128, 2); the same model with only global layers and no cap gets it."""
    from jaxengine.pallas_kernels import ragged_paged_attention_gpu as rpa_gpu

    calls = []

    def ragged_paged_attention_gpu(q, *args, **kwargs):  # stands in for the kernel, by its name
        calls.append(kwargs.get("prefill", "triton"))

    _on_a_hopper(monkeypatch)
    monkeypatch.setattr(rpa_gpu, "ragged_paged_attention_gpu", ragged_paged_attention_gpu)
    shape = dict(PRESETS["gemma-2-9b"], head_dim=128, num_hidden_layers=6)
    all_global = ["full_attention"] * 6
    gemma3 = dict(shape, architectures=["Gemma3ForCausalLM"], attn_logit_softcapping=None, sliding_window_pattern=6)
    configs = {
        "gemma2": ModelConfig.from_hf_dict(shape),
        "gemma2, soft cap only": ModelConfig.from_hf_dict(dict(shape, layer_types=all_global)),
        "gemma3": ModelConfig.from_hf_dict(gemma3),
        "gemma3, global layers only": ModelConfig.from_hf_dict(dict(gemma3, layer_types=all_global)),
    }
    assert configs["gemma3"].layer_types.count("sliding_attention") == 5
    q = jax.ShapeDtypeStruct((gpu_backend.MOSAIC_PREFILL_MIN_TOKENS, 16, 128), jnp.bfloat16)
    described = {}
    for name, cfg in configs.items():
        backend = select_attention_backend("auto", cfg, jnp.bfloat16, 16)
        backend.fn(q, None, None, None, None, None, None, sm_scale=0.1)
        described[name] = backend.description
    no = "ragged_paged_attention_gpu (the Mosaic prefill kernel does not apply)"
    assert described == {"gemma2": no, "gemma2, soft cap only": no, "gemma3": no,
                         "gemma3, global layers only": "ragged_paged_attention_gpu_mosaic_prefill"}
    assert calls == ["triton", "triton", "triton", "auto"]


def _step(rng: np.random.Generator, q_lens=(1, 9, 4), ctx_lens=(20, 0, 7)):
    """A ragged batch, this step's new K/V [T, K, H] and the metadata writing them to free slots."""
    b = make_batch(rng, q_lens=list(q_lens), ctx_lens=list(ctx_lens), num_heads=8, num_kv_heads=2, head_dim=16,
                   block_size=16, dtype=jnp.float32, pad_slots=1, pad_tokens=2)
    t, k_heads, h = b.q.shape[0], b.k_cache.shape[1], b.q.shape[2]
    k = jnp.asarray(rng.standard_normal((t, k_heads, h)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((t, k_heads, h)), jnp.float32)
    slots = rng.choice(np.arange(16, b.k_cache.shape[0] * 16), t, replace=False).astype(np.int32)
    md = AttentionMetadata(jnp.asarray(slots), b.kv_lens, b.block_tables, b.query_start_loc, b.num_seqs)
    return b, k, v, md


def test_attend_writes_the_cache_then_attends():
    b, k, v, md = _step(np.random.default_rng(0))
    backend = AttentionBackend("reference", "jnp reference", ragged_paged_attention_reference)
    o, (kc, vc) = jax.jit(lambda *a: backend.attend(*a, sm_scale=0.25, sliding_window=8))(
        b.q, k, v, (b.k_cache, b.v_cache), md)
    want_k, want_v = write_kv(b.k_cache, b.v_cache, k, v, md.slot_mapping)
    want_o = ragged_paged_attention_reference(b.q, want_k, want_v, md.kv_lens, md.block_tables,
                                              md.query_start_loc, md.num_seqs, sm_scale=0.25, sliding_window=8)
    np.testing.assert_array_equal(np.asarray(kc), np.asarray(want_k))
    np.testing.assert_array_equal(np.asarray(vc), np.asarray(want_v))
    np.testing.assert_allclose(np.asarray(o), np.asarray(want_o), rtol=1e-6, atol=1e-6)


def test_attend_under_a_mesh_equals_one_device():
    """With a mesh the write and the attention run per device under shard_map over "model"
    (here the one CPU device): the same result as without."""
    b, k, v, md = _step(np.random.default_rng(1))
    mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    outs = []
    for m in (None, mesh):
        backend = AttentionBackend("reference", "jnp reference", ragged_paged_attention_reference, m)
        outs.append(jax.jit(lambda *a: backend.attend(*a, sm_scale=0.25))(b.q, k, v, (b.k_cache, b.v_cache), md))
    for a, c in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-6, atol=1e-6)


def test_head_size_not_a_power_of_two_is_padded_for_the_gpu_kernels(monkeypatch):
    """The Pallas GPU kernels take power-of-two head sizes: Phi-3's 96 runs them with a KV cache of
    head size 128; a power-of-two head size keeps its own; the CPU path never pads."""
    _on_a_hopper(monkeypatch)
    phi3 = ModelConfig.from_hf_dict(PRESETS["phi-3-mini"])
    assert phi3.head_dim == 96
    backend = select_attention_backend("auto", phi3, jnp.bfloat16, 16)
    assert backend.kv_head_dim(96) == 128
    assert backend.description.endswith("(head size 96 padded to 128 in the KV cache)")
    assert select_attention_backend("pallas", LLAMA3_8B, jnp.bfloat16, 16).kv_head_dim(128) == 128
    assert select_attention_backend("reference", phi3, jnp.bfloat16, 16).kv_head_dim(96) == 96
    big = ModelConfig.from_hf_dict(dict(PRESETS["llama-3-8b"], head_dim=512))
    assert select_attention_backend("auto", big, jnp.bfloat16, 16).description == "jnp reference"


def test_attend_with_a_padded_cache_equals_the_unpadded():
    """q/k/v of head size 16 through a cache of head size 32 (zero columns): the same output, and
    the cache holds the keys/values in its first 16 columns and zeros after."""
    b, k, v, md = _step(np.random.default_rng(2))
    plain = AttentionBackend("reference", "jnp reference", ragged_paged_attention_reference)
    padded = AttentionBackend("reference", "jnp reference", ragged_paged_attention_reference, cache_head_dim=32)
    want, (wk, wv) = jax.jit(lambda *a: plain.attend(*a, sm_scale=0.25, sliding_window=8))(
        b.q, k, v, (b.k_cache, b.v_cache), md)
    zeros = jnp.zeros(b.k_cache.shape[:3] + (16,), b.k_cache.dtype)
    caches = (jnp.concatenate([b.k_cache, zeros], -1), jnp.concatenate([b.v_cache, zeros], -1))
    got, (gk, gv) = jax.jit(lambda *a: padded.attend(*a, sm_scale=0.25, sliding_window=8))(b.q, k, v, caches, md)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(gk[..., :16]), np.asarray(wk))
    np.testing.assert_array_equal(np.asarray(gv[..., 16:]), 0)
