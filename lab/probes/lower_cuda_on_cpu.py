"""What tracing and lowering a GPU forward program costs, measured on a machine without a GPU:
the runner's forward is traced with the Pallas GPU attention kernels (Triton, not interpreted)
and lowered for CUDA (`lowering_platforms=("cuda",)`), which needs no device. Start-up lowers
one program at a time (model_runner.LOWERING), so this is the part of a cold start that Python
alone decides. Prints trace and lower seconds per bucket, then a cProfile of the smallest
bucket's trace + lower with JAX's caches cleared (as for a program of new shapes).

    python -m lab.probes.lower_cuda_on_cpu --model smollm2-135m --buckets 16,256
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--buckets", default="16,256")
    ap.add_argument("--decode-only", action="store_true", help="the decode-only programs' attention")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from jaxengine import model_runner as mr
    from jaxengine.attention_backend import AttentionBackend
    from jaxengine.config import EngineConfig
    from jaxengine.engine import LLMEngine
    from jaxengine.input_batch import abstract_inputs
    from jaxengine.packing import Layout
    from jaxengine.pallas_kernels.ragged_paged_attention_gpu import ragged_paged_attention_gpu

    runner = LLMEngine(EngineConfig(model=args.model, load_format="dummy", dtype="bfloat16", warmup=False,
                                    num_kv_blocks=256, max_model_len=2048, max_num_seqs=16,
                                    max_num_batched_tokens=512, compilation_cache_dir=None)).runner
    attention = AttentionBackend("pallas", "Pallas GPU kernels", ragged_paged_attention_gpu, decode_only_path=True)
    if args.decode_only:
        attention = attention.for_decode_only_steps()

    def trace_and_lower(t: int) -> tuple[float, float]:
        layout = Layout.of(abstract_inputs(t, runner.rows_for(t), runner.config.max_blocks_per_seq))
        fn = jax.jit(mr._flat(mr._forward, runner.graphdef, runner.param_treedef, layout=layout,
                              attention=attention, lora_rank=0), donate_argnums=(1,))
        prev = jax.ShapeDtypeStruct((runner.config.max_num_seqs,), jnp.int32)
        t0 = time.perf_counter()
        traced = fn.trace(runner._params_abs, mr._abstract(runner.kv_caches), layout.abstract(None), prev)
        t1 = time.perf_counter()
        traced.lower(lowering_platforms=("cuda",))
        return t1 - t0, time.perf_counter() - t1

    buckets = [int(b) for b in args.buckets.split(",")]
    for t in buckets:
        a, b = trace_and_lower(t)
        print(f"forward t={t}: trace {a:.2f} s, lower {b:.2f} s", flush=True)
    prof = cProfile.Profile()
    jax.clear_caches()
    prof.enable()
    trace_and_lower(buckets[0])
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(40)
    print("\n".join(line[:170] for line in buf.getvalue().splitlines()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
