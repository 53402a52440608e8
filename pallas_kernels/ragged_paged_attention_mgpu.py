"""Prefill chunks of ragged paged attention on Hopper: a Mosaic GPU (Pallas) kernel.

Same legend as ragged_paged_attention.py: T tokens, S slots, N query heads, K KV heads,
G = N // K, H head dim, B blocks, P block size, M blocks per sequence.

FlashAttention-3 structure: persistent CTAs (one per SM) walk the (query tile, KV head) work
items, listed heaviest first and dealt in snake order (`snake_item`: a CTA that took a heavy item
in one round takes a light one in the next; `MosaicTiling.persistent=False` launches one CTA per
item instead), with three warpgroups each:
- two compute warpgroups, each owning 64 matmul rows = TQ = 64 // G tokens x the G query heads
  of the KV head (GQA packing: row g * TQ + t is head g, token t), so one K/V page serves all
  G heads; they alternate tensor-core work (Q.K^T, then P.V) through a schedule barrier so that
  one's softmax overlaps the other's matmuls;
- one memory warpgroup streaming K and V pages by TMA, `block_kv` keys per pipeline step = one
  TMA copy per page of P keys (the block table is read as scalars), `stages` steps in flight;
  the pipeline runs on across a persistent CTA's items.
A tile is 2 x TQ consecutive tokens of one sequence with q_len > 1. Only the steps that cross
the causal diagonal are masked. Decode rows (q_len == 1) are not this kernel's work (the
flash-decoding kernel of ragged_paged_attention_gpu.py takes them).

KV splits (flash-decoding for prefill tiles, when the tiles alone would leave SMs idle): the C
CTAs of a cluster take the same (tile, KV head) item and cut its KV steps into C ranges. CTAs
1..C-1 leave their rows (normalised by their own softmax sum) and log2-sum-exps in their shared
memory; after a cluster barrier CTA 0 reads them across the cluster (distributed shared
memory), merges them with its own and stores the tile; a second cluster barrier keeps the
other CTAs' buffers until it has read them. One launch: no side buffers, no merge kernel.

The tile list is built before the call (one row per live tile, the tiles that attend to the
most keys first): by Triton programs (ragged_paged_attention_gpu.tile_table, the default) or by
XLA ops (`tile_layout`). The kernel writes its rows in place into the [T, N, H] output the
decode kernel filled (input/output aliasing): per query head, the tile's live tokens
go out by TMA from an untiled staging buffer in power-of-two row chunks, so no row past the
sequence's end (another tile's) is touched and no gather or select follows the kernel.

Scope: bf16 or f16, H in {64, 128} within the shared memory budget, G in {1, 2, 4, 8}, P a
multiple of 8 dividing block_kv, no soft cap and no sliding window; `supported()` says whether a
call qualifies (the Triton kernel serves every other case).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


_LOG2E = math.log2(math.e)
_ROWS = 64  # matmul rows per compute warpgroup (the wgmma M)
_WGS = 2    # compute warpgroups per CTA
_MAX_SPLITS = 4
_MIN_SPLIT_ROWS = 128  # token rows from which kv_splits=None may split
_MIN_STEPS_PER_SPLIT = 2  # a tile is cut into KV splits only from this many steps per split
_LSE_COLS = 8  # a row's log-sum-exp is kept as an [64, 8] tile (the smallest WGMMA tile)


@dataclasses.dataclass(frozen=True)
class MosaicTiling:
    """Static choices of the Mosaic prefill kernel.

    block_kv: keys per pipeline step (multiple of 64 and of the block size).
    stages: K/V steps buffered in shared memory.
    kv_splits: KV ranges each tile's keys are cut into, one CTA each (a cluster per item),
      merged inside the kernel (flash-decoding for prefill tiles). None: as many as fill
      `sm_count` CTAs when 128+ token rows hold few tiles (up to 4), else 1.
    persistent: True: one CTA per SM (`sm_count`, in clusters of the split count), each
      walking its items in snake order with the K/V pipeline running on across them. False: one
      CTA per item (one cluster per item with splits) up to the items of the token rows' tiles
      plus `sm_count` CTAs (more items than that, from many short sequences, are taken in snake
      order), launched heaviest first for the hardware to dispatch.
    num_ctas: a number of persistent CTAs instead of `sm_count` (None: by `persistent`).
    sm_count: streaming multiprocessors of the GPU (132 on an H100 SXM).
    overlap: within each compute warpgroup, step i's Q.K^T and step i-1's P.V are issued
      together and run on the tensor cores while the warpgroup computes step i's softmax
      (FlashAttention-3's intra-warpgroup pipelining, on top of the two warpgroups' ping-pong);
      P stays in registers one step longer. Off by default: the two warpgroups' ping-pong
      already keeps the tensor cores fed, and the overlapped loop did not beat the plain one
      (lab/kernels/NOTES.md, v13). False: Q.K^T, softmax, P.V in turn.
    profile_dir: diagnostics: a directory where each call writes a Chrome trace of every
      warpgroup's phases (Mosaic GPU's in-kernel profiler; lab/kernels/mosaic_phases.py
      sums them). Empty: off, and the kernel is unchanged.
    tile_table: who builds the tile table (`tile_layout`'s contract): "triton": extra programs
      of the Triton decode kernel, else (a prefill-only call, more than 256 slots) one Triton
      launch of its own; "xla": XLA ops before the call (three
      fusions).
    """

    block_kv: int = 128
    stages: int = 2
    kv_splits: int | None = None
    persistent: bool = True
    num_ctas: int | None = None
    sm_count: int = 132
    overlap: bool = False
    profile_dir: str = ""
    tile_table: str = "triton"

    def __post_init__(self) -> None:
        if self.tile_table not in ("triton", "xla"):
            raise ValueError(f"MosaicTiling.tile_table must be 'triton' or 'xla', "
                             f"got {self.tile_table!r}")
        if self.num_ctas is not None and self.num_ctas < 1:
            raise ValueError(f"MosaicTiling.num_ctas must be >= 1 or None, got {self.num_ctas}")
        if self.kv_splits is not None and not 1 <= self.kv_splits <= _MAX_SPLITS:
            raise ValueError(f"MosaicTiling.kv_splits must be in [1, {_MAX_SPLITS}] or None, "
                             f"got {self.kv_splits}")
        if self.sm_count < 1:
            raise ValueError(f"MosaicTiling.sm_count must be >= 1, got {self.sm_count}")
        if self.block_kv % 64 or self.block_kv < 64:
            raise ValueError(f"MosaicTiling.block_kv must be a multiple of 64, got {self.block_kv}")
        if self.stages < 2:
            raise ValueError(f"MosaicTiling.stages must be >= 2, got {self.stages}")


_SMEM_BYTES = 227 * 1024  # per CTA on Hopper


def smem_bytes(head_dim: int, itemsize: int, tiling: MosaicTiling) -> int:
    """Shared memory one CTA uses: Q/output tiles (swizzled + staging), the K/V stages, the
    row log-sum-exps of split tiles and a zero tile for padding rows."""
    return ((2 * _WGS * _ROWS + 2 * tiling.stages * tiling.block_kv + 8) * head_dim * itemsize
            + _WGS * _ROWS * _LSE_COLS * 4 + 1024)


def in_scope(dtype, head_dim: int, group: int, block_size: int, soft_cap, window, block_kv: int,
             smem: int) -> bool:
    """The scope of the Mosaic kernels (this prefill kernel; the lab's decode kernel shares it):
    16-bit, H in {64, 128}, G a power of two up to 8, pages of a multiple of 8 keys that tile a
    step of block_kv keys, no soft cap, no sliding window, and `smem` bytes of shared memory per
    CTA within the budget."""
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and head_dim in (64, 128) and group in (1, 2, 4, 8) and smem <= _SMEM_BYTES
            and block_size % 8 == 0 and block_kv % block_size == 0
            and soft_cap is None and window is None)


def supported(dtype, head_dim: int, group: int, block_size: int, soft_cap, window,
              tiling: MosaicTiling) -> bool:
    """Whether this kernel can serve a call with these static properties."""
    return in_scope(dtype, head_dim, group, block_size, soft_cap, window, tiling.block_kv,
                    smem_bytes(head_dim, jnp.dtype(dtype).itemsize, tiling))


_PROFILE_RANGES = 128  # phases recorded per warpgroup and call when profiling


def compiler_params(profile_dir: str, ranges: int = _PROFILE_RANGES) -> plgpu.CompilerParams:
    """The Mosaic kernels' compiler parameters: approximate exp2 and, with a profile directory,
    Mosaic GPU's in-kernel profiler recording up to `ranges` named phases (`jax.named_scope` in
    the kernel body) per warpgroup, one trace file per call."""
    if not profile_dir:
        return plgpu.CompilerParams(approx_math=True)
    return plgpu.CompilerParams(approx_math=True, profile_space=ranges, profile_dir=profile_dir)


def mma_transforms(head_dim: int, dtype) -> tuple:
    """Tiling and swizzle of a [rows, head_dim] shared-memory buffer the tensor cores read."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = min(128, head_dim * itemsize)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _cdiv(a, b):
    return (a + b - 1) // b


def load_kv_step(k_ref, v_ref, k_smem, v_smem, k_bars, v_bars, k_free, v_free, *, blks, kh,
                 n, slot, p: int, stages: int):
    """Memory warpgroup, pipeline step n into `slot`: once the slot is free (from step
    `stages` on), one TMA copy per page `blks[j]` of KV head `kh` for K, then for V."""
    pl.when(n >= stages)(lambda: plgpu.barrier_wait(k_free.at[slot]))
    for jj, blk in enumerate(blks):
        plgpu.copy_gmem_to_smem(k_ref.at[blk, kh], k_smem.at[slot, pl.ds(jj * p, p)],
                                k_bars.at[slot])
    pl.when(n >= stages)(lambda: plgpu.barrier_wait(v_free.at[slot]))
    for jj, blk in enumerate(blks):
        plgpu.copy_gmem_to_smem(v_ref.at[blk, kh], v_smem.at[slot, pl.ds(jj * p, p)],
                                v_bars.at[slot])


def softmax_step(s, scale, acc, m_i, l_i, dtype):
    """Online softmax over one step's raw scores s [64, BKV] (masked keys -inf), `scale` =
    softmax scale x log2(e): returns the rescaled accumulator, the new running max and sum, and
    the probabilities in `dtype` for the P.V product. The running max is kept in scaled base-2
    units, so each probability is exp2 of one fused multiply-add (s * scale - m), not of a
    scaled copy of s. acc=None (the accumulator is still in the tensor cores' hands): the
    factor alpha [64] it must be scaled by is returned in its place. dtype=None: the
    probabilities stay float32 (the caller converts them later)."""
    m_new = jnp.maximum(m_i, s.max(axis=1) * scale)
    alpha = jnp.exp2(m_i - m_new)
    pr = jnp.exp2(s * scale - lax.broadcast_in_dim(m_new, s.shape, [0]))
    if acc is not None:
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    l_i = l_i * alpha + pr.sum(axis=1)
    return (alpha if acc is None else acc), m_new, l_i, (pr if dtype is None else pr.astype(dtype))


def _load(ref, layout):
    """A register load of a whole shared-memory ref in `layout` (the keyword form is newer).

    Unoptimised: an untiled buffer read in the WGMMA layout has bank conflicts; it happens
    once per tile."""
    try:
        return plgpu.load(ref, layout=layout, optimized=False)
    except TypeError:
        return plgpu.load(ref, (), layout=layout, optimized=False)


def pow2_chunks(n, top: int) -> list:
    """Rows [0, n) as chunks of static power-of-two sizes (0 <= n <= top, top a power of two):
    (size, start, present) per bit of n from the highest; works on ints and traced scalars."""
    out = []
    b = top
    while b >= 1:
        out.append((b, n & ~(2 * b - 1), (n & b) != 0))
        b //= 2
    return out


def tile_tokens(group: int) -> int:
    """Tokens of one tile: TQ = 64 // G per compute warpgroup."""
    return _WGS * (_ROWS // group)


def num_tiles(t: int, s: int, group: int) -> int:
    """Static bound on live tiles: every prefill sequence has >= 2 tokens."""
    return max(1, _cdiv(t, tile_tokens(group)) + min(s, t // 2))


def kv_splits(t: int, k: int, group: int, tiling: MosaicTiling) -> int:
    """KV ranges per tile (static): when T token rows make fewer (tile, KV head) items than the
    GPU has SMs, each tile's keys are cut so the CTAs fill it (256 tokens, G = 4, K = 8:
    64 items -> 2 splits). Not below _MIN_SPLIT_ROWS rows: those buckets mostly carry decode
    batches, which would pay for the split CTAs and their merge for nothing."""
    if tiling.kv_splits is not None:
        return tiling.kv_splits
    if t < _MIN_SPLIT_ROWS:
        return 1
    items = k * _cdiv(t, tile_tokens(group))
    return int(min(_MAX_SPLITS, max(1, tiling.sm_count // items)))


def grid_clusters(t: int, s: int, k: int, group: int, splits: int,
                  tiling: MosaicTiling) -> int:
    """Clusters of `splits` CTAs launched (static), each walking (tile, KV head) items in snake
    order. Persistent (the default): one CTA per SM. Otherwise one cluster per item, but the
    item bound counts one partial tile per possible prefill sequence and launching that many
    (1,088 CTAs for 256 rows x 256 slots) costs microseconds of empty CTAs, so the grid stops
    at the items of the rows' own tiles plus one CTA per SM."""
    bound = k * num_tiles(t, s, group)
    if tiling.num_ctas is not None or tiling.persistent:
        ctas = tiling.sm_count if tiling.num_ctas is None else tiling.num_ctas
        return max(1, min(bound, ctas // splits))
    return min(bound, k * _cdiv(t, tile_tokens(group)) + max(1, tiling.sm_count // splits))


def split_steps(tile_steps, split, splits: int):
    """KV steps [lo, hi) of one split of a tile of `tile_steps` steps; split 0 is never empty
    when tile_steps >= 1 (ints or traced scalars)."""
    return _cdiv(split * tile_steps, splits), _cdiv((split + 1) * tile_steps, splits)


def split_range(tile_steps, split, splits: int):
    """The KV steps [lo, hi) a split CTA takes of its tile, decided at run time: a tile of
    fewer than _MIN_STEPS_PER_SPLIT steps per split is not cut (each split would pay the Q
    load and the pipeline fill for a step or two): split 0 takes it whole, the others get
    nothing (the merge gives them weight 0); else `split_steps`. Ints or traced scalars."""
    lo, hi = split_steps(tile_steps, split, splits)
    if splits == 1:
        return lo, hi
    whole = tile_steps < _MIN_STEPS_PER_SPLIT * splits
    return (jnp.where(whole, 0, lo),
            jnp.where(whole, jnp.where(split == 0, tile_steps, 0), hi))


def snake_item(c, j, walkers: int):
    """The heaviest-first list index of the j-th work item of walker c (of `walkers`): rounds
    alternate direction (0, 1, .., W-1, then W-1, .., 0), so a walker that took a heavy item in
    one round takes a light one in the next. Ints or traced scalars."""
    return j * walkers + jnp.where(j % 2 == 0, c, walkers - 1 - c)


def snake_count(c, n_items, walkers: int):
    """How many of `n_items` items walker c takes under `snake_item`."""
    rounds = n_items // walkers
    last = jnp.where(rounds % 2 == 0, c, walkers - 1 - c)
    return rounds + (last < n_items - rounds * walkers).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class TileLayout:
    """The prefill tiles of one call (device arrays, built per call), heaviest first.

    Per tile, [NT] int32 each: seq (-1 = no work), t0 (first token row), q_end (the sequence's
    end row), first_pos (KV position of t0); count [1] int32: live tiles (the first entries).
    Separate columns, the ones the kernel reads, each put in order by the same ranks (or the
    same sort, for long tables).
    """

    seq: jax.Array
    t0: jax.Array
    q_end: jax.Array
    first_pos: jax.Array
    count: jax.Array

    @property
    def table(self) -> jax.Array:
        """[NT, 4]: the columns side by side (for inspection and tests)."""
        return jnp.stack([self.seq, self.t0, self.q_end, self.first_pos], axis=1)


def tile_layout(query_start_loc, kv_lens, num_seqs, *, t: int, s: int, n: int, k: int
                ) -> TileLayout:
    g = n // k
    tt = tile_tokens(g)
    nt = num_tiles(t, s, g)
    slot = jnp.arange(s, dtype=jnp.int32)
    n_live = jnp.minimum(num_seqs[0], s)
    q_start = query_start_loc[:-1]
    q_len = jnp.where(slot < n_live, query_start_loc[1:] - q_start, 0)
    tiles = jnp.where(q_len > 1, _cdiv(q_len, tt), 0)
    ends = jnp.cumsum(tiles)  # inclusive
    first_tile = ends - tiles

    # Tile i (in sequence order) -> its sequence and first token.
    i = jnp.arange(nt, dtype=jnp.int32)
    seq = jnp.minimum(jnp.sum((ends[None, :] <= i[:, None]).astype(jnp.int32), axis=1), s - 1)
    live = i < ends[-1]
    t0 = q_start[seq] + (i - first_tile[seq]) * tt
    first_pos = kv_lens[seq] - q_len[seq] + (t0 - q_start[seq])
    # Heaviest first: the tiles that reach furthest into the KV start first (stable).
    key = jnp.where(live, -first_pos, jnp.iinfo(jnp.int32).max)
    cols = [c.astype(jnp.int32) for c in (jnp.where(live, seq, -1), t0,
                                          q_start[seq] + q_len[seq], first_pos)]
    if nt <= _RANK_MAX_TILES:
        cols = _rank_order(key, cols)
    else:
        _, *cols = lax.sort((key, *cols), num_keys=1, is_stable=True)
    return TileLayout(*cols, count=jnp.minimum(ends[-1:], nt).astype(jnp.int32))


_RANK_MAX_TILES = 1024  # tile tables up to this long are ordered by ranks, longer ones sorted


def _rank_order(key, cols):
    """`cols` reordered by ascending `key`, ties in index order (a stable sort), as two
    [NT, NT] comparisons XLA fuses into reductions: each entry's rank (how many entries go
    before it), then per output place the one entry of that rank. On the GPU this is two small
    fusions instead of a sort kernel and its launches."""
    nt = key.shape[0]
    i = jnp.arange(nt, dtype=jnp.int32)
    kj, ki = key[None, :], key[:, None]
    before = (kj < ki) | ((kj == ki) & (i[None, :] < i[:, None]))
    rank = jnp.sum(before.astype(jnp.int32), axis=1)
    at = rank[None, :] == i[:, None]  # [place, entry]
    return [jnp.sum(jnp.where(at, c[None, :], 0), axis=1) for c in cols]


def merge_split_rows(lse0, o0, others):
    """The rows of one item's KV splits -> its rows: o0 [64, H] (split 0, normalised by its own
    softmax sum) with log2-sum-exp lse0 [64], and (lse, rows) of each other split; weights
    exp2(lse - max) (0 for a split that saw no key of a row). Plain jnp: the prefill kernel
    runs it on registers, the CPU tests on arrays."""
    mx, den, num = lse0, jnp.ones_like(lse0), o0
    for lc, oc in others:
        mn = jnp.maximum(mx, lc)
        a = jnp.exp2(mx - mn)
        b = jnp.exp2(lc - mn)
        num = (num * lax.broadcast_in_dim(a, num.shape, [0])
               + oc * lax.broadcast_in_dim(b, num.shape, [0]))
        den = den * a + b
        mx = mn
    return num / lax.broadcast_in_dim(den, num.shape, [0])


def _kernel(q_ref, k_ref, v_ref, bt_ref, seq_ref, t0_ref, qend_ref, fpos_ref, cnt_ref, qsl_ref,
            ns_ref, out_ref, scoped, *,
            g: int, p: int, m: int, h: int, t: int, s: int, k_heads: int, n_groups: int,
            splits: int, bkv: int, stages: int, sm_scale: float, dtype, zero_padding: bool,
            overlap: bool):
    tq = _ROWS // g
    pages = bkv // p
    cta = lax.axis_index("ctas")  # the cluster (one CTA without splits)
    split = lax.axis_index("split") if splits > 1 else jnp.int32(0)
    wg = lax.axis_index("wg")
    ((qo_smem2, stage0, stage1, k_smem, v_smem, lse0, lse1, zero_smem),
     (k_bars, v_bars, q_bars), (k_free, v_free), sched, merge_bars) = scoped
    # Each compute warpgroup's staging buffer and log-sum-exps are buffers of their own (not
    # slices of one): Mosaic GPU reads a peer CTA's buffer across the cluster only at offset 0.
    stage_bufs, lse_bufs = (stage0, stage1), (lse0, lse1)

    # Work item j of this cluster: item snake_item(cta, j) of the heaviest-first list of
    # (tile, KV head) pairs, this CTA's split of its KV steps. Every warpgroup walks the same
    # items and the K/V step counter (which picks the pipeline slot) runs on across them.
    n_items = cnt_ref[0] * k_heads
    my_items = snake_count(cta, n_items, n_groups)

    def item(j):
        it = snake_item(cta, j, n_groups)
        tile = it // k_heads
        kh = it - tile * k_heads
        seq = seq_ref[tile]
        t0 = t0_ref[tile]
        n_valid = jnp.minimum(qend_ref[tile] - t0, _WGS * tq)  # live tokens of the tile
        first_pos = fpos_ref[tile]
        # KV steps the tile needs (up to its last live token's position); this split's share.
        lo, hi = split_range(_cdiv(first_pos + n_valid, bkv), split, splits)
        return kh, seq, t0, n_valid, first_pos, lo, hi

    def schedule_barrier():
        plgpu.barrier_arrive(sched)
        plgpu.barrier_wait(sched)

    @pl.when(wg < _WGS)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        qo_smem = qo_smem2.at[wg]

        def per_wg(fn):
            """fn(w) with this warpgroup's static index w (its own buffers)."""
            for w in range(_WGS):
                pl.when(wg == w)(lambda w=w: fn(w))

        scale = sm_scale * _LOG2E
        if zero_padding:
            # No decode kernel ran before (a prefill-only call into a fresh buffer): padding
            # rows (tokens from query_start_loc[num_seqs] on) get zeros, cluster c taking
            # tokens c, c + n_groups, ... (split 0's first warpgroup, G heads per store).
            with jax.named_scope("zero_padding"):
                @pl.when((wg == 0) & (split == 0))
                def _():
                    zero_smem[...] = jnp.zeros((8, h), dtype)
                    plgpu.commit_smem()
                    pad0 = qsl_ref[jnp.minimum(ns_ref[0], s)]

                    @pl.loop(0, _cdiv(jnp.maximum(t - pad0 - cta, 0), n_groups))
                    def _(i):
                        for kh in range(k_heads):
                            plgpu.copy_smem_to_gmem(zero_smem.at[pl.ds(0, g)],
                                                    out_ref.at[pad0 + cta + i * n_groups,
                                                               pl.ds(kh * g, g)])

        def tile_body(j, base):
            kh, _, t0, n_valid, first_pos, lo, hi = item(j)
            wg_t0 = t0 + wg * tq
            wg_first = first_pos + wg * tq
            wg_valid = jnp.clip(n_valid - wg * tq, 0, tq)
            wg_steps = jnp.where(wg_valid > 0, _cdiv(wg_first + wg_valid, bkv), 0)
            full = jnp.minimum((wg_first + 1) // bkv, wg_steps)  # steps with every key <= every row's
            # This warpgroup's steps of the split, counted from lo: [0, n_full) unmasked,
            # [n_full, n_mine) masked; the split has n_item steps in all.
            n_item = hi - lo
            n_mine = jnp.clip(wg_steps, lo, hi) - lo
            n_full = jnp.clip(full, lo, hi) - lo

            # Q rows start anywhere in the token array. Rows starting at a multiple of 8 (the
            # swizzled buffer's tile) come by TMA straight into the buffer the tensor cores
            # read; others into an untiled buffer (a tiled one needs tile-aligned source
            # offsets), then through registers.
            with jax.named_scope("q_load"):
                aligned = lax.rem(wg_t0, 8) == 0

                @pl.when(aligned)
                def _():
                    for jj in range(g):
                        plgpu.copy_gmem_to_smem(
                            q_ref.at[pl.ds(pl.multiple_of(wg_t0, 8), tq), kh * g + jj],
                            qo_smem.at[pl.ds(jj * tq, tq)], q_bars.at[wg])
                    plgpu.barrier_wait(q_bars.at[wg])

                def load_q_staged(w: int):
                    for jj in range(g):
                        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(wg_t0, tq), kh * g + jj],
                                                stage_bufs[w].at[pl.ds(jj * tq, tq)], q_bars.at[w])
                    plgpu.barrier_wait(q_bars.at[w])
                    qo_smem[...] = _load(stage_bufs[w], plgpu.Layout.WGMMA)

                pl.when(~aligned)(lambda: per_wg(load_q_staged))
                plgpu.commit_smem()

            m_i = plgpu.layout_cast(jnp.full((_ROWS,), -jnp.inf, jnp.float32),
                                    plgpu.Layout.WGMMA.reduce(1))
            l_i = plgpu.layout_cast(jnp.full((_ROWS,), 0, jnp.float32),
                                    plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.full((_ROWS, h), 0, jnp.float32), plgpu.Layout.WGMMA)

            with jax.named_scope("first_k_wait"):
                @pl.when(n_mine > 0)
                def _():
                    plgpu.barrier_wait(k_bars.at[lax.rem(base, stages)])

                pl.when(wg == 1)(schedule_barrier)

            def scores_softmax(i, slot, masked: bool, acc, m_i, l_i, *, issue_more=None,
                               wait_n: int = 0, p_dtype=dtype):
                """Q.K^T of step i (and whatever `issue_more` puts in flight behind it), the
                schedule barrier, the scores once at most `wait_n` matmul groups are left in
                flight, K slot released, mask, softmax (`softmax_step` with `acc` and
                `p_dtype`), and the arrival that says the softmax is done. Returns
                softmax_step's four values."""

                def compute_qk(acc_ref):
                    plgpu.wgmma(acc_ref, qo_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                    if issue_more is not None:
                        issue_more()
                    schedule_barrier()
                    return plgpu.wgmma_accumulator_load(acc_ref, wait_n=wait_n)

                s = pl.run_scoped(compute_qk, plgpu.ACC((_ROWS, bkv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                if masked:
                    s = mask_scores(s, i)
                acc, m_new, l_i, p = softmax_step(s, scale, acc, m_i, l_i, p_dtype)
                # Computed here, not sunk past the waits that follow (for LLVM: ptxas still
                # moves arithmetic past barrier arrivals and wgmma waits).
                acc, l_i, m_new, p = lax.optimization_barrier((acc, l_i, m_new, p))
                plgpu.barrier_arrive(sched)  # softmax done
                return acc, m_new, l_i, p

            def wait_next_k(i):
                nxt = i + 1

                @pl.when(nxt < n_mine)
                def _():
                    plgpu.barrier_wait(k_bars.at[lax.rem(base + nxt, stages)])

            def kv_step(i, carry, masked: bool):
                acc, m_i, l_i = carry
                slot = lax.rem(base + i, stages)
                acc, m_new, l_i, p16 = scores_softmax(i, slot, masked, acc, m_i, l_i)
                plgpu.barrier_wait(v_bars.at[slot])
                plgpu.barrier_wait(sched)  # the tensor cores are free

                def compute_pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                    wait_next_k(i)

                acc = pl.run_state(compute_pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l_i

            def mask_scores(s, i):
                rows = plgpu.broadcasted_iota(jnp.int32, (_ROWS, bkv), 0,
                                              layout=plgpu.Layout.WGMMA)
                cols = plgpu.broadcasted_iota(jnp.int32, (_ROWS, bkv), 1,
                                              layout=plgpu.Layout.WGMMA)
                qpos = wg_first + lax.rem(rows, tq)
                return jnp.where((lo + i) * bkv + cols <= qpos, s, -jnp.inf)

            def kv_loop_overlapped(m0, l0):
                """The steps [0, n_mine) with step i's Q.K^T and step i-1's P.V in flight
                together while this warpgroup runs step i's softmax (MosaicTiling.overlap).
                Step 0 (Q.K^T alone) is a loop of its own, so that every wgmma wait in a loop
                body is the same on every path: ptxas serialises the matmuls (a wait after
                each) when a wait's group count depends on a branch. The schedule barrier is
                met twice per step, as in kv_step: after the matmuls are issued, and after the
                softmax. (ptxas still schedules most of the softmax after the P.V wait; pinning
                it before by a store the arrival must follow did not help: see
                lab/results/kernels_h100_mosaic.md.)"""

                def scope(acc_o):
                    def step(i, carry, masked: bool, first: bool):
                        m_i, l_i, p_prev = carry
                        slot = lax.rem(base + i, stages)
                        prev = lax.rem(base + i - 1, stages)  # i >= 1 unless first

                        def issue_pv():
                            plgpu.barrier_wait(v_bars.at[prev])
                            plgpu.wgmma(acc_o, p_prev, v_smem.at[prev])

                        # Q.K^T is issued first: waiting until one group is left in flight
                        # waits for it, not for P.V. The probabilities stay float32 until P.V
                        # of step i-1 is done: converted during the softmax, step i's P went
                        # into the loop-carried registers the in-flight P.V still reads, and
                        # ptxas serialised every wgmma (C7513).
                        alpha, m_new, l_i, p32 = scores_softmax(
                            i, slot, masked, None, m_i, l_i,
                            issue_more=None if first else issue_pv, wait_n=0 if first else 1,
                            p_dtype=None)
                        if not first:  # (after step 0 the accumulator is still zero)
                            o = plgpu.wgmma_accumulator_load(acc_o, wait_n=0)  # P.V of i-1
                            o, p32 = lax.optimization_barrier((o, p32))  # convert after it
                            plgpu.barrier_arrive(v_free.at[prev])
                            acc_o[...] = o * lax.broadcast_in_dim(alpha, o.shape, [0])
                        p16 = p32.astype(dtype)
                        wait_next_k(i)
                        plgpu.barrier_wait(sched)
                        return m_new, l_i, p16

                    p0 = plgpu.layout_cast(jnp.zeros((_ROWS, bkv), dtype), plgpu.Layout.WGMMA)
                    carry = (m0, l0, p0)
                    # Step 0 masked whatever it is (the mask is exact, only slower).
                    carry = lax.fori_loop(0, jnp.minimum(n_mine, 1),
                                          lambda i, c: step(i, c, True, True), carry)
                    carry = lax.fori_loop(1, n_full, lambda i, c: step(i, c, False, False),
                                          carry)
                    carry = lax.fori_loop(jnp.maximum(n_full, 1), n_mine,
                                          lambda i, c: step(i, c, True, False), carry)
                    m_out, l_out, p_last = carry

                    @pl.when(n_mine > 0)
                    def _():
                        last = lax.rem(base + n_mine - 1, stages)
                        plgpu.barrier_wait(v_bars.at[last])
                        plgpu.wgmma(acc_o, p_last, v_smem.at[last])
                        plgpu.wgmma_wait(0)
                        plgpu.barrier_arrive(v_free.at[last])

                    return acc_o[...], m_out, l_out

                return pl.run_scoped(scope, plgpu.ACC((_ROWS, h), jnp.float32))

            with jax.named_scope("kv_loop"):
                if overlap:
                    acc, m_i, l_i = kv_loop_overlapped(m_i, l_i)
                else:
                    carry = (acc, m_i, l_i)
                    carry = lax.fori_loop(0, n_full, lambda i, c: kv_step(i, c, False), carry)
                    carry = lax.fori_loop(n_full, n_mine, lambda i, c: kv_step(i, c, True),
                                          carry)
                    acc, m_i, l_i = carry

                @pl.loop(n_mine, n_item)
                def _drain(i):
                    # The other warpgroup needs these steps: take the buffers' arrivals (so
                    # every barrier's phase stays in step for the next item), release them, and
                    # keep the schedule barrier's count in step.
                    slot = lax.rem(base + i, stages)
                    plgpu.barrier_wait(k_bars.at[slot])
                    plgpu.barrier_arrive(k_free.at[slot])
                    plgpu.barrier_wait(v_bars.at[slot])
                    plgpu.barrier_arrive(v_free.at[slot])
                    schedule_barrier()
                    schedule_barrier()

            with jax.named_scope("epilogue"):
                pl.when(wg == 0)(schedule_barrier)
                l_safe = jnp.maximum(l_i, 1e-30)
                o = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])  # 0 for an empty split

                # The output goes through the untiled staging buffer, so that any row can start a
                # TMA store: per query head, the wg_valid live tokens in power-of-two chunks.
                def store_rows(w: int, val):
                    stage = stage_bufs[w]
                    stage[...] = val.astype(dtype)
                    plgpu.commit_smem()
                    for jj in range(g):
                        for b, start, present in pow2_chunks(wg_valid, tq):
                            @pl.when(present)
                            def _(b=b, start=start, jj=jj):
                                plgpu.copy_smem_to_gmem(
                                    stage.at[pl.ds(jj * tq + start, b)],
                                    out_ref.at[pl.ds(wg_t0 + start, b), kh * g + jj])

                def merge_splits():
                    """CTA 0 stores the item's rows merged from every split CTA's."""
                    lse = m_i + jnp.log(l_safe) * _LOG2E  # log2; -inf: no key in this split

                    def publish(w: int):
                        # Rows and log-sum-exps stay in this CTA's shared memory for CTA 0.
                        stage_bufs[w][...] = o.astype(dtype)
                        lse_bufs[w][...] = lax.broadcast_in_dim(lse, (_ROWS, _LSE_COLS), [0])
                        plgpu.commit_smem()

                    pl.when(split > 0)(lambda: per_wg(publish))
                    plgpu.barrier_arrive(merge_bars.at[0])
                    plgpu.barrier_wait(merge_bars.at[0])

                    def merge(w: int):
                        def peer(ref, c):
                            return _load(plgpu.cluster_ref(ref, {"split": c}), plgpu.Layout.WGMMA)

                        others = [(peer(lse_bufs[w], c).max(axis=1),
                                   peer(stage_bufs[w], c).astype(jnp.float32))
                                  for c in range(1, splits)]
                        store_rows(w, merge_split_rows(lse, o, others))

                    pl.when(split == 0)(lambda: per_wg(merge))
                    # The other CTAs keep their buffers until CTA 0 has read them.
                    plgpu.barrier_arrive(merge_bars.at[1])
                    plgpu.barrier_wait(merge_bars.at[1])

                # Every item merges, even a tile split 0 took whole: a store path of its own for
                # such tiles cost the split tiles more than it saved (lab/kernels/NOTES.md).
                if splits == 1:
                    per_wg(lambda w: store_rows(w, o))
                else:
                    merge_splits()
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # staging reused next item
            return base + n_item

        lax.fori_loop(0, my_items, tile_body, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _WGS)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        def tile_body(j, base):
            kh, seq, _, _, _, lo, hi = item(j)

            with jax.named_scope("kv_issue"):
                @pl.loop(lo, hi)
                def _(step):
                    n = base + step - lo
                    slot = lax.rem(n, stages)
                    blks = [bt_ref[seq, jnp.minimum(step * pages + jj, m - 1)]
                            for jj in range(pages)]
                    load_kv_step(k_ref, v_ref, k_smem, v_smem, k_bars, v_bars, k_free, v_free,
                                 blks=blks, kh=kh, n=n, slot=slot, p=p, stages=stages)

            return base + hi - lo

        lax.fori_loop(0, my_items, tile_body, jnp.int32(0))


def prefill_attention(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs,
                      out, *, sm_scale: float, tiling: MosaicTiling,
                      layout: TileLayout | None = None):
    """The rows of the prefill chunks. `out` [T, N, H]: they are written into it in place (the
    buffer is aliased) and the other rows are left as they are. `out=None` (a prefill-only
    call: no decode kernel ran): a fresh buffer with the prefill rows, zeros in the padding
    rows and nothing written in decode rows. `layout`: the tile table if built already (only
    its first `count` entries are read), else `tile_layout` builds it. Returns [T, N, H].
    Inputs validated by the caller."""
    t, n, h = q.shape
    _, k, p, _ = k_cache.shape
    s, m = block_tables.shape
    g = n // k
    bkv, stages = tiling.block_kv, tiling.stages
    if layout is None:
        layout = tile_layout(query_start_loc, kv_lens, num_seqs, t=t, s=s, n=n, k=k)
    splits = kv_splits(t, k, g, tiling)
    n_groups = grid_clusters(t, s, k, g, splits, tiling)
    dtype = q.dtype
    transforms = mma_transforms(h, dtype)

    def entry(q_ref, k_ref, v_ref, bt_ref, seq_ref, t0_ref, qend_ref, fpos_ref, cnt_ref,
              qsl_ref, ns_ref, out_ref):
        smem = (plgpu.SMEM((_WGS, _ROWS, h), dtype, transforms=transforms),
                plgpu.SMEM((_ROWS, h), dtype),  # staging, one per compute warpgroup
                plgpu.SMEM((_ROWS, h), dtype),
                plgpu.SMEM((stages, bkv, h), dtype, transforms=transforms),
                plgpu.SMEM((stages, bkv, h), dtype, transforms=transforms),
                plgpu.SMEM((_ROWS, _LSE_COLS), jnp.float32),  # log-sum-exps, likewise
                plgpu.SMEM((_ROWS, _LSE_COLS), jnp.float32),
                plgpu.SMEM((8, h), dtype))
        ready = (plgpu.Barrier(num_arrivals=bkv // p, num_barriers=stages),
                 plgpu.Barrier(num_arrivals=bkv // p, num_barriers=stages),
                 plgpu.Barrier(num_arrivals=g, num_barriers=_WGS))
        free = (plgpu.Barrier(num_arrivals=_WGS, num_barriers=stages),) * 2
        # Split CTAs meet twice per item: rows published, rows read by CTA 0.
        merge = (plgpu.ClusterBarrier(collective_axes=("split",), num_arrivals=_WGS,
                                      num_barriers=2) if splits > 1 else None)
        pl.run_scoped(
            lambda *scoped: _kernel(
                q_ref, k_ref, v_ref, bt_ref, seq_ref, t0_ref, qend_ref, fpos_ref, cnt_ref,
                qsl_ref, ns_ref, out_ref,
                scoped if splits > 1 else (*scoped, None), g=g, p=p, m=m, h=h, t=t, s=s,
                k_heads=k, n_groups=n_groups, splits=splits, bkv=bkv, stages=stages,
                sm_scale=sm_scale, dtype=dtype, zero_padding=out is None,
                overlap=tiling.overlap),
            smem, ready, free, plgpu.Barrier(num_arrivals=_WGS),
            *(() if merge is None else (merge,)), collective_axes="wg")

    call = pl.kernel(
        entry, out_type=jax.ShapeDtypeStruct((t, n, h), dtype) if out is None else (),
        mesh=plgpu.Mesh(grid=(n_groups,), grid_names=("ctas",),
                        cluster=(splits,) if splits > 1 else (),
                        cluster_names=("split",) if splits > 1 else (),
                        num_threads=_WGS + 1, thread_name="wg"),
        compiler_params=compiler_params(tiling.profile_dir),
        name="rpa_prefill_mosaic")
    args = (q, k_cache, v_cache, block_tables, layout.seq, layout.t0, layout.q_end,
            layout.first_pos, layout.count, query_start_loc, num_seqs)
    if out is None:
        return call(*args)
    # `pl.kernel` over a Mosaic GPU mesh: a Ref argument is read and written in place.
    out_ref = jax.new_ref(out)
    call(*args, out_ref)
    return out_ref[...]
