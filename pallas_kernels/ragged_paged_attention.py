"""Ragged paged attention: the contract every implementation serves, its jnp reference, the CPU
path and the KV write.

Legend: T tokens in the flat batch, S sequence slots, N query heads, K KV heads, G = N // K,
H head dim, B blocks in the pool, P block size, M max blocks per sequence.

Inputs (all fixed-shape; live counts are runtime values so padding costs nothing):
  q               [T, N, H]   queries, decode rows first then prefill chunks, padding last
  k_cache/v_cache [B, K, P, H] one layer's cache; block 0 is the null block
  kv_lens         [S] int32   context so far + this step's new tokens; 0 for padded slots
  block_tables    [S, M] int32 block ids of each sequence, padded with 0
  query_start_loc [S + 1] int32 cumulative query lengths (cu_q_lens); padded slots repeat the end
  num_seqs        [1] int32   number of live sequences
Token j of sequence s (0 <= j < q_len[s]) sits at absolute position kv_lens[s] - q_len[s] + j and
attends causally to positions <= its own (and > pos - sliding_window when a window is given).
Rows of padding tokens (t >= query_start_loc[num_seqs]) are returned as zeros.

Logits are (q . k) * sm_scale; with soft_cap they become soft_cap * tanh(logits / soft_cap)
before the softmax. A sliding window W keeps the W most recent positions, the token's own
included. Query head n reads KV head n // G. A sequence with q_len 1 is a decode row wherever it
sits in the batch (a one-token prefill chunk is the same computation).

Implementations: the Pallas GPU kernels of ragged_paged_attention_gpu.py (on an NVIDIA GPU of
sm_80+, `gpu_backend.get_kernel()`); `ragged_paged_attention_cpu` (tiles of one sequence's rows
as batched matmuls, which XLA's CPU backend runs better than the reference's per-block gathers; a
step of one live sequence as a single tile);
the jnp reference below. Which one a model runs is chosen once, outside the kernels, by the
engine's attention backend (jaxengine/attention_backend.py). The reference's einsums use XLA's
default precision, which on a GPU is TF32 for float32 inputs (~3e-4 relative error); the kernel
computes float32 products in full precision.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_MASK_VALUE = -1e30
# Token rows from which the CPU's one-sequence path takes `long_chunk_blocks` keys a loop step.
_LONG_TILE_ROWS = 128


def write_kv(k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Scatters new keys/values [T, K, H] into cache slots (block * P + offset) [T].

    Padding tokens carry slot 0..P-1 of the null block 0, which no live sequence reads.
    Under jit with the caches donated, XLA updates them in place.

    The scatter is declared `unique_indices`: live tokens never share a slot, and where padding
    tokens share a null-block slot, which of their (finite) rows lands there does not matter.
    On the GPU this lets XLA store the rows without its duplicate-safe scatter
    (lab/gpu_checks/kv_write_probe.py).
    """
    p = k_cache.shape[2]
    blk = slot_mapping // p
    off = slot_mapping % p
    k_cache = k_cache.at[blk, :, off].set(_to_cache(k, k_cache.dtype), unique_indices=True)
    v_cache = v_cache.at[blk, :, off].set(_to_cache(v, v_cache.dtype), unique_indices=True)
    return k_cache, v_cache


def _to_cache(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """x in the cache's dtype; an fp8 cache (the values already divided by its scale) saturates at its largest finite value
    instead of overflowing to NaN."""
    if jnp.dtype(dtype).itemsize == 1 and jnp.issubdtype(dtype, jnp.floating):
        top = float(jnp.finfo(dtype).max)
        x = jnp.clip(x.astype(jnp.float32), -top, top)
    return x.astype(dtype)


def token_positions(query_start_loc: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array,
                    num_tokens: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per token: (sequence slot [T], absolute position [T], is-live mask [T])."""
    s = kv_lens.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq_id = jnp.searchsorted(query_start_loc[1:], t, side="right").astype(jnp.int32)
    seq_id = jnp.minimum(seq_id, s - 1)
    live = t < query_start_loc[num_seqs[0]]
    q_len = query_start_loc[seq_id + 1] - query_start_loc[seq_id]
    pos = kv_lens[seq_id] - q_len + (t - query_start_loc[seq_id])
    return seq_id, pos, live


def ragged_paged_attention_reference(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, kv_lens: jax.Array,
    block_tables: jax.Array, query_start_loc: jax.Array, num_seqs: jax.Array, *,
    sm_scale: float, soft_cap: float | None = None, sliding_window: int | None = None,
) -> jax.Array:
    """Pure-jnp paged attention: online softmax over KV blocks, one block per loop step.

    The loop runs to the longest live sequence (a runtime bound), so padded slots cost nothing.
    Memory per step is O(T * K * P * H); works for any mix of decode and prefill rows.
    """
    t_, n, h = q.shape
    _, k_, p, _ = k_cache.shape
    g = n // k_
    seq_id, pos, live = token_positions(query_start_loc, kv_lens, num_seqs, t_)
    qg = q.reshape(t_, k_, g, h).astype(jnp.float32) * sm_scale
    live_lens = jnp.where(jnp.arange(kv_lens.shape[0]) < num_seqs[0], kv_lens, 0)
    n_blocks = (jnp.max(live_lens) + p - 1) // p
    tables = block_tables[seq_id]  # [T, M]

    def body(j, carry):
        m, l, acc = carry
        blk = tables[:, j]
        kb = k_cache[blk].astype(jnp.float32)  # [T, K, P, H]
        vb = v_cache[blk].astype(jnp.float32)
        s = jnp.einsum("tkgh,tkph->tkgp", qg, kb)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kpos = j * p + jnp.arange(p, dtype=jnp.int32)
        mask = (kpos[None, :] <= pos[:, None]) & live[:, None]
        if sliding_window is not None:
            mask &= kpos[None, :] > pos[:, None] - sliding_window
        mask = mask[:, None, None, :]
        s = jnp.where(mask, s, _MASK_VALUE)
        m_new = jnp.maximum(m, s.max(-1))
        pr = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = l * alpha + pr.sum(-1)
        acc = acc * alpha[..., None] + jnp.einsum("tkgp,tkph->tkgh", pr, vb)
        return m_new, l, acc

    init = (jnp.full((t_, k_, g), _MASK_VALUE, jnp.float32), jnp.zeros((t_, k_, g), jnp.float32),
            jnp.zeros((t_, k_, g, h), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, n_blocks, body, init)
    out = jnp.where(l[..., None] > 0, acc / jnp.maximum(l, 1e-30)[..., None], 0.0)
    return out.reshape(t_, n, h).astype(q.dtype)


def _cpu_tiling(num_tokens: int, num_slots: int) -> tuple[int, int]:
    """(query rows per tile, tiles per group). A decode row is a tile of its own; buckets that must
    hold prefill chunks take tiles of up to 16 rows (fewer, larger matmuls, at most ~2x rows of
    padding). Groups keep one loop step's blocks and scores within the L2 cache (measured best on
    SmolLM2's shapes: 8 decode tiles, or 64 rows, per group)."""
    if num_tokens <= 2 * num_slots:
        return 1, 8
    rows = min(16, max(1, num_tokens // max(num_slots, 1)))
    return rows, max(1, 64 // rows)


def ragged_paged_attention_cpu(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, kv_lens: jax.Array,
    block_tables: jax.Array, query_start_loc: jax.Array, num_seqs: jax.Array, *,
    sm_scale: float, soft_cap: float | None = None, sliding_window: int | None = None,
    tile_rows: int | None = None, group: int | None = None, chunk_blocks: int = 2,
    single_chunk_blocks: int | None = 8, long_chunk_blocks: int = 32,
) -> jax.Array:
    """Paged attention shaped as batched matmuls, for XLA's CPU backend (same contract as the
    reference, and faster than it there).

    A step of one live sequence (batch-1 decode, a long prompt's chunks) runs
    `_one_sequence_attention` (all its rows as one tile, `single_chunk_blocks` blocks per loop
    step, or `long_chunk_blocks` in programs of at least `_LONG_TILE_ROWS` token rows, where a
    prompt's chunk amortises a larger gather over many rows); any other step the tiled path below
    (`single_chunk_blocks=None`: always the tiled path). Both are compiled into the program;
    `lax.cond` runs one of them.
    """
    kw = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window)
    args = (q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs)
    tiled = functools.partial(_tiled_attention, tile_rows=tile_rows, group=group, chunk_blocks=chunk_blocks, **kw)
    if single_chunk_blocks is None:
        return tiled(*args)
    blocks = long_chunk_blocks if q.shape[0] >= _LONG_TILE_ROWS else single_chunk_blocks
    one = functools.partial(_one_sequence_attention, chunk_blocks=blocks, **kw)
    return jax.lax.cond(num_seqs[0] == 1, one, tiled, *args)


def _one_sequence_attention(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, kv_lens: jax.Array,
    block_tables: jax.Array, query_start_loc: jax.Array, num_seqs: jax.Array, *,
    sm_scale: float, soft_cap: float | None, sliding_window: int | None, chunk_blocks: int,
) -> jax.Array:
    """The contract's attention when sequence slot 0 is the only live one (num_seqs == 1): its
    q_len = query_start_loc[1] rows are one tile, [K, T * G, H]. A loop over its context, C =
    chunk_blocks * P keys a step, gathers each block once and multiplies it with every row and
    head (scores [K, T * G, C]), with an online softmax across steps; it stops at kv_lens[0].
    A long prompt's 512-row chunk thus reads its context once per layer, not once per tile.

    Steps whose keys every row sees (before the first new token, without a sliding window) run
    without a mask; only the steps on the diagonal build one. Each row's keys end at
    min(its position, kv_len - 1), so padding rows read written keys only (their output is then
    set to zero); a live row always sees key 0 or its window's first key, so each row's
    normaliser is positive when the loop ends.
    """
    t_, n, h = q.shape
    _, k_, p, _ = k_cache.shape
    g = n // k_
    cb, c_tok = chunk_blocks, chunk_blocks * p
    q_len, kv_len = query_start_loc[1], kv_lens[0]
    r = jnp.arange(t_, dtype=jnp.int32)
    pos = kv_len - q_len + r  # [T]
    last_key = jnp.minimum(pos, kv_len - 1)  # padding rows stop at the context's end
    qg = (q.astype(jnp.float32) * sm_scale).reshape(t_, k_, g, h).transpose(1, 0, 2, 3).reshape(k_, t_ * g, h)
    table = jnp.pad(block_tables[0], (0, -block_tables.shape[1] % cb))

    def step(c, carry, masked: bool):
        m, l, acc = carry
        blk = jax.lax.dynamic_slice_in_dim(table, c * cb, cb)  # [cb]
        kb = k_cache[blk].astype(jnp.float32)  # [cb, K, P, H]
        vb = v_cache[blk].astype(jnp.float32)
        s = jnp.einsum("krh,bkph->krbp", qg, kb).reshape(k_, t_ * g, c_tok)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        if masked:
            kpos = c * c_tok + jnp.arange(c_tok, dtype=jnp.int32)
            mask = kpos[None, :] <= last_key[:, None]  # [T, C]
            if sliding_window is not None:
                mask &= kpos[None, :] > pos[:, None] - sliding_window
            mask = jnp.broadcast_to(mask[:, None, :], (t_, g, c_tok)).reshape(t_ * g, c_tok)
            s = jnp.where(mask[None], s, _MASK_VALUE)
        # A row whose keys so far are all masked has m_new = _MASK_VALUE and sums ones here; its
        # first visible key makes alpha exp(_MASK_VALUE - m) = 0, which clears them.
        m_new = jnp.maximum(m, s.max(-1))
        pr = jnp.exp(s - m_new[..., None])
        alpha = jnp.exp(m - m_new)
        l = l * alpha + pr.sum(-1)
        pv = jnp.einsum("krbp,bkph->krh", pr.reshape(k_, t_ * g, cb, p), vb)
        return m_new, l, acc * alpha[..., None] + pv

    shape = (k_, t_ * g)
    carry = (jnp.full(shape, _MASK_VALUE, jnp.float32), jnp.zeros(shape, jnp.float32),
             jnp.zeros(shape + (h,), jnp.float32))
    end = (kv_len + c_tok - 1) // c_tok
    if sliding_window is None:
        full = (kv_len - q_len + 1) // c_tok  # steps wholly at or before the first new token
        carry = jax.lax.fori_loop(0, full, functools.partial(step, masked=False), carry)
    else:
        full = jnp.maximum(kv_len - q_len - sliding_window + 1, 0) // c_tok
    _, l, acc = jax.lax.fori_loop(full, end, functools.partial(step, masked=True), carry)
    live = (r < q_len)[:, None, None]
    o = (acc / l[..., None]).reshape(k_, t_, g, h).transpose(1, 0, 2, 3).reshape(t_, n, h)
    return jnp.where(live, o, 0.0).astype(q.dtype)


def _tiled_attention(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, kv_lens: jax.Array,
    block_tables: jax.Array, query_start_loc: jax.Array, num_seqs: jax.Array, *,
    sm_scale: float, soft_cap: float | None = None, sliding_window: int | None = None,
    tile_rows: int | None = None, group: int | None = None, chunk_blocks: int = 2,
) -> jax.Array:
    """The tiled path of `ragged_paged_attention_cpu`, for any step.

    The new tokens are cut into tiles of `tile_rows` consecutive rows of one sequence (a decode
    row is a tile of its own): at most I = (T + min(S, T) * (tile_rows - 1)) // tile_rows tiles, a
    static bound. Tiles are sorted by context length, longest first, and taken `group` at a time:
    for each group a loop over its context in steps of `chunk_blocks` blocks gathers those blocks
    once per tile and multiplies them with all the tile's rows and heads at once, with an online
    softmax across steps. Each group's loop stops at its own longest context, so short sequences
    do not pay for long ones, and groups past the live tiles do not run.
    """
    t_, n, h = q.shape
    _, k_, p, _ = k_cache.shape
    s_, m_ = block_tables.shape
    g = n // k_
    auto_rows, auto_group = _cpu_tiling(t_, s_)
    qt, grp = tile_rows or auto_rows, group or auto_group
    n_items = (t_ + min(s_, t_) * (qt - 1)) // qt
    n_groups = -(-n_items // grp)
    n_pad = n_groups * grp  # tiles, padded to whole groups
    cb, c_tok = chunk_blocks, chunk_blocks * p

    # Tiles: tile i is rows j0 .. j0 + n_rows - 1 of sequence item_seq's new tokens.
    slot = jnp.arange(s_, dtype=jnp.int32)
    q_lens = jnp.where(slot < num_seqs[0], query_start_loc[1:] - query_start_loc[:-1], 0)
    tiles = (q_lens + qt - 1) // qt
    tile_end = jnp.cumsum(tiles)
    tile_start = tile_end - tiles
    item = jnp.arange(n_items, dtype=jnp.int32)
    item_seq = jnp.minimum(jnp.searchsorted(tile_end, item, side="right"), s_ - 1).astype(jnp.int32)
    j0 = (item - tile_start[item_seq]) * qt
    n_rows = jnp.where(item < tile_end[-1], jnp.clip(q_lens[item_seq] - j0, 0, qt), 0)
    r = jnp.arange(qt, dtype=jnp.int32)
    row_ok = r[None, :] < n_rows[:, None]  # [I, qt]
    rows = jnp.where(row_ok, query_start_loc[item_seq][:, None] + j0[:, None] + r[None, :], 0)
    qpos = (kv_lens[item_seq] - q_lens[item_seq] + j0)[:, None] + r[None, :]  # [I, qt]
    kv_end = jnp.where(n_rows > 0, qpos[:, 0] + n_rows, 0)  # keys the tile reads

    # Sorted order, padded to whole groups with empty tiles (kv_end 0, no live rows).
    order = jnp.argsort(-kv_end).astype(jnp.int32)
    order = jnp.concatenate([order, jnp.zeros((n_pad - n_items,), jnp.int32)])
    real = jnp.arange(n_pad) < n_items
    kv_end_s = jnp.where(real, kv_end[order], 0).reshape(n_groups, grp)
    group_chunks = (kv_end_s.max(1) + c_tok - 1) // c_tok  # [n_groups]
    live_groups = (jnp.sum(kv_end > 0) + grp - 1) // grp
    # Loop-invariant operands laid out for the matmuls once: q as [.., K, qt * G, H].
    qi = (q[rows[order]].astype(jnp.float32) * sm_scale).reshape(n_groups, grp, qt, k_, g, h)
    qi = qi.transpose(0, 1, 3, 2, 4, 5).reshape(n_groups, grp, k_, qt * g, h)
    tables = jnp.pad(block_tables, ((0, 0), (0, -m_ % cb)))[item_seq[order]].reshape(n_groups, grp, -1)
    qpos_s = qpos[order].reshape(n_groups, grp, qt)
    ok_s = (row_ok[order] & real[:, None]).reshape(n_groups, grp, qt)

    def group_body(gi, out):
        qg, tg, pg, okg = qi[gi], tables[gi], qpos_s[gi], ok_s[gi]

        def body(c, carry):
            m, l, acc = carry
            blk = jax.lax.dynamic_slice_in_dim(tg, c * cb, cb, axis=1)  # [grp, cb]
            kb = k_cache[blk].astype(jnp.float32)  # [grp, cb, K, P, H]
            vb = v_cache[blk].astype(jnp.float32)
            s = jnp.einsum("ikrh,ibkph->ikrbp", qg, kb).reshape(grp, k_, qt, g, c_tok)
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            kpos = c * c_tok + jnp.arange(c_tok, dtype=jnp.int32)
            mask = (kpos[None, None, :] <= pg[:, :, None]) & okg[:, :, None]  # [grp, qt, C]
            if sliding_window is not None:
                mask &= kpos[None, None, :] > pg[:, :, None] - sliding_window
            mask = mask[:, None, :, None, :]
            s = jnp.where(mask, s, _MASK_VALUE)
            m_new = jnp.maximum(m, s.max(-1))
            pr = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            l = l * alpha + pr.sum(-1)
            pv = jnp.einsum("ikqgbp,ibkph->ikqgh", pr.reshape(grp, k_, qt, g, cb, p), vb)
            return m_new, l, acc * alpha[..., None] + pv

        shape = (grp, k_, qt, g)
        init = (jnp.full(shape, _MASK_VALUE, jnp.float32), jnp.zeros(shape, jnp.float32),
                jnp.zeros(shape + (h,), jnp.float32))
        _, l, acc = jax.lax.fori_loop(0, group_chunks[gi], body, init)
        o = jnp.where(l[..., None] > 0, acc / jnp.maximum(l, 1e-30)[..., None], 0.0)
        return jax.lax.dynamic_update_slice_in_dim(out, o[None], gi, axis=0)

    out = jnp.zeros((n_groups, grp, k_, qt, g, h), jnp.float32)
    out = jax.lax.fori_loop(0, live_groups, group_body, out)
    out = out.transpose(0, 1, 3, 2, 4, 5).reshape(n_pad * qt, n, h)  # sorted tiles' rows

    # Token t is row `within % qt` of tile tile_start[seq] + within // qt, found at its sorted place.
    sorted_at = jnp.zeros((n_items,), jnp.int32).at[order[:n_items]].set(jnp.arange(n_items, dtype=jnp.int32))
    seq_id, _, live = token_positions(query_start_loc, kv_lens, num_seqs, t_)
    within = jnp.arange(t_, dtype=jnp.int32) - query_start_loc[seq_id]
    tile = jnp.clip(tile_start[seq_id] + within // qt, 0, n_items - 1)
    src = jnp.where(live, sorted_at[tile] * qt + within % qt, 0)
    out = jnp.where(live[:, None, None], out[src], 0.0)
    return out.astype(q.dtype)

