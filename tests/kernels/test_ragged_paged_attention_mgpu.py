"""The Mosaic GPU prefill kernel on the CPU: what can be checked without a Hopper GPU.

- The tile layout (`tile_layout`, XLA ops; the Triton programs that build it by default give
  the same entries): the live tiles, heaviest first, cover every
  prefill row exactly once. The kernel's writes are emulated (each tile's live tokens, cut into
  the power-of-two chunks its TMA stores use) into an output whose prefill rows are poisoned
  with NaN and whose decode and padding rows hold what the decode kernel leaves there.
- The kernel lowers for CUDA (Mosaic GPU's layout and TMA checks run at lowering).
- The tile table is built once per program, however many layers trace it.
- Options are validated with clear errors.
The kernel body itself runs on the H100 (lab/kernels/bench_paged_attention.py --mosaic:
correctness cases and timings in lab/results/kernels_h100_mosaic*); Pallas' Mosaic GPU
interpreter does not run it (no run_state support).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.attention_backend import select_attention_backend
from jaxengine.config import EngineConfig
from jaxengine.models.config import ModelConfig
from jaxengine.pallas_kernels import ragged_paged_attention_mgpu as mgpu
from jaxengine.pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from jaxengine.pallas_kernels.ragged_paged_attention_gpu import (
    Tiling, ragged_paged_attention_gpu)
from tests.kernels.batch_factory import make_batch
from tests.kernels.cuda_target import abstract_h100, mosaic_modules_with_and_without_scopes


def _emulate_kernel(layout, ref: np.ndarray, out: np.ndarray, *, g: int) -> np.ndarray:
    """What the kernel writes into `out`: for each live tile (the first `count` table rows),
    the rows of its live tokens t0 .. min(q_end, t0 + 2 * TQ), every head, each chunk of a
    warpgroup's tokens as `pow2_chunks` cuts it; asserts no row is written twice."""
    tq = 64 // g
    table = np.asarray(layout.table)
    count = int(np.asarray(layout.count)[0])
    assert (table[:count, 0] >= 0).all() and (table[count:, 0] < 0).all()
    written = np.zeros(out.shape[0], bool)
    for seq, t0, q_end in table[:count, :3]:
        for w in range(2):
            valid = int(np.clip(q_end - t0 - w * tq, 0, tq))
            for b, start, present in mgpu.pow2_chunks(valid, tq):
                if present:
                    rows = np.arange(t0 + w * tq + start, t0 + w * tq + start + b)
                    assert not written[rows].any()
                    written[rows] = True
                    out[rows] = ref[rows]
    return out


@pytest.mark.parametrize("n,k,q_lens,ctx_lens,pad_slots,pad_tokens", [
    (32, 8, [1, 1, 37, 300, 17, 64, 2], [15, 3000, 0, 500, 1234, 63, 1], 2, 2),
    (16, 2, [1, 129, 8, 250], [40, 0, 31, 777], 0, 4),
    (4, 4, [3, 200, 1, 100], [0, 64, 10, 129], 1, 0),
    (8, 8, [1, 1, 1], [5, 6, 7], 0, 5),  # decode only: no tile has work
])
def test_tile_layout_covers_every_prefill_row_once(n, k, q_lens, ctx_lens, pad_slots,
                                                  pad_tokens):
    rng = np.random.default_rng(len(q_lens) + n)
    b = make_batch(rng, q_lens=q_lens, ctx_lens=ctx_lens, num_heads=n, num_kv_heads=k,
                   head_dim=16, block_size=16, dtype=jnp.float32, pad_slots=pad_slots,
                   pad_tokens=pad_tokens)
    t, s = b.q.shape[0], b.block_tables.shape[0]
    layout = mgpu.tile_layout(b.query_start_loc, b.kv_lens, b.num_seqs, t=t, s=s, n=n, k=k)
    ref = np.asarray(ragged_paged_attention_reference(*b.args(), sm_scale=0.25))
    # Decode rows and zeroed padding as the decode kernel leaves them, prefill rows poisoned.
    kinds = np.concatenate([np.where(np.asarray(q_lens) == 1, 1, 2).repeat(q_lens),
                            np.zeros(pad_tokens, int)])
    out = np.where((kinds == 2)[:, None, None], np.nan, ref)
    got = _emulate_kernel(layout, ref, out, g=n // k)
    np.testing.assert_array_equal(got, ref)  # exact: every prefill row written, nothing else
    table = np.asarray(layout.table)
    live = table[:, 0] >= 0
    assert live.sum() == sum(-(-q // (2 * 64 // (n // k))) for q in q_lens if q > 1)
    assert (np.diff(table[live, 3]) <= 0).all()  # heaviest (furthest-reaching) tiles first


def test_rank_order_is_the_stable_sort(monkeypatch):
    """The tile table's two orderings (ranks up to _RANK_MAX_TILES tiles, a sort beyond) agree,
    ties (tiles reaching equally far) in sequence order."""
    rng = np.random.default_rng(5)
    key = jnp.asarray(rng.integers(-6, 6, 300).astype(np.int32))
    cols = [jnp.arange(300, dtype=jnp.int32), jnp.asarray(rng.integers(0, 99, 300), jnp.int32)]
    _, *want = jax.lax.sort((key, *cols), num_keys=1, is_stable=True)
    for got, w in zip(mgpu._rank_order(key, cols), want):
        np.testing.assert_array_equal(got, w)
    b = make_batch(rng, q_lens=[1, 37, 300, 1, 64, 2], ctx_lens=[9, 0, 500, 40, 64, 1],
                   num_heads=32, num_kv_heads=8, head_dim=16, block_size=16, dtype=jnp.float32)
    args = (b.query_start_loc, b.kv_lens, b.num_seqs)
    kw = dict(t=b.q.shape[0], s=b.block_tables.shape[0], n=32, k=8)
    ranked = mgpu.tile_layout(*args, **kw)
    monkeypatch.setattr(mgpu, "_RANK_MAX_TILES", 0)
    np.testing.assert_array_equal(mgpu.tile_layout(*args, **kw).table, ranked.table)


@pytest.mark.parametrize("n,k,q_lens,ctx_lens,pad_slots,pad_tokens", [
    (32, 8, [1, 1, 37, 300, 17, 64, 2], [15, 3000, 0, 500, 1234, 63, 1], 2, 2),
    (16, 2, [1, 129, 8, 250], [40, 0, 31, 777], 0, 4),
    (4, 4, [3, 200, 1, 100], [0, 64, 10, 129], 1, 0),
    (8, 8, [1, 1, 1], [5, 6, 7], 0, 5),  # decode only: no tile
    (32, 8, [33, 32, 64, 31], [32, 0, 0, 64], 0, 0),  # tiles reaching equally far: ties
    (32, 8, [2] * 40, [5] * 40, 3, 6),  # more tiles than one table program places
    (8, 8, [1] * 150 + [3] * 120, [4] * 150 + [7] * 120, 30, 0),  # 300 slots: 8 tiles a program
])
def test_triton_tile_table_is_the_xla_one(n, k, q_lens, ctx_lens, pad_slots, pad_tokens):
    """The tile table built by Triton programs (its own launch for prefill-only calls; extra
    programs of the decode kernel otherwise; Pallas interpret mode) holds the entries of
    `tile_layout`'s, in the same order, and the decode rows are unchanged by the extra
    programs."""
    from jaxengine.pallas_kernels import ragged_paged_attention_gpu as rpa

    rng = np.random.default_rng(len(q_lens) * n)
    b = make_batch(rng, q_lens=q_lens, ctx_lens=ctx_lens, num_heads=n, num_kv_heads=k,
                   head_dim=16, block_size=16, dtype=jnp.float32, pad_slots=pad_slots,
                   pad_tokens=pad_tokens)
    t, s = b.q.shape[0], b.block_tables.shape[0]
    meta = (b.query_start_loc, b.kv_lens, b.num_seqs)
    want = mgpu.tile_layout(*meta, t=t, s=s, n=n, k=k)
    count = int(want.count[0])
    dims = rpa._make_dims(b.q, b.k_cache, b.block_tables, Tiling())
    kw = dict(dims=dims, sm_scale=0.25, soft_cap=None, window=None, tiling=Tiling(),
              interpret=True, zero_padding=True)
    rows, none = rpa._decode_rows(*b.args(), table=False, **kw)
    rows_t, in_decode = rpa._decode_rows(*b.args(), table=True, **kw)
    assert none is None
    np.testing.assert_array_equal(np.asarray(rows_t), np.asarray(rows))
    for got in (rpa.tile_table(*meta, t=t, n=n, k=k, interpret=True), in_decode):
        assert int(got.count[0]) == count
        table = np.asarray(got.table)
        np.testing.assert_array_equal(table[:count], np.asarray(want.table)[:count])
        assert len(table) >= len(want.table) and (table[count:, 0] == -1).all()


def _emulate_split_merge(b, layout, out, *, g: int, bkv: int, splits: int, sm_scale: float):
    """What the kernel writes with KV splits: for each live tile, KV head and warpgroup, each
    split CTA's 64 rows (row jj * TQ + r: head jj, token r) over its share of the keys,
    normalised by their own sum, with their log2-sum-exps (rows past the tile's live tokens
    NaN), merged as CTA 0 merges them (`merge_split_rows`); the live tokens' rows go to
    `out`."""
    q = np.asarray(b.q, np.float64)
    kc, vc = np.asarray(b.k_cache, np.float64), np.asarray(b.v_cache, np.float64)
    bt = np.asarray(b.block_tables)
    h = q.shape[2]
    k_heads, p = kc.shape[1], kc.shape[2]
    tq = 64 // g
    table = np.asarray(layout.table)
    count = int(np.asarray(layout.count)[0])
    kv_lens = np.asarray(b.kv_lens)
    for seq, t0, q_end, first_pos in table[:count]:
        pos = np.arange(kv_lens[seq])
        slots = bt[seq, pos // p]
        n_valid = min(q_end - t0, 2 * tq)
        for kh in range(k_heads):
            kk, vv = kc[slots, kh, pos % p], vc[slots, kh, pos % p]
            for w in range(2):
                valid = int(np.clip(n_valid - w * tq, 0, tq))
                rows = np.arange(valid)
                qpos = first_pos + w * tq + rows
                parts = []
                for split in range(splits):
                    lo, hi = (int(x) for x in mgpu.split_range(
                        -(-(first_pos + n_valid) // bkv), split, splits))
                    keys = (pos[None] >= lo * bkv) & (pos[None] < hi * bkv) & (
                        pos[None] <= qpos[:, None])
                    o = np.full((64, h), np.nan)
                    lse = np.full(64, np.nan)
                    for jj in range(g):
                        logits = q[t0 + w * tq + rows, kh * g + jj] @ kk.T * sm_scale
                        logits = np.where(keys, logits, -np.inf)
                        mx = np.max(logits, axis=1, initial=-np.inf)
                        e = np.exp(logits - np.where(np.isfinite(mx), mx, 0)[:, None])
                        tot = e.sum(axis=1)
                        o[jj * tq + rows] = e @ vv / np.maximum(tot, 1e-30)[:, None]
                        lse[jj * tq + rows] = np.where(
                            tot > 0, mx + np.log(np.maximum(tot, 1e-300)), -np.inf) / np.log(2)
                    parts.append((jnp.asarray(lse), jnp.asarray(o)))
                merged = np.asarray(mgpu.merge_split_rows(*parts[0], parts[1:]))
                for jj in range(g):
                    out[t0 + w * tq + rows, kh * g + jj] = merged[jj * tq + rows]
    return out


@pytest.mark.parametrize("n,k,splits,q_lens,ctx_lens", [
    (32, 8, 2, [1, 37, 300, 17, 2], [3000, 0, 500, 1234, 1]),
    (8, 8, 3, [1, 129, 5, 250], [40, 0, 190, 777]),
    (16, 2, 4, [70, 1, 64], [64, 9, 0]),
])
def test_kv_split_rows_merge_to_the_reference(n, k, splits, q_lens, ctx_lens):
    """Tiles whose keys are cut into `splits` ranges (one CTA of a cluster each): the split
    CTAs' rows (emulated in float64, NaN past the live tokens), merged as CTA 0 merges them,
    give the reference on every prefill row; decode and padding rows are kept."""
    rng = np.random.default_rng(splits)
    b = make_batch(rng, q_lens=q_lens, ctx_lens=ctx_lens, num_heads=n, num_kv_heads=k,
                   head_dim=16, block_size=16, dtype=jnp.float32, pad_slots=1, pad_tokens=3)
    t, s = b.q.shape[0], b.block_tables.shape[0]
    layout = mgpu.tile_layout(b.query_start_loc, b.kv_lens, b.num_seqs, t=t, s=s, n=n, k=k)
    ref = np.asarray(ragged_paged_attention_reference(*b.args(), sm_scale=0.25))
    kinds = np.concatenate([np.where(np.asarray(q_lens) == 1, 1, 2).repeat(q_lens),
                            np.zeros(3, int)])
    out = np.where((kinds == 2)[:, None, None], np.nan, ref).astype(np.float64)
    got = _emulate_split_merge(b, layout, out, g=n // k, bkv=64, splits=splits, sm_scale=0.25)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(got[kinds != 2], ref[kinds != 2])


def test_one_tile_table_per_program_however_many_layers():
    """With tile_table="xla", every layer traces its own tile table from the same step
    metadata; XLA keeps one (inlining plus CSE), so the table costs one step, not one per
    layer. Checked on the CPU pipeline."""
    def program(n_layers):
        def layers(qsl, kv_lens, num_seqs, x):
            for _ in range(n_layers):
                layout = mgpu.tile_layout(qsl, kv_lens, num_seqs, t=256, s=16, n=32, k=8)
                x = jnp.sin(x + layout.table.sum() + layout.count[0])  # a layer between
            return x
        return layers

    args = (np.arange(17, dtype=np.int32) * 4, np.full(16, 100, np.int32),
            np.array([16], np.int32), np.float32(0))

    def table_ops(n_layers):  # the reductions (ranks, cumsum, ordering) and any sort
        hlo = jax.jit(program(n_layers)).lower(*args).compile().as_text()
        return hlo.count(" reduce(") + hlo.count(" sort(")

    assert table_ops(1) > 0
    assert table_ops(4) == table_ops(1)


def test_split_steps_and_grid_sizes():
    for steps in range(0, 12):
        for splits in range(1, 5):
            ranges = [mgpu.split_steps(steps, sp, splits) for sp in range(splits)]
            assert [r for lo, hi in ranges for r in range(lo, hi)] == list(range(steps))
            assert steps == 0 or ranges[0][1] > 0  # split 0 has a step
            # What a split CTA takes: the same cover; short tiles whole in split 0.
            taken = [tuple(int(x) for x in mgpu.split_range(steps, sp, splits))
                     for sp in range(splits)]
            assert [r for lo, hi in taken for r in range(lo, hi)] == list(range(steps))
            if splits > 1 and steps < 2 * splits:
                assert taken[0] == (0, steps)
    tiling = mgpu.MosaicTiling()
    # 256 rows, G = 4 (32-token tiles), 8 KV heads: 64 items fill half of 132 SMs -> 2 splits.
    assert mgpu.kv_splits(256, 8, 4, tiling) == 2
    assert mgpu.kv_splits(2048, 8, 4, tiling) == 1
    assert mgpu.kv_splits(128, 8, 4, tiling) == 4  # 32 items: capped at 4
    assert mgpu.kv_splits(64, 8, 4, tiling) == 1  # decode-sized buckets: no merge launch
    assert mgpu.kv_splits(256, 8, 4, mgpu.MosaicTiling(kv_splits=1)) == 1
    # 256 slots: the item bound counts 128 partial tiles; the grid stops at 8 x 8 + 132.
    # Persistent (the default): one CTA per SM, fewer when the item bound is smaller.
    assert mgpu.grid_clusters(256, 256, 8, 4, 1, tiling) == 132
    assert mgpu.grid_clusters(64, 1, 8, 4, 1, tiling) == 8 * 3  # 2 tiles + 1 partial
    assert mgpu.grid_clusters(256, 256, 8, 4, 2, tiling) == 66  # clusters of 2 CTAs
    assert mgpu.grid_clusters(256, 256, 8, 4, 4, mgpu.MosaicTiling(num_ctas=64)) == 16
    # One CTA per item: the rows' own items plus one CTA (or cluster) per SM.
    per_item = mgpu.MosaicTiling(persistent=False)
    assert mgpu.grid_clusters(256, 256, 8, 4, 1, per_item) == 8 * 8 + 132
    assert mgpu.grid_clusters(256, 1, 8, 4, 1, per_item) == 8 * 9
    assert mgpu.grid_clusters(256, 256, 8, 4, 2, per_item) == 8 * 8 + 66
    with pytest.raises(ValueError, match="kv_splits must be in"):
        mgpu.MosaicTiling(kv_splits=5)


@pytest.mark.parametrize("walkers", [1, 3, 132])
def test_snake_order_takes_every_item_once_and_balances(walkers):
    for n_items in range(0, 3 * walkers + 2):
        taken = [int(mgpu.snake_item(c, j, walkers)) for c in range(walkers)
                 for j in range(int(mgpu.snake_count(c, n_items, walkers)))]
        assert sorted(taken) == list(range(n_items))
    # 1024 new tokens, no context, G = 4, 8 KV heads: 256 items of 8, 8, .., 1 steps (32 of
    # each), heaviest first, on 132 persistent CTAs. Round-robin gives one CTA 12 steps; the
    # snake order 9 (the mean is 8.7).
    if walkers == 132:
        steps = [8 - i // 32 for i in range(256)]
        worst = max(sum(steps[int(mgpu.snake_item(c, j, walkers))]
                        for j in range(int(mgpu.snake_count(c, 256, walkers))))
                    for c in range(walkers))
        assert worst == 9


def test_softmax_steps_give_the_softmax():
    """The online softmax step (running max in scaled base-2 units, one multiply-add per
    probability), step by step over a row block with masked keys, against the softmax."""
    rng = np.random.default_rng(0)
    s = rng.normal(size=(64, 384)).astype(np.float32) * 4
    s[:, 300:] = -np.inf  # masked keys
    v = rng.normal(size=(384, 32)).astype(np.float32)
    scale = 0.125 * np.log2(np.e)
    acc = jnp.zeros((64, 32), jnp.float32)
    m_i, l_i = jnp.full((64,), -jnp.inf), jnp.zeros((64,))
    for i in range(3):
        blk = slice(128 * i, 128 * (i + 1))
        acc, m_i, l_i, p = mgpu.softmax_step(jnp.asarray(s[:, blk]), scale, acc, m_i, l_i,
                                             jnp.float32)
        acc = acc + p @ v[blk]
    want = jax.nn.softmax(jnp.asarray(s) * 0.125, axis=1) @ v
    np.testing.assert_allclose(acc / l_i[:, None], want, rtol=1e-5, atol=1e-5)
    # The row log2-sum-exp the split merge uses.
    lse = m_i + jnp.log2(l_i)
    np.testing.assert_allclose(lse, jax.nn.logsumexp(jnp.asarray(s) * 0.125, axis=1) / np.log(2),
                               rtol=1e-5)


@pytest.mark.parametrize("n", range(0, 17))
def test_pow2_chunks_partition_the_rows(n):
    chunks = [(b, start) for b, start, present in mgpu.pow2_chunks(n, 16) if present]
    rows = [r for b, start in chunks for r in range(start, start + b)]
    assert rows == list(range(n))


@pytest.mark.parametrize("n,k,h,p,grid,splits,prefill_only", [
    (32, 8, 128, 16, {}, 1, False),
    (32, 8, 128, 16, {}, 2, False),
    (16, 2, 64, 32, {"num_ctas": 3}, 3, False),
    (32, 8, 128, 16, {"persistent": False}, 1, False),
    (32, 8, 128, 16, {}, 1, True),
    (32, 8, 128, 16, {"persistent": False}, 2, True),
    # Q.K^T of step i and P.V of step i-1 in flight over the softmax.
    (32, 8, 128, 16, {"overlap": True}, 1, False),
    (16, 2, 64, 32, {"overlap": True}, 2, True),
])
def test_mosaic_prefill_lowers_for_cuda(n, k, h, p, grid, splits, prefill_only):
    t, s, m, blocks = 64, 4, 16, 64
    sd = jax.ShapeDtypeStruct
    args = (sd((t, n, h), jnp.bfloat16), sd((blocks, k, p, h), jnp.bfloat16),
            sd((blocks, k, p, h), jnp.bfloat16), sd((s,), jnp.int32), sd((s, m), jnp.int32),
            sd((s + 1,), jnp.int32), sd((1,), jnp.int32))
    tiling = Tiling(mosaic=mgpu.MosaicTiling(kv_splits=splits, **grid))
    with abstract_h100():
        lowered = ragged_paged_attention_gpu.trace(
            *args, sm_scale=h ** -0.5, prefill="mosaic", tiling=tiling,
            prefill_only=prefill_only).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "mosaic_gpu" in text
    # The tile table comes from Triton programs, not XLA reductions.
    assert "stablehlo.reduce" not in text and "stablehlo.sort" not in text
    if prefill_only:
        # No decode kernel before it (the table has a launch of its own); the kernel fills a
        # fresh buffer.
        assert "rpa_decode" not in text and "rpa_tile_table" in text
        assert "output_operand_alias" not in text.split("mosaic_gpu", 1)[1]
    else:
        # The decode kernel builds the table; the Mosaic kernel writes its rows into the
        # decode kernel's output in place.
        assert "rpa_decode" in text and "rpa_tile_table" not in text
        assert "output_operand_alias" in text.split("mosaic_gpu", 1)[1]


def test_wide_slot_counts_give_the_table_a_launch_of_its_own():
    """Up to FUSED_TABLE_MAX_SLOTS slots the decode kernel's programs build the tile table; for
    more, `rpa_tile_table` runs beside it (its slot-wide vectors stay out of the decode
    kernel's registers)."""
    from jaxengine.pallas_kernels import ragged_paged_attention_gpu as rpa

    def kernels(s):
        t, m, blocks, n, k, h, p = 512, 8, 64, 32, 8, 128, 16
        sd = jax.ShapeDtypeStruct
        args = (sd((t, n, h), jnp.bfloat16), sd((blocks, k, p, h), jnp.bfloat16),
                sd((blocks, k, p, h), jnp.bfloat16), sd((s,), jnp.int32), sd((s, m), jnp.int32),
                sd((s + 1,), jnp.int32), sd((1,), jnp.int32))
        with abstract_h100():
            text = ragged_paged_attention_gpu.trace(*args, sm_scale=h ** -0.5, prefill="mosaic"
                                                    ).lower(lowering_platforms=("cuda",)).as_text()
        return "rpa_decode" in text, "rpa_tile_table" in text

    assert kernels(rpa.FUSED_TABLE_MAX_SLOTS) == (True, False)
    assert kernels(rpa.FUSED_TABLE_MAX_SLOTS + 1) == (True, True)


def test_profiling_is_off_unless_a_folder_is_given():
    """Mosaic GPU's in-kernel profiler only with MosaicTiling.profile_dir (diagnostics: it adds
    a trace buffer and a host callback); by default the kernels are compiled without it."""
    off = mgpu.compiler_params("")
    assert off.profile_space == 0 and off.approx_math
    on = mgpu.compiler_params("/tmp/traces", 32)
    assert on.profile_space == 32 and on.profile_dir == "/tmp/traces" and on.approx_math


def test_named_phases_leave_the_kernels_unchanged(monkeypatch):
    """The kernels' `jax.named_scope` phases (for the profiler) change nothing when profiling is
    off: the Mosaic modules (prefill after the decode kernel, prefill-only), printed without
    debug info, are the same with the scopes as with every scope made a no-op."""
    sd = jax.ShapeDtypeStruct
    t, s, m, blocks, n, k, h, p = 256, 8, 16, 64, 32, 8, 128, 16
    args = (sd((t, n, h), jnp.bfloat16), sd((blocks, k, p, h), jnp.bfloat16),
            sd((blocks, k, p, h), jnp.bfloat16), sd((s,), jnp.int32), sd((s, m), jnp.int32),
            sd((s + 1,), jnp.int32), sd((1,), jnp.int32))

    def lower_calls() -> None:
        for prefill_only in (False, True):
            ragged_paged_attention_gpu.trace(*args, sm_scale=h ** -0.5, prefill="mosaic",
                                             prefill_only=prefill_only).lower(lowering_platforms=("cuda",))

    with_scopes, without = mosaic_modules_with_and_without_scopes(monkeypatch, lower_calls)
    assert len(with_scopes) == 2 and with_scopes == without


def test_smem_budget_decides_support():
    tiling = mgpu.MosaicTiling()
    assert mgpu.supported(jnp.bfloat16, 128, 4, 16, None, None, tiling)
    assert not mgpu.supported(jnp.bfloat16, 256, 4, 16, None, None, tiling)  # 384 KiB of smem
    assert not mgpu.supported(jnp.bfloat16, 128, 4, 16, None, None,
                              mgpu.MosaicTiling(block_kv=256))  # 320 KiB


def test_kernel_choice_errors():
    """prefill= takes triton / mosaic / auto; "mosaic" where it cannot serve the call (soft
    cap; the interpreter) is a ValueError naming the option. The decode rows have no choice
    (the Triton kernel): decode= is not an argument."""
    rng = np.random.default_rng(0)
    b = make_batch(rng, q_lens=[1, 9], ctx_lens=[3, 4], num_heads=8, num_kv_heads=2,
                   head_dim=64, block_size=16, dtype=jnp.bfloat16, pad_tokens=6)
    with pytest.raises(ValueError, match="prefill must be 'triton', 'mosaic' or 'auto'"):
        ragged_paged_attention_gpu(*b.args(), sm_scale=0.1, prefill="cuda")
    with pytest.raises(ValueError, match="prefill='mosaic' cannot serve this call"):
        ragged_paged_attention_gpu(*b.args(), sm_scale=0.1, soft_cap=30.0, prefill="mosaic")
    with pytest.raises(ValueError, match="prefill='mosaic' cannot serve this call"):
        ragged_paged_attention_gpu(*b.args(), sm_scale=0.1, interpret=True, prefill="mosaic")
    with pytest.raises(TypeError, match="decode"):
        ragged_paged_attention_gpu(*b.args(), sm_scale=0.1, decode="triton")


def test_prefill_option_errors():
    with pytest.raises(ValueError, match="block_kv must be a multiple of 64"):
        mgpu.MosaicTiling(block_kv=96)
    with pytest.raises(ValueError, match="tile_table must be 'triton' or 'xla'"):
        mgpu.MosaicTiling(tile_table="sort")
    assert EngineConfig(attention_backend="pallas-mosaic").attention_backend == "pallas-mosaic"
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="mosaic")


def test_pallas_mosaic_backend_off_gpu_is_the_reference():
    rng = np.random.default_rng(1)
    b = make_batch(rng, q_lens=[1, 20], ctx_lens=[7, 30], num_heads=4, num_kv_heads=2,
                   head_dim=16, block_size=16, dtype=jnp.float32)
    cfg = ModelConfig("LlamaForCausalLM", vocab_size=8, hidden_size=32, intermediate_size=8, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=16)
    got = select_attention_backend("pallas-mosaic", cfg, jnp.float32, 16).fn(*b.args(), sm_scale=0.25)
    ref = ragged_paged_attention_reference(*b.args(), sm_scale=0.25)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-6, atol=1e-6)
