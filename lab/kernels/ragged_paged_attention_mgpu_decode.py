"""Decode rows of ragged paged attention on Hopper: a Mosaic GPU (Pallas) kernel.

Same legend as ragged_paged_attention.py: T tokens, S slots, N query heads, K KV heads,
G = N // K, H head dim, B blocks, P block size, M blocks per sequence.

A decode row is a sequence slot with q_len == 1 (wherever it sits in the batch). Its work is one
pass over the sequence's K/V pages for each KV head, with the G query heads of that KV head packed
into the rows of one 64-row tile (GQA packing: each page is read once per KV head).

Grid: (K, W) clusters of C CTAs. Cluster (kh, w) walks the slots w, w + W, w + 2W, ... of KV
head kh; the C CTAs of a cluster cut each decode row's KV steps into C ranges (flash-decoding
splits, `split_steps`), so a small batch still fills half the SMs (as many as stream K/V at the
full rate on the H100; more would add only merge work: `num_splits`). Each CTA has two
warpgroups:
- a memory warpgroup streams the K and V pages of its range by TMA (one copy per page of P keys;
  the block ids by copies too: the whole table row, fetched while the row's metadata loads, or
  256 at a time), `stages` steps of `block_kv` keys in flight; it runs on across the CTA's rows,
  so the next row's pages load while this one is finished, and then zeroes the padding rows;
- a compute warpgroup computes Q.K^T and P.V with wgmma and the online softmax.
With C > 1 (`merge_splits` in the kernel): CTAs 1..C-1 send their first 8 rows (normalised by
their own softmax sum; the G live ones and finite filler) to global scratch by TMA; after a
cluster barrier CTA 0 fetches them into rows 8c.. of its swizzled Q tile (beside its own), reads
every split's log2-sum-exps across the cluster (distributed shared memory) and merges with one
small matmul, W [64, 64] @ tile [64, H] (`merge_weights`: split c's weight exp2(lse_c - max),
normalised, of row r at column 8c + r). One launch, no counter, no merge kernel; cluster CTAs are
co-scheduled, so the waits cannot deadlock.

The transposed form (`DecodeTiling.transposed`; by default for clusters of up to 4 CTAs) puts the
keys in the tile rows and the heads in 16 columns: S^T = K Q^T, P.V as O^T = V^T P^T, a quarter
of the tensor and exp work at G = 4. Its softmax sum comes from the tensor cores (ones @ P^T
beside P.V), and without splits its output leaves straight from the registers. Its merge: split
c's O^T [H, 16] (16-bit) goes to global scratch and into CTA 0's tile c; out [64, H] = sum_c
W_c @ (tile c)^T, W_c [64, 16] split c's weight of each head on the diagonal, so the rows come
back out of the tensor cores.

Scope: that of the Mosaic prefill kernel (`in_scope`: bf16 or f16, H in {64, 128}, G in
{1, 2, 4, 8}, P a multiple of 8 dividing block_kv, no soft cap, no sliding window; `supported()`);
the Triton flash-decoding kernel serves every other case.

A lab kernel: the engine never selects it (inside the engine it lost to the product's Triton
decode kernel at batch 1, 6.97 against 6.67 ms/token, and added 37 s of compile time:
lab/results/kernels_h100_mosaic_decode.md, "In the engine"). The product kernel,
jaxengine.pallas_kernels.ragged_paged_attention_gpu, has no decode choice; this module's
`ragged_paged_attention_gpu` is that call with the `decode="triton"|"mosaic"|"auto"` option the
product once had (this kernel's decode rows, then the product's prefill rows), for the bench
(lab/kernels/bench_paged_attention.py --mosaic-decode) and the probes. Run from the repository
root (imported as lab.kernels.ragged_paged_attention_mgpu_decode).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, memref, vector

from jaxengine.pallas_kernels import ragged_paged_attention_gpu as gpu
from jaxengine.pallas_kernels.ragged_paged_attention_mgpu import (
    _LOG2E, _ROWS, _cdiv, _load, compiler_params, in_scope, load_kv_step,
    mma_transforms, softmax_step, split_steps)

_MAX_CLUSTER = 8  # portable cluster size on Hopper
_PROFILE_RANGES = 64  # phases recorded per warpgroup when profiling (in shared memory)
_BT_WINDOW = 256  # block ids fetched per copy by the memory warpgroup
_BT_ROW_MAX = 1024  # table rows up to this many block ids are fetched whole (`bt_row_copies`)
_HEADS_T = 16  # transposed form: query heads padded to 16 wgmma columns (32-byte rows)
_SWIZZLE32 = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))  # 16-bit tiles
# Mosaic GPU stores registers through a transposed view of a swizzled buffer from jax 0.11.
_TRANSPOSED_STORE = jax.__version_info__ >= (0, 11)
_TRANSPOSED_MAX_SPLITS = 4  # DecodeTiling.transposed=None: up to this many splits


@dataclasses.dataclass(frozen=True)
class DecodeTiling:
    """Static choices of the Mosaic decode kernel.

    block_kv: keys per pipeline step (multiple of 64 and of the block size).
    stages: K/V steps buffered in shared memory.
    splits: CTAs (one cluster) per decode row. None: as many as fill half of `sm_count`
      SMs with K x min(S, T) rows (up to 8; 1 once the rows alone fill half the GPU), and no
      more than the KV steps of the longest row the block table can hold (`num_splits`).
    rows_per_sm: clusters launched per KV head are capped at rows_per_sm x sm_count /
      (K x splits); each walks several rows (the grid does not grow with the slot count).
    sm_count: streaming multiprocessors of the GPU (132 on an H100 SXM).
    profile_dir: diagnostics, as MosaicTiling.profile_dir (empty: off).
    transposed: compute S^T = K Q^T with the G query heads as the 16 columns of the wgmma
      tiles (keys as rows) instead of as rows of a 64-row tile: a quarter of the tensor and
      softmax work per key (`row_body_transposed` in the kernel). None: where measured faster
      on the H100, i.e. clusters of up to 4 splits (`use_transposed`). Needs jax >= 0.11 (the
      P tile is stored through a transposed view of a swizzled buffer).
    """

    block_kv: int = 128
    stages: int = 2
    splits: int | None = None
    rows_per_sm: int = 2
    sm_count: int = 132
    profile_dir: str = ""
    transposed: bool | None = None

    def __post_init__(self) -> None:
        if self.block_kv % 64 or self.block_kv < 64:
            raise ValueError(f"DecodeTiling.block_kv must be a multiple of 64, got {self.block_kv}")
        if self.stages < 2:
            raise ValueError(f"DecodeTiling.stages must be >= 2, got {self.stages}")
        if self.splits is not None and not 1 <= self.splits <= _MAX_CLUSTER:
            raise ValueError(f"DecodeTiling.splits must be in [1, {_MAX_CLUSTER}] or None, "
                             f"got {self.splits}")
        if self.transposed and not _TRANSPOSED_STORE:
            raise ValueError("DecodeTiling.transposed needs jax >= 0.11 (Mosaic GPU's store "
                             f"through a transposed swizzled view); this is jax {jax.__version__}")
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


def bt_row_copies(m: int, pages: int) -> int:
    """Copies (of up to 256 ids each) that fetch a whole table row of `m` block ids at a row's
    start, before its metadata is read, so that the two round trips overlap; 0: the row is
    fetched by windows from the split's first step on (`bt_window`), which needs the row's
    KV length first. Needs rows of a multiple of 32 ids (whole 128-byte copies) and of the
    `pages` ids of one step (so every step's ids lie inside the row), at most _BT_ROW_MAX."""
    return _cdiv(m, _BT_WINDOW) if m % max(32, pages) == 0 and m <= _BT_ROW_MAX else 0


def copy_table_row(bt_ref, slot, bt_smem, bar, m: int) -> None:
    """Issues the copies of table row `slot` ([m] block ids) into `bt_smem`, `bt_row_copies`
    of them (up to 256 ids each), all arriving on `bar`; not waited for."""
    for i0 in range(0, m, _BT_WINDOW):
        size = min(_BT_WINDOW, m - i0)
        plgpu.copy_gmem_to_smem(bt_ref.at[slot, pl.ds(i0, size)], bt_smem.at[pl.ds(i0, size)],
                                bar)


def smem_bytes(head_dim: int, itemsize: int, tiling: DecodeTiling) -> int:
    """Shared memory of one CTA: K/V stages, Q (swizzled, also the split merge's tile in the
    row form, + staging), the merge's log-sum-exps, a zero tile and the block ids (a window,
    or a whole row of up to _BT_ROW_MAX); in the transposed form also P and the merge tiles
    O^T of up to 8 splits."""
    common = (2 * tiling.stages * tiling.block_kv * head_dim * itemsize
              + 2 * _ROWS * head_dim * itemsize + 8 * head_dim * itemsize + _BT_ROW_MAX * 4
              + 1024)
    if tiling.transposed is not False and _TRANSPOSED_STORE:  # it may be used
        return (common + _HEADS_T * 4 + tiling.block_kv * _HEADS_T * itemsize
                + _MAX_CLUSTER * head_dim * _HEADS_T * itemsize)
    return common + _ROWS * 4


def split_weights(lses):
    """Each split's weight per row: lses[c] [64] is split c's log2-sum-exp of each row (-inf:
    the split saw no key of it); returns [64] vectors exp2(lse_c - max), normalised over the
    splits. Split 0 never misses a key of a live row, so the max is finite."""
    mx = lses[0]
    for lc in lses[1:]:
        mx = jnp.maximum(mx, lc)
    es = [jnp.exp2(lc - mx) for lc in lses]
    den = es[0]
    for e in es[1:]:
        den = den + e
    inv = 1.0 / den
    return [e * inv for e in es]


def merge_weights(lses, iota=lax.broadcasted_iota):
    """The split merge as one matrix: W [64, 64] with W[r, 8c + r % 8] = split c's weight of
    row r (`split_weights`) and 0 elsewhere, so that W @ T merges the rows of T [64, H] (split
    c's row r at 8c + r, each normalised by its own softmax sum) into row r (rows >= 8 repeat
    rows 0-7 with their own weights: not used). Plain jnp: the kernel runs it on registers
    (`iota` placing its indices in the WGMMA layout), the CPU tests on arrays."""
    shape = (_ROWS, _ROWS)
    rows, cols = iota(jnp.int32, shape, 0), iota(jnp.int32, shape, 1)
    w = jnp.zeros(shape, jnp.float32)
    for c, wc in enumerate(split_weights(lses)):
        w = jnp.where(cols == 8 * c + lax.rem(rows, 8), lax.broadcast_in_dim(wc, shape, [0]), w)
    return w


def column_weights(wc, iota=lax.broadcasted_iota):
    """[64, 16] with W[r, r] = wc[r] (wc [16]: a weight per query head, r < 16) and 0 elsewhere:
    W @ X^T, X [H, 16] a split's O^T, is its rows O [64, H] scaled (rows >= 16 zero)."""
    shape = (_ROWS, _HEADS_T)
    return jnp.where(iota(jnp.int32, shape, 0) == iota(jnp.int32, shape, 1),
                     lax.broadcast_in_dim(wc, shape, [1]), 0.0)


def hi_lo(w, dtype):
    """f32 weights as two 16-bit matmul operands whose sum keeps them to ~2^-17: the high part
    and the rounding left over."""
    hi = w.astype(dtype)
    return hi, (w - hi.astype(jnp.float32)).astype(dtype)


@plgpu.inline_mgpu(
    arg_types=(plgpu.Layout.WGMMA,),
    return_type=plgpu.ShapeDtypeStruct((_HEADS_T,), jnp.float32,
                                       layout=plgpu.Layout.WGMMA.reduce(0)))
def equal_rows_as_vector(ctx, x):
    """x [64, 16] (WGMMA layout) whose rows are all equal (column sums from the tensor cores)
    as one [16] vector, each thread keeping the values of its own first row: its columns are
    those it holds of every row, so no value crosses a thread (`x.max(axis=0)` would exchange
    them across the warps)."""
    del ctx
    rows = x.layout.tiling.tile_dimension(0)  # the register dims along the rows
    first = tuple(slice(0, 1) if r else slice(None) for r in rows)
    cols = x.layout.reduce((0,))
    regs = x.registers[first]
    return type(x)(_registers=regs.reshape(cols.registers_shape((x.shape[1],))), _layout=cols,
                   _is_signed=None)


@plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
def store_columns_as_rows(ctx, x, out_ref):
    """out_ref [G, H] (global memory) = the first G columns of x [H, 16] (WGMMA layout, 16-bit)
    as rows: each thread stores its own elements of those columns, one scalar store each,
    with no staging buffer, fence, barrier or TMA copy (writes of a few KB per call)."""
    del ctx
    g = ir.MemRefType(out_ref.type).shape[0]
    index = ir.IndexType.get()
    [vec_len] = ir.VectorType(x.registers.flat[0].type).shape
    for reg_idx, (r, c) in zip(np.ndindex(x.registers.shape), x.layout.thread_idxs(x.shape)):
        reg = x.registers[reg_idx]
        for v in range(vec_len):
            col = arith.addi(c, arith.constant(index, v))
            live = arith.cmpi(arith.CmpIPredicate.ult, col, arith.constant(index, g))
            with mgpu_utils.when(live):
                memref.store(vector.extract(reg, dynamic_position=[],
                                            static_position=ir.DenseI64ArrayAttr.get([v])),
                             out_ref, [col, r])


_wgmma_iota = functools.partial(plgpu.broadcasted_iota, layout=plgpu.Layout.WGMMA)


def use_transposed(splits: int, tiling: DecodeTiling) -> bool:
    """Whether a cluster of `splits` CTAs computes in the transposed form. By default (None)
    where it was faster on the H100: 1, 2 and 4 splits (batch 8: 2.10x the bundled kernel at
    8 x 512 against 2.03x; 4 splits at 1 x 2048: 9.6 against 10.2 us; 1 split within 1%);
    at 8 splits its merge of O^T tiles costs 0.6 kcyc more and the row form was 0.1-0.2 us
    faster."""
    if tiling.transposed is not None:
        return tiling.transposed
    return _TRANSPOSED_STORE and splits <= _TRANSPOSED_MAX_SPLITS


def supported(dtype, head_dim: int, group: int, block_size: int, soft_cap, window,
              tiling: DecodeTiling) -> bool:
    """Whether this kernel can serve a call with these static properties."""
    return in_scope(dtype, head_dim, group, block_size, soft_cap, window, tiling.block_kv,
                    smem_bytes(head_dim, jnp.dtype(dtype).itemsize, tiling))


def num_splits(rows: int, k: int, tiling: DecodeTiling, max_steps: int | None = None) -> int:
    """CTAs per decode row (static): enough for the K x `rows` row items to fill half the SMs
    (64 CTAs on the H100 stream K/V as fast as 128: `probe_paged_read.py`, so a split that
    only adds CTAs past that buys nothing and costs its merge), but no more than `max_steps`,
    the KV steps of the longest row the block table can hold (more splits would only be
    empty ones, and each adds to the merge)."""
    if tiling.splits is not None:
        return tiling.splits
    fill = min(_MAX_CLUSTER, max(1, tiling.sm_count // 2 // (k * rows)))
    return int(fill if max_steps is None else max(1, min(fill, max_steps)))


def num_row_walkers(rows: int, k: int, splits: int, tiling: DecodeTiling) -> int:
    """Clusters per KV head (static): every row slot, capped so the grid stays near
    `rows_per_sm` CTAs per SM; each cluster then walks rows w, w + W, ..."""
    cap = max(1, tiling.rows_per_sm * tiling.sm_count // (k * splits))
    return int(min(rows, cap))


def _kernel(q_ref, k_ref, v_ref, kvl_ref, bt_ref, qsl_ref, ns_ref, out_ref, part_ref, scoped,
            *, g: int, p: int, m: int, h: int, t: int, s: int, rows: int, walkers: int,
            splits: int, transposed: bool, bkv: int, stages: int, sm_scale: float, dtype,
            zero_padding: bool, row_copies: int):
    pages = bkv // p
    kh = lax.axis_index("kv")
    w = lax.axis_index("walker")
    c = lax.axis_index("split") if splits > 1 else jnp.int32(0)
    wg = lax.axis_index("wg")
    ((qo_smem, q_stage, k_smem, v_smem, lse_smem, zero_smem, bt_smem, *cols_smem),
     (k_bars, v_bars, q_bar, merge_bar, bt_bar), (k_free, v_free), cluster_bars) = scoped
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
        if splits > 1 or transposed:
            # A Q tile's rows >= G are the staging buffer's other rows: zeros at first (later,
            # earlier output rows), so that every row (transposed: column) of a split's result
            # is finite: the merge matmul multiplies the filler ones by zero weights.
            q_stage[...] = jnp.zeros((_ROWS, h), dtype)
            plgpu.commit_smem()

        def load_q(tok):
            """This row's G query heads into rows 0..G-1 of the swizzled Q tile (through the
            untiled staging buffer: TMA cannot write fewer than 8 rows of a tiled buffer)."""
            with jax.named_scope("q_load"):
                plgpu.copy_gmem_to_smem(q_ref.at[tok, pl.ds(kh * g, g)],
                                        q_stage.at[pl.ds(0, g)], q_bar)
                plgpu.barrier_wait(q_bar)
                # Rows g.. of the tile hold whatever the staging buffer held: each output row
                # depends on its own query row only, and only rows < g are stored.
                qo_smem[...] = _load(q_stage, plgpu.Layout.WGMMA)
                plgpu.commit_smem()

        def store_rows(tok):
            def store(val):
                with jax.named_scope("out_store"):
                    q_stage[...] = val.astype(dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(q_stage.at[pl.ds(0, g)],
                                            out_ref.at[tok, pl.ds(kh * g, g)])
            return store

        def kv_loop(base, lo, hi, kv_len, *, scores, keys_axis, acc_shape, qk, softmax, pv,
                    sum_shape=None):
            """The compute side of the K/V pipeline over this CTA's steps [lo, hi) of a row:
            per step, wait for K, `qk` into a `scores`-shaped accumulator, free K, mask the
            keys past kv_len (along `keys_axis`) in the last steps, `softmax`, wait for V, `pv`,
            free V. Shared by both forms, so the barrier order stays that of the memory
            warpgroup. Starts from a zero `acc_shape` accumulator, a running max of -inf and a
            sum of 0 per query head (the scores' other axis); returns the three at the end.
            sum_shape: the sum is a second tensor-core accumulator of this shape (WGMMA
            layout), which `pv(acc_ref, sum_ref, st, p16)` adds to beside the product and
            `softmax` only rescales; without it `pv(acc_ref, st, p16)`."""
            n_full = jnp.clip(kv_len // bkv, lo, hi) - lo  # steps with every key valid

            def kv_step(i, carry, masked: bool):
                acc, m_i, l_i = carry
                st = lax.rem(base + i, stages)
                with jax.named_scope("k_wait"):  # profiled: when each step's K landed
                    plgpu.barrier_wait(k_bars.at[st])

                def compute_qk(acc_ref):
                    qk(acc_ref, st)
                    return acc_ref[...]

                with jax.named_scope("qk"):
                    sc = pl.run_scoped(compute_qk, plgpu.ACC(scores, jnp.float32))
                plgpu.barrier_arrive(k_free.at[st])
                if masked:
                    keys = plgpu.broadcasted_iota(jnp.int32, scores, keys_axis,
                                                  layout=plgpu.Layout.WGMMA)
                    sc = jnp.where((lo + i) * bkv + keys < kv_len, sc, -jnp.inf)
                acc, m_new, l_i, p16 = softmax(sc, acc, m_i, l_i)
                with jax.named_scope("v_wait"):
                    plgpu.barrier_wait(v_bars.at[st])
                if sum_shape is None:
                    acc = pl.run_state(lambda acc_ref: pv(acc_ref, st, p16))(
                        plgpu.ACC.init(acc))
                else:
                    acc, l_i = pl.run_state(lambda refs: pv(*refs, st, p16))(
                        (plgpu.ACC.init(acc), plgpu.ACC.init(l_i)))
                plgpu.barrier_arrive(v_free.at[st])
                return acc, m_new, l_i

            heads = plgpu.Layout.WGMMA.reduce(keys_axis)
            m_i = plgpu.layout_cast(jnp.full((scores[1 - keys_axis],), -jnp.inf, jnp.float32),
                                    heads)
            if sum_shape is not None:
                l_i = plgpu.layout_cast(jnp.full(sum_shape, 0, jnp.float32), plgpu.Layout.WGMMA)
            else:
                l_i = plgpu.layout_cast(jnp.full((scores[1 - keys_axis],), 0, jnp.float32),
                                        heads)
            acc = plgpu.layout_cast(jnp.full(acc_shape, 0, jnp.float32), plgpu.Layout.WGMMA)
            with jax.named_scope("kv_loop"):
                carry = lax.fori_loop(0, n_full, lambda i, cr: kv_step(i, cr, False),
                                      (acc, m_i, l_i))
                return lax.fori_loop(n_full, hi - lo, lambda i, cr: kv_step(i, cr, True), carry)

        def rows_out(mm):
            """out [64, H] from a zero accumulator and the wgmmas `mm` issues, stored."""
            zero = plgpu.layout_cast(jnp.full((_ROWS, h), 0, jnp.float32), plgpu.Layout.WGMMA)
            with jax.named_scope("out_mm"):
                return pl.run_state(mm)(plgpu.ACC.init(zero))

        def merge_splits(slot, lse, own, part, heads, weights, finish):
            """The split merge of one decode row, both forms. Every CTA has its partial result
            in shared memory (`own`, normalised by its own softmax sum) and gives its
            log2-sum-exps `lse` (-inf: the split saw no key), one per query head in layout
            `heads`. CTAs 1..C-1 send `own` to global scratch; after a cluster barrier CTA 0
            fetches split cc's into `part(cc)`, reads every split's log-sum-exps across the
            cluster, computes `weights(lses)` and, once the parts have landed,
            `finish(weights)` (the merge matmul and the store). A second cluster barrier keeps
            the other CTAs' log-sum-exps until CTA 0 has read them."""
            lse_smem[...] = lse
            plgpu.commit_smem()

            @pl.when(c > 0)
            def _publish():
                with jax.named_scope("publish"):
                    plgpu.copy_smem_to_gmem(own, part_ref.at[slot, kh, c - 1])
                    plgpu.wait_smem_to_gmem(0)  # written, before CTA 0 is told

            with jax.named_scope("split_barrier"):
                plgpu.barrier_arrive(cluster_bars.at[0])
                plgpu.barrier_wait(cluster_bars.at[0])

            @pl.when(c == 0)
            def _merge():
                with jax.named_scope("merge"):
                    for cc in range(1, splits):
                        plgpu.copy_gmem_to_smem(part_ref.at[slot, kh, cc - 1], part(cc),
                                                merge_bar)
                    peers = [_load(plgpu.cluster_ref(lse_smem, {"split": cc}), heads)
                             for cc in range(1, splits)]
                    plgpu.barrier_arrive(cluster_bars.at[1])  # peers' log-sum-exps read
                    w = weights([lse, *peers])
                    plgpu.barrier_wait(merge_bar)
                    finish(w)

            pl.when(c > 0)(lambda: plgpu.barrier_arrive(cluster_bars.at[1]))
            plgpu.barrier_wait(cluster_bars.at[1])

        def row_body(j, base):
            slot, live, tok, kv_len, lo, hi = row(j)

            @pl.when(live)
            def _():
                load_q(tok)
                acc, m_i, l_i = kv_loop(
                    base, lo, hi, kv_len, scores=(_ROWS, bkv), keys_axis=1,
                    acc_shape=(_ROWS, h),
                    qk=lambda acc_ref, st: plgpu.wgmma(
                        acc_ref, qo_smem, plgpu.transpose_ref(k_smem.at[st], (1, 0))),
                    softmax=lambda sc, acc, m_i, l_i: softmax_step(sc, scale, acc, m_i, l_i,
                                                                   dtype),
                    pv=lambda acc_ref, st, p16: plgpu.wgmma(acc_ref, p16, v_smem.at[st]))
                with jax.named_scope("epilogue"):
                    l_safe = jnp.maximum(l_i, 1e-30)
                    o = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])  # 0 for an empty split
                    store = store_rows(tok)
                    if splits == 1:
                        store(o)
                    else:
                        # Row form: each CTA's rows go into its swizzled Q tile (Q is no longer
                        # needed); split cc's first 8 rows (the G live ones and finite filler)
                        # land at rows 8cc.. of CTA 0's, merged by one small matmul W [64, 64]
                        # @ tile [64, H] (`merge_weights`, as high and low 16-bit parts).
                        lse = m_i + jnp.log(l_safe) * _LOG2E  # log2; -inf: no key in the split
                        qo_smem[...] = o.astype(dtype)

                        def merge_mm(w_hi_lo):
                            def mm(acc_ref):
                                for wc in w_hi_lo:
                                    plgpu.wgmma(acc_ref, wc, qo_smem)
                            store(rows_out(mm))

                        merge_splits(
                            slot, lse, qo_smem.at[pl.ds(0, 8)],
                            lambda cc: qo_smem.at[pl.ds(8 * cc, 8)],
                            plgpu.Layout.WGMMA.reduce(1),
                            lambda lses: hi_lo(merge_weights(lses, _wgmma_iota), dtype), merge_mm)

                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # staging reused next row

            return base + (hi - lo)

        def row_body_transposed(j, base):
            """`row_body` with the heads as columns: S^T [BKV, 16] = K [BKV, H] @ Q^T, the
            online softmax down the columns (over the keys; its reductions cross the warps),
            P^T stored as P [16, BKV] (through a transposed view, so that V and P share the
            128-byte swizzle: a 32-byte one on V made its TMA loads measurably slower) and
            O^T [H, 16] += V^T @ P^T, and the softmax sum from the tensor cores beside it (ones
            [64, BKV] @ P^T: every row the column sums, so no reduction across the warps). The
            result O^T (normalised, 16-bit): without splits, its first G columns stored from
            the registers straight to the output rows (`store_columns_as_rows`); with splits,
            into merge tile 0, and the rows come back out of the tensor cores: out [64, H] =
            sum over splits c of W_c [64, 16] @ (tile c)^T, W_c split c's weight of each head
            on the diagonal (`column_weights`). Split c > 0 sends its tile to global scratch;
            CTA 0 fetches it into tile c."""
            p_smem, *t_smem = cols_smem
            t_smem = t_smem[0] if t_smem else None  # the merge tiles (splits > 1)
            slot, live, tok, kv_len, lo, hi = row(j)

            @pl.when(live)
            def _():
                load_q(tok)
                q_t = plgpu.transpose_ref(qo_smem.at[pl.ds(0, _HEADS_T)], (1, 0))  # [H, 16]

                def softmax_columns(sc, acc, m_i, l_i):
                    """`softmax_step` down the columns of S^T; P goes to shared memory. The
                    sum l_i [64, 16] is the tensor cores' (every row the column sums: `pv`
                    adds ones [64, BKV] @ P^T): here it is only rescaled."""
                    m_new = jnp.maximum(m_i, sc.max(axis=0) * scale)
                    alpha = jnp.exp2(m_i - m_new)
                    pr = jnp.exp2(sc * scale - lax.broadcast_in_dim(m_new, sc.shape, [1]))
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1])
                    l_i = l_i * lax.broadcast_in_dim(alpha, l_i.shape, [1])
                    plgpu.transpose_ref(p_smem, (1, 0))[...] = pr.astype(dtype)  # P [16, BKV]
                    plgpu.commit_smem()
                    return acc, m_new, l_i, None

                def pv_and_sum(acc_ref, sum_ref, st, _):
                    p_t = plgpu.transpose_ref(p_smem, (1, 0))
                    plgpu.wgmma(acc_ref, plgpu.transpose_ref(v_smem.at[st], (1, 0)), p_t)
                    ones = plgpu.layout_cast(jnp.full((_ROWS, bkv), 1, dtype),
                                             plgpu.Layout.WGMMA)
                    plgpu.wgmma(sum_ref, ones, p_t)

                acc, m_i, l_i = kv_loop(
                    base, lo, hi, kv_len, scores=(bkv, _HEADS_T), keys_axis=0,
                    acc_shape=(h, _HEADS_T),
                    qk=lambda acc_ref, st: plgpu.wgmma(acc_ref, k_smem.at[st], q_t),
                    softmax=softmax_columns, pv=pv_and_sum, sum_shape=(_ROWS, _HEADS_T))
                with jax.named_scope("epilogue"):
                    l_safe = jnp.maximum(equal_rows_as_vector(l_i), 1e-30)
                    o_t = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [1])
                           ).astype(dtype)  # O^T; 0 for an empty split
                    if splits == 1:
                        # O^T's first G columns straight from the registers to the output
                        # rows: no staging buffer, fence, barrier or TMA copy.
                        with jax.named_scope("out_store"):
                            store_columns_as_rows(o_t, out_ref.at[tok, pl.ds(kh * g, g)])
                    else:
                        t_smem.at[0][...] = o_t

                        def out_rows(weights):
                            """out [64, H] = sum_c W_c @ (tile c)^T, W_c as 16-bit parts."""
                            def mm(acc_ref):
                                for cc, parts in enumerate(weights):
                                    for wc in parts:
                                        plgpu.wgmma(acc_ref, wc, plgpu.transpose_ref(
                                            t_smem.at[cc], (1, 0)))
                            store_rows(tok)(rows_out(mm))

                        lse = m_i + jnp.log(l_safe) * _LOG2E  # log2; -inf: no key in the split
                        merge_splits(
                            slot, lse, t_smem.at[0], lambda cc: t_smem.at[cc],
                            plgpu.Layout.WGMMA.reduce(0),  # a value per head (column)
                            lambda lses: [hi_lo(column_weights(wc, _wgmma_iota), dtype)
                                          for wc in split_weights(lses)], out_rows)

                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # staging reused next row

            return base + (hi - lo)

        lax.fori_loop(0, my_rows, row_body_transposed if transposed else row_body,
                      jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _memory():
        # row_copies (`bt_row_copies`): whole table rows, else windows or scalar reads.
        window = 0 if row_copies else bt_window(m, pages)
        steps_per_window = max(window // pages, 1)

        def fetch_row(slot):
            """The whole table row of `slot` into the block-id buffer (not waited for)."""
            plgpu.commit_smem()  # the previous row's scalar reads of the buffer come first
            copy_table_row(bt_ref, slot, bt_smem, bt_bar, m)

        def row_body(j, base):
            if row_copies:
                # Issued before the row's metadata loads: the two round trips overlap, and the
                # first K/V copies wait for one of them, not for both in turn.
                fetch_row(w + j * walkers)
            slot, _, _, _, lo, hi = row(j)
            if row_copies:
                plgpu.barrier_wait(bt_bar)

            with jax.named_scope("kv_issue"):
                @pl.loop(lo, hi)
                def _(step):
                    n = base + step - lo
                    if row_copies:  # every step's ids are in the row
                        blks = [bt_smem[step * pages + jj] for jj in range(pages)]
                    elif window:
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
        if zero_padding:
            # Padding rows (tokens from query_start_loc[num_seqs] on) get zeros for this KV
            # head's G heads, cluster w taking padding tokens w, w + W, ...: here, after the
            # last K/V copies are issued, so that the two dependent loads this needs do not
            # delay the first ones (nor the compute warpgroup's Q load).
            zero_smem[...] = jnp.zeros((8, h), dtype)
            plgpu.commit_smem()

            @pl.when(c == 0)
            def _():
                pad0 = qsl_ref[n_live]

                @pl.loop(0, _cdiv(jnp.maximum(t - pad0 - w, 0), walkers))
                def _(i):
                    plgpu.copy_smem_to_gmem(zero_smem.at[pl.ds(0, g)],
                                            out_ref.at[pad0 + w + i * walkers, pl.ds(kh * g, g)])

            plgpu.wait_smem_to_gmem(0)


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
    splits = num_splits(rows, k, tiling, max_steps=_cdiv(m * p, bkv))
    walkers = num_row_walkers(rows, k, splits, tiling)
    dtype = q.dtype
    transposed = use_transposed(splits, tiling)
    row_copies = bt_row_copies(m, bkv // p)
    # Both operands of a wgmma share one swizzle (128 bytes for H = 128 and for P [16, BKV]).
    transforms = mma_transforms(h, dtype)

    def entry(q_ref, k_ref, v_ref, kvl_ref, bt_ref, qsl_ref, ns_ref, out_ref, part_ref=None):
        smem = (plgpu.SMEM((_ROWS, h), dtype, transforms=transforms),
                plgpu.SMEM((_ROWS, h), dtype),
                plgpu.SMEM((stages, bkv, h), dtype, transforms=transforms),
                plgpu.SMEM((stages, bkv, h), dtype, transforms=transforms),
                # its log-sum-exps, one per row (transposed: column), read across the cluster
                plgpu.SMEM((_HEADS_T if transposed else _ROWS,), jnp.float32),
                plgpu.SMEM((8, h), dtype),
                plgpu.SMEM((max(_BT_WINDOW, m) if row_copies else _BT_WINDOW,), jnp.int32))
        if transposed:  # P, and with splits the merge tiles O^T (this CTA's, then the others')
            smem += (plgpu.SMEM((_HEADS_T, bkv), dtype, transforms=mma_transforms(bkv, dtype)),)
            if splits > 1:
                smem += (plgpu.SMEM((splits, h, _HEADS_T), dtype, transforms=_SWIZZLE32),)
        ready = (plgpu.Barrier(num_arrivals=bkv // p, num_barriers=stages),
                 plgpu.Barrier(num_arrivals=bkv // p, num_barriers=stages),
                 plgpu.Barrier(num_arrivals=1),
                 plgpu.Barrier(num_arrivals=max(splits - 1, 1)),  # CTA 0's fetches
                 plgpu.Barrier(num_arrivals=max(row_copies, 1)))  # block ids
        free = (plgpu.Barrier(num_arrivals=1, num_barriers=stages),) * 2
        extra = []
        if splits > 1:
            extra.append(plgpu.ClusterBarrier(collective_axes=("split",), num_arrivals=1,
                                              num_barriers=2))

        def body(smem_, ready_, free_, *rest):
            _kernel(q_ref, k_ref, v_ref, kvl_ref, bt_ref, qsl_ref, ns_ref, out_ref, part_ref,
                    (smem_, ready_, free_, rest[0] if rest else None), g=g, p=p, m=m, h=h, t=t,
                    s=s, rows=rows, walkers=walkers, splits=splits, transposed=transposed,
                    bkv=bkv, stages=stages, sm_scale=sm_scale, dtype=dtype,
                    zero_padding=zero_padding, row_copies=row_copies)

        pl.run_scoped(body, smem, ready, free, *extra, collective_axes="wg")

    out_type = [jax.ShapeDtypeStruct((t, n, h), dtype)]
    if splits > 1:  # per slot and KV head, splits 1..C-1's first 8 rows, or their O^T tiles
        part = (h, _HEADS_T) if transposed else (8, h)
        out_type += [jax.ShapeDtypeStruct((rows, k, splits - 1, *part), dtype)]
    mesh = plgpu.Mesh(grid=(k, walkers), grid_names=("kv", "walker"),
                      cluster=(splits,) if splits > 1 else (),
                      cluster_names=("split",) if splits > 1 else (),
                      num_threads=2, thread_name="wg")
    res = pl.kernel(entry, out_type=tuple(out_type), mesh=mesh,
                    compiler_params=compiler_params(tiling.profile_dir, _PROFILE_RANGES),
                    name="rpa_decode_mosaic",
                    )(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs)
    return res[0]


@dataclasses.dataclass(frozen=True)
class Tiling(gpu.Tiling):
    """The product kernel's `Tiling` plus this kernel's choices (`mosaic_decode`), as the
    product's Tiling carried them while it offered decode="mosaic". Accepted by the product's
    `ragged_paged_attention_gpu` too (a subclass: the extra field is ignored there)."""

    mosaic_decode: DecodeTiling = DecodeTiling()


def _use_mosaic_decode(choice: str, q, k_cache, soft_cap, window, tiling: DecodeTiling,
                       interpret: bool) -> bool:
    """Whether the decode rows go to this kernel (static: shapes, dtype, options); `choice`
    "mosaic" raises where it does not apply."""
    if choice == "triton":
        return False
    t, n, h = q.shape
    g, p = n // k_cache.shape[1], k_cache.shape[2]
    ok = not interpret and supported(q.dtype, h, g, p, soft_cap, window, tiling)
    if choice == "mosaic" and not ok:
        raise ValueError(
            f"decode='mosaic' cannot serve this call (dtype {q.dtype}, head dim {h}, "
            f"{g} query heads per KV head, block size {p}, {t} token rows, soft_cap "
            f"{soft_cap}, sliding_window {window}, interpret {interpret}); see "
            "lab.kernels.ragged_paged_attention_mgpu_decode.supported")
    return ok


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "tiling",
                                             "interpret", "prefill", "decode", "decode_only",
                                             "prefill_only"))
def ragged_paged_attention_gpu(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, kv_lens: jax.Array,
    block_tables: jax.Array, query_start_loc: jax.Array, num_seqs: jax.Array, *,
    sm_scale: float, soft_cap: float | None = None, sliding_window: int | None = None,
    tiling: gpu.Tiling | None = None, interpret: bool = False, prefill: str = "triton",
    decode: str = "triton", decode_only: bool = False, prefill_only: bool = False,
) -> jax.Array:
    """The product's `ragged_paged_attention_gpu` (same contract and arguments) with a choice
    of who computes the decode rows (q_len == 1):
    `decode`: "triton" (the product call as it is), "mosaic" (this module's kernel; ValueError
    where it does not apply) or "auto" (this kernel where it applies, else the product call).
    With this kernel the call is `decode_attention` (decode rows, and zeroed padding rows when
    the Mosaic prefill kernel follows or, with decode_only, no prefill kernel does), then the
    product's `_prefill_rows` (Triton or Mosaic, by `prefill`) writing the prefill rows into the
    same buffer. A prefill-only call (prefill_only=True) has no decode rows: the product call.
    `tiling`: this module's `Tiling` (its `mosaic_decode` field), or the product's (this
    kernel's defaults).
    """
    if decode not in ("triton", "mosaic", "auto"):
        raise ValueError(f"decode must be 'triton', 'mosaic' or 'auto', got {decode!r}")
    tiling = tiling or Tiling()
    kw = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
              tiling=tiling, interpret=interpret, prefill=prefill, decode_only=decode_only,
              prefill_only=prefill_only)
    args = (q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs)
    if decode == "triton" or prefill_only:
        return gpu.ragged_paged_attention_gpu(*args, **kw)
    gpu._validate(*args, sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window)
    if prefill not in ("triton", "mosaic", "auto"):
        raise ValueError(f"prefill must be 'triton', 'mosaic' or 'auto', got {prefill!r}")
    sm_scale = float(sm_scale)
    soft_cap = None if soft_cap is None else float(soft_cap)
    window = None if sliding_window is None else int(sliding_window)
    mosaic = not decode_only and gpu._use_mosaic(prefill, q, k_cache, soft_cap, window, tiling,
                                                 interpret)
    dec_tiling = getattr(tiling, "mosaic_decode", DecodeTiling())
    if not _use_mosaic_decode(decode, q, k_cache, soft_cap, window, dec_tiling, interpret):
        return gpu.ragged_paged_attention_gpu(*args, **kw)
    out3 = decode_attention(*args, sm_scale=sm_scale, tiling=dec_tiling,
                            zero_padding=mosaic or bool(decode_only))
    if decode_only:
        return out3
    dims = gpu._make_dims(q, k_cache, block_tables, tiling)
    return gpu._prefill_rows(out3.reshape(dims.t * dims.n, dims.h), *args, dims=dims,
                             mosaic=mosaic, sm_scale=sm_scale, soft_cap=soft_cap, window=window,
                             tiling=tiling, interpret=interpret)
