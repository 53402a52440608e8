"""Grouped matmul for mixture-of-experts layers: rows sorted by expert, each group of rows times
its own expert's weight.

    x_sorted [M, K]   rows sorted by group: group g holds rows sum(sizes[:g]) .. sum(sizes[:g+1])
    w        [G, K, N] one weight per group (expert)
    sizes    [G] int32, sum(sizes) <= M
    ->       [M, N]    row r of group g is x_sorted[r] @ w[g]; rows past sum(sizes) are zero

`grouped_matmul` is the one entry point the model calls. It runs `jax.lax.ragged_dot` (the
reference, and the path on CPU and on GPUs other than Hopper) or, on Hopper (sm_90) with bf16 or
f16 operands whose shapes fit its tiles, the Mosaic GPU kernel jax ships in
`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`. Both read every group's weight, empty groups
included. For few rows (M <= GATHERED_MAX_ROWS: decode steps) on an NVIDIA GPU of sm_80+ it runs
the gathered kernel (grouped_matmul_gpu.py) instead, which reads only the weights of the groups
that hold rows: one decode token of Qwen3-30B-A3B hits 8 of 128 experts. That kernel leaves rows past sum(sizes)
unwritten, so its output is masked to keep the contract above. It is called through `_mgpu`, the
one place that knows its signature: a Hopper kernel of this project's own can replace it there.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp

from jaxengine.pallas_kernels import grouped_matmul_gpu as gathered

logger = logging.getLogger(__name__)

IMPLS = ("auto", "ragged_dot", "mgpu", "gathered")
# Few rows: reading only the hit experts beats reading all. At M = T*k rows at most this many
# (a decode bucket of 32 tokens of a top-8 model, 128 of a top-2 one) "auto" takes the gathered
# kernel on GPU. Padding rows of a bucket are excluded from the groups, so batch-1 decode in the
# 16-token bucket (128 rows of Qwen3-30B-A3B) reads the 8 experts of its one token, not all 128.
# On the H100 at 256 tokens of Qwen3-30B-A3B (2,048 rows) the bundled kernel is ahead (0.36 against
# 0.42 ms for gate/up) and at 2,048 tokens 4x ahead; the other paths tile rows more widely.
GATHERED_MAX_ROWS = 256


@dataclasses.dataclass(frozen=True)
class MgpuTiling:
    """Tile sizes for the bundled Hopper kernel: K must be a multiple of block_k, N of
    block_n * grid_block_n; M is padded to a multiple of block_m."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int = 1


def grouped_matmul_reference(x_sorted: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """`jax.lax.ragged_dot`: the reference for every other implementation."""
    return jax.lax.ragged_dot(x_sorted, w, group_sizes.astype(jnp.int32))


def _compute_capability() -> tuple[int, int] | None:
    """(major, minor) of the first GPU; None off GPUs or where it does not parse (ROCm's gfx names)."""
    if jax.default_backend() != "gpu":
        return None
    cc = getattr(jax.devices()[0], "compute_capability", None)
    try:
        major, minor = str(cc).split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def _is_hopper() -> bool:
    cc = _compute_capability()
    return cc is not None and cc[0] == 9


def _is_sm80_plus() -> bool:
    """NVIDIA Ampere or newer: the Triton-lowered kernel's bf16 tensor-core products."""
    cc = _compute_capability()
    return cc is not None and cc >= (8, 0)


def mgpu_applies(x_sorted: jax.Array, w: jax.Array, tiling: MgpuTiling = MgpuTiling()) -> bool:
    """Whether the bundled Hopper kernel takes these operands (shapes and dtypes only; the
    device is checked by `grouped_matmul`); arrays or jax.ShapeDtypeStructs."""
    if len(x_sorted.shape) != 2 or len(w.shape) != 3:
        return False
    _, k = x_sorted.shape
    _, k2, n = w.shape
    return (x_sorted.dtype == w.dtype and x_sorted.dtype in (jnp.bfloat16, jnp.float16) and k == k2
            and k % tiling.block_k == 0 and n % (tiling.block_n * tiling.grid_block_n) == 0)


@functools.lru_cache(maxsize=1)
def _mgpu_module():
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    except ImportError as e:  # a jax without Mosaic GPU
        logger.info("no bundled ragged_dot_mgpu kernel: %s", e)
        return None
    return ragged_dot_mgpu


def _mgpu_call(x_sorted: jax.Array, w: jax.Array, group_sizes: jax.Array, tiling: MgpuTiling) -> jax.Array:
    """The bundled kernel, rows padded to whole row tiles and rows past sum(sizes) zeroed."""
    m = x_sorted.shape[0]
    pad = -m % tiling.block_m
    xp = jnp.pad(x_sorted, ((0, pad), (0, 0))) if pad else x_sorted
    out = _mgpu_module().ragged_dot(
        xp, w, group_sizes=group_sizes.astype(jnp.int32), block_m=tiling.block_m, block_n=tiling.block_n,
        block_k=tiling.block_k, max_concurrent_steps=tiling.max_concurrent_steps,
        grid_block_n=tiling.grid_block_n)[:m]
    valid = jnp.arange(m) < jnp.sum(group_sizes)
    return jnp.where(valid[:, None], out, jnp.zeros((), out.dtype))


# A jitted call: a model calls the kernel with the same shapes in every layer, and jax lowers a
# jitted function once per shape and calls it from each site. Unjitted, every call site lowered
# its own copy of the Mosaic kernel and XLA compiled each one.
_mgpu = jax.jit(_mgpu_call, static_argnames=("tiling",))


def grouped_matmul(x_sorted: jax.Array, w: jax.Array, group_sizes: jax.Array, *, impl: str = "auto",
                   tiling: MgpuTiling = MgpuTiling(),
                   gathered_tiling: gathered.GatheredTiling = gathered.GatheredTiling()) -> jax.Array:
    """x_sorted [M, K], w [G, K, N], group_sizes [G] -> [M, N] (module docstring).

    impl: "auto" (on an sm_80+ GPU the gathered kernel for at most GATHERED_MAX_ROWS rows, else
    the Hopper kernel where it applies, else ragged_dot; a kernel that refuses the call while
    tracing gives way to the next, with a warning), "ragged_dot", "mgpu" (the Hopper kernel, a
    ValueError where it does not apply) or "gathered" (the gathered kernel at any M, a ValueError
    where it does not apply; in Pallas interpret mode off GPUs, for tests)."""
    if impl not in IMPLS:
        raise ValueError(f"grouped_matmul impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if x_sorted.ndim != 2 or w.ndim != 3 or x_sorted.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_matmul: x_sorted {x_sorted.shape} and w {w.shape} are not [M, K] and [G, K, N]")
    if group_sizes.shape != (w.shape[0],):
        raise ValueError(f"grouped_matmul: group_sizes {group_sizes.shape} does not match {w.shape[0]} groups")
    if impl == "gathered":
        if not gathered.supported(x_sorted, w, gathered_tiling):
            raise ValueError(f"grouped_matmul impl='gathered' needs x and w of one float dtype, K a multiple of 16 "
                             f"and N of 32 (or of the tiling's blocks), G*K*N < 2^31; got {x_sorted.dtype} "
                             f"{x_sorted.shape} x {w.dtype} {w.shape}")
        return gathered.gathered_matmul(x_sorted, w, group_sizes, tiling=gathered_tiling,
                                        interpret=jax.default_backend() != "gpu")
    if impl == "mgpu":
        if not (mgpu_applies(x_sorted, w, tiling) and _mgpu_module() is not None):
            raise ValueError(f"grouped_matmul impl='mgpu' needs bf16/f16 operands, K % {tiling.block_k} == 0 and "
                             f"N % {tiling.block_n * tiling.grid_block_n} == 0; got {x_sorted.dtype} "
                             f"{x_sorted.shape} x {w.dtype} {w.shape}")
        return _mgpu(x_sorted, w, group_sizes, tiling)
    if impl == "auto" and x_sorted.shape[0] <= GATHERED_MAX_ROWS and _is_sm80_plus() \
            and gathered.supported(x_sorted, w, gathered_tiling):
        try:
            return gathered.gathered_matmul(x_sorted, w, group_sizes, tiling=gathered_tiling)
        except (TypeError, ValueError, NotImplementedError) as e:
            _warn_once(f"gathered grouped matmul refused {x_sorted.shape} x {w.shape} ({type(e).__name__}: {e}); "
                       "using the other paths")
    if impl == "auto" and _is_hopper() and mgpu_applies(x_sorted, w, tiling) and _mgpu_module() is not None:
        try:
            return _mgpu(x_sorted, w, group_sizes, tiling)
        except (TypeError, ValueError, NotImplementedError) as e:  # a jax whose kernel takes other arguments
            _warn_once(f"bundled ragged_dot_mgpu refused {x_sorted.shape} x {w.shape} ({type(e).__name__}: {e}); "
                       "using lax.ragged_dot")
    return grouped_matmul_reference(x_sorted, w, group_sizes)


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    logger.warning(message)
