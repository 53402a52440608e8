"""The weight-only matmul kernel (Pallas, Triton lowering) in interpret mode against the jnp
reference: 4- and 8-bit, groups of 128 and 256, ragged row counts, K split or not, fresh random
inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.pallas_kernels.weight_only_matmul_gpu import (pick_splits, supported, weight_only_matmul,
                                                             weight_only_matmul_reference)


def _inputs(t: int, k: int, n: int, bits: int, group: int, seed: int, dtype):
    rng = np.random.default_rng(seed)
    per, g = 32 // bits, k // group
    packed = rng.integers(-2**31, 2**31, size=(k // per, n), dtype=np.int64).astype(np.int32)
    scales = rng.uniform(0.001, 0.02, size=(g, n)).astype(np.float32)
    zeros = rng.integers(0, 1 << bits, size=(g, n)).astype(np.uint8)
    x = rng.normal(size=(t, k)).astype(np.float32)
    return (jnp.asarray(x, dtype), jnp.asarray(packed), jnp.asarray(scales, dtype), jnp.asarray(zeros))


@pytest.mark.parametrize("t,k,n,bits,group,splits,magic", [
    (1, 256, 128, 4, 128, 1, True), (5, 512, 256, 4, 256, 4, True), (17, 384, 128, 8, 128, None, True),
    (5, 512, 256, 4, 256, 4, False), (17, 384, 128, 8, 128, None, False),
])
def test_kernel_matches_reference_float32(t, k, n, bits, group, splits, magic):
    """Both conversions (the float32 magic number, an int-to-float convert) give the reference's
    dequantized values: 8-bit values (up to 255) and zero points included."""
    x, packed, scales, zeros = _inputs(t, k, n, bits, group, seed=t + k + bits, dtype=jnp.float32)
    want = weight_only_matmul_reference(x, packed, scales, zeros, bits, group)
    got = weight_only_matmul(x, packed, scales, zeros, bits=bits, group_size=group, splits=splits,
                             magic=magic, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-3)


def test_kernel_bfloat16_close_to_reference():
    x, packed, scales, zeros = _inputs(3, 256, 128, 4, 128, seed=7, dtype=jnp.bfloat16)
    want = weight_only_matmul_reference(x, packed, scales, zeros, 4, 128).astype(jnp.float32)
    got = weight_only_matmul(x, packed, scales, zeros, bits=4, group_size=128, interpret=True).astype(jnp.float32)
    assert float(jnp.max(jnp.abs(got - want))) <= 0.02 * float(jnp.max(jnp.abs(want)))


def test_splits_fill_the_gpu():
    assert pick_splits(32, 112) == 8  # Llama-3-8B down_proj at batch 1: 32 column tiles, 112 K steps
    assert pick_splits(224, 32) == 2 and pick_splits(300, 32) == 1 and pick_splits(1, 3) == 3


def test_unsupported_shapes_refused():
    assert not supported(1, 96, 128, 4, 32) and not supported(1, 256, 100, 4, 128)
    x, packed, scales, zeros = _inputs(1, 256, 128, 4, 128, seed=0, dtype=jnp.float32)
    with pytest.raises(ValueError, match="unsupported shape"):
        weight_only_matmul(x[:, :96], packed[:12], scales[:1], zeros[:1], bits=4, group_size=32, interpret=True)


@pytest.mark.parametrize("magic", [True, False])
def test_kernel_lowers_for_an_h100(magic):
    """Both conversions lower through Triton (3-D shifts, the bitcast and the reshape included)."""
    from tests.kernels.cuda_target import abstract_h100

    x, packed, scales, zeros = _inputs(16, 512, 256, 4, 128, seed=3, dtype=jnp.bfloat16)
    fn = jax.jit(lambda x, p, s, z: weight_only_matmul(x, p, s, z, bits=4, group_size=128, magic=magic))
    with abstract_h100():
        text = fn.trace(x, packed, scales, zeros).lower(lowering_platforms=("cuda",)).as_text()
    assert "weight_only_matmul" in text
