"""The fused SiLU-mul-e4m3 kernel (pallas_kernels/act_quant_gpu.py) on the GPU: equal to its jnp
reference (the unscaled gate/up product with its row and column scales, as the engine calls it),
and timed beside XLA's unfused computation of the same outputs at the Llama-3-8B shape's MLP
width. Prints a table, writes act_quant.json.

    python -m lab.gpu_checks.act_quant_check --out $OUT
    python -m lab.gpu_checks.act_quant_check --warps 8,16,32 --out $OUT   # each form at these num_warps

The one-pass form holds a row's 7 tiles of 2,048 float32 values (F = 14,336) in registers (56 a
thread at 8 warps): how many programs share an SM, and so how many loads are in flight, depends
on the warps a program has.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.pallas_kernels.act_quant_gpu import silu_mul_quant, silu_mul_quant_reference


def _time(fn, x, reps=50):
    jax.block_until_ready(fn(x))
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(x)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--warps", default="", help="num_warps values to time each form at (default: the kernel's)")
    args = ap.parse_args()
    warps = [int(w) for w in args.warps.split(",")] if args.warps else [None]
    rows = []
    ref = jax.jit(silu_mul_quant_reference)
    for t, f in ((256, 14336), (2048, 14336)):
        rng = np.random.default_rng(t + f)
        x = jnp.asarray(rng.normal(size=(t, 2 * f)) * 300.0, jnp.bfloat16)  # an unscaled e4m3 product
        rs = jnp.asarray(rng.uniform(1e-3, 3e-3, size=t), jnp.float32)
        cs = jnp.asarray(rng.uniform(1e-3, 3e-3, size=2 * f), jnp.float32)
        qr, sr = ref(x, rs, cs)
        bytes_moved = t * 2 * f * 2 + t * f + t * 4
        us_x = _time(lambda a: ref(a, rs, cs), x)
        for two_pass, nw in ((tp, w) for tp in (False, True) for w in warps):
            q, s = silu_mul_quant(x, rs, cs, two_pass=two_pass, num_warps=nw)
            mismatch = int(jnp.sum(q.astype(jnp.float32) != qr.astype(jnp.float32)))
            scale_err = float(jnp.max(jnp.abs(s - sr) / sr))
            us_k = _time(lambda a, tp=two_pass, w=nw: silu_mul_quant(a, rs, cs, two_pass=tp, num_warps=w), x)
            form = ("two_pass" if two_pass else "one_pass") + (f" {nw} warps" if nw else "")
            rows.append({"t": t, "f": f, "form": form, "mismatched_values": mismatch,
                         "values": t * f, "scale_rel_err": scale_err, "kernel_us": us_k, "xla_us": us_x,
                         "kernel_GBps": bytes_moved / us_k / 1e3})
            print(rows[-1], flush=True)
    print("\n| T | F | form | mismatched / values | kernel us | XLA unfused us | kernel GB/s |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['t']} | {r['f']} | {r['form']} | {r['mismatched_values']} / {r['values']} | {r['kernel_us']:.1f} | "
              f"{r['xla_us']:.1f} | {r['kernel_GBps']:.0f} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "act_quant.json"), "w") as fh:
        json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
