"""XLA options of each compiled program that runs the model's weights, chosen from the weights
and from the rows the program multiplies them by.

- FP8 weights (`Fp8Weight`): above `quantization.FP8_KERNEL_MAX_ROWS` rows GEMM fusions are not
  emitted with Triton, so every e4m3 dot goes to cuBLASLt's FP8 GEMM. XLA's autotuner otherwise
  searches Triton tilings for each fp8 dot of a large token bucket, which on the H100 ran for
  minutes per program (lab/gpu_checks/fp8_compile_probe.py); cuBLASLt compiles it at once. At
  most that many rows, with `FP8_DECODE="xla"`, XLA's defaults: the weight's convert to bf16 fuses
  into a Triton GEMM (small dots, quick to autotune).
- Plain (bf16 / f16 / f32) weights on the GPU: Triton GEMMs only for programs of at most
  `TRITON_GEMM_MAX_ROWS` rows. On the H100 with the Llama-3-8B shape, cuBLAS alone decoded as
  fast or faster from 32 rows up, while Triton's split-K GEMMs won at the 16-row bucket that
  batch-1 decoding runs; and each Triton GEMM is autotuned at compile time (many tilings
  compiled and timed per distinct GEMM), the largest part of a cold start's compile work
  (benchmarks/results/startup_h100.md). An `xla_gpu_enable_triton_gemm` in XLA_FLAGS is left to rule.
- Weight-only quantized weights: XLA's defaults (above the Pallas kernel's rows, the dequantized
  dot may fuse into a Triton GEMM).
"""

from __future__ import annotations

import os

import jax

from jaxengine.models import quantization
from jaxengine.models.quantization import Fp8Weight, is_quantized

TRITON_GEMM_MAX_ROWS = 16


def program_options(params, rows: int) -> dict[str, object]:
    """Options for `Lowered.compile(compiler_options=...)` of a program that multiplies `rows`
    rows (its token bucket, or the rows whose logits it computes) by the weights `params`."""
    leaves = jax.tree.leaves(params, is_leaf=is_quantized)
    if any(isinstance(w, Fp8Weight) for w in leaves):
        if quantization.FP8_DECODE == "xla" and rows <= quantization.FP8_KERNEL_MAX_ROWS:
            return {}
        return {"xla_gpu_enable_triton_gemm": False}
    if any(is_quantized(w) for w in leaves) or jax.default_backend() != "gpu" or rows <= TRITON_GEMM_MAX_ROWS \
            or "xla_gpu_enable_triton_gemm" in os.environ.get("XLA_FLAGS", ""):
        return {}
    return {"xla_gpu_enable_triton_gemm": False}
