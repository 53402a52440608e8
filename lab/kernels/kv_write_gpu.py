"""A candidate for the KV-cache write on GPU: one Triton kernel stores a step's new keys and
values into their paged slots, in place, where XLA runs two scatter fusions (write_kv in
pallas_kernels/ragged_paged_attention.py). Lab only until lab/gpu_checks/kv_write_probe.py times
it against XLA's scatter.

    k, v [T, K, H]; caches [N, K, P, H] (donated); slots [T] int32 (block * P + offset)
    -> the caches with row (slot // P, kh, slot % P) = k[t, kh] (and v) for every token t

Grid (T / tokens, K): program (i, kh) loads `tokens` rows of head kh ([tokens, H]) of k and v and
stores each row at its slot in the caches viewed flat as [N * K * P, H]. Padding tokens carry
slots of the null block 0, which no sequence reads: where several share a slot, any of them may
land there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _kernel(slot_ref, k_ref, v_ref, kc_in, vc_in, kc_ref, vc_ref, *, tokens: int, heads: int, p: int, h: int):
    del kc_in, vc_in  # aliased to kc_ref, vc_ref
    r = pl.ds(pl.program_id(0) * tokens, tokens)
    kh = pl.program_id(1)
    slots = slot_ref[r]
    rows = ((slots // p) * heads + kh) * p + slots % p
    cols = jnp.arange(h, dtype=jnp.int32)[None, :]
    c = pl.ds(pl.multiple_of(kh * h, h), h)
    plgpu.store(kc_ref.at[rows[:, None], cols], k_ref[r, c].astype(kc_ref.dtype))
    plgpu.store(vc_ref.at[rows[:, None], cols], v_ref[r, c].astype(vc_ref.dtype))


def _write(k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array,
           *, tokens: int = 16, num_warps: int = 4, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """write_kv's contract (same arguments, same result for distinct live slots)."""
    n, heads, p, h = k_cache.shape
    t = k.shape[0]
    if t % tokens or h & (h - 1) or k.shape != (t, heads, h) or v.shape != k.shape:
        raise ValueError(f"write_kv kernel: keys {k.shape} / values {v.shape} into caches {k_cache.shape} "
                         f"(T a multiple of {tokens}, H a power of two)")
    flat = (n * heads * p, h)
    kwargs = {} if interpret else {"compiler_params": plgpu.CompilerParams(num_warps=num_warps, num_stages=1)}
    kc, vc = pl.pallas_call(
        functools.partial(_kernel, tokens=tokens, heads=heads, p=p, h=h),
        grid=(t // tokens, heads),
        out_shape=(jax.ShapeDtypeStruct(flat, k_cache.dtype), jax.ShapeDtypeStruct(flat, v_cache.dtype)),
        input_output_aliases={3: 0, 4: 1}, interpret=interpret, name="kv_write", **kwargs,
    )(slot_mapping.astype(jnp.int32), k.reshape(t, heads * h), v.reshape(t, heads * h),
      k_cache.reshape(flat), v_cache.reshape(flat))
    return kc.reshape(k_cache.shape), vc.reshape(v_cache.shape)


write_kv_kernel = jax.jit(_write, static_argnames=("tokens", "num_warps", "interpret"), donate_argnums=(0, 1))


def write_kv_engine(k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array,
                    slot_mapping: jax.Array) -> tuple[jax.Array, jax.Array]:
    """write_kv's signature, for an engine A/B without changing the engine:
    `step_trace.py --patch attention_backend.write_kv=@lab.kernels.kv_write_gpu:write_kv_engine`.
    The kernel on GPU where it takes the shapes (T a multiple of 16, H a power of two), else
    XLA's scatter; an fp8 cache gets write_kv's saturating convert first."""
    from jaxengine.pallas_kernels.ragged_paged_attention import _to_cache, write_kv

    t, _, h = k.shape
    if jax.default_backend() != "gpu" or t % 16 or h & (h - 1):
        return write_kv(k_cache, v_cache, k, v, slot_mapping)
    return _write(k_cache, v_cache, _to_cache(k, k_cache.dtype), _to_cache(v, v_cache.dtype), slot_mapping)
