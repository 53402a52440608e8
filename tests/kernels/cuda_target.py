"""Lowering for CUDA on a machine without a GPU.

From jax 0.11 Pallas' Triton lowering asks for the target GPU, and with no GPU present it reads
it from the current abstract mesh's device; the Mosaic GPU lowering does not need it. Every
`.lower(lowering_platforms=("cuda",))` of a call that may hold a Triton kernel runs inside
`abstract_h100()`.
"""

from __future__ import annotations

import jax

H100 = "NVIDIA H100 80GB HBM3"


def abstract_h100():
    """A context in which lowering targets one H100 (132 SMs), whatever this machine has."""
    device = jax.sharding.AbstractDevice(device_kind=H100, num_cores=132, platform="cuda")
    return jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((1,), ("gpu",), abstract_device=device))


def mosaic_modules_with_and_without_scopes(monkeypatch, lower_calls) -> tuple[list[str], list[str]]:
    """The Mosaic GPU modules that `lower_calls()` lowers (printed without debug info), once as
    written and once with every `jax.named_scope` made a no-op: profiling phases must change
    nothing when profiling is off. Skips where this jax has no serialization pass to observe."""
    import contextlib
    import re

    import pytest

    core = pytest.importorskip("jax.experimental.mosaic.gpu.core")
    if not hasattr(core, "_run_serde_pass"):
        pytest.skip("this jax has no Mosaic GPU serialization pass to observe")

    def modules() -> list[str]:
        jax.clear_caches()  # lower afresh, not from the previous trace
        seen = []
        serde = core._run_serde_pass

        def capture(module, **kw):
            # newer jax numbers each module's dump name by a process-wide counter
            seen.append(re.sub(r'mosaic_gpu\.dump_basename = "[^"]*"', "",
                               module.operation.get_asm(enable_debug_info=False)))
            return serde(module, **kw)

        with monkeypatch.context() as mp:
            mp.setattr(core, "_run_serde_pass", capture)
            with abstract_h100():
                lower_calls()
        return seen

    with_scopes = modules()
    with monkeypatch.context() as mp:
        mp.setattr(jax, "named_scope", lambda name: contextlib.nullcontext())
        without = modules()
    return with_scopes, without
