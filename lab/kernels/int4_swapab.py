"""A weight-only int4 matmul with the operands swapped: out^T [N, T] = W^T [N, K] . x^T [K, T],
the dequantized weight as the dot's first operand. A laboratory variant of
pallas_kernels/weight_only_matmul_gpu.py, to time beside it.

Why: with the weight as the second operand (the product kernel), Triton must stage the
dequantized bf16 tile through shared memory for the MMA, four times the packed bytes each
step. On Hopper a dot's first operand may live in registers (wgmma's A from registers), and
Triton's dot-operand hoisting moves the layout change of a first operand above elementwise
producers: the packed words go to shared memory (pipelined copies), come back in the dot's
register layout, and are unpacked and converted there, as Marlin-style kernels do by hand.
With T rows of x (16 at batch-1 decode) the dot is [block_n, 16] x [16, T]: the weight's N is
the MMA's 64-row side, the few tokens its narrow side.

Layouts (what a loader would write once):
    wt [N, K / 8] int32: the product's [K / 8, N] words transposed (value j of word i of row n
        is input row 8 i + j), so a program's words are contiguous runs along K;
    scales [G, N], zeros [G, N] uint8 (weight = (value - zero) * scale), groups of 128 rows;
    x [T, K] in bf16; out [T, N] in bf16.

A step is one group (128 rows of K: 16 words a row of wt). Its words unpack into 8 slabs, value
position j of every word (`slabs` of the product kernel), each [block_n, 16] and met by x's
matching 16 columns (x's columns permuted so they are contiguous, and transposed: x^T slabs
[16, T]). `post`: a slab's values become bf16 128 + v by an OR alone (no arithmetic), and the
group's scale and zero are applied to the step's [block_n, T] sums:
    sum_k x (v - z) s = s (sum_k x (128 + v) - (128 + z) sum_k x);
else each value is dequantized in float32 before the dot.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxengine.pallas_kernels.weight_only_matmul_gpu import MAGIC, _slab_pair, pick_splits

_pl_dot = getattr(plgpu, "dot", None) or pl.dot
GROUP = 128
PER = 8  # int4 values a word
ROWS = GROUP // PER  # words a step, per row of wt


def transpose_words(packed: jax.Array) -> jax.Array:
    """The product's [K / 8, N] words -> wt [N, K / 8] (a loader's one-time transpose)."""
    return packed.T


def permute_x(x: jax.Array) -> jax.Array:
    """x [T, K] -> x^T [K, T] with each step's columns in slab order (value position j, word i)."""
    t, k = x.shape
    return x.reshape(t, k // GROUP, ROWS, PER).swapaxes(2, 3).reshape(t, k).T


def _kernel(x_ref, w_ref, s_ref, z_ref, o_ref, *, steps: int, post: bool, mode: str, native: bool):
    _, block_n, tp = o_ref.shape
    first = pl.program_id(1) * steps

    def body(kb, acc):
        if native:  # the product's [K / 8, N] words, transposed in registers
            words = w_ref[pl.ds(kb * ROWS, ROWS), :].T  # [block_n, 16] int32
        else:
            words = w_ref[:, pl.ds(kb * ROWS, ROWS)]  # [block_n, 16] int32
        scale = s_ref[kb, :].astype(jnp.float32)[:, None]  # [block_n, 1]
        zero = z_ref[kb, :].astype(jnp.float32)[:, None]
        if mode in ("lop3", "raw"):  # post-scaled; "raw": no unpacking at all (timing skeleton)
            d = jnp.zeros((block_n, tp), jnp.float32)
            xs = jnp.zeros((1, tp), jnp.float32)
            for j in range(PER // 2):
                if mode == "raw":
                    lo = hi = lax.bitcast_convert_type(words.astype(jnp.int16), jnp.bfloat16)
                else:
                    lo, hi = _slab_pair(words, j, interpret=False)
                for jj, a in ((j, lo), (j + PER // 2, hi)):
                    xb = x_ref[pl.ds(kb * GROUP + jj * ROWS, ROWS), :]  # [16, T]
                    d = d + _pl_dot(a, xb)
                    xs = xs + jnp.sum(xb.astype(jnp.float32), axis=0, keepdims=True)
            return acc + scale * (d - (zero + 128.0) * xs)
        if post:
            d = jnp.zeros((block_n, tp), jnp.float32)
            xs = jnp.zeros((1, tp), jnp.float32)
            for j in range(PER):
                ints = (words >> (4 * j)) & 15
                a = lax.bitcast_convert_type((ints | 0x4300).astype(jnp.int16), jnp.bfloat16)  # 128 + v
                xb = x_ref[pl.ds(kb * GROUP + j * ROWS, ROWS), :]  # [16, T]
                d = d + _pl_dot(a, xb)
                xs = xs + jnp.sum(xb.astype(jnp.float32), axis=0, keepdims=True)
            return acc + scale * (d - (zero + 128.0) * xs)
        for j in range(PER):
            ints = (words >> (4 * j)) & 15
            w = (lax.bitcast_convert_type(ints | MAGIC, jnp.float32) - (zero + float(1 << 23))) * scale
            xb = x_ref[pl.ds(kb * GROUP + j * ROWS, ROWS), :]
            acc = acc + _pl_dot(w.astype(jnp.bfloat16), xb)
        return acc

    acc = lax.fori_loop(first, first + steps, body, jnp.zeros((block_n, tp), jnp.float32))
    o_ref[...] = acc[None]


@functools.partial(jax.jit, static_argnames=("block_n", "splits", "num_warps", "num_stages", "post",
                                             "mode", "native", "interpret"))
def matmul_t(x: jax.Array, wt: jax.Array, scales: jax.Array, zeros: jax.Array, *, block_n: int = 64,
             splits: int | None = None, num_warps: int = 4, num_stages: int = 3, post: bool = True,
             mode: str = "shift", native: bool = False, interpret: bool = False) -> jax.Array:
    """x [T, K] bf16 @ dequant(wt [N, K / 8]) -> [T, N] bf16 (module docstring). `mode`: "shift"
    (shifts, masks and ORs in jnp), "lop3" (a value pair per inline-PTX lop3; GPU only),
    "raw" (no unpacking: wrong values, the skeleton's time). `native`: wt is the product's
    [K / 8, N] words as they are (transposed in the kernel)."""
    t, k = x.shape
    n = wt.shape[1] if native else wt.shape[0]
    if x.dtype != jnp.bfloat16 or k % GROUP or n % block_n or wt.shape != ((k // PER, n) if native else (n, k // PER)) \
            or scales.shape != (k // GROUP, n) or zeros.shape != scales.shape:
        raise ValueError(f"int4 swap-AB: x {x.shape} {x.dtype}, wt {wt.shape}, scales {scales.shape}, "
                         f"zeros {zeros.shape} (bf16 x, groups of {GROUP}, N a multiple of {block_n})")
    tp = max(16, -(-t // 16) * 16)
    xt = permute_x(jnp.pad(x, ((0, tp - t), (0, 0))))  # [K, tp]
    g = k // GROUP
    splits = splits or pick_splits(n // block_n, g)
    if g % splits:
        raise ValueError(f"int4 swap-AB: {splits} splits do not divide {g} steps")
    kwargs = {}
    if not interpret:
        kwargs["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    sums = pl.pallas_call(
        functools.partial(_kernel, steps=g // splits, post=post, mode=mode, native=native),
        grid=(n // block_n, splits),
        in_specs=[pl.BlockSpec((k, tp), lambda i, s: (0, 0)),
                  (pl.BlockSpec((k // PER, block_n), lambda i, s: (0, i)) if native
                   else pl.BlockSpec((block_n, k // PER), lambda i, s: (i, 0))),
                  pl.BlockSpec((g, block_n), lambda i, s: (0, i)),
                  pl.BlockSpec((g, block_n), lambda i, s: (0, i))],
        out_specs=pl.BlockSpec((1, block_n, tp), lambda i, s: (s, i, 0)),
        out_shape=jax.ShapeDtypeStruct((splits, n, tp), jnp.float32),
        interpret=interpret, name="int4_swapab", **kwargs,
    )(xt, wt, scales, zeros)
    return sums.sum(0)[:, :t].T.astype(x.dtype)


__all__ = ["matmul_t", "permute_x", "transpose_words"]
