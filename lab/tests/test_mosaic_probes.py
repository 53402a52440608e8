"""The Mosaic GPU probes (lab/kernels/probe_*.py) still lower for CUDA on this host, so
they run again on a GPU as written: the pushed store between cluster CTAs and the transposed
decode step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")

# The probes' K/V pool (64 blocks, 8 KV heads, block 16, head dim 128) and block tables.
_KC = jax.ShapeDtypeStruct((64, 8, 16, 128), jnp.bfloat16)


def _table(rows: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((rows, 32), jnp.int32)


def test_transposed_decode_step_lowers():
    from lab.kernels import probe_transposed_decode as probe

    q = jax.ShapeDtypeStruct((probe.HEADS, probe.H), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((probe.KEYS, probe.H), jnp.bfloat16)
    text = jax.jit(probe.step).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("tile", ["bf16", "f32sw32"])
def test_async_store_probe_lowers(tile):
    from lab.kernels import probe_async_store as probe

    f, x = probe.kernel(tile, 1)
    assert x.shape == probe.TILES[tile][0]
    assert "mosaic_gpu" in jax.jit(f).trace(x).lower(lowering_platforms=("cuda",)).as_text()


def test_paged_read_probe_lowers_and_tables_are_disjoint():
    """The copy-only probe (the decode kernel's K/V copies, no compute) lowers for CUDA; its
    tables hold distinct live block ids, zero-padded to whole 128-byte rows."""
    import numpy as np

    from lab.kernels import probe_paged_read as probe

    text = jax.jit(lambda k, v, t: probe.paged_read(k, v, t, keys=512, bkv=128, stages=2)).trace(
        _KC, _KC, _table(16)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    tabs = probe.tables_for(np.random.default_rng(0), 4096, rows=8, used=16, n_sets=3,
                            order="random")
    ids = np.stack([np.asarray(t) for t in tabs])
    assert ids.shape == (3, 8, 32) and (ids[:, :, 16:] == 0).all()
    live = ids[:, :, :16].ravel()
    assert (live > 0).all() and len(set(live.tolist())) == live.size


@pytest.mark.parametrize("cluster", ["heads", "rows"])
def test_paged_read_probe_cluster_launches_lower(cluster):
    """The copy-only probe launched in clusters: a row's KV-head CTAs together ("heads"), or
    8 rows of one KV head ("rows")."""
    from lab.kernels import probe_paged_read as probe

    text = jax.jit(lambda k, v, t: probe.paged_read(k, v, t, keys=256, bkv=128, stages=2,
                                                    cluster=cluster)).trace(
        _KC, _KC, _table(16)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    with pytest.raises(ValueError, match="whole clusters"):
        jax.jit(lambda k, v, t: probe.paged_read(k, v, t, keys=256, bkv=128, stages=2,
                                                 cluster="rows")).trace(_KC, _KC, _table(12))
    with pytest.raises(ValueError, match="cluster must be"):
        probe.paged_read(_KC, _KC, _table(16), keys=256, bkv=128, stages=2, cluster="gpc")


def test_fixed_cost_probe_kernels_lower():
    """Every Mosaic kernel of the fixed-cost probe (empty launches, the table round trip by
    TMA and by scalar loads) lowers for CUDA on the decode kernel's batch-8 grid."""
    from lab.kernels import probe_fixed_cost as probe

    for mode in probe.FIXED_MODES:
        text = jax.jit(lambda k, t, mode=mode: probe.fixed_kernel(k, t, mode=mode)).trace(
            _KC, _table(8)).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("mosaic_gpu") >= 1, mode


def test_paged_read_probe_holds_spin():
    """With `hold`, the probe's consumer spins on the SM clock while it holds each slot (the
    decode kernel's compute stand-in): the spin loops are in the kernel, and absent without."""
    from lab.kernels import probe_paged_read as probe

    def text(hold, schedule="serial"):
        return jax.jit(lambda k, v, t: probe.paged_read(k, v, t, keys=256, bkv=128, stages=2,
                                                        hold=hold, schedule=schedule)).trace(
            _KC, _KC, _table(8)).lower(lowering_platforms=("cuda",)).as_text()

    assert text((0, 0, 0)).count("%clock64") == 0
    assert text(probe.HOLD_CYCLES).count("%clock64") >= 3
    # The overlapped schedule: the first Q.K^T's hold, then the softmax's and the products'.
    assert text(probe.HOLD_CYCLES, "overlap").count("%clock64") >= 3
    # Two consumers on alternate steps (3 warpgroups), then the merge's spin.
    assert text((400, 0, 0), "two").count("%clock64") >= 4


def test_paged_read_probe_hold_specs():
    """`--holds` entries: a scale of the kernel's per-step cycles, or the overlapped schedule
    with its combined hold; anything else is a ValueError naming it."""
    from lab.kernels import probe_paged_read as probe

    assert probe.parse_hold("0") == ("serial", (0, 0, 0))
    assert probe.parse_hold("1") == ("serial", probe.HOLD_CYCLES)
    assert probe.parse_hold("0.5") == ("serial", tuple(c // 2 for c in probe.HOLD_CYCLES))
    assert probe.parse_hold("o800") == ("overlap", (*probe.HOLD_CYCLES[:2], 800))
    assert probe.parse_hold("t400") == ("two", (400, 0, 0))
    with pytest.raises(ValueError, match="ox"):
        probe.parse_hold("ox")
    with pytest.raises(ValueError, match="schedule"):
        probe.paged_read(_KC, _KC, _table(8), keys=256, bkv=128, stages=2, schedule="zigzag")
    with pytest.raises(ValueError, match="even"):
        probe.paged_read(_KC, _KC, _table(8), keys=256, bkv=128, stages=3, schedule="two")
