"""Ragged paged attention on GPU: two Triton-lowered Pallas kernels in one jitted call.

Same contract as `ragged_paged_attention_reference` (see ragged_paged_attention.py for the
legend: T tokens, S slots, N query heads, K KV heads, G = N // K, H head dim, B blocks, P block
size, M blocks per sequence). All query heads of one KV head are packed into the rows of one tile
(GQA packing), so each K/V page is read once per KV head, not once per query head.

Kernel 1, `_decode_kernel`, grid (K, NPD): flash-decoding for the sequences with q_len == 1.
  The number of KV splits is chosen at run time from num_seqs, so that live sequences x K x
  splits is about `target_programs`; program p of a KV head handles (seq p // splits, split
  p % splits). Splits past a sequence's end and programs beyond the live work exit at once, so
  padded slots cost ~nothing. A row with one used split is written directly; otherwise each
  split publishes an unnormalised partial (acc, running max, running sum) to f32 scratch and
  bumps an arrival counter, and the last split to arrive merges them (vectorised over splits).
  When the Mosaic prefill kernel follows, extra programs of this kernel build its tile table
  (`_tile_table_program`) beside the decode work.
Kernel 2, `_prefill_kernel`, grid (K, min(NQB, target_programs / K)), output aliased to kernel
  1's output: each program walks a stride of the virtual query tiles of block_q tokens,
  heaviest first. Tiles are mapped to (sequence, tile) without the host: the tiles of sequence s
  are numbered from `query_start_loc[s] // block_q + s`, which leaves room for every sequence's
  tiles, so NQB = cdiv(T, block_q) + S is a static bound and a program finds a tile's sequence
  with one vector compare over query_start_loc. A tile of a sequence with q_len > 1 runs causal
  flash attention over its KV pages (masks only on the tiles that cross the diagonal or the
  window edge); decode rows are skipped; the padding rows (the pseudo sequence after the last
  live one) get zeros. A step with neither (decode rows filling the bucket) leaves every program
  at once: a grid no larger than the SMs hold costs next to nothing then.

K/V pages are gathered row by row through the block table (masked loads: tokens past the
sequence's end or before its sliding window are never fetched), so any block size works and a
tile may span several pages.

The cache is in q's dtype or in float8_e4m3fn (an fp8 KV cache, vLLM's kv_cache_dtype="fp8"):
fp8 K/V tiles are read as fp8 (half the bytes) and upcast to q's dtype in registers before the
dots (exact: e4m3 values are bf16 values). The cache holds K / k_scale and V / v_scale, per-tensor
scales (1.0 today); k_scale is folded into the logit scale and v_scale into the output
normalisation, so neither costs a multiply per element and a scale of 1.0 changes nothing.
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

from jaxengine.pallas_kernels import ragged_paged_attention_mgpu as mgpu
from jaxengine.pallas_kernels.ragged_paged_attention_mgpu import MosaicTiling  # noqa: F401
from jaxengine.pallas_kernels.ragged_paged_attention import (  # noqa: F401  (re-exported)
    ragged_paged_attention_reference,
)

# `dot` moved from pallas to pallas.triton; take whichever this jax version has.
_pl_dot = getattr(plgpu, "dot", None) or pl.dot

_LOG2E = math.log2(math.e)
_MASK = -1e30
_SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
# Cache element types besides q's: e4m3, which Triton converts on sm_89+ (gpu_backend checks).
FP8_KV_DTYPES = (jnp.dtype(jnp.float8_e4m3fn),)


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
    target_programs: decode programs wanted in flight (~2 per SM on a 132-SM H100): the run-time
      split count is cdiv(target_programs, live_seqs * K), capped by max_splits.
    Defaults: the best of the H100 tiling sweeps (lab/results/kernels_h100.json).
    """

    decode_block_kv: int = 64
    decode_num_warps: int = 4
    decode_num_stages: int = 3
    prefill_rows: int = 128
    prefill_block_kv: int = 128
    prefill_num_warps: int = 8
    prefill_num_stages: int = 3
    target_programs: int = 264
    max_splits: int = 32
    mosaic: mgpu.MosaicTiling = mgpu.MosaicTiling()

    def __post_init__(self) -> None:
        for name in ("decode_block_kv", "prefill_rows", "prefill_block_kv"):
            v = getattr(self, name)
            if not _is_pow2(v) or v < 16:
                raise ValueError(f"Tiling.{name} must be a power of two >= 16, got {v}")
        for name in ("decode_num_warps", "decode_num_stages", "prefill_num_warps",
                     "prefill_num_stages", "target_programs", "max_splits"):
            if getattr(self, name) < 1:
                raise ValueError(f"Tiling.{name} must be >= 1, got {getattr(self, name)}")


# Shared memory one program may use (CUDA's opt-in maximum per block), by compute capability;
# Hopper's where the device is unknown (interpret mode). A little is kept back for Triton's own
# scratch (layout conversions, barriers).
_SMEM_BYTES = {(8, 0): 166912, (8, 6): 101376, (8, 7): 166912, (8, 9): 101376, (9, 0): 232448}
_SMEM_DEFAULT = 232448
_SMEM_SLACK = 8 << 10


def smem_estimate(rows: int, block_kv: int, kv_buffers: int, h: int, itemsize: int) -> int:
    """Shared memory of one attention program: its query tile (rows x h) plus `kv_buffers` K and
    V tiles (block_kv x h each). Fitted to what Triton requested on an H100/H200
    (lab/kernels/smem_probe.py): the prefill kernel double-buffers K and V once pipelined
    (num_stages >= 2; a third stage adds ~1 KiB), the decode kernel holds one K and one V tile."""
    return (rows + kv_buffers * 2 * block_kv) * h * itemsize


def fit_shared_memory(tiling: Tiling, h: int, itemsize: int, g: int, smem_bytes: int) -> Tiling:
    """`tiling` with each kernel's tiles shrunk, where they do not fit `smem_bytes`, until they
    do: smaller KV tiles first (down to 32), then fewer prefill rows (down to 32), then an
    unpipelined prefill, then KV tiles down to 16. Head size 256 (Gemma) and float32 need
    this; bf16 head sizes up to 128 keep the defaults."""
    budget = smem_bytes - _SMEM_SLACK

    def shrink(rows: int, bkv: int, stages: int, decode: bool) -> tuple[int, int, int]:
        while smem_estimate(rows, bkv, 1 if decode else min(stages, 2), h, itemsize) > budget:
            if bkv > 32:
                bkv //= 2
            elif not decode and rows > max(32, _next_pow2(g)):
                rows //= 2
            elif not decode and stages > 1:
                stages = 1
            elif bkv > 16:
                bkv //= 2
            else:
                break  # nothing left to shrink: the compiler will say what it needs
        return rows, bkv, stages

    _, dec_kv, dec_st = shrink(max(16, _next_pow2(g)), tiling.decode_block_kv, tiling.decode_num_stages, True)
    rows, pre_kv, pre_st = shrink(tiling.prefill_rows, tiling.prefill_block_kv, tiling.prefill_num_stages, False)
    fitted = dataclasses.replace(tiling, decode_block_kv=dec_kv, decode_num_stages=dec_st, prefill_rows=rows,
                                 prefill_block_kv=pre_kv, prefill_num_stages=pre_st)
    return tiling if fitted == tiling else fitted


def _smem_bytes(interpret: bool) -> int:
    """Shared memory per program on the device the kernels run on."""
    if interpret:
        return _SMEM_DEFAULT
    cc = getattr(jax.devices()[0], "compute_capability", None)
    try:
        major, minor = (int(x) for x in str(cc).split(".")[:2])
    except ValueError:
        return _SMEM_DEFAULT
    return _SMEM_BYTES.get((major, minor), _SMEM_DEFAULT if major >= 9 else _SMEM_BYTES[(8, 6)])


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
    nqb: int    # virtual prefill tiles per KV head (static bound)
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


def _load_kv(ref, rows: jax.Array, valid: jax.Array, h: int, dtype: jnp.dtype) -> jax.Array:
    """Gathers cache rows [BKV] -> [BKV, H] in `dtype` (q's); rows with valid False are not
    fetched (zeros)."""
    cols = jnp.arange(h, dtype=jnp.int32)[None, :]
    mask = jnp.broadcast_to(valid[:, None], (rows.shape[0], h))
    if ref.dtype == dtype:
        return plgpu.load(ref.at[rows[:, None], cols], mask=mask, other=0)
    # fp8 cache: no fp8 fill constant (Triton takes none from an int); the rows not fetched are
    # zeroed after the upcast, so that garbage (an e4m3 NaN) never meets a zero weight in P.V.
    x = _upcast(plgpu.load(ref.at[rows[:, None], cols], mask=mask), dtype)
    return jnp.where(mask, x, 0)


def _upcast(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """A K/V tile in q's dtype: an fp8 tile converted in registers; anything else as it is."""
    return x if x.dtype == dtype else x.astype(dtype)


def _normalize(acc: jax.Array, l: jax.Array, v_scale: float) -> jax.Array:
    """acc [R, H] / l [R], times the cache's static V scale (no multiply at 1.0)."""
    if v_scale == 1.0:
        return acc / jnp.maximum(l, 1e-30)[:, None]
    return acc * (v_scale / jnp.maximum(l, 1e-30))[:, None]


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


def _online_step_unmasked(carry, s2, v, *, f32_pv: bool):
    """`_online_step` for a tile with every key allowed for every row."""
    m, l, acc = carry
    m_new = jnp.maximum(m, jnp.max(s2, axis=1))
    alpha = jnp.exp2(m - m_new)
    pr = jnp.exp2(s2 - m_new[:, None])
    l = l * alpha + jnp.sum(pr, axis=1)
    pv = _dot(pr if f32_pv else pr.astype(v.dtype), v)
    return m_new, l, acc * alpha[:, None] + pv


def _store_rows(out_ref, rows: jax.Array, val: jax.Array, valid: jax.Array) -> None:
    """Masked store of val [R, H] into rows [R] of a flat [X, H] ref."""
    h = val.shape[1]
    cols = jnp.arange(h, dtype=jnp.int32)[None, :]
    mask = jnp.broadcast_to(valid[:, None], val.shape)
    plgpu.store(out_ref.at[rows[:, None], cols], val.astype(out_ref.dtype), mask=mask)


def _split_geometry(kv_len, splits, window: int | None, dims: _Dims, tiling: Tiling):
    """How a decode row's KV range is cut: (first attended position, pages per split, used splits).

    Every program of the sequence computes the same values, so they agree on who merges.
    """
    lo = jnp.maximum(kv_len - window, 0) if window is not None else jnp.int32(0)
    first_page = lo // dims.p
    n_pages = _cdiv(kv_len, dims.p) - first_page
    min_chunk = _cdiv(tiling.decode_block_kv, dims.p)  # at least one full loop step per split
    chunk = jnp.maximum(_cdiv(n_pages, splits), min_chunk)
    chunk = _cdiv(chunk, min_chunk) * min_chunk
    return lo, first_page, chunk, _cdiv(n_pages, chunk)


@dataclasses.dataclass(frozen=True)
class _TableDims:
    """Static shape of the Mosaic prefill kernel's tile table when Triton programs build it."""

    tt: int      # tokens per tile (mgpu.tile_tokens)
    nt: int      # table length (mgpu.num_tiles, a static bound on live tiles)
    sp: int      # slots padded to a power of two (one vector per metadata array)
    per: int     # tiles of the sequence-order list that one table program places
    chunks: int  # table programs

    @staticmethod
    def make(t: int, s: int, g: int) -> _TableDims:
        nt = mgpu.num_tiles(t, s, g)
        sp = _next_pow2(s)
        # [per, S] working set of at most TABLE_ELEMENTS: the table programs share the decode
        # kernel's register budget, so wide slot counts place fewer tiles per program.
        per = max(1, min(TABLE_TILES, TABLE_ELEMENTS // sp))
        return _TableDims(tt=mgpu.tile_tokens(g), nt=nt, sp=sp, per=per, chunks=_cdiv(nt, per))

    @property
    def length(self) -> int:
        """Entries of each table column (>= nt)."""
        return self.chunks * self.per


TABLE_TILES = 16  # tiles of the sequence-order list that one table program places, at most
TABLE_ELEMENTS = 4096  # and its [tiles, slots] comparisons at most this many elements
# Slots (padded to a power of two) up to which the decode kernel's own programs build the table:
# 256, the engine's default max_num_seqs, so that its batches get the table from the decode
# launch; wider tables get a launch of their own (see `_rpa_call`).
FUSED_TABLE_MAX_SLOTS = 256


def _tile_table_program(c, qsl_ref, kvl_ref, ns_ref, seq_ref, t0_ref, qend_ref, fpos_ref,
                        cnt_ref, *, s: int, td: _TableDims):
    """Program c of the tile table (`mgpu.tile_layout`'s contract, without its XLA fusions):
    tiles [c * per, (c + 1) * per) of the sequence-order list, each written at its place in
    the heaviest-first order. The table has chunks * per >= NT entries; those past the live
    count hold seq -1 (no work) and zeros.

    A tile's place is how many tiles go before it: those reaching further into the KV (larger
    first position), and those reaching equally far from an earlier sequence. Sequence b's
    tiles start at positions fp_b + j * TT, j < tiles_b, so how many of them lie above a
    position x is a closed form per sequence: one [per, S] pass, no sort and no
    ordering of the whole table in one place.
    """
    b = jnp.arange(td.sp, dtype=jnp.int32)
    slot = b < s
    n_live = jnp.minimum(ns_ref[0], s)
    q_start = plgpu.load(qsl_ref.at[b], mask=slot, other=0)
    q_next = plgpu.load(qsl_ref.at[b + 1], mask=slot, other=0)
    kv_len = plgpu.load(kvl_ref.at[b], mask=slot, other=0)
    q_len = jnp.where(b < n_live, q_next - q_start, 0)
    tiles = jnp.where(q_len > 1, (q_len + td.tt - 1) // td.tt, 0)
    ends = jnp.cumsum(tiles)  # inclusive
    total = jnp.sum(tiles)
    fp0 = kv_len - q_len  # KV position of each sequence's first new token

    i = c * td.per + jnp.arange(td.per, dtype=jnp.int32)
    seq = jnp.minimum(jnp.sum((ends[None, :] <= i[:, None]).astype(jnp.int32), axis=1), s - 1)
    mine = b[None, :] == seq[:, None]  # [tiles, slots]: each tile's sequence

    def pick(v):
        return jnp.sum(jnp.where(mine, v[None, :], 0), axis=1)

    qs, ql, f0 = pick(q_start), pick(q_len), pick(fp0)
    j = i - (pick(ends) - pick(tiles))  # the tile's index within its sequence
    x = f0 + j * td.tt  # its first position
    d = jnp.maximum(x[:, None] - fp0[None, :], 0)
    reach = x[:, None] >= fp0[None, :]
    # Tiles of b at or below x: j' <= (x - fp_b) / TT; above x: the rest of tiles_b.
    below = jnp.where(reach, jnp.minimum(d // td.tt + 1, tiles[None, :]), 0)
    tie = reach & (d % td.tt == 0) & (d // td.tt < tiles[None, :]) & (b[None, :] < seq[:, None])
    place = jnp.sum(tiles[None, :] - below + tie.astype(jnp.int32), axis=1)
    # The live places are 0 .. total - 1, once each; an entry i past them is written at i
    # with seq -1 (no work), so every entry is written once and no two lanes meet.
    live = i < total
    place = jnp.where(live, place, i)
    plgpu.store(seq_ref.at[place], jnp.where(live, seq, -1))
    plgpu.store(t0_ref.at[place], jnp.where(live, qs + j * td.tt, 0))
    plgpu.store(qend_ref.at[place], jnp.where(live, qs + ql, 0))
    plgpu.store(fpos_ref.at[place], jnp.where(live, x, 0))

    @pl.when(c == 0)
    def _():
        cnt_ref[0] = jnp.minimum(total, td.nt)


def _table_shapes(td: _TableDims) -> tuple:
    return (jax.ShapeDtypeStruct((td.length,), jnp.int32),) * 4 + (
        jax.ShapeDtypeStruct((1,), jnp.int32),)


def tile_table(query_start_loc, kv_lens, num_seqs, *, t: int, n: int, k: int,
               interpret: bool = False) -> mgpu.TileLayout:
    """The Mosaic prefill kernel's tile table by one Triton launch, where the Triton decode
    kernel's extra programs do not build it (prefill-only calls, more than
    FUSED_TABLE_MAX_SLOTS slots). Same first `count` entries as `mgpu.tile_layout`;
    after them, entries with seq -1 (no work)."""
    s = kv_lens.shape[0]
    td = _TableDims.make(t, s, n // k)

    def kernel(qsl_ref, kvl_ref, ns_ref, *refs):
        _tile_table_program(pl.program_id(0), qsl_ref, kvl_ref, ns_ref, *refs, s=s, td=td)

    cols = pl.pallas_call(kernel, grid=(td.chunks,), out_shape=_table_shapes(td),
                          interpret=interpret, name="rpa_tile_table",
                          compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
                          )(query_start_loc, kv_lens, num_seqs)
    return mgpu.TileLayout(*cols)


def _decode_kernel(q_ref, k_ref, v_ref, kvl_ref, bt_ref, qsl_ref, ns_ref, cnt_in_ref,
                   out_ref, op_ref, mp_ref, lp_ref, cnt_ref, *table_refs, dims: _Dims,
                   tiling: Tiling, sm_scale: float, soft_cap: float | None,
                   window: int | None, interpret: bool, zero_padding: bool,
                   table: _TableDims | None = None, v_scale: float = 1.0):
    """Programs (kh, p < NPD): decode rows. With `table` (the Mosaic prefill kernel follows),
    programs (kh, p >= NPD) build its tile table into `table_refs`, beside the decode work
    instead of as XLA ops before it."""
    del cnt_in_ref  # zeroed arrival counters, aliased to cnt_ref
    kh = pl.program_id(0)
    p = pl.program_id(1)
    decode = functools.partial(
        _decode_program, q_ref, k_ref, v_ref, kvl_ref, bt_ref, qsl_ref, ns_ref, out_ref, op_ref,
        mp_ref, lp_ref, cnt_ref, kh=kh, p=p, dims=dims, tiling=tiling, sm_scale=sm_scale,
        soft_cap=soft_cap, window=window, interpret=interpret, zero_padding=zero_padding,
        v_scale=v_scale)
    if table is None:
        decode()
        return
    pl.when(p < dims.npd)(decode)
    c = (p - dims.npd) * dims.k + kh

    @pl.when((p >= dims.npd) & (c < table.chunks))
    def _():
        _tile_table_program(c, qsl_ref, kvl_ref, ns_ref, *table_refs, s=dims.s, td=table)


def _decode_program(q_ref, k_ref, v_ref, kvl_ref, bt_ref, qsl_ref, ns_ref, out_ref, op_ref,
                    mp_ref, lp_ref, cnt_ref, *, kh, p, dims: _Dims, tiling: Tiling,
                    sm_scale: float, soft_cap: float | None, window: int | None,
                    interpret: bool, zero_padding: bool, v_scale: float = 1.0):
    n_live = jnp.minimum(ns_ref[0], dims.s)
    if zero_padding:
        # Padding rows (tokens from query_start_loc[num_seqs] on) get zeros: program p of a
        # KV head takes padding tokens p, p + NPD, ... for its G heads.
        pad0 = qsl_ref[n_live]
        g_all = jnp.arange(dims.rows_dec, dtype=jnp.int32)
        zeros = jnp.zeros((dims.rows_dec, dims.h), jnp.float32)

        def zero_token(i, c):
            tok = pad0 + p + i * dims.npd
            _store_rows(out_ref, tok * dims.n + kh * dims.g + g_all, zeros, g_all < dims.g)
            return c

        lax.fori_loop(0, _cdiv(jnp.maximum(dims.t - pad0 - p, 0), dims.npd), zero_token, 0)
    splits = _num_splits(n_live, dims, tiling)
    seq = p // splits
    split = p % splits
    seq_c = jnp.minimum(seq, dims.s - 1)
    q_start = qsl_ref[seq_c]
    q_len = qsl_ref[seq_c + 1] - q_start
    kv_len = kvl_ref[seq_c]
    lo, first_page, chunk, n_used = _split_geometry(kv_len, splits, window, dims, tiling)

    # Splits past the sequence's end (n_used) and non-decode slots do nothing.
    @pl.when((seq < n_live) & (q_len == 1) & (split < n_used))
    def _():
        bkv = tiling.decode_block_kv
        page_lo = first_page + split * chunk
        tok_base = page_lo * dims.p
        tok_lo = jnp.maximum(tok_base, lo)
        tok_hi = jnp.minimum((page_lo + chunk) * dims.p, kv_len)
        n_iter = _cdiv(tok_hi - tok_base, bkv)

        g = jnp.arange(dims.rows_dec, dtype=jnp.int32)
        heads = kh * dims.g + jnp.minimum(g, dims.g - 1)
        q = q_ref[q_start * dims.n + heads, :]  # [R, H]

        def body(it, carry):
            kpos = tok_base + it * bkv + jnp.arange(bkv, dtype=jnp.int32)
            valid = (kpos >= tok_lo) & (kpos < tok_hi)
            rows = _kv_rows(bt_ref, seq_c, kpos, kh, dims)
            k = _load_kv(k_ref, rows, valid, dims.h, q.dtype)
            v = _load_kv(v_ref, rows, valid, dims.h, q.dtype)
            s2 = _logits_log2(_dot(q, k, trans_b=True), sm_scale, soft_cap)
            return _online_step(carry, s2, valid[None, :], v, f32_pv=q.dtype == jnp.float32)

        r = dims.rows_dec
        init = (jnp.full((r,), _MASK, jnp.float32), jnp.zeros((r,), jnp.float32),
                jnp.zeros((r, dims.h), jnp.float32))
        m, l, acc = lax.fori_loop(0, n_iter, body, init)
        real = g < dims.g
        out_rows = q_start * dims.n + kh * dims.g + g

        @pl.when(n_used == 1)
        def _():
            _store_rows(out_ref, out_rows, _normalize(acc, l, v_scale), real)

        @pl.when(n_used > 1)
        def _():
            # Publish the partial, then count arrivals; the last split to arrive merges. The
            # barrier orders every thread's stores before the (release) atomic.
            prow = (kh * dims.npd + p) * dims.g + g
            _store_rows(op_ref, prow, acc, real)
            plgpu.store(mp_ref.at[prow], m, mask=real)
            plgpu.store(lp_ref.at[prow], l, mask=real)
            if not interpret:
                plgpu.debug_barrier()
            arrived = plgpu.atomic_add(cnt_ref, (seq_c * dims.k + kh,), jnp.int32(1))

            @pl.when(arrived == n_used - 1)
            def _():
                _merge_partials(op_ref, mp_ref, lp_ref, out_ref, base=kh * dims.npd + seq * splits,
                                n_used=n_used, out_row0=q_start * dims.n + kh * dims.g,
                                dims=dims, tiling=tiling, v_scale=v_scale)


def _merge_partials(op_ref, mp_ref, lp_ref, out_ref, *, base, n_used, out_row0, dims: _Dims,
                    tiling: Tiling, v_scale: float = 1.0):
    """Combines the n_used partials (rows (base + j) * G + g) of one decode row.

    Two vector passes instead of a serial loop over splits: all running maxima and sums at
    once, then the accumulators in chunks of `ch` splits.
    """
    sp = _next_pow2(tiling.max_splits)
    gp = dims.gp
    g2 = jnp.minimum(jnp.arange(gp, dtype=jnp.int32), dims.g - 1)[None, :]
    j2 = jnp.arange(sp, dtype=jnp.int32)[:, None]
    rows2 = (base + j2) * dims.g + g2  # [SP, Gp]
    ok2 = jnp.broadcast_to(j2 < n_used, (sp, gp))
    m2 = plgpu.load(mp_ref.at[rows2], mask=ok2, other=_MASK, volatile=True)
    l2 = plgpu.load(lp_ref.at[rows2], mask=ok2, other=0.0, volatile=True)
    m_all = jnp.max(m2, axis=0)  # [Gp]
    l_all = jnp.sum(l2 * jnp.exp2(m2 - m_all[None, :]), axis=0)

    ch = max(1, min(sp, 16 // gp))  # small chunks: the merge must not raise register use
    h3 = jnp.arange(dims.h, dtype=jnp.int32)[None, None, :]

    def body(c, acc):
        jc = c * ch + jnp.arange(ch, dtype=jnp.int32)[:, None]  # [CH, 1]
        rows_c = (base + jc) * dims.g + g2  # [CH, Gp]
        ok_c = jnp.broadcast_to(jc < n_used, (ch, gp))
        mc = plgpu.load(mp_ref.at[rows_c], mask=ok_c, other=_MASK, volatile=True)
        w = jnp.where(ok_c, jnp.exp2(mc - m_all[None, :]), 0.0)  # [CH, Gp]
        ok3 = jnp.broadcast_to(ok_c[:, :, None], (ch, gp, dims.h))
        o3 = plgpu.load(op_ref.at[rows_c[:, :, None], h3], mask=ok3, other=0.0, volatile=True)
        return acc + jnp.sum(o3 * w[:, :, None], axis=0)

    acc = lax.fori_loop(0, _cdiv(n_used, ch), body, jnp.zeros((gp, dims.h), jnp.float32))
    g = jnp.arange(gp, dtype=jnp.int32)
    _store_rows(out_ref, out_row0 + g, _normalize(acc, l_all, v_scale), g < dims.g)


def _load_qsl(qsl_ref, dims: _Dims, shift: int = 0) -> jax.Array:
    """query_start_loc[i + shift] for i < qsl_pad as one vector load (0 past slot S; with
    shift 1 the last entry repeats), instead of a chain of dependent scalar loads."""
    idx = jnp.arange(dims.qsl_pad, dtype=jnp.int32)
    return plgpu.load(qsl_ref.at[jnp.minimum(idx + shift, dims.s)], mask=idx <= dims.s, other=0)


def _find_tile(qsl, n_live, p, dims: _Dims):
    """Largest s in [0, n_live] with qsl[s] // block_q + s <= p (slot n_live = the padding);
    `qsl` is `_load_qsl`'s vector."""
    idx = jnp.arange(dims.qsl_pad, dtype=jnp.int32)
    hit = (idx <= n_live) & (qsl // dims.block_q + idx <= p)
    return jnp.sum(hit.astype(jnp.int32)) - 1


def _attend_tile(q, qpos, kpos0, n_iter, carry, *, masked: bool, kv_lo, kv_hi, s_c, kh,
                 k_ref, v_ref, bt_ref, dims: _Dims, tiling: Tiling, sm_scale: float,
                 soft_cap: float | None, window: int | None):
    """Online softmax of q [RQ, H] over n_iter KV tiles from position kpos0.

    masked=False is for tiles wholly inside every row's causal (and window) range: no
    position masks and no masked loads.
    """
    bkv = tiling.prefill_block_kv

    def body(it, c):
        kpos = kpos0 + it * bkv + jnp.arange(bkv, dtype=jnp.int32)
        rows = _kv_rows(bt_ref, s_c, kpos, kh, dims)
        if masked:
            valid = (kpos >= kv_lo) & (kpos < kv_hi)
            k = _load_kv(k_ref, rows, valid, dims.h, q.dtype)
            v = _load_kv(v_ref, rows, valid, dims.h, q.dtype)
        else:
            k = _upcast(k_ref[rows, :], q.dtype)
            v = _upcast(v_ref[rows, :], q.dtype)
        s2 = _logits_log2(_dot(q, k, trans_b=True), sm_scale, soft_cap)
        if not masked:
            return _online_step_unmasked(c, s2, v, f32_pv=q.dtype == jnp.float32)
        allowed = (kpos[None, :] <= qpos[:, None]) & valid[None, :]
        if window is not None:
            allowed &= kpos[None, :] > qpos[:, None] - window
        return _online_step(c, s2, allowed, v, f32_pv=q.dtype == jnp.float32)

    return lax.fori_loop(0, n_iter, body, carry)


def _query_tile(q_ref, k_ref, v_ref, kvl_ref, bt_ref, qsl_ref, out_ref, *, qsl, kh, p, n_live,
                dims: _Dims, tiling: Tiling, sm_scale: float, soft_cap: float | None,
                window: int | None, v_scale: float = 1.0):
    """Virtual tile p of a KV head: a prefill tile, padding zeros, or nothing (decode rows).
    `qsl`: query_start_loc as `_load_qsl`'s vector."""
    bq = dims.block_q
    s = _find_tile(qsl, n_live, p, dims)
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
        kv_hi = jnp.minimum(first_pos + bq, kv_len)  # past the tile's last live row
        last_pos = kv_hi - 1
        kv_lo = jnp.maximum(first_pos - window + 1, 0) if window is not None else jnp.int32(0)
        start = (kv_lo // dims.p) * dims.p
        n_iter = _cdiv(kv_hi - start, bkv)
        # Tiles [full_lo, full_hi) need no mask: every key is <= first_pos (causal for all
        # rows) and > last_pos - window (inside every row's window).
        full_hi = jnp.maximum((first_pos + 1 - start) // bkv, 0)
        if window is not None:
            full_lo = jnp.minimum(_cdiv(jnp.maximum(last_pos - window + 1 - start, 0), bkv),
                                  full_hi)
        else:
            full_lo = jnp.int32(0)
        kw = dict(kv_lo=kv_lo, kv_hi=kv_hi, s_c=s_c, kh=kh, k_ref=k_ref, v_ref=v_ref,
                  bt_ref=bt_ref, dims=dims, tiling=tiling, sm_scale=sm_scale,
                  soft_cap=soft_cap, window=window)
        carry = (jnp.full((rq,), _MASK, jnp.float32), jnp.zeros((rq,), jnp.float32),
                 jnp.zeros((rq, dims.h), jnp.float32))
        carry = _attend_tile(q, qpos, start, full_lo, carry, masked=True, **kw)
        carry = _attend_tile(q, qpos, start + full_lo * bkv, full_hi - full_lo, carry,
                             masked=False, **kw)
        carry = _attend_tile(q, qpos, start + full_hi * bkv, n_iter - full_hi, carry,
                             masked=True, **kw)
        _, l, acc = carry
        out = jnp.where(l[:, None] > 0, _normalize(acc, l, v_scale), 0.0)
        _store_rows(out_ref, out_rows, out, row_ok)


def _prefill_kernel(q_ref, k_ref, v_ref, kvl_ref, bt_ref, qsl_ref, ns_ref, out_in_ref, out_ref,
                    *, dims: _Dims, tiling: Tiling, sm_scale: float, soft_cap: float | None,
                    window: int | None, v_scale: float = 1.0):
    """Programs (kh, i) of a grid of `_prefill_programs(dims, tiling)` a KV head: program i takes
    the virtual tiles n_tiles - 1 - i, n_tiles - 1 - i - stride, ... (the last tiles of a chunk
    attend to the most keys, so they start first). A step with no prefill row and no padding
    row (a decode step that fills its bucket) leaves every program at once."""
    del out_in_ref  # aliased to out_ref: the decode kernel's rows are already in it
    kh = pl.program_id(0)
    i, stride = pl.program_id(1), pl.num_programs(1)
    n_live = jnp.minimum(ns_ref[0], dims.s)
    n_tiles_max = _cdiv(dims.t, dims.block_q) + n_live  # bound on live virtual tiles
    qsl = _load_qsl(qsl_ref, dims)
    idx = jnp.arange(dims.qsl_pad, dtype=jnp.int32)
    longest = jnp.max(jnp.where(idx < n_live, _load_qsl(qsl_ref, dims, shift=1) - qsl, 0))
    padding = qsl_ref[n_live] < dims.t
    n_tiles = jnp.where((longest > 1) | padding, n_tiles_max, 0)

    def tile(j, carry):
        _query_tile(q_ref, k_ref, v_ref, kvl_ref, bt_ref, qsl_ref, out_ref, qsl=qsl, kh=kh,
                    p=n_tiles - 1 - (i + j * stride), n_live=n_live, dims=dims, tiling=tiling,
                    sm_scale=sm_scale, soft_cap=soft_cap, window=window, v_scale=v_scale)
        return carry

    lax.fori_loop(0, _cdiv(jnp.maximum(n_tiles - i, 0), stride), tile, 0)


# False: one prefill program a virtual tile (the grid before the cap), for comparisons.
PREFILL_PROGRAMS_CAPPED = True


def _prefill_programs(dims: _Dims, tiling: Tiling) -> int:
    """Prefill programs a KV head: about `tiling.target_programs` in all (what the SMs hold at
    once), never more than the virtual tiles' static bound. A grid of one program a tile was
    launched in waves even on decode steps, where every program had nothing to do
    (benchmarks/results/step_trace_h100.md)."""
    if not PREFILL_PROGRAMS_CAPPED:
        return dims.nqb
    return max(1, min(dims.nqb, _cdiv(tiling.target_programs, dims.k)))


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


def _use_mosaic(choice: str, q, k_cache, soft_cap, window, tiling: Tiling,
                interpret: bool, v_scale: float = 1.0) -> bool:
    """Whether the prefill rows go to the Mosaic GPU prefill kernel (static: shapes, dtype,
    options); `choice` "mosaic" raises where that kernel does not apply. Its WGMMAs read the
    cache in q's dtype and it knows no V scale: an fp8 cache always stays on Triton."""
    if choice == "triton":
        return False
    t, n, h = q.shape
    g, p = n // k_cache.shape[1], k_cache.shape[2]
    ok = (t >= 2 and t % 8 == 0 and not interpret and k_cache.dtype == q.dtype
          and v_scale == 1.0
          and mgpu.supported(q.dtype, h, g, p, soft_cap, window, tiling.mosaic))
    if choice == "mosaic" and not ok:
        raise ValueError(
            f"prefill='mosaic' cannot serve this call (dtype {q.dtype}, cache dtype "
            f"{k_cache.dtype}, v_scale {v_scale}, head dim {h}, "
            f"{g} query heads per KV head, block size {p}, {t} token rows, soft_cap "
            f"{soft_cap}, sliding_window {window}, interpret {interpret}); see "
            "ragged_paged_attention_mgpu.supported")
    return ok


def _flat(q, k_cache, v_cache, block_tables, dims: _Dims):
    """The views the Triton kernels index: q [T * N, H], caches [B * K * P, H], tables [S * M]."""
    b = k_cache.shape[0]
    return (q.reshape(dims.t * dims.n, dims.h), k_cache.reshape(b * dims.k * dims.p, dims.h),
            v_cache.reshape(b * dims.k * dims.p, dims.h), block_tables.reshape(dims.s * dims.m))


def _rpa_call(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs, *,
              sm_scale: float, soft_cap: float | None, window: int | None, tiling: Tiling,
              interpret: bool, prefill: str = "triton", decode_only: bool = False,
              prefill_only: bool = False, v_scale: float = 1.0) -> jax.Array:
    """Builds the grids and runs the kernels; inputs already validated. `sm_scale` already
    holds the cache's k_scale."""
    dims = _make_dims(q, k_cache, block_tables, tiling)
    mosaic = not decode_only and _use_mosaic(prefill, q, k_cache, soft_cap, window, tiling,
                                             interpret, v_scale)
    if prefill_only:
        # No decode kernel: the Mosaic kernel fills a fresh buffer (zeroing the padding rows
        # itself); the Triton prefill kernel writes prefill and padding rows into zeros.
        out = None if mosaic else jnp.zeros((dims.t * dims.n, dims.h), q.dtype)
        return _prefill_rows(out, q, k_cache, v_cache, kv_lens, block_tables, query_start_loc,
                             num_seqs, dims=dims, mosaic=mosaic, sm_scale=sm_scale,
                             soft_cap=soft_cap, window=window, tiling=tiling,
                             interpret=interpret, v_scale=v_scale)
    # The decode kernel zeroes the padding rows when the Mosaic prefill kernel follows (it
    # writes its own rows only) or when no prefill kernel follows.
    zero_padding = mosaic or decode_only
    # With the Mosaic prefill kernel next, the decode kernel's extra programs build its tile
    # table (one launch fewer than XLA's three fusions, running beside the decode work), up
    # to FUSED_TABLE_MAX_SLOTS slots: beyond, its slot-wide vectors would weigh on the decode
    # programs' registers, and `_prefill_rows` gives it a launch of its own.
    fused = (mosaic and tiling.mosaic.tile_table == "triton"
             and _next_pow2(dims.s) <= FUSED_TABLE_MAX_SLOTS)
    out, layout = _decode_rows(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc,
                               num_seqs, dims=dims, sm_scale=sm_scale, soft_cap=soft_cap,
                               window=window, tiling=tiling, interpret=interpret,
                               zero_padding=zero_padding, table=fused, v_scale=v_scale)
    if decode_only:
        return out.reshape(dims.t, dims.n, dims.h)
    return _prefill_rows(out, q, k_cache, v_cache, kv_lens, block_tables, query_start_loc,
                         num_seqs, dims=dims, mosaic=mosaic, sm_scale=sm_scale,
                         soft_cap=soft_cap, window=window, tiling=tiling, interpret=interpret,
                         layout=layout, v_scale=v_scale)


def _decode_rows(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs, *,
                 dims: _Dims, sm_scale: float, soft_cap: float | None, window: int | None,
                 tiling: Tiling, interpret: bool, zero_padding: bool, table: bool,
                 v_scale: float = 1.0) -> tuple[jax.Array, mgpu.TileLayout | None]:
    """The Triton decode kernel: decode rows (and zeroed padding rows with `zero_padding`) of
    a fresh [T * N, H] buffer, and with `table` the Mosaic prefill kernel's tile table from
    its extra programs (else None)."""
    q2, kc, vc, bt = _flat(q, k_cache, v_cache, block_tables, dims)
    n_part = dims.k * dims.npd * dims.g
    counters = jnp.zeros((dims.s * dims.k,), jnp.int32)
    td = _TableDims.make(dims.t, dims.s, dims.g) if table else None
    outs = pl.pallas_call(
        functools.partial(_decode_kernel, dims=dims, tiling=tiling, sm_scale=sm_scale,
                          soft_cap=soft_cap, window=window, interpret=interpret,
                          zero_padding=zero_padding, table=td, v_scale=v_scale),
        grid=(dims.k, dims.npd + (0 if td is None else _cdiv(td.chunks, dims.k))),
        out_shape=(jax.ShapeDtypeStruct((dims.t * dims.n, dims.h), q.dtype),
                   jax.ShapeDtypeStruct((n_part, dims.h), jnp.float32),
                   jax.ShapeDtypeStruct((n_part,), jnp.float32),
                   jax.ShapeDtypeStruct((n_part,), jnp.float32),
                   jax.ShapeDtypeStruct((dims.s * dims.k,), jnp.int32),
                   *(() if td is None else _table_shapes(td))),
        input_output_aliases={7: 4},
        compiler_params=plgpu.CompilerParams(num_warps=tiling.decode_num_warps,
                                             num_stages=tiling.decode_num_stages),
        interpret=interpret,
        name="rpa_decode",
    )(q2, kc, vc, kv_lens, bt, query_start_loc, num_seqs, counters)
    return outs[0], (None if td is None else mgpu.TileLayout(*outs[5:]))


def _prefill_rows(out, q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs,
                  *, dims: _Dims, mosaic: bool, sm_scale: float, soft_cap: float | None,
                  window: int | None, tiling: Tiling, interpret: bool,
                  layout: mgpu.TileLayout | None = None, v_scale: float = 1.0) -> jax.Array:
    """Writes the prefill rows (and, on the Triton path, zero padding rows) into `out`
    [T * N, H], which holds the decode rows, in place; returns [T, N, H]. `out=None` (Mosaic
    path, prefill-only call): a fresh buffer, padding rows zeroed by the Mosaic kernel.
    `layout`: the Mosaic kernel's tile table, if the decode kernel built it; else one Triton
    launch builds it (MosaicTiling.tile_table "triton") or XLA ops do ("xla")."""
    if mosaic:
        # The decode kernel wrote the decode rows and zeroed the padding rows; the Mosaic
        # kernel writes the prefill rows into the same buffer, in place.
        if layout is None and tiling.mosaic.tile_table == "triton":
            layout = tile_table(query_start_loc, kv_lens, num_seqs, t=dims.t, n=dims.n,
                                k=dims.k, interpret=interpret)
        out3 = None if out is None else out.reshape(dims.t, dims.n, dims.h)
        return mgpu.prefill_attention(q, k_cache, v_cache, kv_lens, block_tables,
                                      query_start_loc, num_seqs, out3, sm_scale=sm_scale,
                                      tiling=tiling.mosaic, layout=layout)

    q2, kc, vc, bt = _flat(q, k_cache, v_cache, block_tables, dims)
    common = dict(dims=dims, tiling=tiling, sm_scale=sm_scale, soft_cap=soft_cap, window=window,
                  v_scale=v_scale)
    out = pl.pallas_call(
        functools.partial(_prefill_kernel, **common),
        grid=(dims.k, _prefill_programs(dims, tiling)),
        out_shape=jax.ShapeDtypeStruct((dims.t * dims.n, dims.h), q.dtype),
        input_output_aliases={7: 0},
        compiler_params=plgpu.CompilerParams(num_warps=tiling.prefill_num_warps,
                                             num_stages=tiling.prefill_num_stages),
        interpret=interpret,
        name="rpa_prefill",
    )(q2, kc, vc, kv_lens, bt, query_start_loc, num_seqs, out)
    return out.reshape(dims.t, dims.n, dims.h)


def _validate(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs, *,
              sm_scale, soft_cap, sliding_window, k_scale=1.0, v_scale=1.0) -> None:
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
    if k_cache.dtype != v_cache.dtype or (k_cache.dtype != q.dtype
                                          and k_cache.dtype not in FP8_KV_DTYPES):
        raise ValueError(f"k_cache/v_cache dtype ({k_cache.dtype}, {v_cache.dtype}) must match "
                         f"q dtype {q.dtype}, or both be float8_e4m3fn")
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
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not (isinstance(scale, (int, float)) and 0 < scale < math.inf):
            raise ValueError(f"{name} must be a positive finite float (static), got {scale!r}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be > 0 or None, got {soft_cap}")
    if sliding_window is not None and (int(sliding_window) != sliding_window
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window}")


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "tiling",
                                             "interpret", "prefill", "decode_only",
                                             "prefill_only", "k_scale", "v_scale"))
def ragged_paged_attention_gpu(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, kv_lens: jax.Array,
    block_tables: jax.Array, query_start_loc: jax.Array, num_seqs: jax.Array, *,
    sm_scale: float, soft_cap: float | None = None, sliding_window: int | None = None,
    tiling: Tiling | None = None, interpret: bool = False, prefill: str = "triton",
    decode_only: bool = False, prefill_only: bool = False, k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> jax.Array:
    """Ragged paged attention [T, N, H] -> [T, N, H]; contract of the reference.

    k_cache/v_cache are in q's dtype or float8_e4m3fn (an fp8 KV cache, read as fp8 and upcast
    to q's dtype in registers). The cache holds K / k_scale and V / v_scale (per-tensor, static
    floats, 1.0 by default): the result is attention over k_scale * k_cache, v_scale * v_cache.

    `interpret=True` runs the same kernels through Pallas' interpreter (CPU tests).
    `prefill`: who computes the rows of prefill chunks: "triton" (the kernel above, every
    case), "mosaic" (the Hopper kernel of ragged_paged_attention_mgpu.py; ValueError where it
    does not apply) or "auto" (Mosaic where it applies, else Triton). Hopper only for Mosaic.
    The decode rows (q_len == 1) always go to the Triton flash-decoding kernel above.
    `decode_only=True`: a decode-only step (every live sequence has q_len == 1, as after a
    scheduler step with no prefill chunk): the prefill kernel is not launched and the decode
    kernel zeroes the padding rows. Rows of a live sequence with q_len > 1 are then left
    unwritten.
    `prefill_only=True`: a step with no decode row (every live sequence has q_len > 1, as a
    scheduler step of prompt chunks only): the decode kernel is not launched; the prefill
    kernel writes the prefill rows and zeroes the padding rows. Rows of a live sequence with
    q_len == 1 are then not computed (the Mosaic path leaves them unwritten, the Triton path
    zero).
    Run-time preconditions (not checked): query_start_loc is non-decreasing, kv_lens[s] >=
    q_len[s] for live slots, block ids < B, num_seqs <= S.
    """
    _validate(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs,
              sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
              k_scale=k_scale, v_scale=v_scale)
    if prefill not in ("triton", "mosaic", "auto"):
        raise ValueError(f"prefill must be 'triton', 'mosaic' or 'auto', got {prefill!r}")
    if decode_only and prefill_only:
        raise ValueError("decode_only and prefill_only cannot both be set: a step with no "
                         "decode row and no prefill chunk has nothing to attend")
    return _rpa_call(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs,
                     sm_scale=float(sm_scale) * float(k_scale),
                     soft_cap=None if soft_cap is None else float(soft_cap),
                     window=None if sliding_window is None else int(sliding_window),
                     tiling=fit_shared_memory(tiling or Tiling(), q.shape[2], q.dtype.itemsize,
                                              q.shape[1] // k_cache.shape[1], _smem_bytes(interpret)),
                     interpret=interpret, prefill=prefill,
                     decode_only=bool(decode_only), prefill_only=bool(prefill_only),
                     v_scale=float(v_scale))
