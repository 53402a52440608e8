"""Why an fp8 engine's largest-bucket program compiles for minutes on the H100: compile time of
one fp8 linear (per-token activation quantization + e4m3 dot) at prefill rows, per variant.

    python -m lab.gpu_checks.fp8_compile_probe VARIANT   (plain | barrier)

Run each variant in its own process (XLA_FLAGS differ per process)."""

import sys
import time

import jax
import jax.numpy as jnp

from jaxengine.models.quantization import FP8, FP8_MAX


def fp8_linear(x, q, s, barrier: bool):
    xf = x.astype(jnp.float32)
    xs = jnp.maximum(jnp.max(jnp.abs(xf), axis=1, keepdims=True) / FP8_MAX, 1e-12)
    xq = jnp.clip(xf / xs, -FP8_MAX, FP8_MAX).astype(FP8)
    if barrier:
        xq = jax.lax.optimization_barrier(xq)
    y = jax.lax.dot_general(xq, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * xs * s[None, :]).astype(x.dtype)


def main() -> None:
    variant = sys.argv[1]
    for rows in (16, 8192):
        x = jax.ShapeDtypeStruct((rows, 4096), jnp.bfloat16)
        q = jax.ShapeDtypeStruct((14336, 4096), FP8)
        s = jax.ShapeDtypeStruct((14336,), jnp.float32)
        t0 = time.perf_counter()
        c = jax.jit(lambda x, q, s: fp8_linear(x, q, s, variant == "barrier")).lower(x, q, s).compile()
        txt = c.as_text()
        kind = "cublaslt" if "cublas$lt" in txt.lower() else ("triton" if "triton" in txt.lower() else "other")
        print(f"{variant} rows {rows}: compile {time.perf_counter() - t0:.1f} s, gemm {kind}", flush=True)


if __name__ == "__main__":
    main()
