"""Gathered grouped matmul on GPU: one Triton-lowered Pallas kernel that reads only the weights of
the groups (experts) that hold rows, for the few rows of a decode step.

Same contract as `gathered_matmul_reference` (`jax.lax.ragged_dot`, the model's reference path):

    x_sorted [M, K]   rows sorted by group: group g holds rows sum(sizes[:g]) .. sum(sizes[:g+1])
    w        [G, K, N] one weight per group (expert)
    sizes    [G] int32, sum(sizes) <= M
    ->       [M, N]    row r of group g is x_sorted[r] @ w[g]; rows past sum(sizes) are zero

Why: `lax.ragged_dot` and the bundled Mosaic kernel read every group's weight, empty groups
included, so one decode token of Qwen3-30B-A3B (8 of 128 experts hit) reads 16x the bytes it needs.

Grid (S, N / block_n) with S = min(G, M) slots: at most M groups can hold rows. Program (h, j)
finds slot h itself from `sizes` (G padded to a power of two, read whole: a rank of the
non-empty groups by cumsum, then the h-th one's expert id, first row and row count), so the call
is one kernel with no table built before it. For each tile of `block_m` rows of its group (one
tile in decode) it walks K in blocks of `block_k`: loads the rows of x (masked to the group) and
its expert's [block_k, block_n] weight tile by offsets into the whole w, accumulates in float32,
and stores the tile's rows (masked). An empty slot runs no tile. Slot 0's programs also write
zeros to the rows past sum(sizes), so every output row is written by the kernel. Masked rows past
M are neither read nor written on the GPU; interpret mode clamps a slice at the array's end, so
there x and the output carry `block_m` extra rows.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

TARGET_PROGRAMS = 264  # about two programs per SM of an H100 (132 SMs)
_BLOCK_NS = (128, 64, 32)  # column tiles, widest first
_BLOCK_KS = (128, 64, 32, 16)  # K blocks, largest dividing K (float32: at most 64, so that three
# pipeline stages of a [block_k, 128] weight tile stay within an sm_80's shared memory)
_MAX_OFFSET = 2**31 - 1  # element offsets into w are int32
_pl_dot = getattr(plgpu, "dot", None) or pl.dot


@dataclasses.dataclass(frozen=True)
class GatheredTiling:
    """Tile sizes. block_n / block_k None: picked per shape (`pick_block_n`; the largest of
    `_BLOCK_KS` dividing K, at most 64 for float32). block_m is the rows of one tile: 16 is Triton's smallest dot."""

    block_m: int = 16
    block_n: int | None = None
    block_k: int | None = None
    num_warps: int = 4
    num_stages: int = 3


def gathered_matmul_reference(x_sorted: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """`jax.lax.ragged_dot`: the reference."""
    return lax.ragged_dot(x_sorted, w, group_sizes.astype(jnp.int32))


def _block_k(k: int, itemsize: int = 2) -> int | None:
    return next((b for b in _BLOCK_KS if k % b == 0 and b * itemsize <= 256), None)


def pick_block_n(slots: int, n: int, target_programs: int = TARGET_PROGRAMS) -> int | None:
    """The widest column tile dividing N that still gives about `target_programs` programs
    (slots x N / block_n), else the narrowest dividing N: one token of Mixtral hits 2 experts, and
    its down product (N = 4096) in tiles of 128 would occupy 64 of an H100's 132 SMs."""
    fits = [b for b in _BLOCK_NS if n % b == 0]
    if not fits:
        return None
    return next((b for b in fits if slots * (n // b) >= target_programs), fits[-1])


def supported(x_sorted, w, tiling: GatheredTiling = GatheredTiling()) -> bool:
    """Whether the kernel takes these operands (arrays or jax.ShapeDtypeStructs): 2-D x and 3-D w
    of one float dtype, K a multiple of 16 (or of tiling.block_k), N of 32 (or of tiling.block_n),
    and w small enough for int32 element offsets."""
    if len(x_sorted.shape) != 2 or len(w.shape) != 3 or x_sorted.shape[1] != w.shape[1]:
        return False
    g, k, n = w.shape
    if x_sorted.dtype != w.dtype or x_sorted.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        return False
    k_ok = k % tiling.block_k == 0 if tiling.block_k else _block_k(k) is not None
    n_ok = n % tiling.block_n == 0 if tiling.block_n else n % _BLOCK_NS[-1] == 0
    return k_ok and n_ok and g * k * n <= _MAX_OFFSET and (x_sorted.shape[0] + tiling.block_m) * max(k, n) <= _MAX_OFFSET


def _slot(s_ref, h, m: int):
    """Slot h's (expert id, first row, row count): the h-th group holding rows, in group order;
    a count of 0 when fewer than h + 1 groups hold rows. Counts are clipped to the M rows."""
    gi = jnp.arange(s_ref.shape[0], dtype=jnp.int32)
    sizes = s_ref[...]
    hit = sizes > 0
    pick = hit & (jnp.cumsum(hit.astype(jnp.int32)) == h + 1)
    expert = jnp.sum(jnp.where(pick, gi, 0))
    first = jnp.sum(jnp.where(pick, jnp.cumsum(sizes) - sizes, 0))
    rows = jnp.clip(jnp.minimum(jnp.sum(jnp.where(pick, sizes, 0)), m - first), 0)
    return expert, first, rows, jnp.minimum(jnp.sum(sizes), m)


def _kernel(s_ref, x_ref, w_ref, o_ref, *, m: int, block_m: int, block_n: int, block_k: int):
    """Program (slot h, column tile j): every row tile of slot h's group times its expert's
    columns j * block_n .. + block_n; slot 0 also zeroes the rows past the groups' total."""
    h, j = pl.program_id(0), pl.program_id(1)
    expert, first, rows, total = _slot(s_ref, h, m)
    k_steps = x_ref.shape[1] // block_k
    n0 = pl.multiple_of(j * block_n, block_n)
    r = jnp.arange(block_m, dtype=jnp.int32)

    def row_tile(i, carry):
        r0 = first + i * block_m
        valid = (i * block_m + r < rows)[:, None]  # [block_m, 1]

        def k_step(kb, acc):
            k0 = pl.multiple_of(kb * block_k, block_k)
            xt = plgpu.load(x_ref.at[pl.ds(r0, block_m), pl.ds(k0, block_k)],
                            mask=jnp.broadcast_to(valid, (block_m, block_k)), other=0)
            wt = w_ref[expert, pl.ds(k0, block_k), pl.ds(n0, block_n)]  # [block_k, block_n]
            prec = lax.Precision.HIGHEST if xt.dtype == jnp.float32 else None  # not tf32
            return acc + _pl_dot(xt, wt, precision=prec)

        acc = lax.fori_loop(0, k_steps, k_step, jnp.zeros((block_m, block_n), jnp.float32))
        plgpu.store(o_ref.at[pl.ds(r0, block_m), pl.ds(n0, block_n)], acc.astype(o_ref.dtype),
                    mask=jnp.broadcast_to(valid, (block_m, block_n)))
        return carry

    lax.fori_loop(0, (rows + block_m - 1) // block_m, row_tile, 0)  # no tile for an empty slot

    def zero_tile(i, carry):
        r0 = total + i * block_m
        plgpu.store(o_ref.at[pl.ds(r0, block_m), pl.ds(n0, block_n)], jnp.zeros((block_m, block_n), o_ref.dtype),
                    mask=jnp.broadcast_to((r0 + r < m)[:, None], (block_m, block_n)))
        return carry

    lax.fori_loop(0, jnp.where(h == 0, (m - total + block_m - 1) // block_m, 0), zero_tile, 0)


@functools.partial(jax.jit, static_argnames=("tiling", "interpret"))
def gathered_matmul(x_sorted: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                    tiling: GatheredTiling = GatheredTiling(), interpret: bool = False) -> jax.Array:
    """x_sorted [M, K], w [G, K, N], group_sizes [G] -> [M, N] in x's dtype (module docstring);
    reads the weights of the non-empty groups only."""
    if not supported(x_sorted, w, tiling):
        raise ValueError(f"gathered grouped matmul: unsupported operands {x_sorted.dtype} {x_sorted.shape} x "
                         f"{w.dtype} {w.shape} (one float dtype, K a multiple of 16, N of 32, G*K*N < 2^31)")
    if group_sizes.shape != (w.shape[0],):
        raise ValueError(f"gathered grouped matmul: group_sizes {group_sizes.shape} does not match {w.shape[0]} groups")
    m, k = x_sorted.shape
    g, _, n = w.shape
    bm = tiling.block_m
    slots = min(g, m)
    bn = tiling.block_n or pick_block_n(slots, n)
    bk = tiling.block_k or _block_k(k, jnp.dtype(x_sorted.dtype).itemsize)
    sizes = group_sizes.astype(jnp.int32)
    if g & (g - 1):  # a Triton block is a power of two long; the padding groups are empty
        sizes = jnp.pad(sizes, (0, (1 << g.bit_length()) - g))
    pad = bm if interpret else 0  # interpret mode clamps a slice that leaves its array
    xp = jnp.pad(x_sorted, ((0, pad), (0, 0))) if pad else x_sorted
    kwargs = {}
    if not interpret:
        kwargs["compiler_params"] = plgpu.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages)
    out = pl.pallas_call(
        functools.partial(_kernel, m=m, block_m=bm, block_n=bn, block_k=bk),
        grid=(slots, n // bn),
        out_shape=jax.ShapeDtypeStruct((m + pad, n), x_sorted.dtype),
        interpret=interpret, name="gathered_grouped_matmul", **kwargs,
    )(sizes, xp, w)
    return out[:m] if pad else out


__all__ = ["GatheredTiling", "gathered_matmul", "gathered_matmul_reference", "pick_block_n", "supported"]
