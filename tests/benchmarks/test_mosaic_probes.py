"""The Mosaic GPU probes (benchmarks/kernels/probe_*.py) still lower for CUDA on this host, so
they run again on a GPU as written: the pushed store between cluster CTAs and the transposed
decode step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")


def test_transposed_decode_step_lowers():
    from benchmarks.kernels import probe_transposed_decode as probe

    q = jax.ShapeDtypeStruct((probe.HEADS, probe.H), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((probe.KEYS, probe.H), jnp.bfloat16)
    text = jax.jit(probe.step).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("tile", ["bf16", "f32sw32"])
def test_async_store_probe_lowers(tile):
    from benchmarks.kernels import probe_async_store as probe

    f, x = probe.kernel(tile, 1)
    assert x.shape == probe.TILES[tile][0]
    assert "mosaic_gpu" in jax.jit(f).trace(x).lower(lowering_platforms=("cuda",)).as_text()
