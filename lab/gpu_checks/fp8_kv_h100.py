"""The Triton attention kernels over an fp8 (e4m3) KV cache on the device (sm_89+), not yet run: that
they compile (tt.fp_to_fp e4m3 -> bf16 / f32), match the jnp reference over the same cache, and
what they cost or save against a bf16 cache. Llama-3-8B's heads (32 query, 8 KV, head size 128).

    python -m lab.gpu_checks.fp8_kv_h100 [--skip-engine]

Prints, per batch (a decode batch at long context, a prefill chunk, a mixed batch) and query dtype:
the relative error against the reference over the dequantized cache (expect ~1e-3 in bf16, ~1e-6
in f32), against the bf16 cache (expect ~0.03, the e4m3 rounding), and the median time of the
fp8 and bf16 calls. Then an engine with kv_cache_dtype="fp8" (dummy Llama-3-8B weights) generates.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def _median_ms(fn, *args, reps: int = 20) -> float:
    fn(*args).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))


def _rel(a, b) -> float:
    a, b = (np.asarray(x.astype(jnp.float32), np.float64) for x in (a, b))
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main() -> int:
    from jaxengine.pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
    from jaxengine.pallas_kernels.ragged_paged_attention_gpu import ragged_paged_attention_gpu
    from tests.kernels.batch_factory import make_batch

    print(jax.devices()[0].device_kind, jax.devices()[0].compute_capability, flush=True)
    rng = np.random.default_rng(0)
    fp8 = jnp.float8_e4m3fn
    cases = {"decode 64 x 2048": ([1] * 64, [2047] * 64), "prefill 1024 @ 1024": ([1024], [1024]),
             "mixed": ([1] * 32 + [256, 100], [1500] * 32 + [0, 900])}
    for label, (q_lens, ctx) in cases.items():
        for dtype in (jnp.bfloat16, jnp.float32):
            b = make_batch(rng, q_lens=q_lens, ctx_lens=ctx, num_heads=32, num_kv_heads=8, head_dim=128,
                           block_size=16, dtype=dtype, pad_tokens=8)
            rest = b.args()[3:]
            kc, vc = b.k_cache.astype(jnp.bfloat16), b.v_cache.astype(jnp.bfloat16)
            k8, v8 = kc.astype(fp8), vc.astype(fp8)
            kw = dict(sm_scale=128 ** -0.5, prefill="auto")
            out8 = ragged_paged_attention_gpu(b.q, k8, v8, *rest, **kw)
            ref8 = ragged_paged_attention_reference(b.q.astype(jnp.float32), k8.astype(jnp.float32),
                                                    v8.astype(jnp.float32), *rest, sm_scale=kw["sm_scale"])
            ref16 = ragged_paged_attention_reference(b.q.astype(jnp.float32), kc.astype(jnp.float32),
                                                     vc.astype(jnp.float32), *rest, sm_scale=kw["sm_scale"])
            n = int(np.asarray(b.query_start_loc)[len(q_lens)])
            line = (f"{label} {jnp.dtype(dtype).name}: err vs same fp8 cache {_rel(out8[:n], ref8[:n]):.2e}, "
                    f"vs bf16 cache {_rel(out8[:n], ref16[:n]):.3f}")
            if dtype == jnp.bfloat16:
                f = jax.jit(lambda q, k, v, *r: ragged_paged_attention_gpu(q, k, v, *r, **kw))
                line += (f"; fp8 {_median_ms(f, b.q, k8, v8, *rest):.3f} ms, "
                         f"bf16 {_median_ms(f, b.q, kc, vc, *rest):.3f} ms")
            print(line, flush=True)

    if "--skip-engine" in sys.argv:
        return 0
    from jaxengine import LLM, SamplingParams
    llm = LLM("llama-3-8b", load_format="dummy", dtype="bfloat16", kv_cache_dtype="fp8", max_model_len=2048)
    print("engine attention:", llm.llm_engine.runner.attention_impl, flush=True)
    out = llm.generate(["Hello"] * 4, SamplingParams(max_tokens=16, temperature=0.0))
    print("engine generated", [len(o.outputs[0].token_ids) for o in out], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
