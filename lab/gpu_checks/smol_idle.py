"""The GPU suite's SmolLM2-shape figure alone (benchmarks/gpu_suite.py `measure_smol`: batch 256,
random 256 in / 256 out x 1024, then the instrumented run whose steps are replayed to estimate
the GPU's idle share), for A/Bs of code trees in one call. Writes smol_idle_<label>.json.

    python lab/gpu_checks/smol_idle.py --label final --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="tree")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    import jax

    import jaxengine
    from jaxengine.benchmarks.gpu_suite import measure_smol, settings

    st = settings(False, tempfile.mkdtemp())
    rs = measure_smol(st, tempfile.mkdtemp())
    tr, idle = rs["throughput"], rs["gpu_idle"]
    t = tr["engine_timing"]
    print(f"[{args.label}] {tr['output_tokens_per_s']:.0f} output tok/s, step {t['step_ms']:.2f} ms "
          f"(device wait {t['device_wait_ms']:.2f}), GPU idle ~{100 * idle['idle_fraction_estimate']:.0f}% "
          f"(busy {idle['device_busy_s_estimate']:.2f} s of {idle['probe_run']['elapsed_s']:.2f} s)", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"smol_idle_{args.label}.json"), "w") as f:
        json.dump({"label": args.label, "code": os.path.dirname(jaxengine.__file__), "jax": jax.__version__,
                   "device": jax.devices()[0].device_kind, **rs}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
