"""The GPU attention kernels on speculative rows (a few query tokens after a long context), against
the jnp reference, on the device: Llama-3-8B's heads (32 query, 8 KV, head size 128), bf16 and f32.

    python -m lab.gpu_checks.spec_rows_attention
"""

from __future__ import annotations

import sys

import jax.numpy as jnp
import numpy as np


def main() -> int:
    from jaxengine.pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
    from jaxengine.pallas_kernels.ragged_paged_attention_gpu import ragged_paged_attention_gpu
    from tests.kernels.batch_factory import make_batch

    rng = np.random.default_rng(0)
    for q_lens, ctx in (([5], [128]), ([1], [132]), ([5, 5, 1, 5], [130, 200, 77, 140]), ([5] * 16, [140] * 16)):
        for dtype in (jnp.bfloat16, jnp.float32):
            b = make_batch(rng, q_lens=q_lens, ctx_lens=ctx, num_heads=32, num_kv_heads=8, head_dim=128,
                           block_size=16, dtype=dtype, pad_slots=1, pad_tokens=3)
            for prefill in ("triton", "auto"):
                try:
                    out = np.asarray(ragged_paged_attention_gpu(*b.args(), sm_scale=128 ** -0.5, prefill=prefill)
                                     .astype(jnp.float32), np.float64)
                except ValueError as e:
                    print(f"{q_lens} ctx {ctx} {jnp.dtype(dtype).name} {prefill}: {e}")
                    continue
                ref = np.asarray(ragged_paged_attention_reference(*b.args(), sm_scale=128 ** -0.5)
                                 .astype(jnp.float32), np.float64)
                n = int(np.asarray(b.query_start_loc)[len(q_lens)])
                err = np.linalg.norm(out[:n] - ref[:n]) / np.linalg.norm(ref[:n])
                print(f"q_lens {q_lens[:4]}{'...' if len(q_lens) > 4 else ''} ctx {ctx[:4]} {jnp.dtype(dtype).name} "
                      f"{prefill}: rel err {err:.2e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
