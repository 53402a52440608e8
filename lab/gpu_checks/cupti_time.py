"""CUPTI kernel time of a jitted call, per layer: the lab probes' shared measure."""

from __future__ import annotations


def kernel_us(fn, fargs, layers: int, repeats: int = 3) -> dict:
    """Runs `fn(*fargs)` once, then `repeats` times under CUPTI (jax's Mosaic GPU profiler); the
    fastest run's summed kernel time divided by `layers` ("us") and its kernels by name."""
    import jax
    from jax.experimental.mosaic.gpu import profiler

    jax.block_until_ready(fn(*fargs))
    best = None
    for _ in range(repeats):
        _, ts = profiler.measure(fn, aggregate=False)(*fargs)
        by = {}
        for name, ms in ts or []:
            by[name[:50]] = by.get(name[:50], 0.0) + ms * 1e3 / layers
        tot = sum(by.values())
        if best is None or tot < best[0]:
            best = (tot, by)
    return {"us": best[0], "kernels": best[1]}
