"""Launch cost and throughput of the SmolLM2 shape under XLA/allocator variants, alternating
fresh processes on one machine (lab/gpu_checks/smol_throughput.py --time-launch in each).

The lead it tests (benchmarks/results/step_trace_h100.md): programs whose GEMMs are cuBLAS calls
(traced commands in XLA's command buffers, re-captured when the temp buffer moves) may launch
slower than programs of Triton GEMM fusions; a stable temp (VMM allocator + SKIP_TEMP) may remove
the difference.

    python lab/gpu_checks/launch_ab.py --rounds 2 --out $OUT      # prints a table, writes launch_ab.json

(Its first call, before the engine chose the allocator, named JAX's allocator `default`.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

from jaxengine.device_memory import STABLE_TEMP_FLAG

HERE = os.path.dirname(os.path.abspath(__file__))
VMM = {"XLA_PYTHON_CLIENT_ALLOCATOR": "vmm"}
JAX_ALLOCATOR = {"XLA_PYTHON_CLIENT_ALLOCATOR": "default"}  # the engine then leaves JAX's allocator alone
VARIANTS = {  # name -> (extra environment, XLA_FLAGS added)
    "engine_default": ({}, ""),  # since device_memory.choose_launch_allocator: VMM + SKIP_TEMP on one GPU
    "jax_allocator": (JAX_ALLOCATOR, ""),  # the engine's default before that
    "triton_gemm": (JAX_ALLOCATOR, "--xla_gpu_enable_triton_gemm=true"),
    "vmm_skip_temp": (VMM, STABLE_TEMP_FLAG),
    "vmm_skip_temp_triton": (VMM, f"{STABLE_TEMP_FLAG} --xla_gpu_enable_triton_gemm=true"),
}
RUN = re.compile(r"run (\d+): start ([\d.]+) s, (\d+) output tok/s, step ([\d.]+) ms, device wait ([\d.]+) ms")
CALL = re.compile(r"run (\d+): (\S+ \S+) call ms p10/p50/p90 ([\d.]+) / ([\d.]+) / ([\d.]+) \((\d+) calls\)")


def run_one(name: str, repeats: int, prompts: int, timeout: int) -> dict:
    extra, flags = VARIANTS[name]
    env = dict(os.environ, **extra)
    if flags:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
    cmd = [sys.executable, os.path.join(HERE, "smol_throughput.py"), "--label", name, "--repeats", str(repeats),
           "--prompts", str(prompts), "--time-launch"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd="/tmp")
        rc, stdout, stderr = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:  # what it printed before the limit still counts
        rc, stdout, stderr = "timeout", e.stdout or "", e.stderr or ""
        stdout, stderr = (x.decode() if isinstance(x, bytes) else x for x in (stdout, stderr))
    runs, calls = [], []
    for line in stdout.splitlines():
        if m := RUN.search(line):
            runs.append({"run": int(m[1]), "startup_s": float(m[2]), "output_tok_s": int(m[3]),
                         "step_ms": float(m[4]), "device_wait_ms": float(m[5])})
        elif m := CALL.search(line):
            calls.append({"run": int(m[1]), "program": m[2], "p10": float(m[3]), "p50": float(m[4]),
                          "p90": float(m[5]), "calls": int(m[6])})
    return {"variant": name, "env": extra, "xla_flags_added": flags, "rc": rc, "runs": runs,
            "calls": calls, "stderr_tail": stderr[-1500:] if rc else ""}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per process")
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--timeout", type=int, default=150, help="seconds per process")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    names = args.variants.split(",")
    results = []
    for r in range(args.rounds):
        for name in names:
            res = run_one(name, args.repeats, args.prompts, args.timeout)
            res["round"] = r
            results.append(res)
            tps = [x["output_tok_s"] for x in res["runs"]]
            fwd = [c["p50"] for c in res["calls"] if c["program"] == "fwd t=256"]
            print(f"round {r} {name}: rc {res['rc']}, tok/s {tps}, fwd t=256 launch p50 {fwd}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "launch_ab.json"), "w") as f:
        json.dump({"results": results, "variants": {k: VARIANTS[k] for k in names}}, f, indent=1)
    print("\n| variant | output tok/s (every run) | median | forward t=256 launch p50 ms | sampler r=256 launch p50 ms |")
    print("|---|---|---|---|---|")
    for name in names:
        rs = [x for x in results if x["variant"] == name]
        tps = [run["output_tok_s"] for x in rs for run in x["runs"]]
        fwd = [c["p50"] for x in rs for c in x["calls"] if c["program"] == "fwd t=256"]
        smp = [c["p50"] for x in rs for c in x["calls"] if c["program"] == "sampler r=256"]
        med = statistics.median(tps) if tps else float("nan")
        print(f"| {name} | {', '.join(f'{t:,}' for t in tps)} | {med:,.0f} | "
              f"{', '.join(f'{v:.2f}' for v in fwd)} | {', '.join(f'{v:.2f}' for v in smp)} |")


if __name__ == "__main__":
    main()
