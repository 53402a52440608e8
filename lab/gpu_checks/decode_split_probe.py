"""Is batch-1 decode bound by the device, the launch of its programs, or the engine's Python?

For each configuration (its own process; dummy weights, buckets compiled lazily, batch-1 decode of
128 tokens after a 128-token prompt, twice after one warm-up):

- step ms and device wait ms per step, from the engine's own timing (host = step - wait);
- the host time of each forward and sampler call (they return once the work is enqueued: the
  launch cost of the program);
- replay ms: the recorded decode steps' programs run back to back with their inputs already on
  the device, no engine around them. That is max(device time, launch time) per step.

If replay is close to the step, the engine's Python is not what bounds the step; if the forward
call's host time is close to replay, the launch is.

    python -m lab.gpu_checks.decode_split_probe [--configs llama-bf16,llama-fp8,qwen3moe-bf16] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CONFIGS = {"llama-bf16": ("llama-3-8b", None), "llama-fp8": ("llama-3-8b", "fp8"),
           "qwen3moe-bf16": ("qwen3-30b-a3b", None), "smollm2-bf16": ("smollm2-135m", None),
           "llama-w4a16": ("llama-3-8b", "gptq"), "llama-gguf": ("llama-3-8b", "gguf")}


def one(name: str) -> dict:
    from jaxengine.device_memory import size_device_pool

    size_device_pool(0.9)
    import numpy as np

    from jaxengine import LLM
    from jaxengine.benchmarks.common import random_requests
    from jaxengine.benchmarks.gpu_suite import StepCapture, synthetic_tokenizer
    from jaxengine.benchmarks.latency import run_batch
    from jaxengine.models.presets import PRESETS

    model, quant = CONFIGS[name]
    vocab = PRESETS[model]["vocab_size"]
    llm = LLM(model, load_format="dummy", dtype="bfloat16", tokenizer=synthetic_tokenizer(tempfile.mkdtemp(), vocab),
              max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=256, num_kv_blocks=1024,
              quantization=quant, enforce_eager=True)
    eng = llm.llm_engine
    runner = eng.runner

    def prompts(i):
        return [q.prompt_token_ids for q in random_requests(1, 128, 128, 0.0, vocab, seed=700 + i)]

    run_batch(llm, prompts(99), 128)  # compiles the buckets it uses
    calls = {"forward": [], "sampler": []}
    orig_fwd, orig_samp = runner._get_forward, runner._get_sampler

    def timed(kind, fn):
        def call(*a):
            t0 = time.perf_counter()
            out = fn(*a)
            calls[kind].append(time.perf_counter() - t0)
            return out
        return call

    runner._get_forward = lambda t: timed("forward", orig_fwd(t))
    runner._get_sampler = lambda *v: timed("sampler", orig_samp(*v))
    before = dict(eng.timing)
    runs = [run_batch(llm, prompts(i), 128) for i in range(2)]
    after = eng.timing
    del runner._get_forward, runner._get_sampler
    n = max(after["steps"] - before["steps"], 1)
    cap = StepCapture(runner, 4)
    run_batch(llm, prompts(5), 64)
    cap.remove()
    replay = cap.replay(reps=20, max_samples=4)
    decode_bucket = min(replay) if replay else None
    steps = [g for r in runs for g in r["decode_steps"]]
    return {"config": name, "model": model, "quantization": quant, "params": len(runner.param_leaves),
            "layers": eng.model_config.num_layers,
            "ms_per_token_median": 1e3 * float(np.median(steps)),
            "step_ms": 1e3 * (after["step_s"] - before["step_s"]) / n,
            "device_wait_ms": 1e3 * (after["device_wait_s"] - before["device_wait_s"]) / n,
            "forward_call_ms": 1e3 * float(np.median(calls["forward"])),
            "sampler_call_ms": 1e3 * float(np.median(calls["sampler"])),
            "replay_bucket": decode_bucket,
            "replay_ms": 1e3 * replay[decode_bucket]["device_s_mean"] if decode_bucket else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="llama-bf16,llama-fp8,qwen3moe-bf16")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--limit", type=float, default=240.0)
    ap.add_argument("--xla-flags", default="", help="XLA_FLAGS added for every configuration's process")
    ap.add_argument("--label", default="", help="suffix of the JSON file's name")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one)), flush=True)
        return 0
    results = []
    for name in args.configs.split(","):
        t0 = time.perf_counter()
        try:
            env = dict(os.environ)
            env["XLA_FLAGS"] = " ".join(f for f in (env.get("XLA_FLAGS", ""), args.xla_flags) if f)
            p = subprocess.run([sys.executable, "-m", "lab.gpu_checks.decode_split_probe", "--one", name],
                               capture_output=True, text=True, timeout=args.limit, env=env)
            last = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
            r = json.loads(last[-1]) if last else {"config": name, "error": p.stderr[-1500:]}
        except subprocess.TimeoutExpired:
            r = {"config": name, "error": f"over {args.limit:.0f} s"}
        r["process_s"] = time.perf_counter() - t0
        r["xla_flags"] = args.xla_flags
        results.append(r)
        print(r, flush=True)
        with open(os.path.join(args.out, f"decode_split_probe{args.label}.json"), "w") as fh:
            json.dump(results, fh, indent=1)
    print("\n| config | params | ms/token | step ms | device wait ms | forward call ms | sampler call ms | replay ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['config']} | {r['error'][-200:]!r} |")
            continue
        print(f"| {r['config']} | {r['params']} | {r['ms_per_token_median']:.2f} | {r['step_ms']:.2f} | "
              f"{r['device_wait_ms']:.2f} | {r['forward_call_ms']:.2f} | {r['sampler_call_ms']:.2f} | "
              f"{r['replay_ms']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
