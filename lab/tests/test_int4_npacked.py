"""lab/kernels/int4_npacked.py: the N-packed int4 kernel in interpret mode against its float
reference (and that reference against numpy), and its lowering for an H100 (Triton IR on the CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lab.kernels import int4_npacked as m


def _inputs(k: int, n: int, group: int, t: int = 5, dtype=jnp.float32):
    rng = np.random.default_rng(k + n + group)
    vals = rng.integers(0, 16, (k, n), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.02, (k // group, n)).astype(np.float32)
    zeros = rng.integers(0, 16, (k // group, n), dtype=np.uint8)
    x = rng.standard_normal((t, k)).astype(np.float32)
    w = (vals - np.repeat(zeros, group, 0).astype(np.float32)) * np.repeat(scales, group, 0)
    return (jnp.asarray(x, dtype), jnp.asarray(m.pack_cols_n(vals)), jnp.asarray(scales), jnp.asarray(zeros)), x @ w


@pytest.mark.parametrize("kw", [dict(), dict(block_k=64, splits=2), dict(block_n=64)])
def test_npacked_kernel_matches_reference(kw):
    (x, packed, scales, zeros), want = _inputs(512, 256, 128)
    ref = m.reference(x, packed, scales, zeros, 128)
    np.testing.assert_allclose(np.asarray(ref), want, rtol=1e-5, atol=1e-4)
    got = m.matmul(x, packed, scales, zeros, group_size=128, interpret=True, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-4)


def test_npacked_kernel_lowers_for_an_h100():
    from tests.kernels.cuda_target import abstract_h100

    (x, packed, scales, zeros), _ = _inputs(512, 256, 128, t=16, dtype=jnp.bfloat16)
    fn = jax.jit(lambda x, p, s, z: m.matmul(x, p, s, z, group_size=128))
    with abstract_h100():
        text = fn.trace(x, packed, scales.astype(jnp.bfloat16), zeros).lower(lowering_platforms=("cuda",)).as_text()
    assert "int4_npacked_matmul" in text
