"""FP8 weights times bf16 activations on GPU, for the few rows of a decode step: one
Triton-lowered Pallas kernel that reads the e4m3 weight once and converts it to the activations'
dtype in registers (W8A16).

The fp8 linear's large-row path quantizes the activations to e4m3 per row and runs XLA's FP8 GEMM
(cuBLASLt). At a decode step's 16-64 rows that GEMM moves its weight bytes well below the copy
rate, and the activation quantization adds kernels of its own to every linear; this kernel reads
the same bytes with nothing around it. Its output is x @ (qweight * scale).T computed in float32
from bf16 x and the exactly converted weights: the activations are not rounded to e4m3, so it is
at least as accurate as the W8A8 path.

    x [T, K] (bf16 / f16 / f32), qweight [N, K] float8_e4m3fn (the checkpoint's row layout),
    scale [N] float32 -> [T, N] in x's dtype

Grid (T / block_m, N / block_n, K splits). A program walks its share of K in blocks of block_k
(BLOCK_K by default): loads the [block_n, block_k] weight tile, converts it and meets x's [block_m, BLOCK_K] tile in
one dot against the tile's transpose. Narrow outputs (o_proj, down_proj: 32 column tiles at
block_n 128) would occupy a quarter of the H100's 132 SMs, so K is split over programs and the
float32 partial sums added after the call (as in weight_only_matmul_gpu.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxengine.pallas_kernels.weight_only_matmul_gpu import pick_splits

BLOCK_K = 128
_pl_dot = getattr(plgpu, "dot", None) or pl.dot


def fp8_matmul_reference(x: jax.Array, qweight: jax.Array, scale: jax.Array) -> jax.Array:
    """x @ (qweight * scale).T with the weight converted exactly, float32 accumulation."""
    w = qweight.astype(jnp.float32) * scale.astype(jnp.float32)[:, None]
    return jnp.dot(x.astype(jnp.float32), w.T, precision=lax.Precision.HIGHEST).astype(x.dtype)


def supported(t: int, k: int, n: int, block_n: int = 128) -> bool:
    """Whether the kernel takes this shape (else callers keep the W8A8 path)."""
    del t
    return k % BLOCK_K == 0 and n % block_n == 0


def _kernel(x_ref, w_ref, s_ref, o_ref, *, steps: int, block_k: int):
    _, block_m, block_n = o_ref.shape
    first = pl.program_id(2) * steps

    def body(kb, acc):
        w = w_ref[:, pl.ds(kb * block_k, block_k)].astype(x_ref.dtype)  # [block_n, block_k], exact
        xb = x_ref[:, pl.ds(kb * block_k, block_k)]  # [block_m, block_k]
        prec = lax.Precision.HIGHEST if xb.dtype == jnp.float32 else None
        return acc + _pl_dot(xb, w, trans_b=True, precision=prec)

    acc = lax.fori_loop(first, first + steps, body, jnp.zeros((block_m, block_n), jnp.float32))
    o_ref[...] = (acc * s_ref[...].astype(jnp.float32)[None, :])[None]


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "splits", "num_warps", "num_stages",
                                             "interpret"))
def fp8_weight_matmul(x: jax.Array, qweight: jax.Array, scale: jax.Array, *, block_m: int = 16,
                      block_n: int = 128, block_k: int = BLOCK_K, splits: int | None = None, num_warps: int = 4,
                      num_stages: int = 3, interpret: bool = False) -> jax.Array:
    """x [T, K] @ (qweight [N, K] * scale [N]).T -> [T, N] in x's dtype (module docstring). T is
    padded to a multiple of `block_m` (at least 16, Triton's smallest dot). `block_k`: K per step
    (a multiple of BLOCK_K dividing K). `splits`: programs per output tile along K (default
    `pick_splits`)."""
    t, k = x.shape
    n = qweight.shape[0]
    if not supported(t, k, n, block_n) or k % block_k or block_k % BLOCK_K or qweight.shape != (n, k) \
            or scale.shape != (n,):
        raise ValueError(f"fp8_weight_matmul kernel: unsupported shapes x {x.shape}, qweight {qweight.shape}, "
                         f"scale {scale.shape} (K a multiple of {block_k}, {block_k} of {BLOCK_K}, N of {block_n})")
    tp = -(-t // block_m) * block_m
    xp = jnp.pad(x, ((0, tp - t), (0, 0)))
    k_steps = k // block_k
    splits = splits or pick_splits((tp // block_m) * (n // block_n), k_steps)
    if k_steps % splits:
        raise ValueError(f"fp8_weight_matmul kernel: {splits} splits do not divide {k_steps} steps of {block_k}")
    kwargs = {}
    if not interpret:
        kwargs["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    sums = pl.pallas_call(
        functools.partial(_kernel, steps=k_steps // splits, block_k=block_k),
        grid=(tp // block_m, n // block_n, splits),
        in_specs=[pl.BlockSpec((block_m, k), lambda i, j, s: (i, 0)),
                  pl.BlockSpec((block_n, k), lambda i, j, s: (j, 0)),
                  pl.BlockSpec((block_n,), lambda i, j, s: (j,))],
        out_specs=pl.BlockSpec((1, block_m, block_n), lambda i, j, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((splits, tp, n), jnp.float32),
        interpret=interpret, name="fp8_weight_matmul", **kwargs,
    )(xp, qweight, scale.astype(jnp.float32))
    return sums.sum(0)[:t].astype(x.dtype)


__all__ = ["fp8_matmul_reference", "fp8_weight_matmul", "supported"]
