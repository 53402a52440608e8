"""Host time per engine step at 256 running decode requests, by phase, on the CPU.

A tiny random Llama (1 layer, hidden 64, vocabulary 2048, the SmolLM2 tokenizer) keeps the
"device" work (XLA on the same CPU) small, so what is measured is the engine's Python: the
scheduler, the input and sampling-metadata builders, the dispatch call, the resolve of the
sampled tokens and the output processing (detokenization, RequestOutputs). Every phase is
timed by wrapping the engine's own methods with `time.perf_counter`; a step counts as steady
when it schedules 256 decode rows and processes 256 sampled rows, none of them finishing. The
benchmark's own bookkeeping per step (counting the scheduled decode rows) is timed apart and left
out of the step's time (`instrumentation (excluded)`).

Two modes: offline (`LLM.generate`, `emit_unfinished=False`: only final outputs) and server
(`emit_unfinished=True`: one RequestOutput per request per step, as the API server streams).

    python benchmarks/host_overhead.py                        # measure the installed code
    python benchmarks/host_overhead.py --profile offline      # cProfile of the steady steps
    mkdir /tmp/before && git archive <old commit> jaxengine models pallas_kernels server pyproject.toml \
        | tar -x -C /tmp/before
    python benchmarks/host_overhead.py --before-tree /tmp/before   # old vs installed, alternating
                                                                   # processes; writes results/
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# XLA's CPU work on one thread: the "device" keeps to about one core and the engine's Python
# thread has the other, as a host beside a GPU would (the machine has 2 cores).
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(ROOT)  # tests.tiny_checkpoints (after PYTHONPATH: --before-tree puts older code first)

RESULTS = os.path.join(ROOT, "benchmarks", "results", "host_overhead_cpu")
NUM_REQUESTS = 256
PROMPT_LEN = 8
OUTPUT_LEN = 96

# (phase, what it covers); `dispatch: launch` is the dispatch minus its timed parts.
PHASES = [
    ("schedule", "Scheduler.schedule"),
    ("dispatch: inputs", "InputBuilder.build: token ids, positions, slots, block tables (and "
                         "PersistentBatch.rows where there is one)"),
    ("dispatch: sampling md", "SamplingMetadata from the scheduled rows (or the persistent batch's slots, "
                              "packed where the code has rows_sampling_packed)"),
    ("dispatch: launch", "the rest of ModelRunner.dispatch: bucket pick, compiled calls"),
    ("collect (device wait)", "ModelRunner.collect: waiting for the step, device-to-host copy"),
    ("resolve", "EngineCore._resolve minus collect: sampled ids, Scheduler.resolve"),
    ("advance", "Scheduler.advance"),
    ("process outputs", "EngineCore._outputs: the loop's part of output processing (all of it when inline)"),
    ("output processing, any thread", "OutputProcessor.process: detokenize, stop checks, RequestOutputs, "
                                      "in the loop or on the output worker thread (overlapping the device wait)"),
]


def make_engine(tmp: str):
    from jaxengine import LLM
    from jaxengine.default_model import default_model_path
    from jaxengine.models.checkpoint import open_checkpoint
    from tests.tiny_checkpoints import make_checkpoint

    tok = open_checkpoint(default_model_path()).load_tokenizer()
    path = make_checkpoint("llama", os.path.join(tmp, "tiny"), tokenizer=tok, num_layers=1, vocab_size=2048)
    llm = LLM(path, max_num_seqs=NUM_REQUESTS, max_model_len=256, num_kv_blocks=2048,
              max_num_batched_tokens=512, warmup=False, compilation_cache_dir=os.path.join(tmp, "xla"))
    return llm


class Timer:
    """Wraps engine methods; accumulates seconds per phase for the current step."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.cur: dict[str, float] = collections.defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self.sched_rows = self.sched_decode = self.processed = 0
        self.finished_any = self.last_steady = False
        r = engine.runner
        # Older trees (--before-tree) step in LLMEngine itself; newer ones in its EngineCore.
        core = getattr(engine, "core", engine)
        self.wrapped = [(engine.scheduler, "schedule"), (engine.scheduler, "advance"), (core, "_resolve"),
                        (r, "collect"), (r.builder, "build"), (r, "dispatch")]
        self._wrap(engine.scheduler, "schedule", "schedule", self._on_schedule)
        self._wrap(engine.scheduler, "advance", "advance")
        self._wrap(core, "_resolve", "_resolve")
        self._wrap(r, "collect", "collect (device wait)")
        if hasattr(engine, "_dispatch"):  # the engine's own part of an older dispatch
            self._wrap(engine, "_dispatch", "_dispatch")
            self.wrapped.append((engine, "_dispatch"))
        self._wrap(r.builder, "build", "dispatch: inputs")
        if hasattr(r, "batch"):  # the persistent batch's slot lookup belongs to the inputs too
            self._wrap(r.batch, "rows", "dispatch: inputs")
            self.wrapped.append((r.batch, "rows"))
        # the sampling-metadata builder: whichever the code in hand has
        import jaxengine.model_runner as mr
        self._wrap(r, "dispatch", "runner.dispatch")
        self._md_name = "batch_sampling_metadata" if hasattr(mr, "batch_sampling_metadata") else "build_sampling_metadata"
        self._md_names = [self._md_name] + [name for name in ("rows_sampling_metadata", "rows_sampling_packed")
                                            if hasattr(mr, name)]
        for name in self._md_names:  # the per-row builder, and the persistent batch's where there is one
            self._wrap(mr, name, "dispatch: sampling md")
        outputs = "_outputs" if hasattr(core, "_outputs") else "_process_outputs"
        self._wrap(core, outputs, "process outputs", self._on_process)
        self.wrapped.append((core, outputs))
        processor = getattr(engine, "outputs", None)
        if processor is not None and hasattr(processor, "process"):
            self._wrap(processor, "process", "output processing, any thread")
            self.wrapped.append((processor, "process"))

    def _wrap(self, owner, name: str, phase: str, hook=None) -> None:
        orig = getattr(owner, name)
        cur = self.cur

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                out = orig(*a, **k)
            finally:
                cur[phase] += time.perf_counter() - t0
            if hook is not None:  # the benchmark's own bookkeeping: kept out of the step's time
                t1 = time.perf_counter()
                hook(a, out)
                cur["instrumentation"] += time.perf_counter() - t1
            return out

        setattr(owner, name, timed)

    def _on_schedule(self, args, out) -> None:
        self.sched_rows = len(out.seqs)
        columns = getattr(out, "columns", None)  # a steady decode step: every row decodes (its rows
        # are built only when read, which nothing but this count would do)
        self.sched_decode = len(columns.ids) if columns is not None else sum(s.is_decode for s in out.seqs)

    def _on_process(self, args, out) -> None:
        if len(args) == 1:  # EngineCore._outputs(ResolvedStep | None)
            if args[0] is None:
                return
            self.processed, self.finished_any = len(args[0].sched.seqs), bool(args[0].finished)
        else:  # LLMEngine._process_outputs(sched, out, sampled, finished)
            self.processed, self.finished_any = len(args[0].seqs), bool(args[3])

    def step(self):
        self.last_steady = self.sched_rows == NUM_REQUESTS
        self.cur.clear()
        self.sched_rows = self.sched_decode = self.processed = 0
        self.finished_any = False
        t0 = time.perf_counter()
        out = self._step()
        c = self.cur
        total = time.perf_counter() - t0 - c["instrumentation"]
        row = {
            "schedule": c["schedule"],
            "dispatch: inputs": c["dispatch: inputs"],
            # the engine's own part of the dispatch is per-row sampling state (SamplingRow objects)
            "dispatch: sampling md": c["dispatch: sampling md"] + max(c["_dispatch"] - c["runner.dispatch"], 0.0),
            "dispatch: launch": c["runner.dispatch"] - c["dispatch: inputs"] - c["dispatch: sampling md"],
            "collect (device wait)": c["collect (device wait)"],
            "resolve": c["_resolve"] - c["collect (device wait)"],
            "advance": c["advance"],
            "process outputs": c["process outputs"],
            "output processing, any thread": c["output processing, any thread"],
            "step total": total,
            "instrumentation (excluded)": c["instrumentation"],
        }
        row["host (total - device wait)"] = total - c["collect (device wait)"]
        steady = (self.sched_rows == NUM_REQUESTS and self.sched_decode == NUM_REQUESTS
                  and self.processed == NUM_REQUESTS and not self.finished_any)
        if steady:
            self.steps.append(row)
        return out


def run_mode(llm, mode: str, profile: bool = False) -> dict:
    """One batch of NUM_REQUESTS requests to the end; returns mean ms per steady step per phase."""
    from jaxengine import SamplingParams

    engine = llm.llm_engine
    timer = Timer(engine)
    timer._step = engine.step
    engine.step = timer.step
    prof = cProfile.Profile() if profile else None
    if prof is not None:
        inner = timer._step

        def profiled():
            if timer.last_steady:  # the previous step scheduled every request
                prof.enable()
                try:
                    return inner()
                finally:
                    prof.disable()
            return inner()

        timer._step = profiled
    # Greedy: the host work per row is the same for any temperature, and the CPU "device" skips
    # the random draw over [256, vocab] (most of its step), so it takes less of the shared CPU.
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 2000 + 10 for j in range(PROMPT_LEN)]}
               for i in range(NUM_REQUESTS)]
    t0 = time.perf_counter()
    try:
        if mode == "offline":
            outs = llm.generate(prompts, params, use_tqdm=False)
            n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        else:
            ids = []
            for p in prompts:
                rid = engine.new_request_id()
                engine.add_request(rid, p, params)
                ids.append(rid)
            engine.emit_unfinished = True
            n_out = 0
            while engine.has_unfinished_requests():
                for o in engine.step():
                    if o.finished:
                        n_out += len(o.outputs[0].token_ids)
    finally:
        del engine.step
    wall = time.perf_counter() - t0
    assert n_out == NUM_REQUESTS * OUTPUT_LEN, n_out
    # the wrappers are instance attributes: drop them again
    for owner, name in timer.wrapped:
        owner.__dict__.pop(name, None)
    import jaxengine.model_runner as mr
    import jaxengine.sampler as sampler_mod
    for name in timer._md_names:
        setattr(mr, name, getattr(sampler_mod, name))
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    steps = timer.steps
    keys = [p for p, _ in PHASES] + ["step total", "host (total - device wait)", "instrumentation (excluded)"]
    # Medians per phase: the CPU is shared, and a step the OS took the core from says nothing
    # about the engine; the mean host time is kept beside them.
    return {"steady_steps": len(steps), "wall_s": wall, "output_tok_per_s": n_out / wall,
            "ms_per_step": {k: 1e3 * statistics.median(s[k] for s in steps) for k in keys},
            "mean_host_ms": 1e3 * statistics.fmean(s["host (total - device wait)"] for s in steps)}


def median_runs(runs: list[dict]) -> dict:
    """Per phase, the median over repeated runs of the mean per steady step."""
    out = {"runs": len(runs), "steady_steps": runs[0]["steady_steps"],
           "output_tok_per_s": statistics.median(r["output_tok_per_s"] for r in runs),
           "mean_host_ms": statistics.median(r["mean_host_ms"] for r in runs),
           "ms_per_step": {k: statistics.median(r["ms_per_step"][k] for r in runs) for k in runs[0]["ms_per_step"]}}
    return out


def write_markdown(results: dict) -> None:
    labels = [k for k in ("before", "after") if k in results["labels"]] + \
             [k for k in results["labels"] if k not in ("before", "after")]
    lines = ["# Host time per engine step, 256 running decode requests (CPU, tiny model)", "",
             f"Device: this machine's CPU ({results['environment']['cpu']}, {results['environment']['cores']} cores, "
             "shared with other work); JAX on the CPU. The model is tiny (1 layer, hidden 64, vocabulary 2048, "
             "SmolLM2 tokenizer), so the device compute is small and the step is the engine's Python (on an H100 the same host work "
             "is what bounds the Llama-3-8B decode step). "
             f"{NUM_REQUESTS} requests, {PROMPT_LEN}-token prompts, {OUTPUT_LEN} output tokens each, "
             "greedy, ignore_eos. XLA runs on one thread (the \"device\"), the engine's Python on the other core. "
             "Milliseconds per steady decode step (256 decode rows scheduled and 256 processed): per phase the "
             "median over the steady steps of a run (other processes share the CPU), then the median over runs "
             "(before and after alternate, each run a fresh process). Phase medians need not add up to the "
             "total's median.", ""]
    for mode in ("offline", "server"):
        title = {"offline": "Offline (`LLM.generate`, emit_unfinished=False)",
                 "server": "Server (emit_unfinished=True: a RequestOutput per request per step)"}[mode]
        present = [lab for lab in labels if mode in results["labels"][lab]]
        if not present:
            continue
        lines += [f"## {title}", "", "| phase (ms / step) | " + " | ".join(present) + " |",
                  "|---|" + "---|" * len(present)]
        for key in [p for p, _ in PHASES] + ["step total", "host (total - device wait)", "instrumentation (excluded)"]:
            vals = [results["labels"][lab][mode]["ms_per_step"].get(key, float("nan")) for lab in present]
            lines.append(f"| {key} | " + " | ".join(f"{v:.2f}" for v in vals) + " |")
        lines.append("| host ms / step, mean over steps | " + " | ".join(
            f"{results['labels'][lab][mode]['mean_host_ms']:.2f}" for lab in present) + " |")
        lines.append("| output tok/s, whole batch (tiny model) | " + " | ".join(
            f"{results['labels'][lab][mode]['output_tok_per_s']:.0f}" for lab in present) + " |")
        lines.append("")
    lines += ["Reading: `host (total - device wait)` (median over steps) and its mean are the figures to "
              "compare: they hold every phase, tails included. A phase's median shows a typical step; on this "
              "shared 2-core machine a step often loses the core in some phase, so the medians of the parts "
              "add up to less than the median of the whole. tok/s is the tiny model's, bound by the CPU "
              "\"device\", not a host figure.", "", "Phases:", ""] + [f"- {p}: {d}" for p, d in PHASES] + [""]
    for lab in labels:
        note = results["labels"][lab].get("note")
        if note:
            lines.append(f"- {lab}: {note}")
    with open(RESULTS + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def measure(repeats: int, modes: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        llm = make_engine(tmp)
        run_mode(llm, "offline")  # compiles every bucket this workload uses
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for _ in range(repeats):  # modes interleaved, so load changes hit both alike
            for m in modes:
                runs[m].append(run_mode(llm, m))
    return runs


def print_table(summary: dict[str, dict], columns: list[tuple[str, str]]) -> None:
    """columns: (title, key into summary)."""
    print(f"{'phase (ms / step)':<30}" + "".join(f"{t:>18}" for t, _ in columns))
    for key in summary[columns[0][1]]["ms_per_step"]:
        print(f"{key:<30}" + "".join(f"{summary[k]['ms_per_step'][key]:>18.2f}" for _, k in columns))
    print(f"{'host ms / step, mean':<30}" + "".join(f"{summary[k]['mean_host_ms']:>18.2f}" for _, k in columns))
    print(f"{'output tok/s (tiny model)':<30}" + "".join(f"{summary[k]['output_tok_per_s']:>18.0f}" for _, k in columns))


def store(entries: dict[str, tuple[dict, str]], replace: bool = False) -> None:
    """entries: label -> (summary, note); `replace` drops labels stored before."""
    path = RESULTS + ".json"
    results = json.load(open(path)) if os.path.exists(path) and not replace else {"labels": {}}
    results["environment"] = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                              "python": platform.python_version(), "xla_flags": os.environ.get("XLA_FLAGS", "")}
    for label, (summary, note) in entries.items():
        entry = dict(summary)
        if note:
            entry["note"] = note
        results["labels"][label] = entry
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    write_markdown(results)
    print(f"stored {', '.join(entries)} in {path} and .md")


def compare(before_tree: str, rounds: int, repeats: int, modes: list[str]) -> dict[str, dict]:
    """Runs the code in `before_tree` (a copy of the jaxengine package folder's parent) and the
    installed code in turn, each in a fresh process, `rounds` times; medians over all runs."""
    runs: dict[str, dict[str, list[dict]]] = {lab: {m: [] for m in modes} for lab in ("before", "after")}
    for i in range(rounds):
        for lab in ("before", "after"):
            env = dict(os.environ)
            if lab == "before":
                env["PYTHONPATH"] = before_tree + os.pathsep + env.get("PYTHONPATH", "")
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", f.name, "--repeats",
                                str(repeats), "--modes", ",".join(modes)], env=env, check=True)
                got = json.load(open(f.name))
            print(f"round {i + 1}: {lab} ({got['code']})", flush=True)
            for m in modes:
                runs[lab][m] += got["runs"][m]
    return {lab: {m: median_runs(r) for m, r in by_mode.items()} for lab, by_mode in runs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default=None, help="store the result under this label (e.g. before, after)")
    ap.add_argument("--note", default="", help="a line about the code measured (commit, change)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per mode in one process")
    ap.add_argument("--modes", default="offline,server")
    ap.add_argument("--profile", choices=("offline", "server"), default=None)
    ap.add_argument("--before-tree", default=None,
                    help="folder holding an older `jaxengine` package: measure it and the installed code "
                         "in alternating processes and store both (labels before / after)")
    ap.add_argument("--rounds", type=int, default=2, help="with --before-tree: alternations")
    ap.add_argument("--before-note", default="")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    import logging
    logging.basicConfig(level=logging.WARNING)
    modes = args.modes.split(",")
    if args.profile:
        with tempfile.TemporaryDirectory() as tmp:
            llm = make_engine(tmp)
            run_mode(llm, "offline")
            run_mode(llm, args.profile, profile=True)
        return
    if args.worker:
        import jaxengine
        runs = measure(args.repeats, modes)
        with open(args.worker, "w") as f:
            json.dump({"code": os.path.dirname(jaxengine.__file__), "runs": runs}, f)
        return
    if args.before_tree:
        both = compare(args.before_tree, args.rounds, args.repeats, modes)
        for m in modes:
            print(f"\n{m}")
            print_table({lab: both[lab][m] for lab in both}, [("before", "before"), ("after", "after")])
        store({"before": (both["before"], args.before_note), "after": (both["after"], args.note)}, replace=True)
        return
    runs = measure(args.repeats, modes)
    summary = {m: median_runs(r) for m, r in runs.items()}
    print_table(summary, [(m, m) for m in modes])
    if args.label:
        store({args.label: (summary, args.note)})


if __name__ == "__main__":
    main()
