"""Prefill chunks of ragged paged attention on Hopper: a Mosaic GPU (Pallas) kernel.

Same legend as ragged_paged_attention.py: T tokens, S slots, N query heads, K KV heads,
G = N // K, H head dim, B blocks, P block size, M blocks per sequence.

FlashAttention-3 structure, one CTA per (KV head, query tile), three warpgroups:
- two compute warpgroups, each owning 64 matmul rows = TQ = 64 // G tokens x the G query heads
  of the KV head (GQA packing: row g * TQ + t is head g, token t), so one K/V page serves all
  G heads; they alternate tensor-core work (Q.K^T, then P.V) through a schedule barrier so that
  one's softmax overlaps the other's matmuls;
- one memory warpgroup streaming K and V pages by TMA, `block_kv` keys per pipeline step = one
  TMA copy per page of P keys (the block table is read as scalars), `stages` steps in flight.
A tile is 2 x TQ consecutive tokens of one sequence with q_len > 1. Only the steps that cross
the causal diagonal are masked. Decode rows (q_len == 1) are not this kernel's work (the
flash-decoding kernel of ragged_paged_attention_gpu.py takes them).

The tile list is built by XLA before the call (`_tile_table`: one row per live tile, the tiles
that attend to the most keys first) and the kernel writes whole 64-row tiles into a padded
[K, NT, 2, 64, H] buffer; one gather puts the rows back in [T, N, H] order. Writing tiles whole
avoids masked TMA stores at a sequence's end (a tile's tail rows belong to the next sequence).

Scope: bf16 or f16, H in {64, 128, 256}, G in {1, 2, 4, 8}, P a multiple of 8 dividing
block_kv, no soft cap and no sliding window; `supported()` says whether a call qualifies (the
Triton kernel serves every other case).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxengine.pallas_kernels.ragged_paged_attention import token_positions

_LOG2E = math.log2(math.e)
_ROWS = 64  # matmul rows per compute warpgroup (the wgmma M)
_WGS = 2    # compute warpgroups per CTA


@dataclasses.dataclass(frozen=True)
class MosaicTiling:
    """block_kv: keys per pipeline step (multiple of 64 and of the block size);
    stages: K/V steps buffered in shared memory."""

    block_kv: int = 128
    stages: int = 2

    def __post_init__(self) -> None:
        if self.block_kv % 64 or self.block_kv < 64:
            raise ValueError(f"MosaicTiling.block_kv must be a multiple of 64, got {self.block_kv}")
        if self.stages < 2:
            raise ValueError(f"MosaicTiling.stages must be >= 2, got {self.stages}")


def supported(dtype, head_dim: int, group: int, block_size: int, soft_cap, window,
              tiling: MosaicTiling) -> bool:
    """Whether this kernel can serve a call with these static properties."""
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and head_dim in (64, 128, 256) and group in (1, 2, 4, 8)
            and block_size % 8 == 0 and tiling.block_kv % block_size == 0
            and soft_cap is None and window is None)


def _cdiv(a, b):
    return (a + b - 1) // b


def _load(ref, layout):
    """A register load of a whole shared-memory ref in `layout` (the keyword form is newer).

    Unoptimised: an untiled buffer read in the WGMMA layout has bank conflicts; it happens
    once per tile."""
    try:
        return plgpu.load(ref, layout=layout, optimized=False)
    except TypeError:
        return plgpu.load(ref, (), layout=layout, optimized=False)


def num_tiles(t: int, s: int, group: int) -> int:
    """Static bound on live tiles: every prefill sequence has >= 2 tokens."""
    tile_tokens = _WGS * (_ROWS // group)
    return max(1, _cdiv(t, tile_tokens) + min(s, t // 2))


@dataclasses.dataclass(frozen=True)
class TileLayout:
    """Where each prefill tile's rows come from and go to (device arrays, built per call).

    table [NT, 8] int32: per CTA (heaviest first) seq (-1 = no work), t0, q_end, first_pos,
      kv_len; flat [T, N]: the row of token t, head n in the [K * NT * 2 * 64, H] tile buffer.
    """

    table: jax.Array
    flat: jax.Array


def tile_layout(query_start_loc, kv_lens, num_seqs, *, t: int, s: int, n: int, k: int
                ) -> TileLayout:
    g = n // k
    tq = _ROWS // g
    tile_tokens = _WGS * tq
    nt = num_tiles(t, s, g)
    slot = jnp.arange(s, dtype=jnp.int32)
    n_live = jnp.minimum(num_seqs[0], s)
    q_start = query_start_loc[:-1]
    q_len = jnp.where(slot < n_live, query_start_loc[1:] - q_start, 0)
    tiles = jnp.where(q_len > 1, _cdiv(q_len, tile_tokens), 0)
    ends = jnp.cumsum(tiles)  # inclusive
    first_tile = ends - tiles

    # Tile i (in sequence order) -> its sequence and first token.
    i = jnp.arange(nt, dtype=jnp.int32)
    seq = jnp.minimum(jnp.sum((ends[None, :] <= i[:, None]).astype(jnp.int32), axis=1), s - 1)
    live = i < ends[-1]
    t0 = q_start[seq] + (i - first_tile[seq]) * tile_tokens
    kv_len = kv_lens[seq]
    first_pos = kv_len - q_len[seq] + (t0 - q_start[seq])
    # Heaviest first: the tiles that reach furthest into the KV start first.
    order = jnp.argsort(jnp.where(live, -first_pos, jnp.iinfo(jnp.int32).max), stable=True)
    zero = jnp.zeros_like(i)
    table = jnp.stack([jnp.where(live, seq, -1), t0, q_start[seq] + q_len[seq], first_pos,
                       kv_len, zero, zero, zero], axis=1)[order].astype(jnp.int32)
    position = jnp.zeros((nt,), jnp.int32).at[order].set(i)  # tile i's CTA

    # Token r, head h -> (kv head, CTA, warpgroup, row) of the tile buffer.
    tseq, _, _ = token_positions(query_start_loc, kv_lens, num_seqs, t)
    local = jnp.arange(t, dtype=jnp.int32) - q_start[tseq]
    cta = position[jnp.clip(first_tile[tseq] + local // tile_tokens, 0, nt - 1)]
    w = (local % tile_tokens) // tq
    heads = jnp.arange(n, dtype=jnp.int32)
    flat = ((((heads // g)[None, :] * nt + cta[:, None]) * _WGS + w[:, None]) * _ROWS
            + (heads % g)[None, :] * tq + (local % tq)[:, None])
    return TileLayout(table=table, flat=flat)


def _kernel(q_ref, k_ref, v_ref, bt_ref, tab_ref, out_ref, scoped, *, g: int, p: int, m: int,
            h: int, bkv: int, stages: int, sm_scale: float, dtype):
    tq = _ROWS // g
    pages = bkv // p
    kh = lax.axis_index("kv_heads")
    tile = lax.axis_index("tiles")
    wg = lax.axis_index("wg")
    (qo_smem2, q_stage2, k_smem, v_smem), (k_bars, v_bars, q_bars), (k_free, v_free), sched = scoped

    seq = tab_ref[tile, 0]
    t0 = tab_ref[tile, 1]
    q_end = tab_ref[tile, 2]
    first_pos = tab_ref[tile, 3]
    n_valid = jnp.minimum(q_end - t0, _WGS * tq)  # live tokens of the tile
    # KV steps the tile needs: up to its last live token's position.
    tile_steps = _cdiv(first_pos + n_valid, bkv)

    def schedule_barrier():
        plgpu.barrier_arrive(sched)
        plgpu.barrier_wait(sched)

    @pl.when((seq >= 0) & (wg < _WGS))
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        qo_smem = qo_smem2.at[wg]
        wg_t0 = t0 + wg * tq
        wg_first = first_pos + wg * tq
        wg_valid = jnp.clip(n_valid - wg * tq, 0, tq)
        steps = jnp.where(wg_valid > 0, _cdiv(wg_first + wg_valid, bkv), 0)
        full = jnp.minimum((wg_first + 1) // bkv, steps)  # steps with every key <= every row's

        # Q rows start anywhere in the token array, so they come by TMA into an untiled
        # buffer (a tiled one needs tile-aligned source offsets), then through registers
        # into the swizzled buffer the tensor cores read.
        q_stage = q_stage2.at[wg]
        for j in range(g):
            plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(wg_t0, tq), kh * g + j],
                                    q_stage.at[pl.ds(j * tq, tq)], q_bars.at[wg])
        plgpu.barrier_wait(q_bars.at[wg])
        qo_smem[...] = _load(q_stage, plgpu.Layout.WGMMA)
        plgpu.commit_smem()

        m_i = plgpu.layout_cast(jnp.full((_ROWS,), -jnp.inf, jnp.float32),
                                plgpu.Layout.WGMMA.reduce(1))
        l_i = plgpu.layout_cast(jnp.full((_ROWS,), 0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc = plgpu.layout_cast(jnp.full((_ROWS, h), 0, jnp.float32), plgpu.Layout.WGMMA)

        @pl.when(steps > 0)
        def _():
            plgpu.barrier_wait(k_bars.at[0])

        pl.when(wg == 1)(schedule_barrier)
        scale = sm_scale * _LOG2E

        def kv_step(step, carry, masked: bool):
            acc, m_i, l_i = carry
            slot = lax.rem(step, stages)

            def compute_qk(acc_ref):
                plgpu.wgmma(acc_ref, qo_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                schedule_barrier()
                return acc_ref[...]

            s = pl.run_scoped(compute_qk, plgpu.ACC((_ROWS, bkv), jnp.float32))
            plgpu.barrier_arrive(k_free.at[slot])
            s = s * scale
            if masked:
                rows = plgpu.broadcasted_iota(jnp.int32, (_ROWS, bkv), 0, layout=plgpu.Layout.WGMMA)
                cols = plgpu.broadcasted_iota(jnp.int32, (_ROWS, bkv), 1, layout=plgpu.Layout.WGMMA)
                qpos = wg_first + lax.rem(rows, tq)
                s = jnp.where(step * bkv + cols <= qpos, s, -jnp.inf)
            m_new = jnp.maximum(m_i, s.max(axis=1))
            alpha = jnp.exp2(m_i - m_new)
            pr = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            l_i = l_i * alpha + pr.sum(axis=1)
            p16 = pr.astype(dtype)
            acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
            plgpu.barrier_arrive(sched)  # softmax done
            plgpu.barrier_wait(v_bars.at[slot])
            plgpu.barrier_wait(sched)  # the tensor cores are free

            def compute_pv(acc_ref):
                plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                nxt = step + 1

                @pl.when(nxt < steps)
                def _():
                    plgpu.barrier_wait(k_bars.at[lax.rem(nxt, stages)])

            acc = pl.run_state(compute_pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l_i

        carry = (acc, m_i, l_i)
        carry = lax.fori_loop(0, full, lambda i, c: kv_step(i, c, False), carry)
        carry = lax.fori_loop(full, steps, lambda i, c: kv_step(i, c, True), carry)
        acc, m_i, l_i = carry

        @pl.loop(steps, tile_steps)
        def _drain(step):
            # The other warpgroup needs these steps: release the buffers and keep the
            # schedule barrier's count in step.
            slot = lax.rem(step, stages)
            plgpu.barrier_arrive(k_free.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])
            schedule_barrier()
            schedule_barrier()

        pl.when(wg == 0)(schedule_barrier)
        l_safe = jnp.maximum(l_i, 1e-30)
        qo_smem[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[kh, tile, wg])
        plgpu.wait_smem_to_gmem(0)

    @pl.when((seq >= 0) & (wg == _WGS))
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        def fetch(step, slot, wait: bool):
            base = step * pages
            blks = [bt_ref[seq, jnp.minimum(base + j, m - 1)] for j in range(pages)]
            if wait:
                plgpu.barrier_wait(k_free.at[slot])
            for j, blk in enumerate(blks):
                plgpu.copy_gmem_to_smem(k_ref.at[blk, kh], k_smem.at[slot, pl.ds(j * p, p)],
                                        k_bars.at[slot])
            if wait:
                plgpu.barrier_wait(v_free.at[slot])
            for j, blk in enumerate(blks):
                plgpu.copy_gmem_to_smem(v_ref.at[blk, kh], v_smem.at[slot, pl.ds(j * p, p)],
                                        v_bars.at[slot])

        for i in range(stages):
            pl.when(i < tile_steps)(lambda i=i: fetch(i, i, wait=False))

        @pl.loop(stages, jnp.maximum(tile_steps, stages))
        def _(step):
            fetch(step, lax.rem(step, stages), wait=True)


def prefill_attention(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs, *,
                      sm_scale: float, tiling: MosaicTiling):
    """Outputs of the prefill rows, [T, N, H]; rows of decode and padding slots are garbage
    (the caller selects). Inputs validated by the caller."""
    t, n, h = q.shape
    _, k, p, _ = k_cache.shape
    s, m = block_tables.shape
    g = n // k
    bkv, stages = tiling.block_kv, tiling.stages
    layout = tile_layout(query_start_loc, kv_lens, num_seqs, t=t, s=s, n=n, k=k)
    table = layout.table
    nt = table.shape[0]
    dtype = q.dtype
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = min(128, h * itemsize)
    transforms = (plgpu.TilingTransform((8, swizzle // itemsize)),
                  plgpu.SwizzleTransform(swizzle))

    def entry(q_ref, k_ref, v_ref, bt_ref, tab_ref, out_ref):
        smem = (plgpu.SMEM((_WGS, _ROWS, h), dtype, transforms=transforms),
                plgpu.SMEM((_WGS, _ROWS, h), dtype),
                plgpu.SMEM((stages, bkv, h), dtype, transforms=transforms),
                plgpu.SMEM((stages, bkv, h), dtype, transforms=transforms))
        ready = (plgpu.Barrier(num_arrivals=bkv // p, num_barriers=stages),
                 plgpu.Barrier(num_arrivals=bkv // p, num_barriers=stages),
                 plgpu.Barrier(num_arrivals=g, num_barriers=_WGS))
        free = (plgpu.Barrier(num_arrivals=_WGS, num_barriers=stages),) * 2
        pl.run_scoped(
            lambda *scoped: _kernel(q_ref, k_ref, v_ref, bt_ref, tab_ref, out_ref, scoped, g=g,
                                    p=p, m=m, h=h, bkv=bkv, stages=stages, sm_scale=sm_scale,
                                    dtype=dtype),
            smem, ready, free, plgpu.Barrier(num_arrivals=_WGS),
            collective_axes="wg")

    tiles_out = plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((k, nt, _WGS, _ROWS, h), dtype),
        grid=(k, nt),
        grid_names=("kv_heads", "tiles"),
        num_threads=_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(q, k_cache, v_cache, block_tables, table)

    return tiles_out.reshape(k * nt * _WGS * _ROWS, h)[layout.flat]  # [T, N, H]
