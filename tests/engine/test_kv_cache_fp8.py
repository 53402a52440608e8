"""kv_cache_dtype="fp8": the KV cache in float8_e4m3fn with scale 1.0, written saturated and read
upcast by every attention path; the block count sized at 1 byte per element; on a GPU the Triton
kernels for every call (the Mosaic prefill kernel takes bf16 K/V only), the jnp reference below
sm_89."""

from __future__ import annotations

import functools
import logging
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.attention_backend import AttentionBackend, select_attention_backend
from jaxengine.config import EngineConfig
from jaxengine.model_runner import kv_bytes_per_block
from jaxengine.pallas_kernels import ragged_paged_attention_gpu as rpa_gpu
from jaxengine.pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference, write_kv
from tests.model_harness import PagedRunner
from tests.models.test_model import _load
from tests.tiny_checkpoints import make_checkpoint

# Relative root-mean-square logit error of the fp8 cache against the float32 one; measured 0.019 on
# this tiny model (its keys and values keep 3 mantissa bits).
KV_FP8_RTOL = 0.1


def test_fp8_cache_logits_close_to_float_cache(tmp_path):
    cfg, graphdef, state = _load(make_checkpoint("llama", str(tmp_path / "m"), vocab_size=512, num_layers=1))
    toks = [int(t) for t in np.random.default_rng(0).integers(0, cfg.vocab_size, size=35)]
    # the jnp reference here; the engine test runs the CPU path ("auto") with an fp8 cache
    fp8 = select_attention_backend("reference", cfg, jnp.float32, 16, kv_cache_dtype="fp8")
    assert fp8.kv_dtype(jnp.float32) == jnp.float8_e4m3fn
    runner = PagedRunner(graphdef, state, cfg, attention=fp8)
    # prefill then decode steps: the decode rows read what earlier steps wrote in fp8
    got = np.concatenate([runner.step([(0, toks[:32], 0)])[0]] +
                         [runner.step([(0, toks[:n], n - 1)])[0] for n in range(33, 36)])
    assert runner.kv[0][0].dtype == jnp.float8_e4m3fn
    want = PagedRunner(graphdef, state, cfg).step([(0, toks, 0)])[0]
    err = float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want ** 2)))
    assert err < KV_FP8_RTOL, err
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.8


def test_fp8_write_saturates():
    k_cache = jnp.zeros((2, 1, 16, 4), jnp.float8_e4m3fn)
    k = jnp.asarray([[[1000.0, -1000.0, 1.5, 0.0]]])
    kc, _ = write_kv(k_cache, k_cache, k, k, jnp.asarray([17]))
    assert np.asarray(kc[1, 0, 1].astype(jnp.float32)).tolist() == [448.0, -448.0, 1.5, 0.0]


def test_fp8_block_bytes_and_config():
    from tests.engine.test_attention_backend import SMOLLM2

    assert kv_bytes_per_block(SMOLLM2, 16, jnp.float8_e4m3fn) * 2 == kv_bytes_per_block(SMOLLM2, 16, jnp.bfloat16)
    fp8 = select_attention_backend("reference", SMOLLM2, jnp.bfloat16, 16, kv_cache_dtype="fp8")
    assert kv_bytes_per_block(SMOLLM2, 16, fp8.kv_dtype(jnp.bfloat16)) == 2 * 30 * 3 * 16 * 64  # 1 byte an element
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")


def _on_a_gpu(monkeypatch, cc: str, kind: str) -> None:
    """JAX answers as on one GPU of compute capability `cc` (the kernels themselves are not run)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda: [types.SimpleNamespace(
        compute_capability=cc, core_count=132, device_kind=kind)])


class _Records(logging.Handler):
    """The records of the kernels' backend logger (jaxengine's loggers do not propagate to the
    root logger, where caplog listens)."""

    def __init__(self, monkeypatch):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []
        log = logging.getLogger("jaxengine.pallas_kernels.gpu_backend")
        monkeypatch.setattr(log, "level", logging.INFO)
        monkeypatch.setattr(log, "handlers", [self])

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def take(self) -> list[tuple[str, str]]:
        """(level, message) of the records so far; forgets them."""
        out = [(r.levelname, r.getMessage()) for r in self.records]
        self.records.clear()
        return out


def test_fp8_cache_runs_the_triton_kernels_on_hopper(monkeypatch):
    """On a (stand-in) H100 every GPU name takes the plain Triton kernel for an fp8 cache, even
    for a model the Mosaic prefill kernel serves in bf16 (Llama-3-8B), saying so once at INFO for
    the names that would have taken it; the cache is e4m3, at half the bytes a block, padded
    head sizes kept (Phi-3's 96 -> 128). Without fp8 nothing changes."""
    from tests.engine.test_attention_backend import LLAMA3_8B, SMOLLM2

    _on_a_gpu(monkeypatch, "9.0", "H100")
    log = _Records(monkeypatch)
    skipped = ("INFO", "fp8 KV cache: the Mosaic GPU prefill kernel (bf16 K/V only) is skipped; the Triton "
                       "kernels serve every attention call")
    for name in ("auto", "pallas-mosaic", "pallas"):
        backend = select_attention_backend(name, LLAMA3_8B, jnp.bfloat16, 16, kv_cache_dtype="fp8")
        assert backend.fn is rpa_gpu.ragged_paged_attention_gpu
        assert backend.description == "ragged_paged_attention_gpu, fp8 KV cache"
        assert backend.kv_dtype(jnp.bfloat16) == jnp.float8_e4m3fn
        assert log.take() == ([skipped] if name != "pallas" else [])
        bf16 = select_attention_backend(name, LLAMA3_8B, jnp.bfloat16, 16)
        assert bf16.cache_dtype is None and (bf16.fn is rpa_gpu.ragged_paged_attention_gpu) == (name == "pallas")
        h = LLAMA3_8B.head_dim
        assert (kv_bytes_per_block(LLAMA3_8B, 16, backend.kv_dtype(jnp.bfloat16), backend.kv_head_dim(h)) * 2
                == kv_bytes_per_block(LLAMA3_8B, 16, bf16.kv_dtype(jnp.bfloat16), bf16.kv_head_dim(h)))
    assert select_attention_backend("auto", SMOLLM2, jnp.bfloat16, 16, kv_cache_dtype="fp8").fn is (
        rpa_gpu.ragged_paged_attention_gpu)  # outside the Mosaic kernel's scope anyway (G = 3)
    from jaxengine.models.config import ModelConfig
    from jaxengine.models.presets import PRESETS
    phi3 = select_attention_backend("auto", ModelConfig.from_hf_dict(PRESETS["phi-3-mini"]), jnp.bfloat16, 16,
                                    kv_cache_dtype="fp8")
    assert (phi3.kv_head_dim(96), phi3.kv_dtype(jnp.bfloat16)) == (128, jnp.float8_e4m3fn)


def test_fp8_cache_on_ada_and_ampere(monkeypatch):
    """sm_89 (L40S) converts e4m3: the Triton kernels, with nothing to say about Mosaic; sm_80
    (A100) does not: the jnp reference, with a warning; both run the Pallas kernels in bf16."""
    from tests.engine.test_attention_backend import LLAMA3_8B

    log = _Records(monkeypatch)
    _on_a_gpu(monkeypatch, "8.9", "L40S")
    backend = select_attention_backend("auto", LLAMA3_8B, jnp.bfloat16, 16, kv_cache_dtype="fp8")
    assert backend.fn is rpa_gpu.ragged_paged_attention_gpu and log.take() == []
    _on_a_gpu(monkeypatch, "8.0", "A100")
    for name in ("auto", "pallas"):
        backend = select_attention_backend(name, LLAMA3_8B, jnp.bfloat16, 16, kv_cache_dtype="fp8")
        assert (backend.fn, backend.description) == (ragged_paged_attention_reference, "jnp reference, fp8 KV cache")
        assert log.take() == [("WARNING", "no Pallas attention kernel reads an fp8 KV cache on device A100 "
                                          "(compute capability 8.0; e4m3 conversion needs 8.9+)")]
        assert select_attention_backend(name, LLAMA3_8B, jnp.bfloat16, 16).fn is rpa_gpu.ragged_paged_attention_gpu


def test_attend_through_the_triton_kernels_writes_e4m3_saturated():
    """The GPU backend's `attend` (the Triton kernels, interpreted): this step's K/V go into the
    fp8 cache as e4m3 clipped to +-448 (write_kv, as on the reference path), and the attention
    over it equals the reference over the same cache."""
    from tests.engine.test_attention_backend import _step

    b, k, v, md = _step(np.random.default_rng(4))
    k = k.at[0, 0, :4].set(jnp.asarray([1000.0, -1000.0, 448.0, 1.5]))
    caches = (b.k_cache.astype(jnp.float8_e4m3fn), b.v_cache.astype(jnp.float8_e4m3fn))
    fn = functools.partial(rpa_gpu.ragged_paged_attention_gpu, interpret=True)
    gpu = AttentionBackend("pallas", "ragged_paged_attention_gpu", fn, cache_dtype=jnp.dtype(jnp.float8_e4m3fn))
    o, (kc, vc) = jax.jit(lambda *a: gpu.attend(*a, sm_scale=0.25))(b.q, k, v, caches, md)
    want_k, want_v = write_kv(*caches, k, v, md.slot_mapping)
    assert kc.dtype == vc.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(kc.astype(jnp.float32)), np.asarray(want_k.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(vc.astype(jnp.float32)), np.asarray(want_v.astype(jnp.float32)))
    slot = int(md.slot_mapping[0])
    assert np.asarray(kc[slot // 16, 0, slot % 16, :4].astype(jnp.float32)).tolist() == [448.0, -448.0, 448.0, 1.5]
    want_o = ragged_paged_attention_reference(b.q, want_k, want_v, md.kv_lens, md.block_tables, md.query_start_loc,
                                              md.num_seqs, sm_scale=0.25)
    np.testing.assert_allclose(np.asarray(o), np.asarray(want_o), rtol=1e-5, atol=1e-5)
