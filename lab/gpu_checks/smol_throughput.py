"""The GPU suite's SmolLM2-shape throughput alone (dummy bf16 weights, batch 256, random 256 in /
256 out), for A/Bs of code trees in one call: prints output tok/s and the engine's step split.

    python -m lab.gpu_checks.smol_throughput [--prompts 1024]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

try:
    from lab.gpu_checks.step_trace import time_compiled_calls
except ImportError:  # run as a script from another folder: this folder is on sys.path
    from step_trace import time_compiled_calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--label", default="")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs of the workload in this process")
    ap.add_argument("--time-launch", action="store_true",
                    help="also time each forward and sampler call (host time to enqueue the program, untraced)")
    args = ap.parse_args()
    from jaxengine.device_memory import size_device_pool

    size_device_pool(0.9)
    from jaxengine import LLM
    from jaxengine.benchmarks.common import SampleRequest, random_requests
    from jaxengine.benchmarks.gpu_suite import synthetic_tokenizer, timing_summary
    from jaxengine.benchmarks.throughput import run_throughput

    t0 = time.perf_counter()
    llm = LLM("smollm2-135m", load_format="dummy", dtype="bfloat16", max_model_len=2048, max_num_seqs=256,
              max_num_batched_tokens=2048, tokenizer=synthetic_tokenizer(tempfile.mkdtemp(), 49152))
    start = time.perf_counter() - t0
    print(f"{args.label}: allocator {os.environ.get('XLA_PYTHON_CLIENT_ALLOCATOR', 'jax default')}, XLA_FLAGS "
          f"{os.environ.get('XLA_FLAGS', '')!r}", flush=True)
    run_throughput(llm, [SampleRequest(r.prompt_token_ids, 16) for r in random_requests(64, 256, 256, 0.0, 49152,
                                                                                       seed=20_001)])
    launches: dict[str, list[float]] = {}
    if args.time_launch:
        launches = time_compiled_calls(llm.llm_engine.runner)
    for i in range(args.repeats):
        launches.clear()
        tr = run_throughput(llm, random_requests(args.prompts, 256, 256, 0.0, 49152, seed=7 + i))
        for key, ts in sorted(launches.items()):
            if len(ts) >= 20:
                q = np.percentile(np.array(ts) * 1e3, [10, 50, 90])
                print(f"{args.label} run {i}: {key} call ms p10/p50/p90 {q[0]:.3f} / {q[1]:.3f} / {q[2]:.3f} "
                      f"({len(ts)} calls)", flush=True)
        t = timing_summary(tr["engine_timing"])
        print(f"{args.label} run {i}: start {start:.1f} s, {tr['output_tokens_per_s']:.0f} output tok/s, "
              f"step {t['step_ms']:.2f} ms, device wait {t['device_wait_ms']:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
