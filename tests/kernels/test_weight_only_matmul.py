"""The weight-only matmul kernel (Pallas, Triton lowering) in interpret mode against the jnp
reference: 4- and 8-bit, groups of 16 to 256, integer zero points and float minimums (GGUF's
Q4_1 / K-quants), ragged row counts, K split or not, fresh random inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.pallas_kernels.weight_only_matmul_gpu import (pick_splits, supported, weight_only_matmul,
                                                             weight_only_matmul_reference)


def _inputs(t: int, k: int, n: int, bits: int, group: int, seed: int, dtype, float_min: bool = False):
    rng = np.random.default_rng(seed)
    per, g = 32 // bits, k // group
    packed = rng.integers(-2**31, 2**31, size=(k // per, n), dtype=np.int64).astype(np.int32)
    scales = rng.uniform(0.001, 0.02, size=(g, n)).astype(np.float32)
    if float_min:  # a minimum per group, either sign (Q4_1 stores -min, Q4_K dmin * m)
        return (jnp.asarray(rng.normal(size=(t, k)).astype(np.float32), dtype), jnp.asarray(packed),
                jnp.asarray(scales, dtype), jnp.asarray(rng.uniform(-0.2, 0.2, size=(g, n)).astype(np.float32), dtype))
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


@pytest.mark.parametrize("t,k,n,bits,group,float_min,splits", [
    (3, 256, 128, 4, 32, True, None), (16, 512, 256, 4, 32, False, 2), (5, 256, 128, 8, 32, False, None),
    (2, 256, 128, 8, 16, False, 4), (7, 256, 128, 4, 64, True, 1), (1, 512, 128, 8, 256, True, None),
])
def test_small_groups_and_float_minimums(t, k, n, bits, group, float_min, splits):
    """Groups under 128 rows (a kernel step of one group) and weight = value * scale - minimum."""
    x, packed, scales, zeros = _inputs(t, k, n, bits, group, seed=t + group, dtype=jnp.float32, float_min=float_min)
    want = weight_only_matmul_reference(x, packed, scales, zeros, bits, group, float_min)
    got = weight_only_matmul(x, packed, scales, zeros, bits=bits, group_size=group, splits=splits,
                             float_min=float_min, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-3)


def test_reference_float_minimum_formula():
    """float_min: weight = value * scale - zero, against numpy on the unpacked values."""
    from jaxengine.models.quantization import unpack_rows_np
    from jaxengine.pallas_kernels.weight_only_matmul_gpu import dequantize_packed

    _, packed, scales, zeros = _inputs(1, 64, 128, 4, 32, seed=1, dtype=jnp.float32, float_min=True)
    vals = unpack_rows_np(np.asarray(packed), 4).astype(np.float32).reshape(2, 32, 128)
    want = (vals * np.asarray(scales)[:, None] - np.asarray(zeros)[:, None]).reshape(64, 128)
    got = dequantize_packed(packed, scales, zeros, 4, 32, jnp.float32, float_min=True)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


def test_kernel_bfloat16_close_to_reference():
    x, packed, scales, zeros = _inputs(3, 256, 128, 4, 128, seed=7, dtype=jnp.bfloat16)
    want = weight_only_matmul_reference(x, packed, scales, zeros, 4, 128).astype(jnp.float32)
    got = weight_only_matmul(x, packed, scales, zeros, bits=4, group_size=128, interpret=True).astype(jnp.float32)
    assert float(jnp.max(jnp.abs(got - want))) <= 0.02 * float(jnp.max(jnp.abs(want)))


@pytest.mark.parametrize("dtype,bits,group,float_min", [
    (jnp.bfloat16, 4, 128, False), (jnp.bfloat16, 4, 32, True), (jnp.float16, 8, 32, False),
    (jnp.float16, 4, 64, True),
])
def test_post_scale_matches_reference(dtype, bits, group, float_min):
    """Values made 16-bit floats by an OR (base + v) and the scale / zero applied after the dot:
    against the reference over the same inputs, within the 16-bit output's rounding."""
    x, packed, scales, zeros = _inputs(16, 512, 256, bits, group, seed=bits + group, dtype=dtype, float_min=float_min)
    want = weight_only_matmul_reference(x, packed, scales, zeros, bits, group, float_min).astype(jnp.float32)
    got = weight_only_matmul(x, packed, scales, zeros, bits=bits, group_size=group, float_min=float_min,
                             post_scale=True, interpret=True).astype(jnp.float32)
    assert float(jnp.max(jnp.abs(got - want))) <= 0.01 * float(jnp.max(jnp.abs(want)))


@pytest.mark.parametrize("bits,group,float_min,kw", [
    (4, 128, False, dict(slabs=True)), (4, 32, True, dict(slabs=True)), (8, 16, False, dict(slabs=True, splits=2)),
    (4, 64, False, dict(slabs=True)), (8, 128, True, dict(slabs=True)), (4, 128, False, dict(block_k_rows=32)),
    (4, 256, True, dict(block_k_rows=64, splits=2)), (4, 16, True, dict(slabs=True)),  # GGUF Q2_K's form
    (4, 16, False, dict(slabs=True, splits=2)),  # Q3_K's
])
def test_slabs_and_smaller_steps_match_reference(bits, group, float_min, kw):
    """Slabs (one dot per value position of the words, x's columns permuted; 128-row blocks over
    several groups of 16-64 rows) and steps of fewer rows than the group: the reference's values."""
    x, packed, scales, zeros = _inputs(5, 512, 256, bits, group, seed=bits * group, dtype=jnp.float32,
                                       float_min=float_min)
    want = weight_only_matmul_reference(x, packed, scales, zeros, bits, group, float_min)
    got = weight_only_matmul(x, packed, scales, zeros, bits=bits, group_size=group, float_min=float_min,
                             interpret=True, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-3)


def test_step_rows_refused_where_they_do_not_fit():
    x, packed, scales, zeros = _inputs(1, 256, 128, 4, 128, seed=0, dtype=jnp.float32)
    for kw in (dict(block_k_rows=48), dict(block_k_rows=8), dict(slabs=True, block_k_rows=64),
               dict(slabs=True, post_scale=True)):
        with pytest.raises(ValueError, match="rows per step do not fit|post_scale needs"):
            weight_only_matmul(x, packed, scales, zeros, bits=4, group_size=128, interpret=True, **kw)


def test_post_scale_refused_where_the_values_do_not_fit():
    from jaxengine.pallas_kernels.weight_only_matmul_gpu import post_scale_ok

    assert post_scale_ok(jnp.bfloat16, 4) and post_scale_ok(jnp.float16, 8)
    assert not post_scale_ok(jnp.bfloat16, 8) and not post_scale_ok(jnp.float32, 4)
    x, packed, scales, zeros = _inputs(1, 256, 128, 8, 128, seed=0, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="post_scale needs"):
        weight_only_matmul(x, packed, scales, zeros, bits=8, group_size=128, post_scale=True, interpret=True)


def test_splits_fill_the_gpu():
    assert pick_splits(32, 112) == 8  # Llama-3-8B down_proj at batch 1: 32 column tiles, 112 K steps
    assert pick_splits(224, 32) == 2 and pick_splits(300, 32) == 1 and pick_splits(1, 3) == 3


def test_unsupported_shapes_refused():
    assert supported(1, 96, 128, 4, 32) and supported(1, 4096, 128, 8, 16)
    assert not supported(1, 96, 128, 4, 48) and not supported(1, 256, 100, 4, 128) \
        and not supported(1, 384, 128, 4, 192) and not supported(1, 64, 128, 4, 8)
    x, packed, scales, zeros = _inputs(1, 256, 128, 4, 128, seed=0, dtype=jnp.float32)
    with pytest.raises(ValueError, match="unsupported shape"):
        weight_only_matmul(x[:, :96], packed[:12], scales[:2], zeros[:2], bits=4, group_size=48, interpret=True)


@pytest.mark.parametrize("magic,group,float_min,post,slabs", [
    (True, 128, False, False, False), (False, 128, False, False, False), (True, 32, True, False, False),
    (True, 128, False, True, False), (True, 32, True, True, False), (True, 128, False, False, True),
    (True, 32, True, False, True), (True, 16, True, False, True)])
def test_kernel_lowers_for_an_h100(magic, group, float_min, post, slabs):
    """Both conversions lower through Triton (3-D shifts, the bitcast and the reshape included),
    and so do groups of 32 with float minimums, the post-scale form (16-bit bitcast, row sums) and
    slabs (per-group scale rows repeated over a 128-row block)."""
    from tests.kernels.cuda_target import abstract_h100

    x, packed, scales, zeros = _inputs(16, 512, 256, 4, group, seed=3, dtype=jnp.bfloat16, float_min=float_min)
    fn = jax.jit(lambda x, p, s, z: weight_only_matmul(x, p, s, z, bits=4, group_size=group, magic=magic,
                                                       float_min=float_min, post_scale=post, slabs=slabs))
    with abstract_h100():
        text = fn.trace(x, packed, scales, zeros).lower(lowering_platforms=("cuda",)).as_text()
    assert "weight_only_matmul" in text


@pytest.mark.parametrize("t,k,n,splits", [(1, 256, 128, None), (16, 512, 256, 2), (11, 384, 384, 3)])
def test_swapped_form_matches_reference(t, k, n, splits):
    """The swapped form (weight as the dot's first operand, scales and zeros applied to each
    group's sums) in interpret mode: bf16 x, 4-bit values, groups of 128, ragged rows, K splits."""
    from jaxengine.pallas_kernels.weight_only_matmul_gpu import swapped_supported, weight_only_matmul_swapped

    x, packed, scales, zeros = _inputs(t, k, n, 4, 128, seed=t + n, dtype=jnp.bfloat16)
    assert swapped_supported(t, k, n, 4, 128, x.dtype, False)
    want = np.asarray(weight_only_matmul_reference(x, packed, scales, zeros, 4, 128), np.float32)
    got = np.asarray(weight_only_matmul_swapped(x, packed, scales, zeros, splits=splits, interpret=True),
                     np.float32)
    # bf16 outputs: one rounding of the result, and the zero's sum subtracted from x . (128 + v)
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()


def test_swapped_form_refuses_and_lowers_for_an_h100():
    """Calls outside its form are refused by name; on the GPU path (inline PTX lop3) it lowers."""
    from jaxengine.pallas_kernels.weight_only_matmul_gpu import swapped_supported, weight_only_matmul_swapped
    from tests.kernels.cuda_target import abstract_h100

    assert not swapped_supported(16, 512, 256, 8, 128, jnp.bfloat16, False)
    assert not swapped_supported(16, 512, 256, 4, 64, jnp.bfloat16, False)
    assert not swapped_supported(16, 512, 256, 4, 128, jnp.float32, False)
    assert not swapped_supported(16, 512, 256, 4, 128, jnp.bfloat16, True)
    x, packed, scales, zeros = _inputs(16, 512, 256, 4, 128, seed=4, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="weight_only_matmul_swapped"):
        weight_only_matmul_swapped(x.astype(jnp.float32), packed, scales, zeros, interpret=True)
    fn = jax.jit(lambda x, p, s, z: weight_only_matmul_swapped(x, p, s, z))
    with abstract_h100():
        text = fn.trace(x, packed, scales, zeros).lower(lowering_platforms=("cuda",)).as_text()
    assert "weight_only_matmul_t" in text
