"""Lab kernels: a linear at a decode step's few rows (T <= 64), Pallas Triton, K split over
programs with float32 partial sums added after the call (as XLA's split-K), in two forms each:
`plain` keeps x as the dot's first operand (T rows padded to 16), `swapped` computes
out^T = w . x^T so the weight's columns are the MMA's 64-row side.

- `bf16_rows`: x [T, K] @ w [K, N] (the engine's bf16 layout).
- `fp8_rows`: x [T, K] @ (qweight [N, K] e4m3 * scale [N]).T, the weight converted in registers
  (W8A16; `plain` is the product's fp8_weight_matmul).

Question asked of them (lab/gpu_checks/bf16_rows_probe.py): do XLA's own GEMMs at 16 rows leave
time that a tiling chosen on cold weights, or the swapped form, wins?
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_pl_dot = getattr(plgpu, "dot", None) or pl.dot


def _kernel(x_ref, w_ref, *rest, steps: int, bk: int, swapped: bool, fp8: bool):
    s_ref, o_ref = rest if fp8 else (None, rest[0])
    _, tp, bn = o_ref.shape
    first = pl.program_id(1) * steps

    def body(i, acc):
        xb = x_ref[:, pl.ds(i * bk, bk)]  # [tp, bk]
        if fp8:  # [bn, bk], converted exactly
            wb = w_ref[:, pl.ds(i * bk, bk)].astype(xb.dtype)
            return acc + (_pl_dot(wb, xb, trans_b=True) if swapped else _pl_dot(xb, wb, trans_b=True))
        wb = w_ref[pl.ds(i * bk, bk), :]  # [bk, bn]
        return acc + (_pl_dot(wb, xb, trans_a=True, trans_b=True) if swapped else _pl_dot(xb, wb))

    acc = lax.fori_loop(first, first + steps, body, jnp.zeros((bn, tp) if swapped else (tp, bn), jnp.float32))
    if fp8:
        s = s_ref[...].astype(jnp.float32)
        acc = acc * (s[:, None] if swapped else s[None, :])
    o_ref[...] = (acc.T if swapped else acc)[None]


def _launch(x, operands, w_spec, n: int, *, fp8: bool, block_n: int, block_k: int, splits: int, num_warps: int,
            num_stages: int, swapped: bool, interpret: bool) -> jax.Array:
    t, k = x.shape
    tp = max(16, -(-t // 16) * 16)
    if n % block_n or k % (block_k * splits):
        raise ValueError(f"rows_matmul: N={n} K={k} do not fit block_n={block_n}, block_k={block_k} x {splits} splits")
    xp = jnp.pad(x, ((0, tp - t), (0, 0)))
    kwargs = {} if interpret else {"compiler_params": plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)}
    in_specs = [pl.BlockSpec((tp, k), lambda j, s: (0, 0)), w_spec]
    if fp8:
        in_specs.append(pl.BlockSpec((block_n,), lambda j, s: (j,)))
    sums = pl.pallas_call(
        functools.partial(_kernel, steps=k // (block_k * splits), bk=block_k, swapped=swapped, fp8=fp8),
        grid=(n // block_n, splits), in_specs=in_specs,
        out_specs=pl.BlockSpec((1, tp, block_n), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((splits, tp, n), jnp.float32),
        interpret=interpret, name="fp8_rows" if fp8 else "bf16_rows", **kwargs,
    )(xp, *operands)
    return sums.sum(0)[:t].astype(x.dtype)


_STATIC = ("block_n", "block_k", "splits", "num_warps", "num_stages", "swapped", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def bf16_rows(x: jax.Array, w: jax.Array, *, block_n: int = 128, block_k: int = 128, splits: int = 4,
              num_warps: int = 4, num_stages: int = 3, swapped: bool = False, interpret: bool = False) -> jax.Array:
    """x [T, K] @ w [K, N] -> [T, N] in x's dtype."""
    k, n = w.shape
    return _launch(x, (w,), pl.BlockSpec((k, block_n), lambda j, s: (0, j)), n, fp8=False, block_n=block_n,
                   block_k=block_k, splits=splits, num_warps=num_warps, num_stages=num_stages, swapped=swapped,
                   interpret=interpret)


@functools.partial(jax.jit, static_argnames=_STATIC)
def fp8_rows(x: jax.Array, qweight: jax.Array, scale: jax.Array, *, block_n: int = 128, block_k: int = 128,
             splits: int = 4, num_warps: int = 4, num_stages: int = 3, swapped: bool = True,
             interpret: bool = False) -> jax.Array:
    """x [T, K] @ (qweight [N, K] e4m3 * scale [N]).T -> [T, N] in x's dtype."""
    n, k = qweight.shape
    return _launch(x, (qweight, scale.astype(jnp.float32)), pl.BlockSpec((block_n, k), lambda j, s: (j, 0)), n,
                   fp8=True, block_n=block_n, block_k=block_k, splits=splits, num_warps=num_warps,
                   num_stages=num_stages, swapped=swapped, interpret=interpret)
