"""bf16 linears at 16 rows (a batch-1 decode step's bucket), Llama-3-8B shapes: XLA's dot (the
engine's GEMM today) against the lab kernel `bf16_rows` (lab/kernels/rows_matmul.py) over a sweep
of tilings, K splits and pipeline stages. With `--dtype fp8`: e4m3 weights with per-channel scales
(W8A16), the engine's XLA fusion of the convert and its Pallas kernel against `fp8_rows` of the
same module. CUPTI kernel time per layer, each program running the layer over distinct weights
(more bytes than the L2 holds), every kernel of the call counted (the split sums included): the
same method as int4_swapab_probe.py.

    python -m lab.gpu_checks.bf16_rows_probe --out $OUT [--shapes qkv,o] [--budget-s 90] [--dtype fp8]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import time

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--budget-s", type=float, default=100.0, help="sweep time a shape at most")
    ap.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from jaxengine.benchmarks import ceilings
    from lab.gpu_checks.cupti_time import kernel_us
    from lab.kernels.rows_matmul import bf16_rows, fp8_rows

    fp8 = args.dtype == "fp8"
    if fp8:
        from jaxengine.pallas_kernels.fp8_matmul_gpu import fp8_weight_matmul
        from jaxengine.models import quantization

    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": args.rows, "dtype": args.dtype,
           "ceilings": ceilings.measure(), "shapes": {}}
    path = os.path.join(args.out, f"{args.dtype}_rows.json")

    def save():
        with open(path, "w") as f:
            json.dump(res, f, indent=1)

    t = args.rows
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        nbytes = (k * n + 4 * n) if fp8 else 2 * k * n
        layers = max(2, min(16, math.ceil(600e6 / nbytes)))
        key = jax.random.PRNGKey(k * n)
        x = jax.random.normal(key, (t, k), jnp.float32).astype(jnp.bfloat16)
        if fp8:  # weights [N, K] e4m3 with per-channel scales, as quantize_fp8 makes them
            ws = [(jax.random.normal(jax.random.fold_in(key, i), (n, k), jnp.float32) * 64).astype(jnp.float8_e4m3fn)
                  for i in range(layers)]
            sc = [(1e-3 * (1 + jax.random.uniform(jax.random.fold_in(key, 500 + i), (n,)))).astype(jnp.float32)
                  for i in range(layers)]
            ref = jnp.dot(x.astype(jnp.float32), (ws[0].astype(jnp.float32) * sc[0][:, None]).T)
            kernel = fp8_rows
        else:
            ws = [(0.02 * jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.float32)).astype(jnp.bfloat16)
                  for i in range(layers)]
            sc = [None] * layers
            ref = jnp.dot(x.astype(jnp.float32), ws[0].astype(jnp.float32))
            kernel = lambda x, w, s, **c: bf16_rows(x, w, **c)  # noqa: E731
        ref_scale = float(jnp.max(jnp.abs(ref)))
        row = {"K": k, "N": n, "layers": layers, "bytes": nbytes, "variants": {}}
        res["shapes"][name] = row

        def record(vname, fn, check=None):
            t0 = time.perf_counter()
            try:
                r = kernel_us(fn, (x, ws, sc), layers)
                r["GBps"] = nbytes / (r["us"] * 1e-6) / 1e9
                if check is not None:
                    r["max_err_rel"] = float(jnp.max(jnp.abs(check().astype(jnp.float32) - ref))) / ref_scale
            except Exception as e:  # noqa: BLE001
                r = {"error": repr(e)[:400]}
            r["wall_s"] = time.perf_counter() - t0
            row["variants"][vname] = r
            print(name, vname, json.dumps({a: b for a, b in r.items() if a != "kernels"}, default=str)[:200], flush=True)
            save()
            return r.get("us")

        if fp8:
            record("xla", jax.jit(lambda x, ws, sc: [quantization.fp8_matmul(x, w, s, None) for w, s in zip(ws, sc)]))
            record("product_kernel", jax.jit(lambda x, ws, sc: [
                fp8_weight_matmul(x, w, s, num_warps=8 if n <= 4096 else 4) for w, s in zip(ws, sc)]))
        else:
            record("xla", jax.jit(lambda x, ws, sc: [jnp.dot(x, w) for w in ws]))
        t_shape = time.perf_counter()
        configs = []
        bks = (128, 256, 512) if fp8 else (64, 128, 256)
        for swapped, bn, bk, st, wp in itertools.product((False, True), (64, 128, 256), bks, (3, 5),
                                                         (4, 8) if fp8 else (4,)):
            if swapped and bn == 256:
                continue
            tiles = n // bn
            for sp in (1, 2, 4, 8, 16):
                if k % (bk * sp) or not 100 <= tiles * sp <= 800:
                    continue
                configs.append(dict(swapped=swapped, block_n=bn, block_k=bk, splits=sp, num_stages=st, num_warps=wp))
        random.Random(0).shuffle(configs)  # a sweep cut by the budget samples every form
        row["configs"] = len(configs)
        for cfg in configs:
            if time.perf_counter() - t_shape > args.budget_s:
                row["sweep_cut"] = True
                break
            tag = (f"{'swap' if cfg['swapped'] else 'plain'}_bn{cfg['block_n']}_bk{cfg['block_k']}"
                   f"_sp{cfg['splits']}_st{cfg['num_stages']}_w{cfg['num_warps']}")
            fn = jax.jit(lambda x, ws, sc, c=cfg: [kernel(x, w, s, **c) for w, s in zip(ws, sc)])
            record(tag, fn)
            row["variants"][tag]["cfg"] = cfg
        best = min(((v["us"], vn) for vn, v in row["variants"].items() if "cfg" in v and "us" in v), default=None)
        if best:
            cfg = row["variants"][best[1]]["cfg"]
            err = float(jnp.max(jnp.abs(kernel(x, ws[0], sc[0], **cfg).astype(jnp.float32) - ref))) / ref_scale
            row["best"] = {"name": best[1], "us": best[0], "max_err_rel": err}
        del ws
    save()
    print(f"\n{args.dtype} at {t} rows. shape: xla us (GB/s) | best kernel config us (GB/s) | configs timed")
    for name, row in res["shapes"].items():
        xv = row["variants"]["xla"]
        b = row.get("best") or {}
        gb = row["bytes"] / (b["us"] * 1e-6) / 1e9 if b else 0
        pk = row["variants"].get("product_kernel", {})
        print(f"{name}: {xv.get('us', 0):.1f} ({xv.get('GBps', 0):.0f}) | {b.get('name')} {b.get('us', 0):.1f} "
              f"({gb:.0f}) err {b.get('max_err_rel', 0):.1e} | {len(row['variants']) - 1} of {row['configs']}"
              + (f" | product kernel {pk.get('us', 0):.1f}" if pk else ""))
    print("ceilings", json.dumps(res["ceilings"])[:300])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
