"""Lab kernel: a bf16 linear at a decode step's few rows (x [T, K] @ w [K, N], T <= 64), Pallas
Triton, K split over programs with float32 partial sums added after the call (as XLA's split-K).

Two forms: `plain` keeps x as the dot's first operand (T rows padded to 16, mma.sync), `swapped`
computes out^T = w^T . x^T so the weight's columns are the MMA's 64-row side. Question asked of it:
do XLA's own GEMMs at 16 rows (96% of the copy rate in sum, 2.4-2.5 TB/s on the small qkv and o
shapes: benchmarks/results/step_trace_h100.md) leave time a tiling chosen on cold weights wins?
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_pl_dot = getattr(plgpu, "dot", None) or pl.dot


def _kernel(x_ref, w_ref, o_ref, *, steps: int, bk: int, swapped: bool):
    _, tp, bn = o_ref.shape
    first = pl.program_id(1) * steps

    def body(i, acc):
        xb = x_ref[:, pl.ds(i * bk, bk)]  # [tp, bk]
        wb = w_ref[pl.ds(i * bk, bk), :]  # [bk, bn]
        if swapped:
            return acc + _pl_dot(wb, xb, trans_a=True, trans_b=True)  # [bn, tp]
        return acc + _pl_dot(xb, wb)  # [tp, bn]

    shape = (bn, tp) if swapped else (tp, bn)
    acc = lax.fori_loop(first, first + steps, body, jnp.zeros(shape, jnp.float32))
    o_ref[...] = (acc.T if swapped else acc)[None]


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "splits", "num_warps", "num_stages", "swapped",
                                             "interpret"))
def matmul_rows(x: jax.Array, w: jax.Array, *, block_n: int = 128, block_k: int = 128, splits: int = 4,
                num_warps: int = 4, num_stages: int = 3, swapped: bool = False, interpret: bool = False) -> jax.Array:
    t, k = x.shape
    n = w.shape[1]
    tp = max(16, -(-t // 16) * 16)
    if n % block_n or k % (block_k * splits):
        raise ValueError(f"matmul_rows: N={n} K={k} do not fit block_n={block_n}, block_k={block_k} x {splits} splits")
    xp = jnp.pad(x, ((0, tp - t), (0, 0)))
    kwargs = {} if interpret else {"compiler_params": plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)}
    sums = pl.pallas_call(
        functools.partial(_kernel, steps=k // (block_k * splits), bk=block_k, swapped=swapped),
        grid=(n // block_n, splits),
        in_specs=[pl.BlockSpec((tp, k), lambda j, s: (0, 0)), pl.BlockSpec((k, block_n), lambda j, s: (0, j))],
        out_specs=pl.BlockSpec((1, tp, block_n), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((splits, tp, n), jnp.float32),
        interpret=interpret, name="bf16_rows", **kwargs,
    )(xp, w)
    return sums.sum(0)[:t].astype(x.dtype)
