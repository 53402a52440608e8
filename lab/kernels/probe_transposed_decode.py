"""Probe (Hopper GPU): one KV step of decode attention in the transposed form, S^T = K Q^T.

The decode kernel today puts the G query heads of a KV head in the rows of a 64-row wgmma tile
(4 live rows of 64 at G = 4), so every 128-key step costs a full 64 x 128 x 128 Q.K^T and P.V
plus a softmax over 64 x 128 scores. Transposed, the keys are the wgmma rows (M = 64) and the
heads its columns (N = 16: the smallest width whose rows fill a 32-byte swizzle), so the tensor
and exp work shrink to the live heads:
- S^T [64 keys, 16 heads] = K [64, H] @ Q^T [H, 16] (Q^T as a transposed view of Q [16, H]);
- the softmax reduces over axis 0 (across the warps of the warpgroup);
- P^T goes to shared memory (bf16, 32-byte swizzle) as the B operand of
  O^T [H, 16] = V^T [H, 64] @ P^T [64, 16], in two M = 64 halves of H (V^T a transposed view).
wgmma needs the same swizzle on both operands, so every tile here uses the 32-byte one.

    python lab/kernels/probe_transposed_decode.py           # run and check (GPU)
    python lab/kernels/probe_transposed_decode.py --lower   # lower for CUDA only (any host)

It lowers with jax 0.10.2 and 0.11.2. On the H100 (jax 0.11.2) it printed "max relative error
9.09e-04: ok". The decode kernel now has this form (`DecodeTiling.transposed`), with V and P at
the 128-byte swizzle instead (P stored through a transposed view, jax >= 0.11).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

H, KEYS, HEADS = 128, 64, 16  # head dim, keys per step (wgmma M), heads padded to 16 (wgmma N)
_SWIZZLE32 = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))


def _body(q_ref, k_ref, v_ref, o_ref):
    def scoped(q_s, k_s, v_s, p_s, o_s, bar):
        for src, dst in ((q_ref, q_s), (k_ref, k_s), (v_ref, v_s)):
            plgpu.copy_gmem_to_smem(src, dst, bar)
        plgpu.barrier_wait(bar)

        def qk(acc):
            plgpu.wgmma(acc, k_s, plgpu.transpose_ref(q_s, (1, 0)))
            return acc[...]

        st = pl.run_scoped(qk, plgpu.ACC((KEYS, HEADS), jnp.float32))  # S^T, keys x heads
        m = st.max(axis=0)
        p = jnp.exp2((st - lax.broadcast_in_dim(m, st.shape, [1])) * np.log2(np.e))
        l = p.sum(axis=0)
        p_s[...] = p.astype(jnp.bfloat16)
        plgpu.commit_smem()
        for half in range(H // 64):
            def pv(acc, half=half):
                plgpu.wgmma(acc, plgpu.transpose_ref(v_s.at[:, pl.ds(64 * half, 64)], (1, 0)),
                            p_s)
                return acc[...]

            ot = pl.run_scoped(pv, plgpu.ACC((64, HEADS), jnp.float32))  # O^T rows of H
            o_s.at[pl.ds(64 * half, 64)][...] = ot / lax.broadcast_in_dim(l, ot.shape, [1])
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, o_ref)
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scoped,
                  plgpu.SMEM((HEADS, H), jnp.bfloat16, transforms=_SWIZZLE32),
                  plgpu.SMEM((KEYS, H), jnp.bfloat16, transforms=_SWIZZLE32),
                  plgpu.SMEM((KEYS, H), jnp.bfloat16, transforms=_SWIZZLE32),
                  plgpu.SMEM((KEYS, HEADS), jnp.bfloat16, transforms=_SWIZZLE32),
                  plgpu.SMEM((H, HEADS), jnp.float32),
                  plgpu.Barrier(num_arrivals=3))


step = pl.kernel(_body, out_type=jax.ShapeDtypeStruct((H, HEADS), jnp.float32),
                 mesh=plgpu.Mesh(grid=(1,), grid_names=("g",)))


def main() -> None:
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(s) * 0.3, jnp.bfloat16)
               for s in ((HEADS, H), (KEYS, H), (KEYS, H)))
    if "--lower" in sys.argv:
        jax.jit(step).trace(q, k, v).lower(lowering_platforms=("cuda",))
        print("lowered")
        return
    got = np.asarray(jax.block_until_ready(jax.jit(step)(q, k, v))).T  # [heads, H]
    s = np.asarray(q, np.float32) @ np.asarray(k, np.float32).T
    p = np.exp(s - s.max(1, keepdims=True))
    want = (p / p.sum(1, keepdims=True)) @ np.asarray(v, np.float32)
    err = float(np.abs(got - want).max() / np.abs(want).max())
    print(f"max relative error {err:.2e}: {'ok' if err < 2e-2 else 'FAIL'}")


if __name__ == "__main__":
    main()
