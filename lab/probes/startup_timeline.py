"""Where a cold start's wall time goes, program by program: one engine start in this process
(empty cache directory), every trace / lowering / XLA compile recorded with its thread, its
start and end (from jax.monitoring's duration events) and the program it belongs to (the
warm-up job, or "kv_sizing" / "load" outside it). Prints per-kind sums, the union of the
intervals that hold Python's lock (trace + lower), the longest programs, and writes the full
timeline as JSON.

    python -m lab.probes.startup_timeline --model llama-3-8b --out $OUT       # GPU, dummy weights
    python -m lab.probes.startup_timeline --workers 1 --out /tmp/x            # serial: true per-program costs
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import tempfile
import threading
import time

_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
           "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
           "/jax/core/compile/backend_compile_duration": "compile"}


def _union(intervals):
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a preset or path; default: the embedded SmolLM2")
    ap.add_argument("--workers", type=int, default=0, help="warm-up threads (0: the engine's own choice)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--warmup", action="store_true", help="compile every bucket ahead (the GPU default) on the CPU too")
    ap.add_argument("--no-lowering-lock", action="store_true", help="warm-up threads lower side by side")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()

    import jax

    from jaxengine import model_runner
    from jaxengine.config import EngineConfig
    from jaxengine.engine import LLMEngine

    t_origin = time.perf_counter()
    events = []
    local = threading.local()
    lock = threading.Lock()

    def on_duration(event, duration, **kw):
        kind = _EVENTS.get(event)
        if kind is None:
            return
        end = time.perf_counter() - t_origin
        with lock:
            events.append({"kind": kind, "job": getattr(local, "job", None) or "outside", "thread":
                           threading.get_ident(), "start": end - duration, "end": end})

    jax.monitoring.register_event_duration_secs_listener(on_duration)

    build = model_runner.ModelRunner._build

    def tagged_build(self, kind, key, compile_fn):
        local.job = f"{kind}:{key!r}"
        try:
            return build(self, kind, key, compile_fn)
        finally:
            local.job = None

    model_runner.ModelRunner._build = tagged_build
    if args.workers:
        model_runner.os = type("os_view", (), {"cpu_count": staticmethod(lambda: args.workers),
                                               "environ": os.environ, "path": os.path})

    if args.no_lowering_lock:
        model_runner.LOWERING = contextlib.nullcontext()

    cache = tempfile.mkdtemp(prefix="jaxengine-timeline-")
    try:
        kw = {"compilation_cache_dir": cache}
        if args.model:
            kw.update(model=args.model, load_format="dummy")
        if args.warmup:
            kw["warmup"] = True
        if args.max_num_batched_tokens:
            kw["max_num_batched_tokens"] = args.max_num_batched_tokens
        t0 = time.perf_counter() - t_origin
        engine = LLMEngine(EngineConfig(**kw))
        t1 = time.perf_counter() - t_origin
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    st = engine.startup
    phases = {p: getattr(st, f"{p}_s") for p in ("device_init", "weight_load", "kv_sizing", "runner_init", "warmup")}

    by_job = collections.defaultdict(lambda: collections.defaultdict(float))
    span = {}
    for e in events:
        by_job[e["job"]][e["kind"]] += e["end"] - e["start"]
        a, b = span.get(e["job"], (e["start"], e["end"]))
        span[e["job"]] = (min(a, e["start"]), max(b, e["end"]))
    by_kind = collections.defaultdict(lambda: collections.defaultdict(float))
    count = collections.Counter()
    for job, d in by_job.items():
        k = job.split(":")[0]
        count[k] += 1
        for kind, s in d.items():
            by_kind[k][kind] += s
    gil = _union([(e["start"], e["end"]) for e in events if e["kind"] in ("trace", "lower") and e["start"] >= t0])
    busy_compile = _union([(e["start"], e["end"]) for e in events if e["kind"] == "compile" and e["start"] >= t0])
    print(f"\n## startup timeline {args.label} ({jax.devices()[0].device_kind}, workers "
          f"{args.workers or 'default'}): engine {t1 - t0:.2f} s")
    print("phases: " + ", ".join(f"{p} {s:.2f}" for p, s in phases.items()))
    print(f"trace+lower union {gil:.2f} s, compile union {busy_compile:.2f} s (from the engine's start)")
    print("| kind | programs | trace s | lower s | compile s |\n|---|---|---|---|---|")
    for k in sorted(by_kind, key=lambda k: -sum(by_kind[k].values())):
        d = by_kind[k]
        print(f"| {k} | {count[k]} | {d['trace']:.2f} | {d['lower']:.2f} | {d['compile']:.2f} |")
    print("\nlongest programs (wall from first trace to compile end):")
    print("| job | start | end | trace | lower | compile |\n|---|---|---|---|---|---|")
    for job, (a, b) in sorted(span.items(), key=lambda kv: kv[1][0] - kv[1][1])[:20]:
        d = by_job[job]
        print(f"| {job} | {a - t0:.2f} | {b - t0:.2f} | {d['trace']:.2f} | {d['lower']:.2f} | {d['compile']:.2f} |")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"startup_timeline{('_' + args.label) if args.label else ''}.json")
    with open(path, "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "workers": args.workers, "model": args.model,
                   "engine_s": t1 - t0, "engine_start": t0, "phases": phases, "trace_lower_union_s": gil,
                   "compile_union_s": busy_compile, "events": events}, f)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
