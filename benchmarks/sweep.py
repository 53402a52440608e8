"""`jaxengine bench sweep`: compare bucket schedules for one model and one workload.

A schedule is (max_num_batched_tokens, max_num_seqs, block_size): the engine derives its token
buckets (powers of two up to the budget, `jaxengine.config.token_buckets`) and row buckets
(min(bucket, max_num_seqs)) from it. For each schedule, on a fresh engine built without start-up
compilation, every token bucket is:
- compiled, timed as the first step of that bucket minus its steady step time (the persistent
  XLA cache makes repeats cheap: pass --compilation-cache-dir '' for cold numbers);
- stepped `--bucket-iters` times after warm-up with the bucket full (its tokens spread evenly over
  its rows, each row a fresh prefill chunk): the median step latency and tokens/s.
Then the workload (random lengths, ShareGPT, or a JSONL trace) is replayed offline through
`LLM.generate`, recording every step's scheduled tokens against its bucket: padding waste is
the share of bucket slots that held no token. The schedule with the least replay time wins; its
engine flags are printed. Writes JSON, two CSVs and (with matplotlib) PNG plots.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import gc
import json
import logging
import os
import time

import numpy as np

from jaxengine.benchmarks.common import (SampleRequest, args_dict, environment, make_llm, percentiles,
                                         write_json)

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Schedule:
    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int

    @classmethod
    def parse(cls, text: str) -> Schedule:
        """`"512:64:16"` -> Schedule(512, 64, 16)."""
        parts = text.split(":")
        try:
            values = [int(p) for p in parts]
        except ValueError:
            values = []
        if len(values) != 3 or min(values) <= 0:
            raise ValueError(f"--schedule takes TOKENS:SEQS:BLOCK (positive integers), got {text!r}")
        return cls(*values)

    @property
    def flags(self) -> str:
        return (f"--max-num-batched-tokens {self.max_num_batched_tokens} --max-num-seqs {self.max_num_seqs} "
                f"--block-size {self.block_size}")

    @property
    def label(self) -> str:
        return f"{self.max_num_batched_tokens}:{self.max_num_seqs}:{self.block_size}"


def load_trace(path: str, vocab_size: int, seed: int = 0) -> list[SampleRequest]:
    """A JSONL trace: one request a line, `{"input_len": N, "output_len": M}` (random tokens) or
    `{"prompt_token_ids": [...], "output_len": M}`; other keys (timestamps) are ignored."""
    rng = np.random.default_rng(seed)
    out = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            if "output_len" not in rec or not ("input_len" in rec or "prompt_token_ids" in rec):
                raise ValueError(f"{path}:{i}: each line needs output_len and input_len or prompt_token_ids")
            ids = rec.get("prompt_token_ids") or rng.integers(10, vocab_size, size=int(rec["input_len"])).tolist()
            out.append(SampleRequest([int(t) for t in ids], int(rec["output_len"])))
    if not out:
        raise ValueError(f"{path} holds no requests")
    return out


def _fake_step(runner, t: int, first_block: int):
    """A scheduler output whose rows fill bucket `t` exactly (tokens spread over min(t, max_num_seqs) rows,
    each a prefill chunk from position 0), or None when a row would exceed max_model_len."""
    from jaxengine.sampling_params import SamplingParams
    from jaxengine.request import RequestSpec
    from jaxengine.scheduler import ScheduledSeq, SchedulerOutput

    r = runner.rows_for(t)
    cfg = runner.config
    sizes = [t // r + (1 if i < t % r else 0) for i in range(r)]
    if max(sizes) >= cfg.max_model_len:
        return None
    params = SamplingParams(temperature=0.0, max_tokens=1)
    seqs, block = [], first_block
    usable = cfg.num_kv_blocks - 1  # block 0 is the null block
    for i, n in enumerate(sizes):
        nb = -(-n // cfg.block_size)
        blocks = [1 + (block + j) % usable for j in range(nb)]
        block += nb
        toks = list(range(10, 10 + n))
        seqs.append(ScheduledSeq(f"bench-{i}", 0, n, toks, blocks, True, RequestSpec(params, 0, toks), None))
    return SchedulerOutput(seqs, t, [], [])


def measure_buckets(llm, iters: int, warmup: int) -> list[dict[str, object]]:
    """Per token bucket: first-step (compile) seconds and steady step latency, on an idle engine."""
    runner = llm.llm_engine.runner
    out = []
    for t in runner.token_buckets:
        step = _fake_step(runner, t, 0)
        if step is None:
            out.append({"bucket": t, "rows": runner.rows_for(t), "skipped": "a row would exceed max_model_len"})
            continue
        t0 = time.perf_counter()
        runner.execute(step)
        first = time.perf_counter() - t0
        for _ in range(warmup):
            runner.execute(step)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            runner.execute(step)
            times.append(time.perf_counter() - t0)
        med = float(np.median(times))
        out.append({"bucket": t, "rows": runner.rows_for(t), "compile_s": max(first - med, 0.0),
                    "first_step_s": first, "step_ms": {k: v * 1e3 for k, v in percentiles(times).items()},
                    "tokens_per_s": t / med})
    return out


def replay(llm, requests: list[SampleRequest]) -> dict[str, object]:
    """Runs the workload through `LLM.generate`, counting real vs padded tokens of every step."""
    from jaxengine.config import pick_bucket
    from jaxengine.sampling_params import SamplingParams

    runner = llm.llm_engine.runner
    steps: list[tuple[int, int]] = []  # (scheduled tokens, bucket)
    original = runner.dispatch

    def counting(sched, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        n = sched.num_batched_tokens
        steps.append((n, pick_bucket(runner.token_buckets, n)))
        return original(sched, *a, **kw)

    runner.dispatch = counting
    try:
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
        params = [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True) for r in requests]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        total = time.perf_counter() - t0
    finally:
        del runner.dispatch  # back to the class method
    real = sum(n for n, _ in steps)
    slots = sum(b for _, b in steps)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    per_bucket: dict[int, int] = {}
    for _, b in steps:
        per_bucket[b] = per_bucket.get(b, 0) + 1
    return {"total_s": total, "steps": len(steps), "scheduled_tokens": real, "bucket_slots": slots,
            "padding_waste": 1 - real / slots if slots else 0.0, "output_tokens": n_out,
            "output_tokens_per_s": n_out / total,
            "steps_per_bucket": {str(k): v for k, v in sorted(per_bucket.items())}}


def release(llm) -> None:
    """Frees the engine's device buffers (weights, KV cache) now, so the next schedule's engine
    sizes its KV cache from memory that is really free."""
    import jax

    runner = llm.llm_engine.runner
    for a in jax.tree.leaves((runner.kv_caches, runner.state, runner.param_leaves)):
        if isinstance(a, jax.Array) and not a.is_deleted():
            a.delete()


def _workload(args: argparse.Namespace, vocab: int, tokenizer, max_len: int) -> list[SampleRequest]:
    from jaxengine.benchmarks.throughput import build_requests

    if args.trace:
        reqs = load_trace(args.trace, vocab, args.dataset_seed)
        if any(r.prompt_len + r.output_len > max_len for r in reqs):
            raise ValueError(f"the trace has requests longer than max_model_len={max_len}")
        return reqs
    return build_requests(args, vocab, tokenizer, max_len)


def cmd_sweep(args: argparse.Namespace) -> int:
    schedules = [Schedule.parse(s) for s in (args.schedule or ["256:64:16", "512:64:16", "1024:64:16"])]
    rows = []
    workload = None
    for sched in schedules:
        t0 = time.perf_counter()
        llm = make_llm(args, max_num_batched_tokens=sched.max_num_batched_tokens, max_num_seqs=sched.max_num_seqs,
                       block_size=sched.block_size, warmup=False)
        load_s = time.perf_counter() - t0
        eng = llm.llm_engine
        if workload is None:  # the same requests for every schedule
            workload = _workload(args, eng.model_config.vocab_size, eng.tokenizer, eng.config.max_model_len)
        buckets = measure_buckets(llm, args.bucket_iters, args.bucket_warmup)
        rep = replay(llm, workload)
        rows.append({"schedule": dataclasses.asdict(sched), "label": sched.label, "flags": sched.flags,
                     "token_buckets": list(eng.runner.token_buckets), "num_kv_blocks": eng.config.num_kv_blocks,
                     "load_s": load_s, "compile_s": sum(b.get("compile_s", 0.0) for b in buckets),
                     "buckets": buckets, "replay": rep})
        logger.info("schedule %s: replay %.2f s, padding waste %.1f%%", sched.label, rep["total_s"],
                    100 * rep["padding_waste"])
        release(llm)
        del llm, eng
        gc.collect()
    best = min(rows, key=lambda r: (r["replay"]["total_s"], r["compile_s"]))
    stem = args.output_prefix or os.path.join(".",
                                              f"bench_sweep_{os.path.basename(str(args.model or 'default'))}")
    payload = {"benchmark": "sweep", "environment": environment(), "args": args_dict(args),
               "workload": {"num_requests": len(workload), "input_tokens": sum(r.prompt_len for r in workload),
                            "output_tokens": sum(r.output_len for r in workload)},
               "schedules": rows, "recommended": {"label": best["label"], "flags": best["flags"]}}
    files = [write_json(stem + ".json", payload), *write_csvs(stem, rows)]
    files += write_plots(stem, rows)
    print("| schedule T:S:B | buckets | compile s | replay s | padding waste | output tok/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        rep = r["replay"]
        print(f"| {r['label']} | {len(r['token_buckets'])} | {r['compile_s']:.2f} | {rep['total_s']:.2f} | "
              f"{100 * rep['padding_waste']:.1f}% | {rep['output_tokens_per_s']:.1f} |")
    dummy = " --load-format dummy" if getattr(args, "load_format", None) == "dummy" else ""
    print(f"recommended schedule {best['label']} (least replay time); engine flags: {best['flags']}")
    print(f"  e.g. jaxengine serve {args.model or ''}{dummy} {best['flags']}")
    for f in files:
        print(f"wrote {f}")
    return 0


def write_csvs(stem: str, rows: list[dict]) -> list[str]:
    """`<stem>_buckets.csv` (one line per schedule x bucket) and `<stem>_schedules.csv`."""
    bpath, spath = stem + "_buckets.csv", stem + "_schedules.csv"
    with open(bpath, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["schedule", "bucket", "rows", "compile_s", "step_ms_median", "step_ms_p99", "tokens_per_s"])
        for r in rows:
            for b in r["buckets"]:
                if "skipped" in b:
                    continue
                w.writerow([r["label"], b["bucket"], b["rows"], f"{b['compile_s']:.4f}",
                            f"{b['step_ms']['median']:.4f}", f"{b['step_ms']['p99']:.4f}", f"{b['tokens_per_s']:.2f}"])
    with open(spath, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["schedule", "max_num_batched_tokens", "max_num_seqs", "block_size", "num_buckets", "compile_s",
                    "replay_s", "padding_waste", "output_tokens_per_s", "flags"])
        for r in rows:
            s, rep = r["schedule"], r["replay"]
            w.writerow([r["label"], s["max_num_batched_tokens"], s["max_num_seqs"], s["block_size"],
                        len(r["token_buckets"]), f"{r['compile_s']:.4f}", f"{rep['total_s']:.4f}",
                        f"{rep['padding_waste']:.4f}", f"{rep['output_tokens_per_s']:.2f}", r["flags"]])
    return [bpath, spath]


def write_plots(stem: str, rows: list[dict]) -> list[str]:
    """Step latency per bucket, and replay time / padding waste per schedule (PNG, needs matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed (pip install 'jaxengine[bench]'): skipping the PNG plots")
        return []
    p1, p2 = stem + "_buckets.png", stem + "_schedules.png"
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        bs = [b for b in r["buckets"] if "skipped" not in b]
        ax.plot([b["bucket"] for b in bs], [b["step_ms"]["median"] for b in bs], marker="o", label=r["label"])
    ticks = sorted({b["bucket"] for r in rows for b in r["buckets"]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set(xlabel="token bucket", ylabel="median step latency (ms)", title="step latency per bucket")
    ax.legend(title="T:S:B")
    fig.tight_layout()
    fig.savefig(p1, dpi=120)
    plt.close(fig)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 4))
    labels = [r["label"] for r in rows]
    a1.bar(labels, [r["replay"]["total_s"] for r in rows])
    a1.set(ylabel="replay time (s)", title="workload replay")
    a2.bar(labels, [100 * r["replay"]["padding_waste"] for r in rows])
    a2.set(ylabel="padding waste (%)", title="bucket padding")
    for a in (a1, a2):
        a.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(p2, dpi=120)
    plt.close(fig)
    return [p1, p2]


def add_parser(sub) -> None:
    from jaxengine.arg_utils import add_engine_args
    from jaxengine.benchmarks.throughput import add_dataset_args

    p = sub.add_parser("sweep", help="compare bucket schedules: compile time, step latency, padding waste")
    p.add_argument("--model", default=None, help="HF folder, GGUF file, hub id, or a preset with --load-format dummy "
                                                "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--schedule", action="append", default=None, metavar="TOKENS:SEQS:BLOCK",
                   help="a candidate (max_num_batched_tokens:max_num_seqs:block_size), repeatable "
                        "(default 256:64:16, 512:64:16, 1024:64:16)")
    add_dataset_args(p, num_prompts=64)
    p.add_argument("--trace", default=None,
                   help="JSONL workload trace (input_len/prompt_token_ids, output_len) (default: the dataset flags)")
    p.add_argument("--bucket-iters", type=int, default=20, help="timed steps per bucket")
    p.add_argument("--bucket-warmup", type=int, default=3, help="untimed steps per bucket before timing")
    p.add_argument("--output-prefix", default=None,
                   help="path stem for .json, _buckets.csv, _schedules.csv, .png (default: ./bench_sweep_<model>)")
    add_engine_args(p)
    p.set_defaults(func=cmd_sweep)
