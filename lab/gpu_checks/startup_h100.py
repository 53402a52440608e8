"""Start-up on one GPU: `jaxengine bench startup` for the Llama-3-8B shape with dummy weights
and default engine flags (every bucket compiled ahead on an accelerator), cold then warm, each in
a fresh process; then the same with lazy compilation (--no-warmup), cold then warm. Prints the
breakdown tables and writes startup_h100.json to --out ($OUT). About 4-6 minutes on an H100
(a cold start compiles every bucket; a warm one loads them from the program bundle).

    python -m lab.gpu_checks.startup_h100 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--warm-runs", type=int, default=2)
    ap.add_argument("--skip-lazy", action="store_true", help="only the default (ahead-of-time) configuration")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds one run may take")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    from jaxengine.benchmarks.common import environment
    from jaxengine.benchmarks.startup import format_table, measure

    env = environment()
    try:
        env["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                            "--format=csv,noheader"], capture_output=True, text=True,
                                           timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        env["nvidia_smi"] = None
    configs = [("default (warm-up ahead)", {"load_format": "dummy"})]
    if not args.skip_lazy:
        configs.append(("lazy (--no-warmup)", {"load_format": "dummy", "warmup": False}))
    out = {"environment": env, "model": args.model, "configs": []}
    t0 = time.perf_counter()
    for label, engine in configs:
        cache = tempfile.mkdtemp(prefix="jaxengine-startup-h100-")
        try:
            res = measure(args.model, engine, "Hello", 8, 1, args.warm_runs, cache, args.timeout)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        text = format_table(res)
        print(f"\n## {args.model}, {label}; same tokens in every run: {res['same_tokens']}\n{text}", flush=True)
        out["configs"].append({"label": label, "engine": engine, "results": res, "table": text})
    out["wall_s"] = time.perf_counter() - t0
    path = os.path.join(args.out, "startup_h100.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=2, default=str)
    print(f"wrote {path} ({out['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
