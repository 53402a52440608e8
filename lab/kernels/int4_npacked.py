"""A weight-only int4 matmul whose words pack 8 values along N (the output columns) instead of
along K: a laboratory variant of pallas_kernels/weight_only_matmul_gpu.py, to time beside it.

Why (benchmarks/results/quant_h100.md, weight_only_h100.md): with K-packed words a step's
unpacked values come out as [rows, 8, block_n], and putting K back in order means either a
reshape of the middle axis (data moved between threads) or one shallow dot of depth rows per
value position (`slabs`, the engine's form: 8 dots of depth 16 per 128-row step). Packed along
N, a word's 8 values are 8 neighbouring columns of one row: the unpacked [block_k, block_n / 8, 8]
tile merges its two minor axes into [block_k, block_n], which keeps each thread's values where
they are, and the step is one dot of depth block_k, as in the fp8-weight kernel (which moves its
weight at 1.6-2.2 TB/s inside the engine's step against 0.6-0.9 TB/s for the int4 kernel).

    x [T, K] (bf16 / f32), packed [K, N / 8] int32 (value i of word (k, j) is column 8 j + i of
    row k), scales [G, N], zeros [G, N] uint8 (weight = (value - zero) * scale), groups of
    `group_size` rows (a multiple of block_k) -> [T, N] in x's dtype

Conversion as in the product kernel: the value ORed into the float32 2^23, minus (2^23 + zero).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxengine.pallas_kernels.weight_only_matmul_gpu import MAGIC, pick_splits

_pl_dot = getattr(plgpu, "dot", None) or pl.dot


def pack_cols_n(values: np.ndarray) -> np.ndarray:
    """[K, N] unsigned 4-bit values -> [K, N / 8] int32, value i of a word = column 8 j + i."""
    k, n = values.shape
    v = values.astype(np.uint32).reshape(k, n // 8, 8) << (4 * np.arange(8, dtype=np.uint32))
    return np.bitwise_or.reduce(v, axis=2).view(np.int32)


def reference(x, packed, scales, zeros, group_size: int):
    """The dequantized weight (float32) times x, float32 accumulation, x's dtype out."""
    k = packed.shape[0]
    vals = (packed[:, :, None] >> (4 * jnp.arange(8, dtype=jnp.int32))) & 15
    vals = vals.reshape(k, -1).astype(jnp.float32)
    s = jnp.repeat(scales.astype(jnp.float32), group_size, axis=0)
    z = jnp.repeat(zeros.astype(jnp.float32), group_size, axis=0)
    w = (vals - z) * s
    return jnp.dot(x.astype(jnp.float32), w, precision=lax.Precision.HIGHEST).astype(x.dtype)


def _kernel(x_ref, p_ref, s_ref, z_ref, o_ref, *, block_k: int, group_size: int, steps: int):
    _, block_m, block_n = o_ref.shape
    first = pl.program_id(2) * steps
    shifts = lax.broadcasted_iota(jnp.int32, (1, 1, 8), 2) * 4

    def body(kb, acc):
        words = p_ref[pl.ds(kb * block_k, block_k), :]  # [block_k, block_n / 8]
        ints = ((words[:, :, None] >> shifts) & 15).reshape(block_k, block_n)  # columns in order
        g = (kb * block_k) // group_size
        scale = s_ref[pl.ds(g, 1), :].astype(jnp.float32)  # [1, block_n]
        zero = z_ref[pl.ds(g, 1), :].astype(jnp.float32)
        w = (lax.bitcast_convert_type(ints | MAGIC, jnp.float32) - (zero + float(1 << 23))) * scale
        xb = x_ref[:, pl.ds(kb * block_k, block_k)]
        prec = lax.Precision.HIGHEST if xb.dtype == jnp.float32 else None
        return acc + _pl_dot(xb, w.astype(x_ref.dtype), precision=prec)

    acc = lax.fori_loop(first, first + steps, body, jnp.zeros((block_m, block_n), jnp.float32))
    o_ref[...] = acc[None]


@functools.partial(jax.jit, static_argnames=("group_size", "block_m", "block_n", "block_k", "splits", "num_warps",
                                             "num_stages", "interpret"))
def matmul(x, packed, scales, zeros, *, group_size: int, block_m: int = 16, block_n: int = 128, block_k: int = 128,
           splits: int | None = None, num_warps: int = 4, num_stages: int = 3, interpret: bool = False):
    """x [T, K] @ dequant(packed [K, N / 8]) -> [T, N] (module docstring)."""
    t, k = x.shape
    n = packed.shape[1] * 8
    if group_size % block_k or k % group_size or n % block_n or block_n % 8 or scales.shape != (k // group_size, n):
        raise ValueError(f"int4_npacked: T={t} K={k} N={n} group {group_size} block_k {block_k} block_n {block_n}")
    tp = -(-t // block_m) * block_m
    xp = jnp.pad(x, ((0, tp - t), (0, 0)))
    k_steps = k // block_k
    splits = splits or pick_splits((tp // block_m) * (n // block_n), k_steps)
    kwargs = {} if interpret else {"compiler_params": plgpu.CompilerParams(num_warps=num_warps,
                                                                           num_stages=num_stages)}
    g = k // group_size
    sums = pl.pallas_call(
        functools.partial(_kernel, block_k=block_k, group_size=group_size, steps=k_steps // splits),
        grid=(tp // block_m, n // block_n, splits),
        in_specs=[pl.BlockSpec((block_m, k), lambda i, j, s: (i, 0)),
                  pl.BlockSpec((k, block_n // 8), lambda i, j, s: (0, j)),
                  pl.BlockSpec((g, block_n), lambda i, j, s: (0, j)),
                  pl.BlockSpec((g, block_n), lambda i, j, s: (0, j))],
        out_specs=pl.BlockSpec((1, block_m, block_n), lambda i, j, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((splits, tp, n), jnp.float32),
        interpret=interpret, name="int4_npacked_matmul", **kwargs,
    )(xp, packed, scales, zeros)
    return sums.sum(0)[:t].astype(x.dtype)
