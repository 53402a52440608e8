"""What tracing and lowering one program costs under Python's lock, one at a time: the engine is
built without warm-up (and with a fixed KV size, so no memory profile), then each named program
is traced and lowered alone (the runner's `_lower_*`: XLA's compile is not run); one of them runs under cProfile and its
heaviest functions are printed.

    python -m lab.probes.lower_profile --model llama-3-8b --out $OUT
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--buckets", default="16,512,8192", help="forward token buckets to lower")
    ap.add_argument("--profile", type=int, default=16, help="the bucket lowered under cProfile")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()

    import jax

    from jaxengine.config import EngineConfig
    from jaxengine.engine import LLMEngine

    cache = tempfile.mkdtemp(prefix="jaxengine-lower-")
    kw = {"compilation_cache_dir": cache, "warmup": False, "num_kv_blocks": 1024}
    if args.model:
        kw.update(model=args.model, load_format="dummy")
    try:
        runner = LLMEngine(EngineConfig(**kw)).runner
    finally:
        shutil.rmtree(cache, ignore_errors=True)

    res = {"device": jax.devices()[0].device_kind, "model": args.model, "lower_s": {}}
    jobs = [(f"forward:{t}", lambda t=int(t): runner._lower_forward(t)) for t in args.buckets.split(",")]
    jobs += [("sampler:(256, True, True, None)", lambda: runner._lower_sampler(256, True, True, None)),
             ("sampler:(16, False, False, False)", lambda: runner._lower_sampler(16, False, False, False)),
             ("prompt_logprobs:8192", lambda: runner._lower_prompt_logprobs(8192))]
    for name, fn in jobs:
        t0 = time.perf_counter()
        fn()
        res["lower_s"][name] = dt = time.perf_counter() - t0
        print(f"{name}: trace + lower {dt:.2f} s", flush=True)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    runner._lower_forward(args.profile)
    prof.disable()
    res["profiled"] = {"program": f"forward:{args.profile}", "s": time.perf_counter() - t0}
    for order in ("cumulative", "tottime"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(order).print_stats(35)
        text = buf.getvalue()
        res[f"profile_{order}"] = text
        print(f"\n## forward:{args.profile} under cProfile ({res['profiled']['s']:.2f} s), by {order}\n"
              + "\n".join(line[:160] for line in text.splitlines()[6:50]))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "lower_profile.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
