"""Measured device ceilings: copy bandwidth (bytes read + written) and bf16 matmul rate."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp


def _time(fn, *args, iters: int = 20, repeats: int = 5) -> float:
    """Seconds per call: `iters` calls enqueued back to back, one wait at the end (so launch and
    sync overheads are amortised, as a kernel timer would see it); best of `repeats`."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    x = jax.random.normal(jax.random.key(0), (nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0001)
    return 2 * nbytes / _time(f, x)


def matmul_rate(n: int = 8192) -> float:
    """FLOP/s of a bf16 n^3 matrix product."""
    k1, k2 = jax.random.split(jax.random.key(1))
    a = jax.random.normal(k1, (n, n), jnp.bfloat16)
    b = jax.random.normal(k2, (n, n), jnp.bfloat16)
    f = jax.jit(lambda x, y: x @ y)
    return 2 * n ** 3 / _time(f, a, b)


def measure(copy_bytes: int = 2 << 30, matmul_n: int = 8192) -> dict[str, float]:
    """Both ceilings; the defaults are sized for an H100/H200 (small sizes for a CPU smoke run)."""
    return {"copy_bandwidth_GBps": copy_bandwidth(copy_bytes) / 1e9, "bf16_matmul_TFLOPs": matmul_rate(matmul_n) / 1e12}
