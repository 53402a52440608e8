"""The fp8-weight and int4 weight-only Pallas kernels at a decode step's 16 rows over larger K
steps (block_k), stages, column tiles, warps and K splits: whether more bytes in flight per
program lift them from about half of the copy rate (benchmarks/results/quant_h100.md,
weight_only_h100.md). bf16 and XLA's fused fp8 convert are timed beside them, and the
laboratory's N-packed int4 kernel (lab/kernels/int4_npacked.py: one dot of depth block_k a step).

    python -m lab.gpu_checks.narrow_kernel_sweep --out $OUT    # prints the best per shape, writes narrow_sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

try:
    from lab.gpu_checks.xla_narrow_probe import SHAPES, int4_layers, per_call
except ImportError:
    from xla_narrow_probe import SHAPES, int4_layers, per_call

FP8 = [dict(block_k=bk, num_stages=st, block_n=bn, num_warps=w) for bk, st, bn, w in
       itertools.product((128, 256, 512), (3, 5), (64, 128), (4, 8))]
INT4 = [dict(block_k_rows=bk, num_stages=st, block_n=bn, num_warps=w) for bk, st, bn, w in
        itertools.product((128, 256, 512), (3, 4), (64, 128), (4, 8))]
# lab/kernels/int4_npacked.py: words packed along N, one dot of depth block_k a step
NPACKED = [dict(block_k=bk, num_stages=st, block_n=bn, num_warps=w) for bk, st, bn, w in
           itertools.product((64, 128), (2, 3, 4), (64, 128, 256), (4, 8))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--kinds", default="fp8,int4,npacked", help="which kernels to sweep")
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp

    from jaxengine.benchmarks import ceilings
    from jaxengine.pallas_kernels import fp8_matmul_gpu as fk
    from jaxengine.pallas_kernels import weight_only_matmul_gpu as wk

    try:
        from lab.kernels import int4_npacked
    except ImportError:  # run as a script: the repository root is not on sys.path
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        from lab.kernels import int4_npacked

    res: dict = {"ceilings": ceilings.measure(), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                 "rows": args.rows}
    print(f"ceilings: {res['ceilings']}", flush=True)
    key = jax.random.key(0)
    bf = jnp.bfloat16
    for name, (k, n) in SHAPES.items():
        g = k // 128
        wb, packed, gs, pz = int4_layers(key, k, n)
        layers = len(wb)
        ks = jax.random.split(jax.random.fold_in(key, k * n), 3)
        f8 = [jnp.clip(16 * jax.random.normal(jax.random.fold_in(ks[1], i), (n, k), jnp.float32), -448, 448)
              .astype(jnp.float8_e4m3fn) for i in range(layers)]
        fs = jnp.full((n,), 0.02 / 16, jnp.float32)
        x = jax.random.normal(key, (args.rows, k), jnp.float32).astype(bf)
        cells: dict = {}

        def put(label, fn, ws, nbytes):
            try:
                t, _ = per_call(fn, x, ws)
                cells[label] = {"us": 1e6 * t, "weight_GBps": nbytes / t / 1e9}
            except Exception as e:  # recorded; the others still run
                cells[label] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}

        put("bf16", lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(bf), wb, 2 * k * n)
        put("xla_f8_nk", lambda x, w: (jax.lax.dot_general(x, w.astype(bf), (((1,), (1,)), ((), ())),
                                                           preferred_element_type=jnp.float32) * fs).astype(bf),
            f8, k * n)
        kinds = args.kinds.split(",")
        for c in (FP8 if "fp8" in kinds else []):
            if k % c["block_k"] == 0:
                put("fp8 " + " ".join(f"{a}={v}" for a, v in c.items()),
                    lambda x, w, c=c: fk.fp8_weight_matmul(x, w, fs, **c), f8, k * n)
        for c in (INT4 if "int4" in kinds else []):
            put("int4 " + " ".join(f"{a}={v}" for a, v in c.items()),
                lambda x, w, c=c: wk.weight_only_matmul(x, w[0], w[1], pz, bits=4, group_size=128, slabs=True, **c),
                list(zip(packed, gs)), k * n // 2 + g * n * 3)
        npacked = [jax.lax.bitcast_convert_type(jax.random.bits(jax.random.fold_in(ks[2], 100 + i), (k, n // 8),
                                                                jnp.uint32), jnp.int32) for i in range(layers)]
        for c in (NPACKED if "npacked" in kinds else []):
            put("npacked " + " ".join(f"{a}={v}" for a, v in c.items()),
                lambda x, w, c=c: int4_npacked.matmul(x, w[0], w[1], pz, group_size=128, **c),
                list(zip(npacked, gs)), k * n // 2 + g * n * 3)
        res[name] = cells
        for kind in kinds:
            ok = {lab: c["us"] for lab, c in cells.items() if lab.startswith(kind) and "us" in c}
            best = sorted(ok, key=ok.get)[:3]
            first = {"fp8": FP8, "int4": INT4, "npacked": NPACKED}[kind][0]
            base = cells.get(f"{kind} " + " ".join(f"{a}={v}" for a, v in first.items()))
            print(f"{name:<8} {kind}: bf16 {cells['bf16'].get('us', 0):.1f} us, xla_f8 "
                  f"{cells['xla_f8_nk'].get('us', 0):.1f}, first config {base and base.get('us', 0):.1f}, best "
                  + "; ".join(f"{lab[len(kind) + 1:]} {ok[lab]:.1f} us ({cells[lab]['weight_GBps']:.0f} GB/s)"
                              for lab in best), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "narrow_sweep.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
