"""kv_cache_dtype="fp8": the KV cache in float8_e4m3fn with scale 1.0, written saturated and read
upcast by the jnp attention paths; the block count sized at 1 byte per element; refused with the
Pallas GPU kernels."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine import attention_backend
from jaxengine.attention_backend import select_attention_backend
from jaxengine.config import EngineConfig
from jaxengine.model_runner import kv_bytes_per_block
from jaxengine.pallas_kernels.ragged_paged_attention import write_kv
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


def test_fp8_cache_refused_with_pallas_kernels(monkeypatch):
    from tests.engine.test_attention_backend import SMOLLM2

    def fake_kernel(*a, **kw):
        raise AssertionError("not called")

    monkeypatch.setattr(attention_backend.gpu_backend, "get_kernel", lambda mosaic_prefill: fake_kernel)
    assert select_attention_backend("pallas", SMOLLM2, jnp.bfloat16, 16).fn is fake_kernel
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' is not supported by the Pallas GPU attention kernels"):
        select_attention_backend("pallas", SMOLLM2, jnp.bfloat16, 16, kv_cache_dtype="fp8")
