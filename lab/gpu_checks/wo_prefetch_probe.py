"""The int4 weight-only kernel with and without `prefetch` (the next block's words, scales and
zeros loaded before the current block's arithmetic; an option of the kernel at 0c8336b, removed
after it lost: run this at that commit) at a batch-1 decode step's 16 rows, Llama-3-8B
shapes, groups of 128, slabs form (the engine's): whether the kernel's loads were waiting on its
arithmetic (weight_only_h100.md: the loads alone reached 21-43% of the copy rate). Also twice the
default K splits (more programs in flight). bf16 `jnp.dot` beside them; each figure is the median
of one compiled program running the layer over distinct weights (lab/gpu_checks/xla_narrow_probe.py).

    python -m lab.gpu_checks.wo_prefetch_probe --out $OUT [--splits]   # writes wo_prefetch.json (wo_splits.json)
"""

from __future__ import annotations

import argparse
import json
import os

from lab.gpu_checks.xla_narrow_probe import SHAPES, int4_layers, per_call

VARIANTS = {"slabs": dict(slabs=True), "slabs_prefetch": dict(slabs=True, prefetch=True),
            "slabs_prefetch_st3": dict(slabs=True, prefetch=True, num_stages=3),
            "slabs_2x_splits": dict(slabs=True, splits="2x"),
            "slabs_prefetch_2x_splits": dict(slabs=True, prefetch=True, splits="2x")}
# --splits: the K splits' multiple of the default (more, shorter programs), slabs form
SPLITS = {f"slabs_{m}x_splits": dict(slabs=True, splits=f"{m}x") for m in (1, 2, 4, 8, 16)} | \
    {"slabs_bn64_4x_splits": dict(slabs=True, splits="4x", block_n=64),
     "slabs_4x_splits_st3": dict(slabs=True, splits="4x", num_stages=3),
     "slabs_4x_splits_w8": dict(slabs=True, splits="4x", num_warps=8)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--splits", action="store_true", help="the K-splits sweep instead of the prefetch variants")
    args = ap.parse_args()
    variants = SPLITS if args.splits else VARIANTS
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxengine.benchmarks import ceilings
    from jaxengine.pallas_kernels import weight_only_matmul_gpu as wk

    res: dict = {"ceilings": ceilings.measure(), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                 "rows": args.rows, "group_size": 128}
    print(f"ceilings: {res['ceilings']}", flush=True)
    key = jax.random.key(0)
    bf = jnp.bfloat16
    totals: dict[str, float] = {}
    for name, (k, n) in SHAPES.items():
        g = k // 128
        wb, packed, gs, pz = int4_layers(key, k, n)
        x = jax.random.normal(key, (args.rows, k), jnp.float32).astype(bf)
        cells: dict = {}
        t, _ = per_call(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(bf), x, wb)
        cells["bf16"] = {"us": 1e6 * t, "weight_GBps": 2 * k * n / t / 1e9}
        want = np.asarray(wk.weight_only_matmul(x, packed[0], gs[0], pz, bits=4, group_size=128, slabs=True),
                          np.float32)
        for label, opts in variants.items():
            o = dict(opts)
            if isinstance(o.get("splits"), str):
                o["splits"] = int(o["splits"][:-1]) * wk.pick_splits(n // o.get("block_n", 128), k // 128)
                if (k // 128) % o["splits"]:
                    cells[label] = {"error": f"{o['splits']} splits do not divide the steps"}
                    continue
            try:
                got = np.asarray(wk.weight_only_matmul(x, packed[0], gs[0], pz, bits=4, group_size=128, **o),
                                 np.float32)
                t, _ = per_call(lambda x, w, o=o: wk.weight_only_matmul(x, w[0], w[1], pz, bits=4, group_size=128,
                                                                       **o), x, list(zip(packed, gs)))
                cells[label] = {"us": 1e6 * t, "weight_GBps": (k * n // 2 + g * n * 3) / t / 1e9, "opts": o,
                                "max_abs_diff_vs_slabs": float(np.max(np.abs(got - want)))}
            except Exception as e:  # noqa: BLE001 - recorded; the others still run
                cells[label] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        res[name] = cells
        for label, c in cells.items():
            if "us" in c:
                totals[label] = totals.get(label, 0.0) + c["us"]
        print(f"{name:<8} " + "; ".join(f"{lab} {c['us']:.1f} us" if "us" in c else f"{lab} {c['error'][:60]}"
                                        for lab, c in cells.items()), flush=True)
    res["sum_us"] = totals
    print("sum over the four linears (us): " + "; ".join(f"{k} {v:.1f}" for k, v in totals.items()), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "wo_splits.json" if args.splits else "wo_prefetch.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
