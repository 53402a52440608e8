"""The gated MLP's activation and its e4m3 quantization in one pass, on GPU: SwiGLU's
h = silu(gate) * up read from the fused [T, 2F] gate/up product, each row's absmax scale taken,
and h written once as float8_e4m3fn with its per-row scale (the W8A8 down projection's input).
The gate/up product may arrive unscaled, as the FP8 GEMM writes it, with its per-row activation
scales and per-column weight scales: the kernel applies them as it reads.

Unfused, XLA writes the scaled product, then h, reads h for the row maxima and again to convert
it: four passes over [T, F]-sized arrays where this kernel makes one read of [T, 2F] and one
write of [T, F] bytes of e4m3.

    gate_up [T, 2F] (bf16 / f16 / f32; gate columns first), optional row_scale [T] and
    col_scale [2F] (float32) -> (hq [T, F] float8_e4m3fn, scale [T] float32), h = hq * scale

Grid (T / rows,): a program holds its rows whole, in F / chunk register tiles of `chunk` columns
(unrolled), so the maximum is known before the first store; or (`two_pass`) it walks the row's
tiles twice, for the maximum and then for the store, holding one tile at a time. h is rounded to gate_up's dtype
before it is scaled, as the unfused path rounds the activation it writes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

FP8_MAX = 448.0  # largest finite float8_e4m3fn
MAX_CHUNK = 2048  # columns per register tile
MAX_TILES = 16  # unrolled tiles per row: F up to 32,768 at the largest chunk


def pick_chunk(f: int) -> int | None:
    """The largest power of two up to MAX_CHUNK dividing F with at most MAX_TILES tiles a row, or
    None where F has no such divisor (callers keep the unfused path)."""
    chunk = MAX_CHUNK
    while chunk >= 16:
        if f % chunk == 0:
            return chunk if f // chunk <= MAX_TILES else None
        chunk //= 2
    return None


def supported(t: int, f: int) -> bool:
    """Whether the kernel takes gate_up [t, 2f]."""
    del t
    return pick_chunk(f) is not None


def silu_mul_quant_reference(gate_up: jax.Array, row_scale: jax.Array | None = None,
                             col_scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The same computation in plain jnp: the product scaled, h = silu(gate) * up in float32,
    rounded to gate_up's dtype, then per-row e4m3."""
    y = gate_up.astype(jnp.float32)
    if row_scale is not None:
        y = y * row_scale.astype(jnp.float32)[:, None] * col_scale.astype(jnp.float32)[None, :]
    gate, up = jnp.split(y, 2, axis=-1)
    h = (gate * jax.nn.sigmoid(gate) * up).astype(gate_up.dtype).astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(h), axis=1) / FP8_MAX, 1e-12)
    hq = jnp.clip(h * (1.0 / scale)[:, None], -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return hq, scale


def _activation(gu_ref, cs_ref, r, rs, start, *, f: int, chunk: int) -> jax.Array:
    """h of rows `r`, columns [start, start + chunk), float32 after rounding to gate_up's dtype."""
    gc, uc = pl.ds(start, chunk), pl.ds(f + start, chunk)
    g = gu_ref[r, gc].astype(jnp.float32) * rs * cs_ref[gc].astype(jnp.float32)[None, :]
    u = gu_ref[r, uc].astype(jnp.float32) * rs * cs_ref[uc].astype(jnp.float32)[None, :]
    return (g * jax.nn.sigmoid(g) * u).astype(gu_ref.dtype).astype(jnp.float32)


def _quantize(h: jax.Array, inv: jax.Array, dtype) -> jax.Array:
    return jnp.clip(h * inv[:, None], -FP8_MAX, FP8_MAX).astype(dtype)


def _kernel(gu_ref, rs_ref, cs_ref, q_ref, s_ref, *, f: int, chunk: int, rows: int):
    """One pass: the row's tiles stay in registers until its maximum is known."""
    r = pl.ds(pl.program_id(0) * rows, rows)
    rs = rs_ref[r].astype(jnp.float32)[:, None]
    tiles = []
    amax = jnp.zeros((rows,), jnp.float32)
    for c in range(f // chunk):
        h = _activation(gu_ref, cs_ref, r, rs, c * chunk, f=f, chunk=chunk)
        tiles.append(h)
        amax = jnp.maximum(amax, jnp.max(jnp.abs(h), axis=1))
    scale = jnp.maximum(amax / FP8_MAX, 1e-12)
    inv = 1.0 / scale
    for c, h in enumerate(tiles):
        q_ref[r, pl.ds(c * chunk, chunk)] = _quantize(h, inv, q_ref.dtype)
    s_ref[r] = scale


def _kernel_two_pass(gu_ref, rs_ref, cs_ref, q_ref, s_ref, *, f: int, chunk: int, rows: int):
    """Two passes over the row, one tile at a time: the maximum, then h again (its inputs read
    back, mostly from L2) to quantize and store. Few registers a program, so more programs share
    an SM than with the whole row held."""
    r = pl.ds(pl.program_id(0) * rows, rows)
    rs = rs_ref[r].astype(jnp.float32)[:, None]

    def tile(c):
        return _activation(gu_ref, cs_ref, r, rs, pl.multiple_of(c * chunk, chunk), f=f, chunk=chunk)

    amax = jax.lax.fori_loop(0, f // chunk, lambda c, m: jnp.maximum(m, jnp.max(jnp.abs(tile(c)), axis=1)),
                             jnp.zeros((rows,), jnp.float32))
    scale = jnp.maximum(amax / FP8_MAX, 1e-12)
    inv = 1.0 / scale

    def store(c, carry):
        q_ref[r, pl.ds(pl.multiple_of(c * chunk, chunk), chunk)] = _quantize(tile(c), inv, q_ref.dtype)
        return carry

    jax.lax.fori_loop(0, f // chunk, store, 0)
    s_ref[r] = scale


@functools.partial(jax.jit, static_argnames=("rows", "num_warps", "two_pass", "interpret"))
def silu_mul_quant(gate_up: jax.Array, row_scale: jax.Array | None = None, col_scale: jax.Array | None = None,
                   *, rows: int = 1, num_warps: int | None = None, two_pass: bool = False,
                   interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """gate_up [T, 2F], optional row_scale [T] with col_scale [2F] -> (hq [T, F] e4m3, scale [T]
    float32) (module docstring). `rows`: rows a program holds (a power of two dividing T);
    `num_warps`: 8 from F = 8,192 up for the one-pass form, else 4; `two_pass`: the form that
    reads the row twice instead of holding it (same outputs)."""
    t, f2 = gate_up.shape
    f = f2 // 2
    chunk = pick_chunk(f) if f2 % 2 == 0 else None
    if chunk is None or t % rows or rows & (rows - 1):
        raise ValueError(f"silu_mul_quant kernel: unsupported shape {gate_up.shape} with rows={rows} "
                         f"(2F even, F a multiple of a power of two >= 16 with at most {MAX_TILES} tiles, "
                         f"T a multiple of rows)")
    if (row_scale is None) != (col_scale is None):
        raise ValueError("silu_mul_quant kernel: row_scale and col_scale come together")
    if row_scale is None:
        row_scale, col_scale = jnp.ones((t,), jnp.float32), jnp.ones((f2,), jnp.float32)
    if row_scale.shape != (t,) or col_scale.shape != (f2,):
        raise ValueError(f"silu_mul_quant kernel: scales {row_scale.shape} and {col_scale.shape} do not match "
                         f"gate_up {gate_up.shape} (want ({t},) and ({f2},))")
    kwargs = {}
    if not interpret:
        warps = num_warps or (8 if f >= 8192 and not two_pass else 4)
        kwargs["compiler_params"] = plgpu.CompilerParams(num_warps=warps, num_stages=1)
    return pl.pallas_call(
        functools.partial(_kernel_two_pass if two_pass else _kernel, f=f, chunk=chunk, rows=rows),
        grid=(t // rows,),
        out_shape=(jax.ShapeDtypeStruct((t, f), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((t,), jnp.float32)),
        interpret=interpret, name="silu_mul_quant", **kwargs,
    )(gate_up, row_scale.astype(jnp.float32), col_scale.astype(jnp.float32))


__all__ = ["pick_chunk", "silu_mul_quant", "silu_mul_quant_reference", "supported"]
