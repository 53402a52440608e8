"""`jaxengine bench startup`: cold and warm starts, each in a fresh process, with their breakdown.

A run is what `jaxengine generate PROMPT --max-tokens N` does: a new Python process imports the
engine, builds it (weights, KV cache, programs), generates greedily and exits. The cold runs
start from an empty cache directory; the warm runs reuse it, so they find the persistent
compilation cache and the program bundle (jaxengine.program_bundle) of the runs before them.
Each run reports its process wall time, the time its one request took (lazy compiles land
there) and the engine's start-up record (jaxengine.startup: phases, traces, compiles, programs
loaded). The command prints a table and writes JSON (`--output-json`) with the cache directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

_MARK = ".jaxengine-bench-startup"  # a cache directory this command made (and may empty)
_RESULT = "JAXENGINE_STARTUP_RESULT "  # prefix of the child's result line on stdout


def _child(spec: dict) -> int:
    """One start in this process: build the engine, generate, print the result line."""
    from jaxengine.llm import LLM
    from jaxengine.sampling_params import SamplingParams

    llm = LLM(model=spec["model"], **spec["engine"])
    engine = llm.llm_engine
    ready = engine.startup.as_dict()
    prompt = spec["prompt"] if engine.tokenizer is not None else {"prompt_token_ids": list(range(1, 17))}
    t0 = time.perf_counter()
    out = llm.generate(prompt, SamplingParams(max_tokens=spec["max_tokens"], temperature=0), use_tqdm=False)
    first = time.perf_counter() - t0
    engine.startup.update_compiles(engine.runner.bundle)  # now with the lazy compiles of the request
    result = {"startup": ready, "first_output_s": first, "after_request": engine.startup.as_dict(),
              "token_ids": list(out[0].outputs[0].token_ids), "num_kv_blocks": engine.config.num_kv_blocks,
              "warmup": engine.config.warmup}
    print(_RESULT + json.dumps(result), flush=True)
    return 0


def prepare_cache_dir(path: str | None) -> str:
    """The cache directory of the runs: a new temporary one, or `path` when it is empty, absent
    or made by this command earlier (cold runs empty it, so any other folder is refused)."""
    if path is None:
        path = tempfile.mkdtemp(prefix="jaxengine-startup-")
    elif os.path.isdir(path) and os.listdir(path) and not os.path.exists(os.path.join(path, _MARK)):
        raise ValueError(f"--compilation-cache-dir {path} is not empty and was not made by `jaxengine bench "
                         "startup`: cold runs empty it; pass a new folder (or none: a temporary one)")
    os.makedirs(path, exist_ok=True)
    open(os.path.join(path, _MARK), "w").close()
    return path


def _empty(path: str) -> None:
    for name in os.listdir(path):
        if name == _MARK:
            continue
        full = os.path.join(path, name)
        shutil.rmtree(full) if os.path.isdir(full) and not os.path.islink(full) else os.unlink(full)


def run_one(spec: dict, timeout_s: float) -> dict:
    """Starts a fresh Python process for one run; returns its result plus the process wall time."""
    cmd = [sys.executable, "-m", "jaxengine.benchmarks.startup", "--child", json.dumps(spec)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_RESULT)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"start-up run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads(lines[-1][len(_RESULT):])
    result["process_wall_s"] = wall
    result["log_tail"] = [ln for ln in proc.stderr.splitlines() if "start-up" in ln][-1:]
    return result


def measure(model: str | None, engine: dict, prompt: str, max_tokens: int, cold_runs: int, warm_runs: int,
            cache_dir: str | None, timeout_s: float = 600.0) -> dict:
    """Cold runs (each from an empty cache dir), then warm runs reusing it; see the module docstring."""
    if cold_runs < 1 or warm_runs < 0:
        raise ValueError(f"need at least one cold run and no negative warm runs, got {cold_runs} and {warm_runs}")
    cache_dir = prepare_cache_dir(cache_dir)
    spec = {"model": model, "engine": {**engine, "compilation_cache_dir": cache_dir}, "prompt": prompt,
            "max_tokens": max_tokens}
    runs = []
    for i in range(cold_runs):
        _empty(cache_dir)
        runs.append({"label": f"cold {i + 1}", "kind": "cold", **run_one(spec, timeout_s)})
    for i in range(warm_runs):
        runs.append({"label": f"warm {i + 1}", "kind": "warm", **run_one(spec, timeout_s)})
    tokens = {tuple(r["token_ids"]) for r in runs}
    return {"cache_dir": cache_dir, "runs": runs, "same_tokens": len(tokens) == 1}


def format_table(results: dict) -> str:
    from jaxengine.startup import table

    rows = []
    for r in results["runs"]:
        row = dict(r["after_request"])
        row.update(process_wall_s=r["process_wall_s"], first_output_s=r["first_output_s"])
        rows.append((r["label"], row))
    return table(rows)


def cmd_startup(args) -> int:
    from jaxengine.arg_utils import engine_kwargs
    from jaxengine.benchmarks.common import args_dict, environment, write_json

    engine = engine_kwargs(args)
    cache_dir = engine.pop("compilation_cache_dir", None)
    results = measure(args.model, engine, args.prompt, args.max_tokens, args.cold_runs, args.warm_runs, cache_dir,
                      args.timeout)
    text = format_table(results)
    print(f"cache dir: {results['cache_dir']}; same tokens in every run: {results['same_tokens']}")
    print("(after_request counts: the start plus the compiles of its one request; seconds unless named)")
    print(text)
    out = args.output_json or f"bench_startup_{os.path.basename(str(args.model or 'smollm2'))}_{int(time.time())}.json"
    write_json(out, {"environment": environment(), "args": args_dict(args), "results": results, "table": text})
    return 0


def add_parser(sub) -> None:
    from jaxengine.arg_utils import add_engine_args

    p = sub.add_parser("startup", help="start-up time: cold and warm starts in fresh processes, with their breakdown",
                       description="Start-up time, like `jaxengine generate PROMPT --max-tokens N` run in fresh "
                                   "processes: cold runs from an empty cache dir (--compilation-cache-dir, default: "
                                   "a new temporary folder), then warm runs reusing it.")
    p.add_argument("--model", default=None, help="HF folder, GGUF file, hub id, or a preset with --load-format dummy "
                                                "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompt", default="Hello", help="the one prompt each run generates for (a model without a "
                                                   "tokenizer, such as a dummy preset, gets token ids 1..16)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens each run generates (greedy)")
    p.add_argument("--cold-runs", type=int, default=1, help="runs from an empty cache dir")
    p.add_argument("--warm-runs", type=int, default=2, help="runs reusing the cache dir")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    p.add_argument("--output-json", default=None,
                   help="where to write the results (default: ./bench_startup_<model>_<time>.json)")
    add_engine_args(p)
    p.set_defaults(func=cmd_startup)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        sys.exit(_child(json.loads(sys.argv[2])))
    sys.exit("usage: jaxengine bench startup --help (this module's --child entry is for the command's own runs)")
