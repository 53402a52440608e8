"""Lab kernel: e4m3 weights [N, K] with per-channel scales times bf16 x at a decode step's few rows
(W8A16: the weight converted in registers), in two forms. `plain` is the product's
fp8_weight_matmul (x the dot's first operand, the converted weight tile its transposed second);
`swapped` computes out^T = w . x^T, so the converted [block_n, block_k] tile, K-contiguous as
stored, is the dot's first operand and the MMA's 64-row side (the form that took the int4 kernel
from 150 to 117 us a layer: benchmarks/results/weight_only_h100.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_pl_dot = getattr(plgpu, "dot", None) or pl.dot


def _kernel(x_ref, w_ref, s_ref, o_ref, *, steps: int, bk: int, swapped: bool):
    _, tp, bn = o_ref.shape
    first = pl.program_id(1) * steps

    def body(i, acc):
        xb = x_ref[:, pl.ds(i * bk, bk)]  # [tp, bk]
        wb = w_ref[:, pl.ds(i * bk, bk)].astype(xb.dtype)  # [bn, bk], exact
        if swapped:
            return acc + _pl_dot(wb, xb, trans_b=True)  # [bn, tp]
        return acc + _pl_dot(xb, wb, trans_b=True)  # [tp, bn]

    acc = lax.fori_loop(first, first + steps, body, jnp.zeros((bn, tp) if swapped else (tp, bn), jnp.float32))
    s = s_ref[...].astype(jnp.float32)
    o_ref[...] = ((acc * s[:, None]).T if swapped else acc * s[None, :])[None]


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "splits", "num_warps", "num_stages", "swapped",
                                             "interpret"))
def matmul_rows(x: jax.Array, qweight: jax.Array, scale: jax.Array, *, block_n: int = 128, block_k: int = 128,
                splits: int = 4, num_warps: int = 4, num_stages: int = 3, swapped: bool = True,
                interpret: bool = False) -> jax.Array:
    """x [T, K] @ (qweight [N, K] e4m3 * scale [N]).T -> [T, N] in x's dtype."""
    t, k = x.shape
    n = qweight.shape[0]
    tp = max(16, -(-t // 16) * 16)
    if n % block_n or k % (block_k * splits):
        raise ValueError(f"matmul_rows: N={n} K={k} do not fit block_n={block_n}, block_k={block_k} x {splits} splits")
    xp = jnp.pad(x, ((0, tp - t), (0, 0)))
    kwargs = {} if interpret else {"compiler_params": plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)}
    sums = pl.pallas_call(
        functools.partial(_kernel, steps=k // (block_k * splits), bk=block_k, swapped=swapped),
        grid=(n // block_n, splits),
        in_specs=[pl.BlockSpec((tp, k), lambda j, s: (0, 0)), pl.BlockSpec((block_n, k), lambda j, s: (j, 0)),
                  pl.BlockSpec((block_n,), lambda j, s: (j,))],
        out_specs=pl.BlockSpec((1, tp, block_n), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((splits, tp, n), jnp.float32),
        interpret=interpret, name="fp8_rows", **kwargs,
    )(xp, qweight, scale.astype(jnp.float32))
    return sums.sum(0)[:t].astype(x.dtype)
