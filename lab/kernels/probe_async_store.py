"""Probe (Hopper GPU): `plgpu.async_store_smem` from CTA 1 of a 2-CTA cluster into CTA 0's shared
memory, completing on CTA 0's barrier; CTA 0 copies what landed to the output, which must equal
the input. A pushed split merge in the decode kernel was built on it, measured slower than the
fetched merge on the H100 and removed (kernels_h100_mosaic_decode.md).

    python lab/kernels/probe_async_store.py VARIANT   # run each under `timeout 45`

VARIANT is TILE_ARRIVALS: TILE in bf16 ([64, 128], 128-byte swizzle), f32sw32 ([64, 8] f32,
32-byte swizzle), f32sw128 ([64, 32] f32, 128-byte swizzle); ARRIVALS is the barrier's arrival
count. On the H100 (jax 0.11.2; the same kernel as a one-off script, before it was tidied into
this module) bf16_1 and f32sw32_1 printed "equal"; bf16_128, f32sw32_128 and f32sw128_128 hung:
a store counts as one arrival, not one per thread.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

TILES = {
    "bf16": ((64, 128), jnp.bfloat16, (8, 64), 128),
    "f32sw32": ((64, 8), jnp.float32, (8, 8), 32),
    "f32sw128": ((64, 32), jnp.float32, (8, 32), 128),
}


def kernel(tile: str, arrivals: int):
    """The probe kernel for a tile kind and a barrier arrival count, and its input."""
    shape, dtype, tiling, swizzle = TILES[tile]
    transforms = (plgpu.TilingTransform(tiling), plgpu.SwizzleTransform(swizzle))

    def body(x_ref, o_ref):
        c = lax.axis_index("split")

        def scoped(src, land, bar, loaded, cluster_bar):
            @pl.when(c == 1)
            def _():
                plgpu.copy_gmem_to_smem(x_ref, src, loaded)
                plgpu.barrier_wait(loaded)
                plgpu.async_store_smem(src[...], land, bar, cluster_idx=0, cluster_dim="split")

            @pl.when(c == 0)
            def _():
                plgpu.barrier_wait(bar)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(land, o_ref)
                plgpu.wait_smem_to_gmem(0)

            plgpu.barrier_arrive(cluster_bar)
            plgpu.barrier_wait(cluster_bar)

        pl.run_scoped(scoped, plgpu.SMEM(shape, dtype, transforms=transforms),
                      plgpu.SMEM(shape, dtype, transforms=transforms),
                      plgpu.Barrier(num_arrivals=arrivals), plgpu.Barrier(num_arrivals=1),
                      plgpu.ClusterBarrier(collective_axes=("split",), num_arrivals=1))

    f = pl.kernel(body, out_type=jax.ShapeDtypeStruct(shape, dtype),
                  mesh=plgpu.Mesh(grid=(1,), grid_names=("g",), cluster=(2,),
                                  cluster_names=("split",)))
    return f, jnp.asarray(np.random.default_rng(0).standard_normal(shape), dtype)


def probe(tile: str, arrivals: int) -> bool:
    """Runs the probe (GPU): whether the pushed tile landed intact."""
    f, x = kernel(tile, arrivals)
    return bool(jnp.all(jax.block_until_ready(jax.jit(f)(x)) == x))


if __name__ == "__main__":
    tile, arrivals = sys.argv[1].rsplit("_", 1)
    print(sys.argv[1], "equal" if probe(tile, int(arrivals)) else "DIFFERENT")
