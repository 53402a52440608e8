"""The decode-only steps' one-launch kernel (rotary embedding, cache write, attention), run
through Pallas' interpreter on the CPU, against the three steps it replaces: the model's
rotation (models.layers.apply_rotary), `write_kv` and the jnp reference attention."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.models.layers import apply_rotary
from jaxengine.pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference, write_kv
from jaxengine.pallas_kernels.ragged_paged_attention_gpu import Tiling, decode_attention_rope_write
from tests.kernels.batch_factory import make_batch


def _case(rng, *, ctx_lens, n, k, h, p, dtype, pad_tokens=3, rotary=None, cache_dtype=None):
    """A decode-only step: one new token after each context (its slot: position kv_len - 1),
    un-rotated q/k/v rows, angles of each token's position, padding tokens at the null block."""
    b = make_batch(rng, q_lens=[1] * len(ctx_lens), ctx_lens=ctx_lens, num_heads=n, num_kv_heads=k,
                   head_dim=h, block_size=p, dtype=dtype, pad_slots=2, pad_tokens=pad_tokens)
    t = b.q.shape[0]
    live = len(ctx_lens)
    tables = np.asarray(b.block_tables)
    pos = np.zeros(t, np.int64)
    pos[:live] = ctx_lens
    slots = np.zeros(t, np.int32)
    slots[:live] = [tables[i, c // p] * p + c % p for i, c in enumerate(ctx_lens)]
    slots[live:] = np.arange(t - live) % p  # the null block's slots
    qkv = jnp.asarray(rng.standard_normal((t, n + 2 * k, h)), dtype)
    half = (rotary or h) // 2
    freqs = pos[:, None] * (10000.0 ** (-np.arange(half) / half))[None, :]
    cos, sin = jnp.asarray(np.cos(freqs), jnp.float32), jnp.asarray(np.sin(freqs), jnp.float32)
    kc, vc = b.k_cache, b.v_cache
    if cache_dtype is not None:
        kc, vc = kc.astype(cache_dtype), vc.astype(cache_dtype)
    return b, qkv, kc, vc, jnp.asarray(slots), cos, sin


def _reference(b, qkv, kc, vc, slots, cos, sin, n, k, **kw):
    q, kn, vn = qkv[:, :n], qkv[:, n:n + k], qkv[:, n + k:]
    q, kn = apply_rotary(q, cos, sin), apply_rotary(kn, cos, sin)
    kc, vc = write_kv(kc, vc, kn, vn, slots)
    o = ragged_paged_attention_reference(q, kc, vc, b.kv_lens, b.block_tables, b.query_start_loc, b.num_seqs, **kw)
    return o, kc, vc


def _run(b, qkv, kc, vc, slots, cos, sin, **kw):
    return decode_attention_rope_write(qkv, kc, vc, b.kv_lens, b.block_tables, b.query_start_loc, b.num_seqs,
                                       slots, cos, sin, interpret=True, **kw)


def _f64(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


# (block size, query heads, KV heads, head dim, dtype, rotary dim)
_GRID = [
    (16, 8, 2, 64, jnp.float32, None),
    (16, 32, 8, 128, jnp.bfloat16, None),
    (16, 9, 3, 64, jnp.bfloat16, None),  # G = 3 (SmolLM2)
    (32, 8, 4, 64, jnp.float32, 32),  # partial rotary: the last 32 columns pass through
]


@pytest.mark.parametrize("p,n,k,h,dtype,rotary", _GRID)
def test_matches_rotate_write_attend(p, n, k, h, dtype, rotary):
    """Contexts of 0, P-1, P (the new token opens a page) and several pages: the output matches
    the reference's, the caches hold exactly what write_kv writes (live tokens' rotated keys and
    values, nothing else changed: the padding tokens write nothing)."""
    rng = np.random.default_rng(p + n + k + h)
    ctx = [0, p - 1, p, 3 * p + 5, 7]
    b, qkv, kc, vc, slots, cos, sin = _case(rng, ctx_lens=ctx, n=n, k=k, h=h, p=p, dtype=dtype, rotary=rotary)
    sm = h ** -0.5
    o, kc2, vc2 = _run(b, qkv, kc, vc, slots, cos, sin, sm_scale=sm)
    ro, rkc, rvc = _reference(b, qkv, kc, vc, slots, cos, sin, n, k, sm_scale=sm)
    live = len(ctx)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    got, want = _f64(o), _f64(ro)
    assert not np.isnan(got).any()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < tol
    assert (got[live:] == 0).all(), "padding rows are zeros"
    # Every cache slot but the live tokens' is unchanged; those hold the rotated rows (rounded
    # once to the cache's type: equal to the reference's, or one unit in the last place off).
    written = np.zeros(kc.shape[0] * kc.shape[2], bool)
    written[np.asarray(slots)[:live]] = True
    written = written.reshape(kc.shape[0], 1, kc.shape[2], 1)
    for got_c, want_c, before in ((kc2, rkc, kc), (vc2, rvc, vc)):
        g, w, b0 = _f64(got_c), _f64(want_c), _f64(before)
        np.testing.assert_array_equal(np.where(written, 0, g), np.where(written, 0, b0))
        # (Block 0, the null block, holds the reference's padding rows.)
        np.testing.assert_allclose(g[1:], w[1:], rtol=1e-2 if dtype == jnp.bfloat16 else 1e-6, atol=1e-6)


@pytest.mark.parametrize("splits", [1, 32])
def test_split_counts_and_window(splits):
    """One split a sequence (the new token in the only split) and many (the last of several
    merges it), with a sliding window and a soft cap."""
    rng = np.random.default_rng(splits)
    n, k, h, p = 8, 2, 64, 16
    b, qkv, kc, vc, slots, cos, sin = _case(rng, ctx_lens=[3, 40, 200], n=n, k=k, h=h, p=p, dtype=jnp.float32)
    kw = dict(sm_scale=0.5, soft_cap=20.0, sliding_window=50)
    o, kc2, vc2 = _run(b, qkv, kc, vc, slots, cos, sin, tiling=Tiling(target_programs=splits * 100, max_splits=splits,
                                                                       decode_block_kv=16), **kw)
    ro, rkc, rvc = _reference(b, qkv, kc, vc, slots, cos, sin, n, k, **kw)
    np.testing.assert_allclose(_f64(o), _f64(ro), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(_f64(kc2)[1:], _f64(rkc)[1:], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(_f64(vc2)[1:], _f64(rvc)[1:])


def test_fp8_cache_written_saturated():
    """An e4m3 cache: the new rows are written saturated (values past 448 clipped, as write_kv
    does) and attended as written."""
    rng = np.random.default_rng(4)
    n, k, h, p = 8, 2, 64, 16
    b, qkv, kc, vc, slots, cos, sin = _case(rng, ctx_lens=[5, 33], n=n, k=k, h=h, p=p, dtype=jnp.bfloat16,
                                            cache_dtype=jnp.float8_e4m3fn)
    qkv = qkv.at[:, n + k:].multiply(1000.0)  # values beyond e4m3's range
    o, kc2, vc2 = _run(b, qkv, kc, vc, slots, cos, sin, sm_scale=0.125)
    ro, rkc, rvc = _reference(b, qkv, kc, vc, slots, cos, sin, n, k, sm_scale=0.125)
    assert np.isfinite(_f64(vc2)).all() and np.abs(_f64(vc2)).max() == 448.0
    np.testing.assert_array_equal(_f64(vc2)[1:], _f64(rvc)[1:])
    got, want = _f64(o), _f64(ro)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2


def test_bad_inputs_raise_value_error():
    rng = np.random.default_rng(0)
    n, k, h, p = 4, 2, 64, 16
    b, qkv, kc, vc, slots, cos, sin = _case(rng, ctx_lens=[2], n=n, k=k, h=h, p=p, dtype=jnp.float32)
    with pytest.raises(ValueError, match="N query heads"):
        _run(b, qkv[:, :2 * k], kc, vc, slots, cos, sin, sm_scale=0.1)
    with pytest.raises(ValueError, match="slot_mapping"):
        _run(b, qkv, kc, vc, slots[:-1], cos, sin, sm_scale=0.1)
    with pytest.raises(ValueError, match="cos and sin"):
        _run(b, qkv, kc, vc, slots, cos[:, :1], sin, sm_scale=0.1)
    with pytest.raises(ValueError, match="cos and sin"):
        _run(b, qkv, kc, vc, slots, jnp.concatenate([cos, cos], 1), jnp.concatenate([sin, sin], 1), sm_scale=0.1)
