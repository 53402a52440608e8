"""The grouped matmul of the MoE layer against a numpy loop over experts: ragged group sizes,
empty experts (first, middle, last), and rows past the groups' total, which must come out zero.
The gathered kernel (grouped_matmul_gpu.py) runs in Pallas interpret mode against lax.ragged_dot,
and is lowered for an H100 (Triton) without one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.pallas_kernels import grouped_matmul_gpu as gathered
from jaxengine.pallas_kernels.grouped_matmul import GATHERED_MAX_ROWS, MgpuTiling, grouped_matmul, mgpu_applies
from tests.kernels.cuda_target import abstract_h100


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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("sizes,m,k,n", [
    ([3, 0, 5, 1], 9, 64, 96),  # ragged, an empty middle expert; N in tiles of 32
    ([0, 37, 2, 0], 39, 48, 128),  # 37 rows: three row tiles of 16; K in blocks of 16
    ([1, 0, 0, 1, 0, 0, 1, 0], 3, 256, 64),  # M < G (3 slots for 8 experts), two K blocks of 128
    ([0, 0, 0, 7], 7, 64, 64),  # all rows in one expert
    ([2, 0, 1, 0], 6, 64, 64),  # rows past the total (3 of 6) are zero
    ([0, 3, 0, 2, 1, 0], 6, 32, 64),  # 6 groups (padded to 8 in the kernel), slots 1, 3, 4
    ([0, 0, 0, 0, 0], 4, 32, 32),  # no group holds rows: every row is zero
    ([0, 20, 0, 0, 0, 0, 0], 40, 32, 32),  # one group of two row tiles, 20 rows past the total
])
def test_gathered_kernel_matches_ragged_dot(sizes, m, k, n, dtype):
    rng = np.random.default_rng(m * 1000 + k + n)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((len(sizes), k, n)), dtype)
    s = jnp.asarray(sizes, jnp.int32)
    got = np.asarray(grouped_matmul(x, w, s, impl="gathered"), np.float32)
    want = np.asarray(jax.lax.ragged_dot(x, w, s, preferred_element_type=jnp.float32), np.float32)
    assert got.shape == (m, n)
    np.testing.assert_array_equal(got[sum(sizes):], 0.0)
    if dtype == jnp.float32:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    else:  # one bf16 rounding of a float32 sum
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * float(np.abs(want).max()))


def test_gathered_tiles_and_constraints():
    assert gathered.pick_block_n(2, 4096) == 32  # Mixtral down, one token: 2 experts x 128 tiles
    assert gathered.pick_block_n(2, 28672) == 128 and gathered.pick_block_n(64, 2048) == 128
    assert gathered.pick_block_n(8, 96) == 32 and gathered.pick_block_n(8, 100) is None

    def applies(x, w, dtype=jnp.bfloat16, wdtype=None):
        return gathered.supported(jax.ShapeDtypeStruct(x, dtype), jax.ShapeDtypeStruct(w, wdtype or dtype))

    assert applies((8, 2048), (128, 2048, 1536)) and applies((8, 768), (128, 768, 2048))  # Qwen3-30B-A3B
    assert applies((2, 4096), (8, 4096, 28672)) and applies((3, 64), (4, 64, 96), jnp.float32)
    assert not applies((3, 40), (4, 40, 128))  # K % 16
    assert not applies((3, 64), (4, 64, 100))  # N % 32
    assert not applies((3, 64), (4, 64, 128), jnp.bfloat16, jnp.float32)  # mixed dtypes
    assert not applies((3, 8192), (64, 8192, 8192))  # 2^32 weight elements: int32 offsets overflow
    with pytest.raises(ValueError, match="impl='gathered'"):
        grouped_matmul(jnp.zeros((3, 40)), jnp.zeros((4, 40, 128)), jnp.zeros((4,), jnp.int32), impl="gathered")


def test_auto_takes_gathered_kernel_for_few_rows_on_gpu(monkeypatch):
    """"auto" on an sm_80+ GPU (faked here): the gathered kernel up to GATHERED_MAX_ROWS rows,
    the other paths above it (here ragged_dot: not Hopper)."""
    from jaxengine.pallas_kernels import grouped_matmul as gm

    calls = []

    def fake_gathered(x, w, s, *, tiling):
        calls.append(x.shape[0])
        return gathered.gathered_matmul(x, w, s, tiling=tiling, interpret=True)

    monkeypatch.setattr(gm, "_is_sm80_plus", lambda: True)
    monkeypatch.setattr(gm.gathered, "gathered_matmul", fake_gathered)
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((4, 32, 64)), jnp.float32)
    for m in (5, GATHERED_MAX_ROWS + 1):
        x = jnp.asarray(rng.standard_normal((m, 32)), jnp.float32)
        s = jnp.asarray([m - 2, 0, 2, 0], jnp.int32)
        np.testing.assert_allclose(np.asarray(grouped_matmul(x, w, s)), np.asarray(jax.lax.ragged_dot(x, w, s)),
                                   rtol=1e-5, atol=1e-4)
    assert calls == [5]


@pytest.mark.parametrize("m,g,k,n", [(8, 128, 768, 2048), (2, 8, 4096, 28672)])  # Qwen3-30B-A3B down, Mixtral gate/up
def test_gathered_kernel_lowers_for_h100(m, g, k, n):
    """The Triton lowering takes the kernel at the models' decode shapes (no GPU needed)."""
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16),
            jax.ShapeDtypeStruct((g,), jnp.int32))
    with abstract_h100():
        text = jax.jit(gathered.gathered_matmul).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "gathered_grouped_matmul" in text


def test_bundled_hopper_kernel_lowered_once_for_many_call_sites():
    """Every MoE layer calls the bundled Mosaic kernel with the same shapes: jitted, it is lowered
    into the program once and called from each site (unjitted, each site carried its own copy,
    and a 48-layer model's prefill programs took minutes to compile)."""
    import re

    from jaxengine.pallas_kernels import grouped_matmul as gm

    pytest.importorskip("jax.experimental.pallas.ops.gpu.ragged_dot_mgpu")
    args = (jax.ShapeDtypeStruct((256, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((8, 2048, 256), jnp.bfloat16),
            jax.ShapeDtypeStruct((8,), jnp.int32))

    def count(n: int) -> int:
        def layers(x, w, s):
            for _ in range(n):
                x = x + gm._mgpu(x, w, s, MgpuTiling())[:, :1]
            return x

        with abstract_h100():
            text = jax.jit(layers).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        return len(re.findall(r"custom_call @mosaic_gpu", text))

    # the first site (the program's own argument) may get its own copy; the copies do not grow with the sites
    assert count(3) == count(8) <= 2
