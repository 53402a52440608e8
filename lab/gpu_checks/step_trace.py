"""A device trace of the engine's steps (jax.profiler): per token bucket, where a step's device
time goes (matmuls, attention kernels, other fusions, sampler, copies), and when the device
idles, what the host loop was doing.

    python lab/gpu_checks/step_trace.py --model llama --out $OUT   # Llama-3-8B shape, 256/256 x 1000
    python lab/gpu_checks/step_trace.py --model smol --out $OUT    # SmolLM2-135M shape, 256/256 x 1024
    python lab/gpu_checks/step_trace.py --model llama --quantization fp8 --batch1 --windows 100:40 --out $OUT
    python lab/gpu_checks/step_trace.py --smoke --out /tmp/st      # CPU, tiny model: exercises the parser

The engine is the GPU suite's (benchmarks/gpu_suite.py settings: max_num_seqs 256,
max_num_batched_tokens 2048, dummy bf16 weights). One untraced run of the workload gives the
throughput; then the same workload runs under `jax.profiler.trace` with the host loop's phases
annotated (`je:*` TraceAnnotations wrapped around the engine's methods by this script; nothing in
the engine changes). XLA replaces command buffers (CUDA graphs) by op-by-op launches while a
profiler is active unless `--xla_enable_command_buffers_during_profiling=true` is in XLA_FLAGS;
this script adds it before JAX starts (`--no-graphs-flag` leaves XLA_FLAGS alone), so the traced
launches are the engine's.

Device events are attributed to programs through CUPTI correlation ids (device kernel -> the host
launch call -> the `je:` annotation around it); where that fails, by module name in launch order.
Writes step_trace_<model>.json (the breakdown, diagnostics, a window of raw events for re-analysis)
and prints a short table.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import glob
import gzip
import json
import os
import sys
import tempfile
import time

GRAPHS_FLAG = "--xla_enable_command_buffers_during_profiling=true"
CATEGORIES = ("matmul", "attention", "other", "copy")


def categorize(name: str, line: str = "") -> str:
    """A device event's kind, by its kernel name: cuBLAS / cuBLASLt / Triton GEMM kernels, the
    engine's attention kernels, memory copies, everything else (norms, rope, activations, gathers)."""
    n, ln = name.lower(), line.lower()
    if "memcpy" in n or "memset" in n or "memcpy" in ln:
        return "copy"
    if any(k in n for k in ("rpa_", "attention", "paged", "flash")):
        return "attention"
    if any(k in n for k in ("gemm", "nvjet", "xmma", "cutlass", "cublas", "splitk", "matmul", "dot")):
        return "matmul"
    return "other"


# -- host annotations -------------------------------------------------------------------------------
def time_compiled_calls(runner) -> dict[str, list[float]]:
    """Times every forward and sampler call of `runner` (the host time XLA takes to enqueue the
    program) into the returned dict, by program (`fwd t=T`, `sampler r=R`); `del
    runner._get_forward, runner._get_forward_decode, runner._get_sampler` stops it."""
    launches: dict[str, list[float]] = {}

    def timed(fn, key):
        def call(*a):
            t = time.perf_counter()
            out = fn(*a)
            launches.setdefault(key, []).append(time.perf_counter() - t)
            return out
        return call
    orig_fwd, orig_dec, orig_samp = runner._get_forward, runner._get_forward_decode, runner._get_sampler
    runner._get_forward = lambda t: timed(orig_fwd(t), f"fwd t={t}")
    runner._get_forward_decode = lambda t: timed(orig_dec(t), f"fwd t={t} decode-only")
    runner._get_sampler = lambda *v: timed(orig_samp(*v), f"sampler r={v[0]}")
    return launches


class TraceWindows:
    """Traces the steps of each window (start, count) of a run into its own folder."""

    def __init__(self, windows: list[tuple[int, int]], root: str):
        import jax

        self.jax, self.windows, self.root = jax, windows, root
        self.k, self.active, self.dirs = 0, None, []

    def before(self) -> None:
        for i, (start, _) in enumerate(self.windows):
            if self.k == start and self.active is None:
                d = os.path.join(self.root, f"w{i}")
                opts = self.jax.profiler.ProfileOptions()
                opts.python_tracer_level = 0
                opts.host_tracer_level = 2
                self.jax.profiler.start_trace(d, profiler_options=opts)
                self.active = i
                self.dirs.append(d)

    def after(self) -> None:
        if self.active is not None:
            start, count = self.windows[self.active]
            if self.k >= start + count - 1:
                self.stop()
        self.k += 1

    def stop(self) -> None:
        if self.active is not None:
            self.jax.profiler.stop_trace()
            self.active = None


def annotate_engine(llm, windows: TraceWindows | None = None) -> None:
    """Wraps the engine's loop methods in `je:` TraceAnnotations (instance attributes, this process
    only). Compiled calls are tagged with their bucket: `je:fwd t=T`, `je:sampler r=R`. With
    `windows`, each step also counts towards the trace windows."""
    import jax

    eng = llm.llm_engine
    core, runner = eng.core, eng.runner

    def wrap(owner, attr, label):
        fn = getattr(owner, attr)

        def call(*a, **k):
            with jax.profiler.TraceAnnotation(label):
                return fn(*a, **k)
        setattr(owner, attr, call)

    wrap(core, "step", "je:step")
    if windows is not None:
        inner = core.step

        def counted_step(*a, **k):
            windows.before()
            try:
                return inner(*a, **k)
            finally:
                windows.after()
        core.step = counted_step
    wrap(core.scheduler, "schedule", "je:schedule")
    wrap(core.scheduler, "advance", "je:advance")
    wrap(core, "_resolve", "je:resolve")
    wrap(core, "_outputs", "je:outputs")
    wrap(runner, "collect", "je:collect")
    wrap(runner, "dispatch_forward", "je:dispatch_forward")
    wrap(runner, "dispatch_sampler", "je:dispatch_sampler")
    wrap(runner.builder, "build", "je:inputs")
    wrap(core.worker.processor, "process", "je:worker_process")
    orig_fwd, orig_dec, orig_samp = runner._get_forward, runner._get_forward_decode, runner._get_sampler

    def get_forward(t, orig=orig_fwd, suffix=""):
        fn = orig(t)

        def call(*a):
            with jax.profiler.TraceAnnotation(f"je:fwd t={t}{suffix}"):
                return fn(*a)
        return call

    def get_sampler(*variant):
        fn = orig_samp(*variant)

        def call(*a):
            with jax.profiler.TraceAnnotation(f"je:sampler r={variant[0]}"):
                return fn(*a)
        return call

    runner._get_forward, runner._get_sampler = get_forward, get_sampler
    runner._get_forward_decode = lambda t: get_forward(t, orig_dec, " decode-only")


# -- the profile ------------------------------------------------------------------------------------
def load_events(path: str) -> dict:
    """Host events (the `je:` annotations, CUDA API calls) and device events from an .xplane.pb,
    as plain dicts. Stats are read only where needed: reading them is most of the parse time."""
    from jax.profiler import ProfileData

    pd = ProfileData.from_file(path)
    planes = list(pd.planes)
    has_gpu = any(p.name.startswith("/device:GPU") for p in planes)
    host, device, corr_host = [], [], {}
    other_host = collections.defaultdict(lambda: [0, 0.0])  # (line, name) -> [count, ms]
    diag = {"planes": [], "device_stat_keys": collections.Counter(), "host_corr_events": collections.Counter()}
    for plane in planes:
        lines = list(plane.lines)
        diag["planes"].append({"name": plane.name, "lines": [ln.name for ln in lines][:40]})
        is_device = plane.name.startswith("/device:GPU")
        is_host = plane.name.startswith("/host:")
        for ln in lines:
            for ev in ln.events:
                name, dur = ev.name, ev.duration_ns
                if is_device:
                    if dur <= 0:
                        continue
                    st = dict(ev.stats)
                    diag["device_stat_keys"].update(st.keys())
                    device.append({"name": name, "line": ln.name, "start": ev.start_ns, "end": ev.start_ns + dur,
                                   "module": st.get("hlo_module"), "corr": st.get("correlation_id")})
                elif not is_host:
                    continue
                elif name.startswith("je:"):
                    # the output worker's thread may carry the loop's name (both are the process's OS thread name)
                    line = "output worker" if name == "je:worker_process" else ln.name
                    host.append({"name": name, "line": line, "start": ev.start_ns, "end": ev.start_ns + dur})
                elif name.startswith("cu"):  # a CUDA API call seen by CUPTI (launch, graph launch, copy)
                    st = dict(ev.stats)
                    if "correlation_id" in st:
                        corr_host[st["correlation_id"]] = (ln.name, ev.start_ns)
                        diag["host_corr_events"][name] += 1
                    o = other_host[(ln.name, name)]
                    o[0] += 1
                    o[1] += dur / 1e6
                else:
                    o = other_host[(ln.name, name)]
                    o[0] += 1
                    o[1] += dur / 1e6
                    if not has_gpu and plane.name == "/host:CPU" and dur > 0 and "hlo_module" in (st := dict(ev.stats)):
                        # CPU backend (smoke): XLA's thunks run on its own threads; they stand in for the device
                        device.append({"name": name, "line": ln.name, "start": ev.start_ns,
                                       "end": ev.start_ns + dur, "module": st.get("hlo_module"), "corr": None})
    diag["device_stat_keys"] = dict(diag["device_stat_keys"])
    diag["host_corr_events"] = dict(diag["host_corr_events"].most_common(12))
    device.sort(key=lambda e: e["start"])
    host.sort(key=lambda e: e["start"])
    return {"host": host, "device": device, "corr_host": corr_host, "diag": diag, "other_host": other_host}


def _enclosing(host_by_line: dict, line: str, t: int, prefix: tuple[str, ...]) -> dict | None:
    """The innermost `je:` annotation of `line` containing time t whose name starts with prefix."""
    evs = host_by_line.get(line)
    if not evs:
        return None
    starts = [e["start"] for e in evs]
    i = bisect.bisect_right(starts, t) - 1
    best = None
    # annotations nest; scan back over the few that may still be open at t
    for j in range(i, max(-1, i - 64), -1):
        e = evs[j]
        if e["start"] <= t <= e["end"] and e["name"].startswith(prefix):
            if best is None or (e["start"], -e["end"]) > (best["start"], -best["end"]):
                best = e
    return best


def attribute_programs(ev: dict) -> tuple[list[dict], str]:
    """Device events grouped into program instances ({kind, tag, events}), in device order.

    By correlation: each device event's launch call sits inside a `je:fwd t=..` or
    `je:sampler r=..` annotation (one instance per annotation). Fallback (no correlation ids): runs
    of consecutive events of one module are instances, matched in order to the annotations of that
    program kind."""
    host, device, corr_host = ev["host"], ev["device"], ev["corr_host"]
    by_line = collections.defaultdict(list)
    for h in host:
        by_line[h["line"]].append(h)
    calls = [h for h in host if h["name"].startswith(("je:fwd", "je:sampler"))]
    instances: dict[int, dict] = {}
    matched = 0
    for d in device:
        c = d["corr"]
        if c is None or c not in corr_host:
            continue
        line, t = corr_host[c]
        ann = _enclosing(by_line, line, t, ("je:fwd", "je:sampler"))
        if ann is None:
            continue
        key = id(ann)
        inst = instances.get(key)
        if inst is None:
            inst = instances[key] = {"kind": ann["name"].split()[0][3:], "tag": ann["name"], "host": ann, "events": []}
        inst["events"].append(d)
        matched += 1
    if matched >= 0.5 * max(1, len(device)) and instances:
        out = sorted(instances.values(), key=lambda i: i["events"][0]["start"])
        return out, f"correlation ({matched} of {len(device)} device events)"
    # fallback: module runs in order
    runs: list[dict] = []
    for d in device:
        mod = d["module"] or ""
        kind = "fwd" if "forward" in mod else "sampler" if "sample" in mod else None
        if kind is None:
            if runs:
                runs[-1]["events"].append(d)  # copies and unnamed kernels join the instance they follow
            continue
        if not runs or runs[-1]["kind"] != kind or runs[-1].get("module") != mod:
            runs.append({"kind": kind, "module": mod, "events": []})
        runs[-1]["events"].append(d)
    by_kind = {k: [c for c in calls if c["name"].startswith("je:" + k)] for k in ("fwd", "sampler")}
    seen = collections.Counter()
    for r in runs:
        k = r["kind"]
        i = seen[k]
        seen[k] += 1
        ann = by_kind[k][i] if i < len(by_kind[k]) else None
        r["tag"], r["host"] = (ann["name"], ann) if ann else (f"je:{k} ?", None)
    ok = all(seen[k] == len(by_kind[k]) for k in by_kind)
    return runs, f"module order ({'counts match' if ok else 'COUNTS DIFFER: ' + str(dict(seen)) + ' vs ' + str({k: len(v) for k, v in by_kind.items()})})"


def _union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def analyze(ev: dict, top: int = 40) -> dict:
    """The breakdown: per forward bucket and sampler size, mean device ms per instance by category,
    span and busy time; the device's idle gaps inside the loop's steps, by host phase."""
    instances, method = attribute_programs(ev)
    host = ev["host"]
    steps = [h for h in host if h["name"] == "je:step"]
    loop_line = steps[0]["line"] if steps else None
    per: dict[str, dict] = {}
    for inst in instances:
        evs = inst["events"]
        agg = per.setdefault(inst["tag"], {"count": 0, "busy_ms": 0.0, "span_ms": 0.0, "launch_ms": 0.0,
                                           **{c + "_ms": 0.0 for c in CATEGORIES}, "kernels": collections.Counter(),
                                           "kernel_ms": collections.Counter()})
        agg["count"] += 1
        busy = _union([(e["start"], e["end"]) for e in evs])
        agg["busy_ms"] += sum(e - s for s, e in busy) / 1e6
        agg["span_ms"] += (max(e["end"] for e in evs) - min(e["start"] for e in evs)) / 1e6
        if inst.get("host"):
            agg["launch_ms"] += (inst["host"]["end"] - inst["host"]["start"]) / 1e6
        for e in evs:
            d = (e["end"] - e["start"]) / 1e6
            agg[categorize(e["name"], e["line"]) + "_ms"] += d
            agg["kernels"][e["name"]] += 1
            agg["kernel_ms"][e["name"]] += d
    table = {}
    for tag, a in per.items():
        n = a["count"]
        table[tag] = {"count": n, "kernels_per_instance": sum(a["kernels"].values()) / n,
                      **{k: a[k] / n for k in ("busy_ms", "span_ms", "launch_ms") + tuple(c + "_ms" for c in CATEGORIES)},
                      "top_kernels": [{"name": k[:120], "ms_per_instance": v / n, "calls_per_instance": a["kernels"][k] / n,
                                       "category": categorize(k)} for k, v in a["kernel_ms"].most_common(top)]}
    # The device's idle time inside the traced loop, and what the loop thread was doing then.
    dev_busy = _union([(e["start"], e["end"]) for e in ev["device"]])
    idle_by_phase: collections.Counter = collections.Counter()
    window = (steps[0]["start"], steps[-1]["end"]) if steps else (0, 0)
    loop_anns = [h for h in host if h["line"] == loop_line]
    starts = [h["start"] for h in loop_anns]
    gaps = []
    prev_end = window[0]
    for s, e in dev_busy + [(window[1], window[1])]:
        lo, hi = max(prev_end, window[0]), min(s, window[1])
        if hi > lo:
            gaps.append((lo, hi))
        prev_end = max(prev_end, e)
    bounds = sorted({t for h in loop_anns for t in (h["start"], h["end"])})
    for lo, hi in gaps:
        # split each gap where a loop annotation starts or ends; each piece goes to the innermost
        # annotation around it
        i0, i1 = bisect.bisect_right(bounds, lo), bisect.bisect_left(bounds, hi)
        cuts = [lo] + bounds[i0:i1] + [hi]
        for t, u in zip(cuts, cuts[1:]):
            mid = (t + u) // 2
            i = bisect.bisect_right(starts, mid) - 1
            best = None
            for j in range(i, max(-1, i - 64), -1):
                h = loop_anns[j]
                if h["start"] <= mid <= h["end"] and (best is None or (h["start"], -h["end"]) >
                                                      (best["start"], -best["end"])):
                    best = h  # the innermost: the latest start, then the earliest end
            name = best["name"].split(" ")[0] if best is not None else "outside je:step"
            idle_by_phase[name] += (u - t) / 1e6
    wall_ms = (window[1] - window[0]) / 1e6
    busy_in = sum(max(0, min(e, window[1]) - max(s, window[0])) for s, e in dev_busy) / 1e6
    host_phase_ms = collections.Counter()
    for h in loop_anns:
        host_phase_ms[h["name"].split(" ")[0]] += (h["end"] - h["start"]) / 1e6
    loop_host = collections.Counter({name: v[1] for (line, name), v in ev["other_host"].items() if line == loop_line})
    return {"attribution": method, "programs": table, "loop_host_events_ms": dict(loop_host.most_common(15)), "steps": len(steps), "window_ms": wall_ms,
            "device_busy_ms": busy_in, "device_idle_share": 1 - busy_in / wall_ms if wall_ms else None,
            "idle_ms_by_loop_phase": dict(idle_by_phase.most_common()),
            "loop_phase_ms_total": dict(host_phase_ms.most_common()),
            "device_gaps": len(gaps), "diag": ev["diag"]}


def raw_window(ev: dict, n_steps: int = 12, skip_frac: float = 0.5) -> dict:
    """The raw events of `n_steps` consecutive steps from the middle of the trace (for re-analysis)."""
    steps = [h for h in ev["host"] if h["name"] == "je:step"]
    if not steps:
        return {}
    i = int(len(steps) * skip_frac)
    lo, hi = steps[i]["start"], steps[min(len(steps) - 1, i + n_steps)]["end"]
    keep = lambda e: e["end"] >= lo and e["start"] <= hi  # noqa: E731
    dev = [e for e in ev["device"] if keep(e)]
    corr = {str(e["corr"]): ev["corr_host"][e["corr"]] for e in dev if e["corr"] in ev["corr_host"]}
    return {"host": [e for e in ev["host"] if keep(e)], "device": dev, "corr_host": corr}


# -- the run ----------------------------------------------------------------------------------------
def run(args) -> dict:
    import jax
    import numpy as np

    from jaxengine import LLM
    from jaxengine.benchmarks.common import SampleRequest, random_requests
    from jaxengine.benchmarks.gpu_suite import measure_ceilings, settings, synthetic_tokenizer
    from jaxengine.benchmarks.throughput import run_throughput

    tmp = tempfile.mkdtemp()
    st = settings(args.smoke, tmp)
    ceil = measure_ceilings(st["ceilings"])  # in a subprocess that exits before the engine starts
    spec = st["llama" if args.model == "llama" else "smol"]
    if args.model == "llama":
        _, til, tol, n, _ = st["throughput"][0]
    else:
        _, til, tol, n = st["smol_throughput"]
    if args.num_prompts:
        n = args.num_prompts
    for patch in args.patch:  # module constants of the engine, e.g. models.quantization.FP8_DECODE=xla
        target, value = patch.split("=", 1)
        module, name = target.rsplit(".", 1)
        import importlib

        mod = importlib.import_module(f"jaxengine.{module}")
        if value.startswith("@"):  # a function from this repository, e.g. @lab.kernels.kv_write_gpu:write_kv_engine
            sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
            where, attr = value[1:].split(":")
            setattr(mod, name, getattr(importlib.import_module(where), attr))
            continue
        setattr(mod, name, type(getattr(mod, name))(value) if not isinstance(getattr(mod, name), bool)
                else value.lower() in ("1", "true"))
    kwargs = dict(spec.engine_kwargs())
    if args.patch:  # programs built under patched constants: a cache of their own (the bundle's key
        kwargs["compilation_cache_dir"] = tempfile.mkdtemp()  # holds module constants, not a =@ swap)
    if args.quantization:
        kwargs["quantization"] = args.quantization
    if args.batch1:  # one request, 128 in / 256 out; the small engine quant_h100's decode parts use
        kwargs.update(max_num_seqs=16, max_num_batched_tokens=512)
        til, tol, n = 128, 256, 1
    tok = spec.model if st["smoke"] else synthetic_tokenizer(os.path.join(tmp, "tok"), spec.vocab_size)
    t0 = time.perf_counter()
    llm = LLM(**kwargs, tokenizer=tok)
    startup = time.perf_counter() - t0
    warm = [SampleRequest(r.prompt_token_ids, 16)
            for r in random_requests(n if args.batch1 else st["throughput_warmup"], til, tol, 0.0,
                                     spec.vocab_size, seed=20_001)]
    run_throughput(llm, warm)
    reqs = random_requests(n, til, tol, 0.0, spec.vocab_size, seed=7)
    runner = llm.llm_engine.runner
    launches = time_compiled_calls(runner)
    try:
        plain = run_throughput(llm, reqs)
    finally:
        del runner._get_forward, runner._get_forward_decode, runner._get_sampler
    launch_ms = {k: {"calls": len(v), **dict(zip(("p10", "p50", "p90"), np.percentile(np.array(v) * 1e3, [10, 50, 90])))}
                 for k, v in sorted(launches.items())}
    print(f"[{args.model}] untraced: {plain['output_tokens_per_s']:.0f} output tok/s "
          f"({plain['engine_timing']['steps']} steps, {plain['elapsed_s']:.2f} s, "
          f"{1e3 * plain['elapsed_s'] / max(1, plain['engine_timing']['steps']):.2f} ms a step)", flush=True)
    tw = TraceWindows(args.windows, tempfile.mkdtemp())
    annotate_engine(llm, tw)
    reqs2 = random_requests(n, til, tol, 0.0, spec.vocab_size, seed=8)
    try:
        traced = run_throughput(llm, reqs2)  # annotated; only the windows' steps are traced
    finally:
        tw.stop()
    print(f"[{args.model}] annotated, windows traced: {traced['output_tokens_per_s']:.0f} output tok/s", flush=True)
    res = []
    for (start, count), d in zip(args.windows, tw.dirs):
        path = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0]
        t1 = time.perf_counter()
        ev = load_events(path)
        r = analyze(ev)
        r.update(window={"first_step": start, "steps": count}, parse_s=time.perf_counter() - t1,
                 xplane_bytes=os.path.getsize(path))
        res.append(r)
        print(f"[{args.model}] window {start}:{count} parsed in {r['parse_s']:.1f} s ({r['attribution']})", flush=True)
        with gzip.open(os.path.join(args.out, f"step_trace_{args.model}{args.quantization or ''}_w{start}.json.gz"), "wt") as f:
            json.dump(raw_window(ev), f, default=str)
    return {"model": spec.label, "engine": kwargs, "patches": args.patch, "workload": {"input_len": til, "output_len": tol,
            "num_prompts": n}, "startup_s": startup, "ceilings": ceil, "untraced": plain,
            "untraced_launch_ms": launch_ms,
            "traced": traced, "xla_flags": os.environ.get("XLA_FLAGS", ""), "device": jax.devices()[0].device_kind,
            "jax": jax.__version__, "attention_impl": llm.llm_engine.runner.attention_impl, "windows": res}


def print_table(out: dict) -> None:
    print(f"\n{out['model']} on {out['device']}: untraced {out['untraced']['output_tokens_per_s']:.0f} tok/s, "
          f"annotated with windows traced {out['traced']['output_tokens_per_s']:.0f}")
    c = out["ceilings"]
    print(f"ceilings: copy {c.get('copy_bandwidth_GBps', 0):.0f} GB/s, bf16 matmul {c.get('bf16_matmul_TFLOPs', 0):.1f} TFLOP/s")
    print("untraced launch (host ms of the compiled call, p50):",
          ", ".join(f"{k} {v['p50']:.3f}" for k, v in out["untraced_launch_ms"].items() if v["calls"] >= 10))
    for tr in out["windows"]:
        w = tr["window"]
        print(f"window {w['first_step']}:{w['steps']} ({tr['attribution']}): {tr['steps']} steps over "
              f"{tr['window_ms']:.1f} ms, device busy {tr['device_busy_ms']:.1f} ms "
              f"(idle {100 * (tr['device_idle_share'] or 0):.0f}%)")
        print(f"{'program':>18} {'n':>5} {'busy':>7} {'span':>7} {'launch':>7} "
              + " ".join(f"{c:>9}" for c in CATEGORIES) + "  (ms per instance)")
        for tag, r in sorted(tr["programs"].items(), key=lambda kv: (kv[0].split()[0], int(kv[0].split("=")[-1])
                                                                       if kv[0].split("=")[-1].isdigit() else 0)):
            print(f"{tag:>18} {r['count']:>5} {r['busy_ms']:>7.3f} {r['span_ms']:>7.3f} {r['launch_ms']:>7.3f} "
                  + " ".join(f"{r[c + '_ms']:>9.3f}" for c in CATEGORIES))
        print("  device idle by what the loop thread was doing (ms):",
              ", ".join(f"{k} {v:.1f}" for k, v in list(tr["idle_ms_by_loop_phase"].items())[:8]))
        print("  loop thread's phases (ms):", ", ".join(f"{k} {v:.1f}" for k, v in list(tr["loop_phase_ms_total"].items())[:10]))
        print("  loop thread's XLA / CUDA events (ms):",
              ", ".join(f"{k} {v:.1f}" for k, v in list(tr["loop_host_events_ms"].items())[:8]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("llama", "smol"), default="llama")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model")
    ap.add_argument("--num-prompts", type=int, default=0, help="default: the suite's count")
    ap.add_argument("--windows", default="", help="traced steps, START:COUNT[,START:COUNT...] "
                    "(default: llama 250:80,1020:40; smol 300:80)")
    ap.add_argument("--quantization", default=None, help="the engine's quantization (fp8, gptq, gguf: dummy weights)")
    ap.add_argument("--patch", action="append", default=[], help="MODULE.NAME=VALUE (or =@PKG.MOD:ATTR, a "
                    "function of this repository): a module constant of the "
                    "engine set before it starts (e.g. models.quantization.FP8_DECODE=xla)")
    ap.add_argument("--tag", default="", help="added to the output file names")
    ap.add_argument("--batch1", action="store_true", help="one request, 128 in / 256 out (batch-1 decode)")
    ap.add_argument("--no-graphs-flag", action="store_true", help=f"leave XLA_FLAGS without {GRAPHS_FLAG}")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if not args.no_graphs_flag and not args.smoke and GRAPHS_FLAG not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + GRAPHS_FLAG).strip()
    if "jax" in sys.modules:
        raise RuntimeError("XLA_FLAGS must be set before jax is imported")
    os.makedirs(args.out, exist_ok=True)
    spec = args.windows or ("2:6,20:6" if args.smoke else "250:80,1020:40" if args.model == "llama" else "300:80")
    args.windows = [tuple(int(x) for x in w.split(":")) for w in spec.split(",")]
    out = run(args)
    tag = args.model + (f"_{args.quantization}" if args.quantization else "") + ("_b1" if args.batch1 else "") + args.tag \
        + ("_smoke" if args.smoke else "")
    with open(os.path.join(args.out, f"step_trace_{tag}.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    print_table(out)


if __name__ == "__main__":
    main()
