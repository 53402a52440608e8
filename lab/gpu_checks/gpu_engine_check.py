"""GPU check-and-time of the whole engine at a real model shape with dummy weights.

Measures, in one run: the ceilings (copy bandwidth, bf16 matmul), start-up time, batch-1 decode
ms/token against the HBM roofline (weight bytes / copy bandwidth), and offline throughput.
Writes JSON to $OUT (or ./) and prints a short table last.

    python lab/gpu_checks/gpu_engine_check.py --model llama-3-8b --attention-backend auto
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxengine.benchmarks.ceilings import measure  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    args = ap.parse_args()
    out_dir = os.environ.get("OUT", ".")
    result: dict = {"args": vars(args), "jax": jax.__version__, "devices": [str(d) for d in jax.devices()]}
    try:
        result["device_name"] = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                               capture_output=True, text=True).stdout.strip()
    except OSError:
        result["device_name"] = jax.devices()[0].device_kind
    result["ceilings"] = measure()
    print("ceilings", result["ceilings"], flush=True)

    from jaxengine import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", max_model_len=2048,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              attention_backend=args.attention_backend)
    result["startup_s"] = time.perf_counter() - t0
    eng = llm.llm_engine
    result["num_kv_blocks"] = eng.config.num_kv_blocks
    result["attention_impl"] = eng.runner.attention_impl
    result["compile_s"] = eng.runner.compile_seconds
    weight_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(eng.runner.state))
    result["weight_bytes"] = weight_bytes

    # batch-1 decode
    p = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(100, 132))}
    llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    eng.timing.update(steps=0, device_wait_s=0.0, step_s=0.0)
    out = llm.generate(prompt, p, use_tqdm=False)[0]
    result["decode_timing"] = dict(eng.timing)
    eng.timing.update(steps=0, device_wait_s=0.0, step_s=0.0)
    m = out.metrics
    ms_per_tok = (m.last_token_time - m.first_token_time) / (len(out.outputs[0].token_ids) - 1) * 1e3
    roofline_ms = weight_bytes / (result["ceilings"]["copy_bandwidth_GBps"] * 1e9) * 1e3
    result["decode_b1"] = {"ms_per_token": ms_per_tok, "tok_per_s": 1e3 / ms_per_tok,
                           "roofline_ms": roofline_ms, "fraction_of_roofline": roofline_ms / ms_per_tok}
    print("decode b1", result["decode_b1"], flush=True)

    # offline throughput (random token ids)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(0, 32000, size=args.input_len).tolist()}
               for _ in range(args.num_prompts)]
    tp = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, tp, use_tqdm=False)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    result["throughput_timing"] = dict(eng.timing)
    result["throughput_token_ids"] = [list(o.outputs[0].token_ids) for o in outs]
    result["throughput"] = {"seconds": dt, "requests_per_s": len(outs) / dt, "output_tok_per_s": n_out / dt,
                            "total_tok_per_s": (n_out + args.num_prompts * args.input_len) / dt}
    with open(os.path.join(out_dir, f"engine_{args.model}_{args.attention_backend}.json"), "w") as f:
        json.dump(result, f, indent=2)
    print("\n| metric | value |\n|---|---|")
    print(f"| device | {result['device_name']} |")
    print(f"| copy bandwidth GB/s | {result['ceilings']['copy_bandwidth_GBps']:.0f} |")
    print(f"| bf16 matmul TFLOP/s | {result['ceilings']['bf16_matmul_TFLOPs']:.0f} |")
    print(f"| start-up s (compile s) | {result['startup_s']:.1f} ({result['compile_s']:.1f}) |")
    print(f"| attention | {result['attention_impl']} |")
    for k in ("decode_timing", "throughput_timing"):
        tm = result[k]
        print(f"| {k}: steps, step ms, device-wait ms | {tm['steps']}, {1e3 * tm['step_s'] / max(tm['steps'], 1):.2f}, "
              f"{1e3 * tm['device_wait_s'] / max(tm['steps'], 1):.2f} |")
    print(f"| batch-1 decode ms/token | {ms_per_tok:.2f} (roofline {roofline_ms:.2f}, "
          f"{100 * roofline_ms / ms_per_tok:.0f}%) |")
    print(f"| throughput {args.num_prompts}x{args.input_len}/{args.output_len} output tok/s | "
          f"{result['throughput']['output_tok_per_s']:.0f} |")


if __name__ == "__main__":
    main()
