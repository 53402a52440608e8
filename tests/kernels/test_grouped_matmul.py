"""The grouped matmul of the MoE layer against a numpy loop over experts: ragged group sizes,
empty experts (first, middle, last), and rows past the groups' total, which must come out zero."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.pallas_kernels.grouped_matmul import MgpuTiling, grouped_matmul, mgpu_applies


def _numpy_loop(x: np.ndarray, w: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    out = np.zeros((x.shape[0], w.shape[2]), np.float64)
    start = 0
    for g, n in enumerate(sizes):
        out[start:start + n] = x[start:start + n].astype(np.float64) @ w[g].astype(np.float64)
        start += n
    return out


@pytest.mark.parametrize("sizes,m", [
    ([3, 0, 5, 1], 9),  # an empty middle expert
    ([0, 4, 4, 0], 8),  # empty first and last
    ([0, 0, 0, 7], 7),  # everything in one
    ([2, 0, 1, 0], 6),  # rows past the total (3 of 6) are zero
    ([1], 1),  # one row, one expert (decode with top-1)
])
def test_grouped_matmul_matches_numpy_loop(sizes, m):
    rng = np.random.default_rng(len(sizes) * 10 + m)
    g, k, n = len(sizes), 24, 40
    x = rng.standard_normal((m, k), np.float32)
    w = rng.standard_normal((g, k, n), np.float32)
    got = np.asarray(grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes, jnp.int32)))
    np.testing.assert_allclose(got, _numpy_loop(x, w, np.asarray(sizes)), atol=1e-4, rtol=1e-5)


def test_bad_arguments_are_value_errors():
    x, w = jnp.zeros((4, 8)), jnp.zeros((2, 8, 16))
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_matmul(x, w, jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match=r"\[M, K\] and \[G, K, N\]"):
        grouped_matmul(x, jnp.zeros((2, 4, 16)), jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="impl must be one of"):
        grouped_matmul(x, w, jnp.zeros((2,), jnp.int32), impl="cutlass")
    with pytest.raises(ValueError, match="bf16/f16"):  # float32: the Hopper kernel does not apply
        grouped_matmul(x, w, jnp.zeros((2,), jnp.int32), impl="mgpu")


def test_hopper_kernel_constraints():
    t = MgpuTiling()
    bf, f32 = jnp.bfloat16, jnp.float32

    def applies(x, w, dtype=bf):
        return mgpu_applies(jax.ShapeDtypeStruct(x, dtype), jax.ShapeDtypeStruct(w, dtype), t)

    assert applies((3, 4096), (8, 4096, 28672))  # Mixtral fused gate/up
    assert applies((16, 768), (128, 768, 2048))  # Qwen3-30B-A3B down
    assert not applies((3, 4096), (8, 4096, 128), f32)
    assert not applies((3, 96), (8, 96, 128))  # K % block_k
    assert not applies((3, 128), (8, 128, 96))  # N % block_n


def test_hopper_wrapper_pads_masks_and_falls_back(monkeypatch):
    """The wrapper around the bundled kernel, with a stand-in kernel on CPU: rows padded to whole
    row tiles and sliced back, rows past the groups' total (which the kernel leaves unwritten)
    zeroed; and under "auto" a kernel that refuses the call while tracing gives ragged_dot's result."""
    import types

    from jaxengine.pallas_kernels import grouped_matmul as gm

    seen = {}

    def fake_ragged_dot(lhs, rhs, *, group_sizes, block_m, block_n, block_k, max_concurrent_steps, grid_block_n):
        seen["rows"] = lhs.shape[0]
        out = jax.lax.ragged_dot(lhs, rhs, group_sizes)
        return out + 7.0 * (jnp.arange(lhs.shape[0]) >= jnp.sum(group_sizes))[:, None].astype(out.dtype)  # junk

    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((10, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((3, 64, 128)), jnp.bfloat16)
    sizes = jnp.asarray([4, 0, 3], jnp.int32)  # 3 rows past the total
    want = np.asarray(jax.lax.ragged_dot(x, w, sizes), np.float32)
    monkeypatch.setattr(gm, "_mgpu_module", lambda: types.SimpleNamespace(ragged_dot=fake_ragged_dot))
    got = np.asarray(gm.grouped_matmul(x, w, sizes, impl="mgpu"), np.float32)
    assert seen["rows"] == 64 and got.shape == (10, 128)
    np.testing.assert_array_equal(got, want)

    def refusing(*args, **kwargs):
        raise TypeError("unexpected keyword argument 'block_m'")

    monkeypatch.setattr(gm, "_mgpu_module", lambda: types.SimpleNamespace(ragged_dot=refusing))
    monkeypatch.setattr(gm, "_is_hopper", lambda: True)
    np.testing.assert_array_equal(np.asarray(gm.grouped_matmul(x, w, sizes), np.float32), want)
