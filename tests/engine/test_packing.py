"""A step's inputs travel as one packed int32 buffer: every leaf comes back bit for bit inside a
jitted program, with the layout the runner compiles against."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.input_batch import abstract_inputs
from jaxengine.packing import Layout, pack, unpack
from jaxengine.sampler import SamplingRow, build_sampling_metadata
from jaxengine.sampling_params import SamplingParams


def _roundtrip(tree):
    layout = Layout.of(tree)
    out = jax.jit(lambda flat: unpack(flat, layout))(pack(tree))
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(tree)):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.ascontiguousarray(want).view(np.uint8))


def test_step_inputs_roundtrip():
    rng = np.random.default_rng(0)
    abstract = abstract_inputs(32, 8, 6)
    tree = jax.tree.map(lambda a: rng.integers(-2**31, 2**31 - 1, size=a.shape, dtype=np.int64).astype(np.int32),
                        abstract)
    _roundtrip(tree)
    assert Layout.of(abstract) == Layout.of(tree)  # the runner compiles against the abstract layout


def test_sampling_metadata_roundtrip():
    """float32 (negative, fractional, inf), uint32 seeds above 2**31 and int32 histories."""
    rows = [SamplingRow(SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, presence_penalty=-0.5,
                                       frequency_penalty=0.25, repetition_penalty=1.3, min_tokens=3),
                        seed=2**32 - 7, step=1, prompt_ids=[5, 6, 7], output_ids=[8], eos_token_ids=(2,)),
            SamplingRow(SamplingParams(), seed=3, step=0, prompt_ids=[1], output_ids=[], eos_token_ids=(2,))]
    md = build_sampling_metadata(rows, 4, 16)
    md.temperature[3] = np.inf
    _roundtrip(md)


def test_pack_is_concatenation_in_leaf_order_at_256_byte_offsets():
    """Leaves in order, each starting at a multiple of 256 bytes (Mosaic GPU kernels reject
    operands that are not 256-byte aligned, and XLA may pass a slice of the buffer as a view)."""
    tree = {"a": np.arange(3, dtype=np.int32), "b": np.array([[1.5, -2.0]], np.float32),
            "c": np.arange(70, dtype=np.int32)}
    flat = pack(tree)
    layout = Layout.of(tree)
    assert layout.offsets == (0, 64, 128) and layout.size == 256 == flat.size
    assert flat.dtype == np.int32 and all(off * 4 % 256 == 0 for off in layout.offsets)
    np.testing.assert_array_equal(flat[:3], [0, 1, 2])
    np.testing.assert_array_equal(flat[64:66].view(np.float32), [1.5, -2.0])
    np.testing.assert_array_equal(flat[128:198], np.arange(70))
    assert not flat[3:64].any() and not flat[66:128].any()


def test_layout_rejects_other_itemsizes_and_wrong_buffers():
    with pytest.raises(ValueError, match="4-byte"):
        Layout.of({"x": np.zeros(3, np.int64)})
    with pytest.raises(ValueError, match="4-byte"):
        Layout.of({"x": jax.ShapeDtypeStruct((3,), jnp.bfloat16)})
    layout = Layout.of({"x": np.zeros(3, np.int32)})
    with pytest.raises(ValueError, match="layout needs"):
        unpack(jnp.zeros(4, jnp.int32), layout)
