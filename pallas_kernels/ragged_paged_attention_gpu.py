"""Ragged paged attention on GPU: two Triton-lowered Pallas kernels in one jitted call.

Same contract as `ragged_paged_attention_reference` (see ragged_paged_attention.py for the
legend: T tokens, S slots, N query heads, K KV heads, G = N // K, H head dim, B blocks, P block
size, M blocks per sequence). All query heads of one KV head are packed into the rows of one tile
(GQA packing), so each K/V page is read once per KV head, not once per query head.

Kernel 1, `_decode_kernel`, grid (K, NPD): flash-decoding for the sequences with q_len == 1.
  The number of KV splits is chosen at run time from num_seqs, so that live sequences x K x
  splits is about `target_programs`; program p of a KV head handles (seq p // splits, split
  p % splits). Programs beyond the live work exit at once, so padded slots cost ~nothing. With one
  split the program writes its rows of the output; otherwise it writes an unnormalised partial
  (acc, running max, running sum) to f32 scratch.
Kernel 2, `_finish_kernel`, grid (K, NQB), output aliased to kernel 1's output: program p is
  a query tile of block_q tokens. Tiles are mapped to (sequence, tile) without the host: the
  tiles of sequence s are numbered from `query_start_loc[s] // block_q + s`, which leaves room
  for every sequence's tiles, so NQB = cdiv(T, block_q) + S is a static bound and each program
  finds its sequence with one vector compare over query_start_loc. A tile of a sequence with
  q_len > 1 runs causal flash attention over its KV pages; the one tile of a decode sequence
  merges that row's split partials (when there are several); the padding rows (the pseudo
  sequence after the last live one) get zeros.

K/V pages are gathered row by row through the block table (masked loads: tokens past the
sequence's end or before its sliding window are never fetched), so any block size works and a
tile may span several pages.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxengine.pallas_kernels.ragged_paged_attention import (  # noqa: F401  (re-exported)
    ragged_paged_attention_reference,
)

# `dot` moved from pallas to pallas.triton; take whichever this jax version has.
_pl_dot = getattr(plgpu, "dot", None) or pl.dot

_LOG2E = math.log2(math.e)
_MASK = -1e30
_SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _cdiv(a, b):
    return (a + b - 1) // b


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Static tile sizes and launch shapes (all powers of two where Triton needs them).

    decode_block_kv: KV tokens per decode loop step (one K and one V tile of that many rows).
    prefill_rows: matmul rows of a prefill tile = block_q tokens x G (padded to a power of two).
    target_programs: decode programs wanted in flight (~4 per SM on a 132-SM H100): the run-time
      split count is cdiv(target_programs, live_seqs * K), capped by max_splits.
    """

    decode_block_kv: int = 64
    decode_num_warps: int = 4
    decode_num_stages: int = 2
    prefill_rows: int = 128
    prefill_block_kv: int = 64
    prefill_num_warps: int = 8
    prefill_num_stages: int = 2
    target_programs: int = 528
    max_splits: int = 64

    def __post_init__(self) -> None:
        for name in ("decode_block_kv", "prefill_rows", "prefill_block_kv"):
            v = getattr(self, name)
            if not _is_pow2(v) or v < 16:
                raise ValueError(f"Tiling.{name} must be a power of two >= 16, got {v}")
        for name in ("decode_num_warps", "decode_num_stages", "prefill_num_warps",
                     "prefill_num_stages", "target_programs", "max_splits"):
            if getattr(self, name) < 1:
                raise ValueError(f"Tiling.{name} must be >= 1, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class _Dims:
    """Static shapes of one call, derived once in the wrapper."""

    t: int      # tokens
    n: int      # query heads
    h: int      # head dim
    k: int      # KV heads
    p: int      # block size
    s: int      # sequence slots
    m: int      # max blocks per sequence
    g: int      # query heads per KV head
    gp: int     # g padded to a power of two
    rows_dec: int  # decode matmul rows: max(16, gp)
    npd: int    # decode programs per KV head (static bound)
    block_q: int   # query tokens per prefill tile
    nqb: int    # prefill tile programs per KV head (static bound)
    qsl_pad: int  # S + 1 padded to a power of two (one vector load)


def _num_splits(n_live, dims: _Dims, tiling: Tiling):
    """KV splits per decode sequence, from the live sequence count (a run-time scalar)."""
    want = _cdiv(tiling.target_programs, jnp.maximum(n_live, 1) * dims.k)
    return jnp.clip(want, 1, tiling.max_splits).astype(jnp.int32)


def _dot(a: jax.Array, b: jax.Array, trans_b: bool = False) -> jax.Array:
    # float32 inputs get full-precision products (Triton would default to tf32).
    prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return _pl_dot(a, b, trans_b=trans_b, precision=prec)


def _logits_log2(s: jax.Array, sm_scale: float, soft_cap: float | None) -> jax.Array:
    """Raw q.k products -> logits in base-2 units (softmax runs on exp2)."""
    if soft_cap is None:
        return s * (sm_scale * _LOG2E)
    return jnp.tanh(s * (sm_scale / soft_cap)) * (soft_cap * _LOG2E)


def _load_kv(ref, rows: jax.Array, valid: jax.Array, h: int) -> jax.Array:
    """Gathers cache rows [BKV] -> [BKV, H]; rows with valid False are not fetched (zeros)."""
    cols = jnp.arange(h, dtype=jnp.int32)[None, :]
    mask = jnp.broadcast_to(valid[:, None], (rows.shape[0], h))
    return plgpu.load(ref.at[rows[:, None], cols], mask=mask, other=0)


def _kv_rows(bt_ref, seq, kpos, kh, dims: _Dims) -> jax.Array:
    """Absolute KV positions [BKV] of sequence `seq` -> rows of the flat [B*K*P, H] cache."""
    page = jnp.minimum(kpos // dims.p, dims.m - 1)
    blk = bt_ref[seq * dims.m + page]
    return (blk * dims.k + kh) * dims.p + kpos % dims.p


def _online_step(carry, s2, allowed, v, *, f32_pv: bool):
    """One online-softmax step: logits s2 [R, BKV] (base 2), mask, values v [BKV, H]."""
    m, l, acc = carry
    s2 = jnp.where(allowed, s2, _MASK)
    m_new = jnp.maximum(m, jnp.max(s2, axis=1))
    alpha = jnp.exp2(m - m_new)
    pr = jnp.where(allowed, jnp.exp2(s2 - m_new[:, None]), 0.0)
    l = l * alpha + jnp.sum(pr, axis=1)
    pv = _dot(pr if f32_pv else pr.astype(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l, acc


def _store_rows(out_ref, rows: jax.Array, val: jax.Array, valid: jax.Array) -> None:
    """Masked store of val [R, H] into rows [R] of a flat [X, H] ref."""
    h = val.shape[1]
    cols = jnp.arange(h, dtype=jnp.int32)[None, :]
    mask = jnp.broadcast_to(valid[:, None], val.shape)
    plgpu.store(out_ref.at[rows[:, None], cols], val.astype(out_ref.dtype), mask=mask)


def _decode_kernel(q_ref, k_ref, v_ref, kvl_ref, bt_ref, qsl_ref, ns_ref,
                   out_ref, op_ref, mp_ref, lp_ref, *, dims: _Dims, tiling: Tiling,
                   sm_scale: float, soft_cap: float | None, window: int | None):
    kh = pl.program_id(0)
    p = pl.program_id(1)
    n_live = jnp.minimum(ns_ref[0], dims.s)
    splits = _num_splits(n_live, dims, tiling)
    seq = p // splits
    split = p % splits
    seq_c = jnp.minimum(seq, dims.s - 1)
    q_start = qsl_ref[seq_c]
    q_len = qsl_ref[seq_c + 1] - q_start

    @pl.when((seq < n_live) & (q_len == 1))
    def _():
        bkv = tiling.decode_block_kv
        kv_len = kvl_ref[seq_c]
        lo = jnp.maximum(kv_len - window, 0) if window is not None else jnp.int32(0)
        first_page = lo // dims.p
        end_page = _cdiv(kv_len, dims.p)
        min_chunk = _cdiv(bkv, dims.p)  # at least one full loop step per split
        chunk = jnp.maximum(_cdiv(end_page - first_page, splits), min_chunk)
        chunk = _cdiv(chunk, min_chunk) * min_chunk
        page_lo = first_page + split * chunk
        page_hi = jnp.minimum(page_lo + chunk, end_page)
        tok_base = page_lo * dims.p
        tok_lo = jnp.maximum(tok_base, lo)
        tok_hi = jnp.minimum(page_hi * dims.p, kv_len)
        n_iter = jnp.maximum(_cdiv(tok_hi - tok_base, bkv), 0)

        g = jnp.arange(dims.rows_dec, dtype=jnp.int32)
        heads = kh * dims.g + jnp.minimum(g, dims.g - 1)
        q = q_ref[q_start * dims.n + heads, :]  # [R, H]

        def body(it, carry):
            kpos = tok_base + it * bkv + jnp.arange(bkv, dtype=jnp.int32)
            valid = (kpos >= tok_lo) & (kpos < tok_hi)
            rows = _kv_rows(bt_ref, seq_c, kpos, kh, dims)
            k = _load_kv(k_ref, rows, valid, dims.h)
            v = _load_kv(v_ref, rows, valid, dims.h)
            s2 = _logits_log2(_dot(q, k, trans_b=True), sm_scale, soft_cap)
            return _online_step(carry, s2, valid[None, :], v, f32_pv=q.dtype == jnp.float32)

        r = dims.rows_dec
        init = (jnp.full((r,), _MASK, jnp.float32), jnp.zeros((r,), jnp.float32),
                jnp.zeros((r, dims.h), jnp.float32))
        m, l, acc = lax.fori_loop(0, n_iter, body, init)
        real = g < dims.g

        @pl.when(splits == 1)
        def _():
            out = jnp.where(l[:, None] > 0, acc / jnp.maximum(l, 1e-30)[:, None], 0.0)
            _store_rows(out_ref, q_start * dims.n + kh * dims.g + g, out, real)

        @pl.when(splits > 1)
        def _():
            prow = (kh * dims.npd + p) * dims.g + g
            _store_rows(op_ref, prow, acc, real)
            plgpu.store(mp_ref.at[prow], m, mask=real)
            plgpu.store(lp_ref.at[prow], l, mask=real)


def _find_tile(qsl_ref, n_live, p, dims: _Dims):
    """Largest s in [0, n_live] with qsl[s] // block_q + s <= p (slot n_live = the padding).

    One vector load of query_start_loc instead of a chain of dependent scalar loads.
    """
    idx = jnp.arange(dims.qsl_pad, dtype=jnp.int32)
    qsl = plgpu.load(qsl_ref.at[idx], mask=idx <= dims.s, other=0)
    hit = (idx <= n_live) & (qsl // dims.block_q + idx <= p)
    return jnp.sum(hit.astype(jnp.int32)) - 1


def _query_tile(q_ref, k_ref, v_ref, kvl_ref, bt_ref, qsl_ref, op_ref, mp_ref, lp_ref, out_ref,
                *, kh, p, n_live, dims: _Dims, tiling: Tiling, sm_scale: float,
                soft_cap: float | None, window: int | None):
    """Program p of a KV head: a prefill tile, a decode merge, padding zeros, or nothing."""
    bq = dims.block_q
    s = _find_tile(qsl_ref, n_live, p, dims)
    is_pad = s == n_live
    q_start = qsl_ref[s]
    q_end = jnp.where(is_pad, dims.t, qsl_ref[jnp.minimum(s + 1, dims.s)])
    q_len = q_end - q_start
    t0 = q_start + (p - (q_start // bq + s)) * bq

    rq = bq * dims.gp
    r = jnp.arange(rq, dtype=jnp.int32)
    tok = t0 + r // dims.gp
    g = r % dims.gp
    out_rows = tok * dims.n + kh * dims.g + g
    row_ok = (tok < q_end) & (g < dims.g)

    @pl.when((t0 < q_end) & is_pad)
    def _():
        _store_rows(out_ref, out_rows, jnp.zeros((rq, dims.h), jnp.float32), row_ok)

    # A decode sequence owns one tile; it merges the split partials (if any) of its row.
    @pl.when((t0 < q_end) & jnp.logical_not(is_pad) & (q_len == 1))
    def _():
        _merge_partials(op_ref, mp_ref, lp_ref, out_ref, kh=kh, seq=s, q_start=q_start,
                        n_live=n_live, dims=dims, tiling=tiling)

    @pl.when((t0 < q_end) & jnp.logical_not(is_pad) & (q_len > 1))
    def _():
        bkv = tiling.prefill_block_kv
        s_c = jnp.minimum(s, dims.s - 1)
        kv_len = kvl_ref[s_c]
        ctx = kv_len - q_len  # tokens before this chunk
        q_rows = jnp.minimum(tok, dims.t - 1) * dims.n + kh * dims.g + jnp.minimum(g, dims.g - 1)
        q = q_ref[q_rows, :]  # [RQ, H]
        qpos = ctx + (tok - q_start)  # [RQ]
        first_pos = ctx + (t0 - q_start)
        kv_hi = jnp.minimum(first_pos + bq, kv_len)
        kv_lo = jnp.maximum(first_pos - window + 1, 0) if window is not None else jnp.int32(0)
        start = (kv_lo // dims.p) * dims.p
        n_iter = _cdiv(kv_hi - start, bkv)

        def body(it, carry):
            kpos = start + it * bkv + jnp.arange(bkv, dtype=jnp.int32)
            valid = (kpos >= kv_lo) & (kpos < kv_hi)
            rows = _kv_rows(bt_ref, s_c, kpos, kh, dims)
            k = _load_kv(k_ref, rows, valid, dims.h)
            v = _load_kv(v_ref, rows, valid, dims.h)
            s2 = _logits_log2(_dot(q, k, trans_b=True), sm_scale, soft_cap)
            allowed = (kpos[None, :] <= qpos[:, None]) & valid[None, :]
            if window is not None:
                allowed &= kpos[None, :] > qpos[:, None] - window
            return _online_step(carry, s2, allowed, v, f32_pv=q.dtype == jnp.float32)

        init = (jnp.full((rq,), _MASK, jnp.float32), jnp.zeros((rq,), jnp.float32),
                jnp.zeros((rq, dims.h), jnp.float32))
        m, l, acc = lax.fori_loop(0, n_iter, body, init)
        out = jnp.where(l[:, None] > 0, acc / jnp.maximum(l, 1e-30)[:, None], 0.0)
        _store_rows(out_ref, out_rows, out, row_ok)


def _merge_partials(op_ref, mp_ref, lp_ref, out_ref, *, kh, seq, q_start, n_live,
                    dims: _Dims, tiling: Tiling):
    splits = _num_splits(n_live, dims, tiling)

    @pl.when(splits > 1)
    def _():
        g = jnp.arange(dims.gp, dtype=jnp.int32)
        g_c = jnp.minimum(g, dims.g - 1)

        def body(j, carry):
            m, l, acc = carry
            prow = (kh * dims.npd + seq * splits + j) * dims.g + g_c
            mj = mp_ref[prow]
            lj = lp_ref[prow]
            oj = op_ref[prow, :]
            m_new = jnp.maximum(m, mj)
            a = jnp.exp2(m - m_new)
            b = jnp.exp2(mj - m_new)
            return m_new, l * a + lj * b, acc * a[:, None] + oj * b[:, None]

        init = (jnp.full((dims.gp,), _MASK, jnp.float32), jnp.zeros((dims.gp,), jnp.float32),
                jnp.zeros((dims.gp, dims.h), jnp.float32))
        _, l, acc = lax.fori_loop(0, splits, body, init)
        out = jnp.where(l[:, None] > 0, acc / jnp.maximum(l, 1e-30)[:, None], 0.0)
        _store_rows(out_ref, q_start * dims.n + kh * dims.g + g, out, g < dims.g)


def _finish_kernel(q_ref, k_ref, v_ref, kvl_ref, bt_ref, qsl_ref, ns_ref, op_ref, mp_ref,
                   lp_ref, out_in_ref, out_ref, *, dims: _Dims, tiling: Tiling, sm_scale: float,
                   soft_cap: float | None, window: int | None):
    del out_in_ref  # aliased to out_ref: the decode kernel's rows are already in it
    kh = pl.program_id(0)
    p = pl.program_id(1)
    n_live = jnp.minimum(ns_ref[0], dims.s)
    n_tiles_max = _cdiv(dims.t, dims.block_q) + n_live  # bound on live virtual tiles

    @pl.when(p < n_tiles_max)
    def _():
        _query_tile(q_ref, k_ref, v_ref, kvl_ref, bt_ref, qsl_ref, op_ref, mp_ref, lp_ref,
                    out_ref, kh=kh, p=p, n_live=n_live, dims=dims, tiling=tiling,
                    sm_scale=sm_scale, soft_cap=soft_cap, window=window)


def _make_dims(q: jax.Array, k_cache: jax.Array, block_tables: jax.Array,
               tiling: Tiling) -> _Dims:
    t, n, h = q.shape
    _, k, p, _ = k_cache.shape
    s, m = block_tables.shape
    g = n // k
    gp = _next_pow2(g)
    block_q = max(1, tiling.prefill_rows // gp)
    return _Dims(
        t=t, n=n, h=h, k=k, p=p, s=s, m=m, g=g, gp=gp, rows_dec=max(16, gp),
        npd=min(s * tiling.max_splits, _cdiv(tiling.target_programs, k) + s),
        block_q=block_q, nqb=_cdiv(t, block_q) + s,
        qsl_pad=_next_pow2(s + 1),
    )


def _rpa_call(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs, *,
              sm_scale: float, soft_cap: float | None, window: int | None, tiling: Tiling,
              interpret: bool) -> jax.Array:
    """Builds both grids and runs the two kernels; inputs already validated."""
    dims = _make_dims(q, k_cache, block_tables, tiling)
    b = k_cache.shape[0]
    q2 = q.reshape(dims.t * dims.n, dims.h)
    kc = k_cache.reshape(b * dims.k * dims.p, dims.h)
    vc = v_cache.reshape(b * dims.k * dims.p, dims.h)
    bt = block_tables.reshape(dims.s * dims.m)
    common = dict(dims=dims, tiling=tiling, sm_scale=sm_scale, soft_cap=soft_cap, window=window)
    n_part = dims.k * dims.npd * dims.g

    out, op, mp, lp = pl.pallas_call(
        functools.partial(_decode_kernel, **common),
        grid=(dims.k, dims.npd),
        out_shape=(jax.ShapeDtypeStruct((dims.t * dims.n, dims.h), q.dtype),
                   jax.ShapeDtypeStruct((n_part, dims.h), jnp.float32),
                   jax.ShapeDtypeStruct((n_part,), jnp.float32),
                   jax.ShapeDtypeStruct((n_part,), jnp.float32)),
        compiler_params=plgpu.CompilerParams(num_warps=tiling.decode_num_warps,
                                             num_stages=tiling.decode_num_stages),
        interpret=interpret,
        name="rpa_decode",
    )(q2, kc, vc, kv_lens, bt, query_start_loc, num_seqs)

    out = pl.pallas_call(
        functools.partial(_finish_kernel, **common),
        grid=(dims.k, dims.nqb),
        out_shape=jax.ShapeDtypeStruct((dims.t * dims.n, dims.h), q.dtype),
        input_output_aliases={10: 0},
        compiler_params=plgpu.CompilerParams(num_warps=tiling.prefill_num_warps,
                                             num_stages=tiling.prefill_num_stages),
        interpret=interpret,
        name="rpa_prefill_merge",
    )(q2, kc, vc, kv_lens, bt, query_start_loc, num_seqs, op, mp, lp, out)
    return out.reshape(dims.t, dims.n, dims.h)


def _validate(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs, *,
              sm_scale, soft_cap, sliding_window) -> None:
    """Raises ValueError naming the offending argument; shapes and dtypes are static."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, N, H], got shape {q.shape}")
    if k_cache.ndim != 4:
        raise ValueError(f"k_cache must be [B, K, P, H], got shape {k_cache.shape}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {v_cache.shape} != k_cache shape {k_cache.shape}")
    t, n, h = q.shape
    _, k, p, hk = k_cache.shape
    if t < 1:
        raise ValueError(f"q needs at least one token row, got shape {q.shape}")
    if hk != h:
        raise ValueError(f"head dim of q ({h}) and k_cache ({hk}) differ")
    if not _is_pow2(h) or not 16 <= h <= 256:
        raise ValueError(f"head dim must be a power of two in [16, 256], got {h}")
    if k < 1 or n % k:
        raise ValueError(f"query heads ({n}) must be a multiple of KV heads ({k})")
    if q.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"q dtype must be bfloat16 or float32, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"k_cache/v_cache dtype ({k_cache.dtype}, {v_cache.dtype}) must match "
                         f"q dtype {q.dtype}")
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables must be [S, M], got shape {block_tables.shape}")
    s = block_tables.shape[0]
    if kv_lens.shape != (s,):
        raise ValueError(f"kv_lens shape {kv_lens.shape} != ({s},) (rows of block_tables)")
    if query_start_loc.shape != (s + 1,):
        raise ValueError(f"query_start_loc shape {query_start_loc.shape} != ({s + 1},)")
    if num_seqs.shape != (1,):
        raise ValueError(f"num_seqs shape {num_seqs.shape} != (1,)")
    for name, arr in (("kv_lens", kv_lens), ("block_tables", block_tables),
                      ("query_start_loc", query_start_loc), ("num_seqs", num_seqs)):
        if arr.dtype != jnp.int32:
            raise ValueError(f"{name} dtype must be int32, got {arr.dtype}")
    if not sm_scale > 0:
        raise ValueError(f"sm_scale must be > 0, got {sm_scale}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be > 0 or None, got {soft_cap}")
    if sliding_window is not None and (int(sliding_window) != sliding_window
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window}")


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "tiling",
                                             "interpret"))
def ragged_paged_attention_gpu(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, kv_lens: jax.Array,
    block_tables: jax.Array, query_start_loc: jax.Array, num_seqs: jax.Array, *,
    sm_scale: float, soft_cap: float | None = None, sliding_window: int | None = None,
    tiling: Tiling | None = None, interpret: bool = False,
) -> jax.Array:
    """Ragged paged attention [T, N, H] -> [T, N, H]; contract of the reference.

    `interpret=True` runs the same kernels through Pallas' interpreter (CPU tests).
    Run-time preconditions (not checked): query_start_loc is non-decreasing, kv_lens[s] >=
    q_len[s] for live slots, block ids < B, num_seqs <= S.
    """
    _validate(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs,
              sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window)
    return _rpa_call(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs,
                     sm_scale=float(sm_scale),
                     soft_cap=None if soft_cap is None else float(soft_cap),
                     window=None if sliding_window is None else int(sliding_window),
                     tiling=tiling or Tiling(), interpret=interpret)
