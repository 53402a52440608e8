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
