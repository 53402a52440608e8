"""Which Pallas GPU kernel serves this device: a kernel-level fact the engine's attention
backend (jaxengine/attention_backend.py) asks for; None off supported GPUs."""

from __future__ import annotations

import logging
from typing import Callable

import jax

logger = logging.getLogger(__name__)

# The Triton-lowered kernels use bf16 tensor-core products: Ampere (sm_80) or newer.
_MIN_COMPUTE_CAPABILITY = (8, 0)
# An fp8 (float8_e4m3fn) KV cache: Pallas' Triton lowering converts e4m3 from Ada/Hopper (sm_89)
# on; below, no Pallas kernel reads it.
FP8_KV_MIN_COMPUTE_CAPABILITY = (8, 9)
# Largest head size the kernels take (they take powers of two from 16 up to it).
MAX_HEAD_DIM = 256


def _compute_capability(device: jax.Device) -> tuple[int, int] | None:
    cc = getattr(device, "compute_capability", None)
    if not cc:
        return None
    try:
        major, minor = str(cc).split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


# Token buckets from which the engine's programs take the Mosaic prefill kernel. Each distinct
# Mosaic kernel (one per token bucket) is compiled again in every process: Mosaic GPU builds
# its binary when XLA instantiates the custom call, and keeps it in memory only, so the
# persistent compilation cache does not hold it: each one adds to every start-up.
# Smaller buckets carry decode steps and short chunks; the Triton kernels serve them whole.
MOSAIC_PREFILL_MIN_TOKENS = 512


def get_kernel(mosaic_prefill: bool = False,
               min_tokens: int = MOSAIC_PREFILL_MIN_TOKENS, kv_fp8: bool = False) -> Callable | None:
    """The GPU kernel's public function on an NVIDIA GPU of sm_80+, else None.

    mosaic_prefill: on Hopper (sm_90), prefill chunks of calls with at least `min_tokens`
    token rows go to the Mosaic GPU kernel where it applies
    (ragged_paged_attention_mgpu.supported); elsewhere the flag changes nothing.
    kv_fp8: the KV cache is float8_e4m3fn. The Triton kernels read it from sm_89 on (None
    below); the Mosaic prefill kernel's WGMMAs take bf16 K/V only, so `mosaic_prefill` is
    dropped (said once, at INFO) and the Triton kernels serve every call."""
    if jax.default_backend() != "gpu":
        return None
    device = jax.devices()[0]
    cc = _compute_capability(device)  # "9.0" on CUDA; ROCm names (gfx...) do not parse
    if cc is None or cc < _MIN_COMPUTE_CAPABILITY:
        logger.info("no Pallas attention kernel for device %s (compute capability %s)",
                    device.device_kind, cc)
        return None
    if kv_fp8 and cc < FP8_KV_MIN_COMPUTE_CAPABILITY:
        logger.warning("no Pallas attention kernel reads an fp8 KV cache on device %s (compute "
                       "capability %d.%d; e4m3 conversion needs %d.%d+)", device.device_kind, *cc,
                       *FP8_KV_MIN_COMPUTE_CAPABILITY)
        return None
    from jaxengine.pallas_kernels import ragged_paged_attention_mgpu as mgpu
    from jaxengine.pallas_kernels.ragged_paged_attention_gpu import (
        MosaicTiling, Tiling, ragged_paged_attention_gpu)
    if mosaic_prefill and cc[0] == 9 and kv_fp8:
        logger.info("fp8 KV cache: the Mosaic GPU prefill kernel (bf16 K/V only) is skipped; "
                    "the Triton kernels serve every attention call")
    elif mosaic_prefill and cc[0] == 9:
        # The Mosaic kernel sizes its KV splits and grid by the SM count (132 on an H100 SXM).
        sms = getattr(device, "core_count", None) or MosaicTiling().sm_count
        tiling = Tiling(mosaic=MosaicTiling(sm_count=int(sms)))

        def ragged_paged_attention_gpu_mosaic_prefill(q, *args, **kwargs):
            kwargs.setdefault("tiling", tiling)
            prefill = "auto" if q.shape[0] >= min_tokens else "triton"
            return ragged_paged_attention_gpu(q, *args, **kwargs, prefill=prefill)

        def mosaic_applies(dtype, head_dim: int, group: int, block_size: int,
                           sliding_window: int | None = None, soft_cap: float | None = None
                           ) -> bool:
            """Whether a model with these properties gets the Mosaic kernel at all."""
            return mgpu.supported(dtype, head_dim, group, block_size, soft_cap, sliding_window,
                                  tiling.mosaic)

        ragged_paged_attention_gpu_mosaic_prefill.mosaic_applies = mosaic_applies
        return ragged_paged_attention_gpu_mosaic_prefill
    return ragged_paged_attention_gpu

