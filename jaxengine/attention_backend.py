"""The attention backend: which ragged paged-attention function the model runs, chosen once.

The engine config names a backend (`EngineConfig.attention_backend`, one of
`config.ATTENTION_BACKENDS`); `select_attention_backend` turns that name into an
`AttentionBackend` when the model runner is built, and the runner hands it to the model's
`__call__`, which passes it to every attention layer. A layer calls `backend.attend(...)`: the
new K/V go into the paged cache and the chosen function attends over it. Nothing else decides
which kernel runs, and the kernels know nothing of the engine's names.

What each name runs:
  "auto"           the Pallas GPU kernels on an NVIDIA GPU of sm_80+ (with the Mosaic GPU
                   prefill kernel on Hopper for calls of gpu_backend.MOSAIC_PREFILL_MIN_TOKENS+
                   token rows, the Triton kernels elsewhere and for a model outside its scope:
                   head size, group size, a window or a soft cap on any layer);
                   `ragged_paged_attention_cpu` on the CPU; the jnp reference anywhere else
  "pallas-mosaic"  the same GPU kernels as "auto"; the jnp reference off supported GPUs
  "pallas"         the Triton-lowered GPU kernels only; the jnp reference off supported GPUs
  "reference"      the jnp reference everywhere
With kv_cache_dtype="fp8" (a float8_e4m3fn cache) the GPU names run the Triton kernels for every
call, on sm_89+ (Ada, Hopper): the Mosaic prefill kernel takes bf16 K/V only; below sm_89 no
Pallas kernel reads e4m3 and the jnp reference runs.

Under tensor parallelism (a mesh with a "model" axis) the write and the attention run per device
under `shard_map`: Pallas calls are not auto-partitioned, and each device holds the query heads
and the KV heads they read (KV heads split like query heads, so the group size is unchanged).

Legend: T tokens, N query heads, K KV heads, H head dim, B blocks, P block size.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import TYPE_CHECKING, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxengine.config import ATTENTION_BACKENDS
from jaxengine.models.config import ModelConfig
from jaxengine.pallas_kernels import gpu_backend
from jaxengine.pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention_cpu, ragged_paged_attention_reference, write_kv)

if TYPE_CHECKING:
    from jaxengine.models.attention import AttentionMetadata, KVCache

# q [T, N, H], k_cache/v_cache [B, K, P, H], kv_lens, block_tables, query_start_loc, num_seqs,
# keyword sm_scale / soft_cap / sliding_window -> o [T, N, H]; the contract of
# pallas_kernels.ragged_paged_attention.
AttentionFn = Callable[..., jax.Array]

logger = logging.getLogger(__name__)


def shard_map(f: Callable, *, mesh: Mesh, in_specs, out_specs) -> Callable:
    """`jax.shard_map` without replication checks (Pallas kernels carry no replication rules)."""
    try:
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    except TypeError:  # older spelling
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """The attention one engine runs: built once, passed to the model at call time.

    Immutable and hashable, so it can be a static argument of a jitted function.
    """

    name: str  # the config value it was chosen from (config.ATTENTION_BACKENDS)
    description: str  # what runs, for the log and ModelRunner.attention_impl
    fn: AttentionFn  # the chosen ragged paged-attention function
    mesh: Mesh | None = None  # tensor parallelism: heads and KV cache split over its "model" axis
    # Head size of the KV cache and of the kernel's q/k/v. The Pallas GPU kernels take power-of-two
    # head sizes only; a model whose head size is not one (Phi-3's 96) keeps its cache at the next
    # power of two, its q/k/v zero-padded on the way in and the output cut back: zero columns add
    # nothing to q.k and their output columns are dropped. None: the model's own head size.
    cache_head_dim: int | None = None
    # Element type of the KV cache (kv_cache_dtype="fp8": float8_e4m3fn, scaled by kv_scales, written
    # saturated by write_kv and read upcast by every attention path: the jnp ones and the Triton
    # GPU kernels); None: the model's dtype.
    cache_dtype: jnp.dtype | None = None
    # Whether `fn` takes `decode_only=True` (the Pallas GPU kernels): a step whose every live row
    # is one token then launches the flash-decoding kernel alone, not the prefill kernel too,
    # which would find no prefill rows and exit (one launch a layer, and on a 256-row step of the
    # Llama-3-8B shape 0.35-0.40 ms of device time: benchmarks/results/step_trace_h100.md).
    decode_only_path: bool = False
    # This backend traces the programs of decode-only steps (`for_decode_only_steps`).
    decode_only: bool = False
    # An fp8 cache's per-layer (k_scale, v_scale) from the checkpoint (models/kv_scales.py); None:
    # 1.0 everywhere. The model hands layer i `layer_metadata(md, i)`, which carries that layer's
    # pair as a traced value (AttentionMetadata.kv_scale): the cache holds k / k_scale and
    # v / v_scale, the queries are multiplied by k_scale and the output by v_scale. (As static
    # floats they would make every layer a trace of its own: +55% cold start on SmolLM2's 30 layers.)
    kv_scales: tuple[tuple[float, float], ...] | None = None

    def for_decode_only_steps(self) -> AttentionBackend | None:
        """This backend for the programs of decode-only steps (every live row one token: the
        scheduler's decode steady state), where its kernel has such a path; else None (one
        program serves every step)."""
        if not self.decode_only_path:
            return None
        return dataclasses.replace(self, decode_only=True, description=f"{self.description}, decode-only steps")

    def layer_metadata(self, md: AttentionMetadata, index: int) -> AttentionMetadata:
        """The step's metadata as the model's layer `index` reads it: with that layer's KV scales,
        if the cache has any."""
        if self.kv_scales is None:
            return md
        # behind a barrier the pair is a buffer the layer's fusions read, not a constant inside them:
        # the layers' fusions stay alike and XLA compiles each kind once (distinct constants made
        # SmolLM2's 30 layers compile apart: +54% start-up on the CPU)
        scale = jax.lax.optimization_barrier(jnp.asarray(self.kv_scales[index], jnp.float32))
        return dataclasses.replace(md, kv_scale=scale)

    def kv_head_dim(self, head_dim: int) -> int:
        """Head size of the KV cache for a model of head size `head_dim`."""
        return self.cache_head_dim or head_dim

    def kv_dtype(self, dtype: jnp.dtype) -> jnp.dtype:
        """Element type of the KV cache for a model running in `dtype`."""
        return jnp.dtype(self.cache_dtype) if self.cache_dtype is not None else jnp.dtype(dtype)

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, kv_cache: KVCache, md: AttentionMetadata, *,
               sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None
               ) -> tuple[jax.Array, KVCache]:
        """Writes this step's keys/values into the cache, then attends over it.

        q [T, N, H], k/v [T, K, H] (rotary applied), kv_cache one layer's (k, v), each
        [B, K, P, H] -> (o [T, N, H], the updated (k, v)). Under jit with the caches donated, the
        write happens in place.
        """
        local = functools.partial(self._write_and_attend, sm_scale=sm_scale, sliding_window=sliding_window,
                                  soft_cap=soft_cap)
        if self.mesh is not None:
            heads, cache = P(None, "model", None), P(None, "model", None, None)
            md_spec = jax.tree.map(lambda _: P(), md)  # metadata replicated on every device
            local = shard_map(local, mesh=self.mesh, in_specs=(heads, heads, heads, cache, cache, md_spec),
                              out_specs=(heads, cache, cache))
        o, k_cache, v_cache = local(q, k, v, kv_cache[0], kv_cache[1], md)
        return o, (k_cache, v_cache)

    def _write_and_attend(self, q: jax.Array, k: jax.Array, v: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                          md: AttentionMetadata, *, sm_scale: float, sliding_window: int | None,
                          soft_cap: float | None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """One device's share (all of it without a mesh): (o, k_cache, v_cache)."""
        h, pad = q.shape[-1], k_cache.shape[-1] - q.shape[-1]
        if pad:  # cache head size above the model's (cache_head_dim): zero columns
            q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, pad))) for x in (q, k, v))
        scale = md.kv_scale  # None, or this layer's (k_scale, v_scale)
        if scale is not None:
            k, v = k.astype(jnp.float32) / scale[0], v.astype(jnp.float32) / scale[1]
            q = (q.astype(jnp.float32) * scale[0]).astype(q.dtype)  # q . (k_scale k_cache)
        k_cache, v_cache = write_kv(k_cache, v_cache, k, v, md.slot_mapping)
        step_kind = {"decode_only": True} if self.decode_only else {}
        o = self.fn(q, k_cache, v_cache, md.kv_lens, md.block_tables, md.query_start_loc, md.num_seqs,
                    sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window, **step_kind)
        if scale is not None:
            o = (o.astype(jnp.float32) * scale[1]).astype(o.dtype)
        return o[..., :h], k_cache, v_cache


def select_attention_backend(name: str, model_config: ModelConfig, dtype: jnp.dtype, block_size: int,
                             mesh: Mesh | None = None, kv_cache_dtype: str = "auto",
                             kv_scales: tuple[tuple[float, float], ...] | None = None) -> AttentionBackend:
    """The backend `name` (config.ATTENTION_BACKENDS) runs on this machine for this model.

    `model_config`, `dtype` and `block_size` decide whether the Mosaic prefill kernel applies to
    the model at all (its head size, group size, any layer's window or soft cap): where it does
    not, the Triton kernels run every call. `mesh`: the tensor-parallel mesh, or None on one device.
    `kv_cache_dtype` (config.KV_CACHE_DTYPES): "fp8" keeps the cache in float8_e4m3fn (scaled by
    `kv_scales`), which every path reads: on a GPU the Triton kernels for every call (the Mosaic prefill kernel
    takes bf16 K/V only), or the jnp reference where no Pallas kernel converts e4m3 (below sm_89).
    `kv_scales`: the fp8 cache's per-layer (k_scale, v_scale) (models/kv_scales.py); None: 1.0.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
    if kv_cache_dtype == "auto":
        return _select(name, model_config, dtype, block_size, mesh)
    if kv_scales is not None and len(kv_scales) != model_config.num_layers:
        raise ValueError(f"kv_scales: {len(kv_scales)} layers' scales for a model of {model_config.num_layers} layers")
    backend = _select(name, model_config, dtype, block_size, mesh, kv_fp8=True)
    scaled = ", the checkpoint's per-layer KV scales" if kv_scales is not None else ""
    return dataclasses.replace(backend, description=f"{backend.description}, fp8 KV cache{scaled}",
                               cache_dtype=jnp.dtype(jnp.float8_e4m3fn), kv_scales=kv_scales)


def _select(name: str, model_config: ModelConfig, dtype: jnp.dtype, block_size: int,
            mesh: Mesh | None, kv_fp8: bool = False) -> AttentionBackend:
    platform = jax.default_backend()
    if name in ("pallas", "pallas-mosaic") or (name == "auto" and platform == "gpu"):
        kernel = gpu_backend.get_kernel(mosaic_prefill=name in ("auto", "pallas-mosaic"), kv_fp8=kv_fp8)
        h = model_config.head_dim
        if kernel is not None and h > gpu_backend.MAX_HEAD_DIM:
            logger.warning("head size %d is above the Pallas GPU kernels' %d: attention runs the jnp reference",
                           h, gpu_backend.MAX_HEAD_DIM)
            kernel = None
        padded = _padded_head_dim(h) if kernel is not None else None
        note = f" (head size {h} padded to {padded} in the KV cache)" if padded else ""
        if kernel is not None and not _mosaic_applies(kernel, model_config, dtype, block_size):
            # No layer of this model runs the Mosaic prefill kernel, not even the global layers of
            # a model whose windows or soft cap are on some layers only (Gemma 3's 1 in 6).
            kernel = gpu_backend.get_kernel(mosaic_prefill=False, kv_fp8=kv_fp8)
            return AttentionBackend(name, f"{_name(kernel)} (the Mosaic prefill kernel does not apply){note}",
                                    kernel, mesh, padded, decode_only_path=True)
        if kernel is not None:
            return AttentionBackend(name, _name(kernel) + note, kernel, mesh, padded, decode_only_path=True)
    if name == "auto" and platform == "cpu":
        return AttentionBackend(name, "ragged_paged_attention_cpu", ragged_paged_attention_cpu, mesh)
    return AttentionBackend(name, "jnp reference", ragged_paged_attention_reference, mesh)


def _padded_head_dim(h: int) -> int | None:
    """The power-of-two head size (at least 16) the GPU kernels run a head size `h` at; None
    where `h` is one already."""
    p = max(16, 1 << (h - 1).bit_length())
    return None if p == h else p


def _name(kernel: AttentionFn) -> str:
    return getattr(kernel, "__name__", "pallas kernel")


def _mosaic_applies(kernel: AttentionFn, mc: ModelConfig, dtype: jnp.dtype, block_size: int) -> bool:
    """Whether the kernel's Mosaic prefill path serves this model at all: its head size, group
    size, window (`sliding_window`: any layer's) and soft cap (`attention_soft_cap`: any layer's).
    True for a kernel without that path (nothing to avoid)."""
    applies = getattr(kernel, "mosaic_applies", None)
    return applies is None or applies(dtype, _padded_head_dim(mc.head_dim) or mc.head_dim, mc.num_heads // mc.num_kv_heads, block_size,
                                      mc.sliding_window, mc.attention_soft_cap)
