"""Decode rows of ragged paged attention on Hopper: a Mosaic GPU (Pallas) kernel.

Same legend as ragged_paged_attention.py: T tokens, S slots, N query heads, K KV heads,
G = N // K, H head dim, B blocks, P block size, M blocks per sequence.

A decode row is a sequence slot with q_len == 1 (wherever it sits in the batch). Its work is one
pass over the sequence's K/V pages for each KV head, with the G query heads of that KV head packed
into the rows of one 64-row tile (GQA packing: each page is read once per KV head).

Grid: (K, W) clusters of C CTAs. Cluster (kh, w) walks the slots w, w + W, w + 2W, ... of KV
head kh; the C CTAs of a cluster cut each decode row's KV steps into C ranges (flash-decoding
splits, `split_steps`), so a small batch still fills the GPU. Each CTA has two warpgroups:
- a memory warpgroup streams the K and V pages of its range by TMA (one copy per page of P keys,
  the block ids fetched 256 at a time by one copy), `stages` steps of `block_kv` keys in flight; it runs on
  across the CTA's rows, so the next row's pages load while this one is finished;
- a compute warpgroup computes Q.K^T and P.V with wgmma and the online softmax.
With C > 1, CTAs 1..C-1 write their rows (normalised by their own softmax sum) and each row's
log2-sum-exp to global scratch by TMA and wait for the copies to complete; a cluster barrier
then lets CTA 0 read them back and merge them (weights exp2(lse_c - max)) into the output: one
launch, no counter, no merge kernel. Cluster CTAs are co-scheduled, so the wait cannot deadlock.

Scope: that of the Mosaic prefill kernel (`in_scope`: bf16 or f16, H in {64, 128}, G in
{1, 2, 4, 8}, P a multiple of 8 dividing block_kv, no soft cap, no sliding window; `supported()`);
the Triton flash-decoding kernel serves every other case.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxengine.pallas_kernels.ragged_paged_attention_mgpu import (
    _LOG2E, _LSE_COLS, _ROWS, _cdiv, _load, compiler_params, in_scope, load_kv_step,
    merge_split_rows, mma_transforms, softmax_step, split_steps)

_MAX_CLUSTER = 8  # portable cluster size on Hopper
_PROFILE_RANGES = 32  # phases recorded per warpgroup when profiling (its shared memory is tight)
_BT_WINDOW = 256  # block ids fetched per copy by the memory warpgroup


@dataclasses.dataclass(frozen=True)
class DecodeTiling:
    """Static choices of the Mosaic decode kernel.

    block_kv: keys per pipeline step (multiple of 64 and of the block size).
    stages: K/V steps buffered in shared memory.
    splits: CTAs (one cluster) per decode row. None: as many as fill `sm_count` SMs with
      K x min(S, T) rows (up to 8; 1 once the rows alone fill the GPU).
    rows_per_sm: clusters launched per KV head are capped at rows_per_sm x sm_count /
      (K x splits); each walks several rows (the grid does not grow with the slot count).
    sm_count: streaming multiprocessors of the GPU (132 on an H100 SXM).
    profile_dir: diagnostics, as MosaicTiling.profile_dir (empty: off).
    """

    block_kv: int = 128
    stages: int = 2
    splits: int | None = None
    rows_per_sm: int = 2
    sm_count: int = 132
    profile_dir: str = ""

    def __post_init__(self) -> None:
        if self.block_kv % 64 or self.block_kv < 64:
            raise ValueError(f"DecodeTiling.block_kv must be a multiple of 64, got {self.block_kv}")
        if self.stages < 2:
            raise ValueError(f"DecodeTiling.stages must be >= 2, got {self.stages}")
        if self.splits is not None and not 1 <= self.splits <= _MAX_CLUSTER:
            raise ValueError(f"DecodeTiling.splits must be in [1, {_MAX_CLUSTER}] or None, "
                             f"got {self.splits}")
        if self.rows_per_sm < 1 or self.sm_count < 1:
            raise ValueError(f"DecodeTiling.rows_per_sm and sm_count must be >= 1, got "
                             f"{self.rows_per_sm}, {self.sm_count}")


def bt_window(m: int, pages: int) -> int:
    """Block ids the memory warpgroup copies at once (0: read them one by one). A copy needs
    16-byte aligned table rows (M a multiple of 4), a multiple of 128 bytes (32 ids) and
    whole steps of `pages` ids."""
    unit = max(pages, 32)
    window = min(_BT_WINDOW, m) // unit * unit
    return window if m % 4 == 0 and window >= pages else 0


def merge_rows(splits: int) -> int:
    """Rows of the merge buffers: split c's rows land at row 8 * (c - 1) of CTA 0's, each read
    back as the 64-row window starting there."""
    return _ROWS + 8 * max(splits - 2, 0)


def smem_bytes(head_dim: int, itemsize: int, tiling: DecodeTiling) -> int:
    """Shared memory of one CTA (at the largest cluster): K/V stages, Q (swizzled + staging),
    the f32 rows and log-sum-exps of the split merge, and a zero tile."""
    rows = merge_rows(tiling.splits or _MAX_CLUSTER)
    return (2 * tiling.stages * tiling.block_kv * head_dim * itemsize
            + 2 * _ROWS * head_dim * itemsize + rows * (head_dim + _LSE_COLS) * 4
            + 8 * head_dim * itemsize + _BT_WINDOW * 4 + 1024)


def supported(dtype, head_dim: int, group: int, block_size: int, soft_cap, window,
              tiling: DecodeTiling) -> bool:
    """Whether this kernel can serve a call with these static properties."""
    return in_scope(dtype, head_dim, group, block_size, soft_cap, window, tiling.block_kv,
                    smem_bytes(head_dim, jnp.dtype(dtype).itemsize, tiling))


def num_splits(rows: int, k: int, tiling: DecodeTiling) -> int:
    """CTAs per decode row (static): fill the SMs with the K x `rows` row items."""
    if tiling.splits is not None:
        return tiling.splits
    return int(min(_MAX_CLUSTER, max(1, tiling.sm_count // (k * rows))))


def num_row_walkers(rows: int, k: int, splits: int, tiling: DecodeTiling) -> int:
    """Clusters per KV head (static): every row slot, capped so the grid stays near
    `rows_per_sm` CTAs per SM; each cluster then walks rows w, w + W, ..."""
    cap = max(1, tiling.rows_per_sm * tiling.sm_count // (k * splits))
    return int(min(rows, cap))


def _kernel(q_ref, k_ref, v_ref, kvl_ref, bt_ref, qsl_ref, ns_ref, out_ref, part_ref, lse_ref,
            scoped, *, g: int, p: int, m: int, h: int, t: int, s: int, rows: int, walkers: int,
            splits: int, bkv: int, stages: int, sm_scale: float, dtype, zero_padding: bool):
    pages = bkv // p
    kh = lax.axis_index("kv")
    w = lax.axis_index("walker")
    c = lax.axis_index("split") if splits > 1 else jnp.int32(0)
    wg = lax.axis_index("wg")
    ((qo_smem, q_stage, k_smem, v_smem, part_smem, lse_smem, zero_smem, bt_smem),
     (k_bars, v_bars, q_bar, merge_bar, bt_bar), (k_free, v_free), cluster_bar) = scoped
    n_live = jnp.minimum(ns_ref[0], s)
    my_rows = _cdiv(rows - w, walkers)

    def row(j):
        """Row j of this cluster: its slot, whether it is a live decode row, its token, its
        KV length and this CTA's KV steps [lo, hi)."""
        slot = w + j * walkers
        tok = qsl_ref[slot]
        kv_len = kvl_ref[slot]
        live = (slot < n_live) & (qsl_ref[slot + 1] - tok == 1)
        lo, hi = split_steps(_cdiv(kv_len, bkv), c, splits)
        hi = jnp.where(live, hi, lo)
        return slot, live, tok, kv_len, lo, hi

    @pl.when(wg == 0)
    def _compute():
        scale = sm_scale * _LOG2E
        if zero_padding:
            # Padding rows (tokens from query_start_loc[num_seqs] on) get zeros for this KV
            # head's G heads: cluster w takes padding tokens w, w + W, ...
            pad0 = qsl_ref[n_live]
            zero_smem[...] = jnp.zeros((8, h), dtype)
            plgpu.commit_smem()

            @pl.when(c == 0)
            def _():
                @pl.loop(0, _cdiv(jnp.maximum(t - pad0 - w, 0), walkers))
                def _(i):
                    plgpu.copy_smem_to_gmem(zero_smem.at[pl.ds(0, g)],
                                            out_ref.at[pad0 + w + i * walkers, pl.ds(kh * g, g)])

        def row_body(j, base):
            slot, live, tok, kv_len, lo, hi = row(j)

            @pl.when(live)
            def _():
                with jax.named_scope("q_load"):
                    plgpu.copy_gmem_to_smem(q_ref.at[tok, pl.ds(kh * g, g)],
                                            q_stage.at[pl.ds(0, g)], q_bar)
                    plgpu.barrier_wait(q_bar)
                    # Rows g.. of the tile hold whatever the staging buffer held: each output row
                    # depends on its own query row only, and only rows < g are stored.
                    qo_smem[...] = _load(q_stage, plgpu.Layout.WGMMA)
                    plgpu.commit_smem()
                n_full = jnp.clip(kv_len // bkv, lo, hi) - lo  # steps with every key valid

                def kv_step(i, carry, masked: bool):
                    acc, m_i, l_i = carry
                    st = lax.rem(base + i, stages)
                    plgpu.barrier_wait(k_bars.at[st])

                    def compute_qk(acc_ref):
                        plgpu.wgmma(acc_ref, qo_smem, plgpu.transpose_ref(k_smem.at[st], (1, 0)))
                        return acc_ref[...]

                    sc = pl.run_scoped(compute_qk, plgpu.ACC((_ROWS, bkv), jnp.float32))
                    plgpu.barrier_arrive(k_free.at[st])
                    if masked:
                        cols = plgpu.broadcasted_iota(jnp.int32, (_ROWS, bkv), 1,
                                                      layout=plgpu.Layout.WGMMA)
                        sc = jnp.where((lo + i) * bkv + cols < kv_len, sc, -jnp.inf)
                    acc, m_new, l_i, p16 = softmax_step(sc, scale, acc, m_i, l_i, dtype)
                    plgpu.barrier_wait(v_bars.at[st])

                    def compute_pv(acc_ref):
                        plgpu.wgmma(acc_ref, p16, v_smem.at[st])

                    acc = pl.run_state(compute_pv)(plgpu.ACC.init(acc))
                    plgpu.barrier_arrive(v_free.at[st])
                    return acc, m_new, l_i

                m_i = plgpu.layout_cast(jnp.full((_ROWS,), -jnp.inf, jnp.float32),
                                        plgpu.Layout.WGMMA.reduce(1))
                l_i = plgpu.layout_cast(jnp.full((_ROWS,), 0, jnp.float32),
                                        plgpu.Layout.WGMMA.reduce(1))
                acc = plgpu.layout_cast(jnp.full((_ROWS, h), 0, jnp.float32), plgpu.Layout.WGMMA)
                with jax.named_scope("kv_loop"):
                    carry = lax.fori_loop(0, n_full, lambda i, cr: kv_step(i, cr, False),
                                          (acc, m_i, l_i))
                    acc, m_i, l_i = lax.fori_loop(n_full, hi - lo,
                                                  lambda i, cr: kv_step(i, cr, True), carry)
                with jax.named_scope("epilogue"):
                    l_safe = jnp.maximum(l_i, 1e-30)
                    o = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])  # 0 for an empty split

                    def store(val):
                        q_stage[...] = val.astype(dtype)
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(q_stage.at[pl.ds(0, g)],
                                                out_ref.at[tok, pl.ds(kh * g, g)])

                    if splits == 1:
                        store(o)
                    else:
                        lse = m_i + jnp.log(l_safe) * _LOG2E  # log2; -inf: no key in this split

                        @pl.when(c > 0)
                        def _publish():
                            part_smem[pl.ds(0, _ROWS)] = o
                            lse_smem[pl.ds(0, _ROWS)] = lax.broadcast_in_dim(
                                lse, (_ROWS, _LSE_COLS), [0])
                            plgpu.commit_smem()
                            plgpu.copy_smem_to_gmem(part_smem.at[pl.ds(0, g)],
                                                    part_ref.at[slot, kh, c - 1])
                            plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, g)],
                                                    lse_ref.at[slot, kh, c - 1])
                            plgpu.wait_smem_to_gmem(0)  # written, before CTA 0 is told

                        plgpu.barrier_arrive(cluster_bar)
                        plgpu.barrier_wait(cluster_bar)

                        @pl.when(c == 0)
                        def _merge():
                            # All splits' rows come in one round trip: split cc's G rows land at
                            # row 8 * (cc - 1) of the merge buffers, read back as the 64-row window
                            # starting there (its rows >= G are not used).
                            for cc in range(1, splits):
                                plgpu.copy_gmem_to_smem(part_ref.at[slot, kh, cc - 1],
                                                        part_smem.at[pl.ds(8 * (cc - 1), g)],
                                                        merge_bar)
                                plgpu.copy_gmem_to_smem(lse_ref.at[slot, kh, cc - 1],
                                                        lse_smem.at[pl.ds(8 * (cc - 1), g)],
                                                        merge_bar)
                            plgpu.barrier_wait(merge_bar)
                            merged = merge_split_rows(lse, o, [
                                (_load(lse_smem.at[pl.ds(8 * (cc - 1), _ROWS)],
                                       plgpu.Layout.WGMMA).max(axis=1),
                                 _load(part_smem.at[pl.ds(8 * (cc - 1), _ROWS)],
                                       plgpu.Layout.WGMMA))
                                for cc in range(1, splits)])
                            plgpu.commit_smem()  # read before the next row's copies overwrite
                            store(merged)

                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # staging reused next row

            return base + (hi - lo)

        lax.fori_loop(0, my_rows, row_body, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _memory():
        window = bt_window(m, pages)
        steps_per_window = max(window // pages, 1)

        def row_body(j, base):
            slot, _, _, _, lo, hi = row(j)

            with jax.named_scope("kv_issue"):
                @pl.loop(lo, hi)
                def _(step):
                    n = base + step - lo
                    if window:
                        @pl.when(lax.rem(step - lo, steps_per_window) == 0)
                        def _():
                            # The block ids of the next steps in one copy (ids past the table's
                            # end read as 0, the null block; their keys are masked).
                            plgpu.commit_smem()  # earlier scalar reads of the window come first
                            plgpu.copy_gmem_to_smem(bt_ref.at[slot, pl.ds(step * pages, window)],
                                                    bt_smem.at[pl.ds(0, window)], bt_bar)
                            plgpu.barrier_wait(bt_bar)

                        w0 = lax.rem(step - lo, steps_per_window) * pages
                        blks = [bt_smem[w0 + jj] for jj in range(pages)]
                    else:  # the table's rows are not 16-byte aligned: one scalar read per page
                        blks = [bt_ref[slot, jnp.minimum(step * pages + jj, m - 1)]
                                for jj in range(pages)]
                    load_kv_step(k_ref, v_ref, k_smem, v_smem, k_bars, v_bars, k_free, v_free,
                                 blks=blks, kh=kh, n=n, slot=lax.rem(n, stages), p=p, stages=stages)

            return base + (hi - lo)

        lax.fori_loop(0, my_rows, row_body, jnp.int32(0))


def decode_attention(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs, *,
                     sm_scale: float, tiling: DecodeTiling, zero_padding: bool):
    """[T, N, H] with the rows of every decode row (q_len == 1) written; with zero_padding the
    padding rows (from query_start_loc[num_seqs] on) are zeros; prefill rows are left unwritten
    (the prefill kernel writes them into this buffer in place). Inputs validated by the caller;
    every live slot has at least one token (so at most min(S, T) slots hold decode rows)."""
    t, n, h = q.shape
    _, k, p, _ = k_cache.shape
    s, m = block_tables.shape
    g = n // k
    bkv, stages = tiling.block_kv, tiling.stages
    rows = min(s, t)
    splits = num_splits(rows, k, tiling)
    walkers = num_row_walkers(rows, k, splits, tiling)
    dtype = q.dtype
    transforms = mma_transforms(h, dtype)

    def entry(q_ref, k_ref, v_ref, kvl_ref, bt_ref, qsl_ref, ns_ref, out_ref, part_ref=None,
              lse_ref=None):
        smem = (plgpu.SMEM((_ROWS, h), dtype, transforms=transforms),
                plgpu.SMEM((_ROWS, h), dtype),
                plgpu.SMEM((stages, bkv, h), dtype, transforms=transforms),
                plgpu.SMEM((stages, bkv, h), dtype, transforms=transforms),
                plgpu.SMEM((merge_rows(splits), h), jnp.float32),
                plgpu.SMEM((merge_rows(splits), _LSE_COLS), jnp.float32),
                plgpu.SMEM((8, h), dtype),
                plgpu.SMEM((_BT_WINDOW,), jnp.int32))
        ready = (plgpu.Barrier(num_arrivals=bkv // p, num_barriers=stages),
                 plgpu.Barrier(num_arrivals=bkv // p, num_barriers=stages),
                 plgpu.Barrier(num_arrivals=1),
                 plgpu.Barrier(num_arrivals=max(2 * (splits - 1), 1)),
                 plgpu.Barrier(num_arrivals=1))
        free = (plgpu.Barrier(num_arrivals=1, num_barriers=stages),) * 2
        cluster = (plgpu.ClusterBarrier(collective_axes=("split",), num_arrivals=1)
                   if splits > 1 else None)
        pl.run_scoped(
            lambda *scoped: _kernel(
                q_ref, k_ref, v_ref, kvl_ref, bt_ref, qsl_ref, ns_ref, out_ref, part_ref,
                lse_ref, scoped if splits > 1 else (*scoped, None), g=g, p=p, m=m, h=h, t=t,
                s=s, rows=rows, walkers=walkers, splits=splits, bkv=bkv, stages=stages,
                sm_scale=sm_scale, dtype=dtype, zero_padding=zero_padding),
            smem, ready, free, *(() if cluster is None else (cluster,)),
            collective_axes="wg")

    out_type = [jax.ShapeDtypeStruct((t, n, h), dtype)]
    if splits > 1:  # rows and log-sum-exps of splits 1..C-1, per slot and KV head
        out_type += [jax.ShapeDtypeStruct((rows, k, splits - 1, g, h), jnp.float32),
                     jax.ShapeDtypeStruct((rows, k, splits - 1, g, _LSE_COLS), jnp.float32)]
    mesh = plgpu.Mesh(grid=(k, walkers), grid_names=("kv", "walker"),
                      cluster=(splits,) if splits > 1 else (),
                      cluster_names=("split",) if splits > 1 else (),
                      num_threads=2, thread_name="wg")
    res = pl.kernel(entry, out_type=tuple(out_type), mesh=mesh,
                    compiler_params=compiler_params(tiling.profile_dir, _PROFILE_RANGES),
                    name="rpa_decode_mosaic",
                    )(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs)
    return res[0]
