"""`jaxengine bench latency`: one batch at a time, batch size x input length x output length.

For each combination, the engine is stepped by hand with every request of the batch submitted at
once: time to first token (until every request of the batch has its first token), the decode
step latency (gaps between successive steps after that, median and p99), tokens/s, and the share
of the memory roofline. The roofline of one decode step is the bytes it must read: every weight
except an untied input embedding table, of which it gathers one row per sequence, plus the KV cache
of every row (batch x mean context), over the copy bandwidth measured in the same run with
`benchmarks/ceilings.py`; on a CPU that is host memory bandwidth and labelled so. The older
formula (every weight read whole, the embedding table included) is printed beside it: it
overstates a decode step's bytes by the table's size (about 7% for Llama-3-8B).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
import time

import numpy as np

from jaxengine.benchmarks.common import (args_dict, decode_weight_bytes, default_out, environment, make_llm,
                                         percentiles, random_requests, weight_bytes, write_json)

logger = logging.getLogger(__name__)


def run_batch(llm, prompts: list[list[int]], output_len: int) -> dict[str, object]:
    """One batch to completion; times from the engine's own step loop (seconds)."""
    from jaxengine import SamplingParams

    eng = llm.llm_engine
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    emit, eng.emit_unfinished = eng.emit_unfinished, True
    seen: dict[str, int] = {}
    step_ends: list[float] = []  # when each step that produced tokens returned
    first_all = None
    try:
        t0 = time.perf_counter()
        for p in prompts:
            eng.add_request(eng.new_request_id(), {"prompt_token_ids": p}, params)
        while eng.has_unfinished_requests():
            outs = eng.step()
            now = time.perf_counter()
            grew = False
            for o in outs:
                n = len(o.outputs[0].token_ids)
                grew |= n > seen.get(o.request_id, 0)
                seen[o.request_id] = n
            if grew:
                step_ends.append(now)
            if first_all is None and len(seen) == len(prompts) and all(v > 0 for v in seen.values()):
                first_all = now
        total = time.perf_counter() - t0
    finally:
        eng.emit_unfinished = emit
    ttft = (first_all if first_all is not None else t0 + total) - t0
    after = [t for t in step_ends if first_all is not None and t >= first_all]
    gaps = np.diff(after).tolist() if len(after) > 1 else []
    return {"ttft_s": ttft, "total_s": total, "decode_steps": gaps, "output_tokens": sum(seen.values())}


def cmd_latency(args: argparse.Namespace) -> int:
    import jax

    from jaxengine.benchmarks.ceilings import copy_bandwidth
    from jaxengine.device_memory import choose_launch_allocator, size_device_pool
    from jaxengine.model_runner import kv_bytes_per_block

    # as the engine would, before the ceiling below starts the backend (its pool and allocator)
    size_device_pool(args.gpu_memory_utilization)
    choose_launch_allocator(args.tensor_parallel_size)
    on_cpu = jax.default_backend() == "cpu"
    nbytes = args.bandwidth_bytes or ((256 << 20) if on_cpu else (2 << 30))
    bw = copy_bandwidth(nbytes)
    t0 = time.perf_counter()
    llm = make_llm(args)
    startup = time.perf_counter() - t0
    eng = llm.llm_engine
    wbytes = weight_bytes(llm)
    read_bytes = decode_weight_bytes(llm)  # the input embedding table is gathered, not read
    mc = eng.model_config  # one gathered embedding row per sequence (none if the table is the output projection)
    row_bytes = 0 if mc.tie_word_embeddings else mc.hidden_size * np.dtype(eng.runner.dtype).itemsize
    kv_per_token = kv_bytes_per_block(eng.model_config, eng.config.block_size,
                                     eng.runner.attention.kv_dtype(eng.runner.dtype),
                                     eng.runner.attention.kv_head_dim(eng.model_config.head_dim)) / eng.config.block_size
    rows = []
    for bs, il, ol in itertools.product(args.batch_size, args.input_len, args.output_len):
        if bs > eng.config.max_num_seqs:
            raise ValueError(f"batch size {bs} exceeds max_num_seqs={eng.config.max_num_seqs}")
        if il + ol > eng.config.max_model_len:
            raise ValueError(f"input {il} + output {ol} exceeds max_model_len={eng.config.max_model_len}")
        def prompts(i: int) -> list[list[int]]:  # fresh tokens each iteration: no prefix-cache hits
            reqs = random_requests(bs, il, ol, 0.0, eng.model_config.vocab_size, seed=args.dataset_seed + 1000 * i)
            return [r.prompt_token_ids for r in reqs]

        for i in range(args.num_iters_warmup):
            run_batch(llm, prompts(args.num_iters + i), ol)
        runs = [run_batch(llm, prompts(i), ol) for i in range(args.num_iters)]
        steps = [g for r in runs for g in r["decode_steps"]]
        step = percentiles(steps)
        totals = [r["total_s"] for r in runs]
        ttfts = [r["ttft_s"] for r in runs]
        kv_bytes = bs * (il + ol / 2) * kv_per_token
        step_bytes = read_bytes + bs * row_bytes + kv_bytes
        roof_s = step_bytes / bw
        roof_all_s = (wbytes + kv_bytes) / bw  # the older formula: the whole embedding table read
        rows.append({
            "batch_size": bs, "input_len": il, "output_len": ol, "iters": args.num_iters,
            "latency_s": percentiles(totals), "ttft_ms": {k: v * 1e3 for k, v in percentiles(ttfts).items()},
            "decode_step_ms": {k: v * 1e3 for k, v in step.items()}, "decode_steps_measured": len(steps),
            "tokens_per_s": bs * ol / float(np.mean(totals)),
            "decode_tokens_per_s": bs / step["median"] if steps else None,
            "decode_step_bytes": step_bytes, "roofline_step_ms": roof_s * 1e3,
            "fraction_of_roofline": roof_s / step["median"] if steps else None,
            "roofline_step_ms_all_weights": roof_all_s * 1e3,
            "fraction_of_roofline_all_weights": roof_all_s / step["median"] if steps else None,
        })
    payload = {"benchmark": "latency", "environment": environment(), "args": args_dict(args),
               "engine_config": dataclasses.asdict(eng.config), "startup_s": startup, "compile_s": eng.runner.compile_seconds,
               "weight_bytes": wbytes, "decode_weight_bytes": read_bytes, "kv_bytes_per_token": kv_per_token,
               "bandwidth": {"copy_bandwidth_GBps": bw / 1e9, "buffer_bytes": nbytes,
                             "kind": "host memory (CPU)" if on_cpu else "device memory (HBM)",
                             "roofline_note": ("CPU: the roofline is host memory bandwidth, a loose bound"
                                               if on_cpu else "HBM roofline: weight bytes read (an untied input embedding "
                                               "table is gathered, one row per sequence, not read) + KV bytes per "
                                               "decode step; *_all_weights: the older formula, every weight read")},
               "results": rows}
    path = write_json(default_out(args, "latency"), payload)
    mem = "host-mem" if on_cpu else "HBM"
    print(f"copy bandwidth ({mem}): {bw / 1e9:.1f} GB/s; weights {wbytes / 1e9:.3f} GB")
    print(f"| batch | in | out | TTFT ms (median) | step ms median | step ms p99 | tok/s | {mem} roofline ms "
          f"(share) | older formula: all weights ms (share) |")
    print("|---|---|---|---|---|---|---|---|---|")

    def share(ms: float, frac: float | None) -> str:
        return f"{ms:.2f} ({'n/a' if frac is None else f'{100 * frac:.0f}%'})"

    for r in rows:
        print(f"| {r['batch_size']} | {r['input_len']} | {r['output_len']} | {r['ttft_ms']['median']:.2f} | "
              f"{r['decode_step_ms']['median']:.2f} | {r['decode_step_ms']['p99']:.2f} | {r['tokens_per_s']:.1f} | "
              f"{share(r['roofline_step_ms'], r['fraction_of_roofline'])} | "
              f"{share(r['roofline_step_ms_all_weights'], r['fraction_of_roofline_all_weights'])} |")
    print(f"results: {path}")
    return 0


def add_parser(sub) -> None:
    from jaxengine.arg_utils import add_engine_args

    p = sub.add_parser("latency", help="per-batch latency: TTFT, decode step median/p99, share of the roofline")
    p.add_argument("--model", default=None, help="HF folder, GGUF file, hub id, or a preset with --load-format dummy "
                                                "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1], help="batch sizes to measure")
    p.add_argument("--input-len", type=int, nargs="+", default=[32], help="prompt lengths in tokens")
    p.add_argument("--output-len", type=int, nargs="+", default=[128], help="output lengths in tokens")
    p.add_argument("--num-iters-warmup", type=int, default=1, help="untimed batches before the measurement")
    p.add_argument("--num-iters", type=int, default=3, help="timed batches per configuration")
    p.add_argument("--dataset-seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--bandwidth-bytes", type=int, default=None,
                   help="buffer for the copy-bandwidth measurement (default 256 MiB on CPU, 2 GiB otherwise)")
    p.add_argument("--output-json", default=None,
                   help="where to write the results (default: ./bench_latency_<model>_<time>.json)")
    add_engine_args(p)
    p.set_defaults(func=cmd_latency)
