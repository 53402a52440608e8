"""The int4 swap-AB lab kernel (lab/kernels/int4_swapab.py) beside the product's weight-only
kernel (slabs form, the engine's) and bf16 `jnp.dot`, at the Llama-3-8B linears' shapes and 16
rows (a batch-1 decode step's bucket): CUPTI kernel time per layer, each program running the
layer over distinct weights (more bytes than the L2 holds), every kernel of the call counted
(the split-K sum and x's permutation included). Also each variant's error against the
dequantize-then-dot reference, and, with XLA's dump on, the PTX counts of each Triton kernel
(wgmma / mma.sync / shared-memory traffic / local spills): whether the dequantized operand
stays in registers.

    XLA_FLAGS=--xla_dump_to=/tmp/wodump python -m lab.gpu_checks.int4_swapab_probe --out $OUT --dump /tmp/wodump
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import time

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
SWAP_VARIANTS = {
    "swap_bn128_lop3_2x": dict(block_n=128, num_warps=4, num_stages=3, mode="lop3", splits="2x"),
    "native_bn128_lop3_2x": dict(block_n=128, num_warps=4, num_stages=3, mode="lop3", splits="2x", native=True),
}


def ptx_counts(dump: str) -> dict:
    """Per kernel entry of the dumped PTX whose name looks like a Pallas kernel: instruction counts."""
    out = {"files": sorted(os.path.basename(p) for p in glob.glob(f"{dump}/**/*", recursive=True))[:40]}
    for path in sorted(glob.glob(f"{dump}/**/*.ptx", recursive=True)):
        text = open(path, errors="replace").read()
        for m in re.finditer(r"\.entry\s+(\w+)", text):
            body = text[m.start(): text.find("\n}", m.start())]
            if "mma" not in body:
                continue
            out[f"{os.path.basename(path)[:50]}:{m.group(1)[:40]}"] = {
                "lines": body.count("\n"), "wgmma": body.count("wgmma.mma_async"), "mma.sync": body.count("mma.sync"),
                "cp.async": body.count("cp.async"), "ld.shared": body.count("ld.shared"),
                "st.shared": body.count("st.shared"), "ldmatrix": body.count("ldmatrix"),
                "lop3": body.count("lop3"), "ld.local": body.count("ld.local"), "st.local": body.count("st.local"),
                "ld.global": body.count("ld.global")}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--dump", default=None)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--product-only", action="store_true", help="bf16 and the product's two forms only")
    ap.add_argument("--sweep", action="store_true",
                    help="the product's swapped form over K splits (x1, x2 of its default), stages and warps")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxengine.benchmarks import ceilings
    from lab.gpu_checks.cupti_time import kernel_us
    from jaxengine.pallas_kernels import weight_only_matmul_gpu as product
    from lab.kernels import int4_swapab as swap

    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": args.rows,
           "ceilings": ceilings.measure(), "shapes": {}}
    path = os.path.join(args.out, "int4_swapab.json")

    def save():
        with open(path, "w") as f:
            json.dump(res, f, indent=1)

    t = args.rows
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        g = k // 128
        int4_bytes = k * n // 2 + 3 * g * n
        layers = max(4, min(32, math.ceil(300e6 / int4_bytes)))
        bf_layers = max(2, min(8, math.ceil(600e6 / (2 * k * n))))
        key = jax.random.PRNGKey(k * n)
        x = (jax.random.normal(key, (t, k), jnp.float32)).astype(jnp.bfloat16)
        packed = [jax.random.randint(jax.random.fold_in(key, i), (k // 8, n), -2**31, 2**31 - 1, jnp.int32)
                  for i in range(layers)]
        scales = [(0.01 + 0.01 * jax.random.uniform(jax.random.fold_in(key, 100 + i), (g, n))).astype(jnp.bfloat16)
                  for i in range(layers)]
        zeros = [jax.random.randint(jax.random.fold_in(key, 200 + i), (g, n), 0, 16, jnp.int32).astype(jnp.uint8)
                 for i in range(layers)]
        wts = [swap.transpose_words(p) for p in packed]
        jax.block_until_ready(wts)
        wb = [(0.02 * jax.random.normal(jax.random.fold_in(key, 300 + i), (k, n), jnp.float32)).astype(jnp.bfloat16)
              for i in range(bf_layers)]
        row = {"K": k, "N": n, "layers": layers, "int4_bytes": int4_bytes, "variants": {}}
        res["shapes"][name] = row
        ref = product.weight_only_matmul_reference(x, packed[0], scales[0], zeros[0], 4, 128).astype(jnp.float32)
        ref_scale = float(jnp.max(jnp.abs(ref)))

        def record(vname, fn, fargs, nlayers, nbytes, check=None):
            t0 = time.perf_counter()
            try:
                r = kernel_us(fn, fargs, nlayers)
                r["GBps"] = nbytes / (r["us"] * 1e-6) / 1e9
                if check is not None:
                    got = check().astype(jnp.float32)
                    r["max_err_rel"] = float(jnp.max(jnp.abs(got - ref))) / ref_scale
            except Exception as e:  # noqa: BLE001
                r = {"error": repr(e)[:800]}
            r["wall_s"] = time.perf_counter() - t0
            row["variants"][vname] = r
            print(name, vname, json.dumps({a: b for a, b in r.items() if a != "kernels"}, default=str)[:300],
                  flush=True)
            save()

        record("bf16_xla", jax.jit(lambda x, ws: [jnp.dot(x, w) for w in ws]), (x, wb), bf_layers, 2 * k * n)
        prod = jax.jit(lambda x, ps, ss, zs: [product.weight_only_matmul(x, p, s, z, bits=4, group_size=128, slabs=True)
                                              for p, s, z in zip(ps, ss, zs)])
        record("product_slabs", prod, (x, packed, scales, zeros), layers, int4_bytes,
               check=lambda: product.weight_only_matmul(x, packed[0], scales[0], zeros[0], bits=4, group_size=128,
                                                        slabs=True))
        swapped = jax.jit(lambda x, ps, ss, zs: [product.weight_only_matmul_swapped(x, p, s, z)
                                                 for p, s, z in zip(ps, ss, zs)])
        record("product_swapped", swapped, (x, packed, scales, zeros), layers, int4_bytes,
               check=lambda: product.weight_only_matmul_swapped(x, packed[0], scales[0], zeros[0]))
        if args.sweep:
            base = product.swapped_splits(n // product.SWAPPED_BLOCK_N, g)
            for mult in (0.5, 1, 2):
                sp = int(base * mult)
                if sp < 1 or g % sp:
                    continue
                for st in (1, 2, 3, 4):
                    for wp in (4, 8):
                        fn = jax.jit(lambda x, ps, ss, zs, o=dict(splits=sp, num_stages=st, num_warps=wp): [
                            product.weight_only_matmul_swapped(x, p, s, z, **o) for p, s, z in zip(ps, ss, zs)])
                        record(f"swapped_sp{sp}_st{st}_w{wp}", fn, (x, packed, scales, zeros), layers, int4_bytes)
        for vname, opts in ({} if args.product_only or args.sweep else SWAP_VARIANTS).items():
            opts = dict(opts)
            if opts.get("splits") == "2x":  # twice the default K splits where they divide the steps
                d = product.pick_splits(n // opts["block_n"], g)
                opts["splits"] = 2 * d if g % (2 * d) == 0 else d
            fn = jax.jit(lambda x, ws, ss, zs, o=opts: [swap.matmul_t(x, w, s, z, **o) for w, s, z in zip(ws, ss, zs)])
            ws = packed if opts.get("native") else wts
            record(vname, fn, (x, ws, scales, zeros), layers, int4_bytes,
                   check=lambda o=opts, ws=ws: swap.matmul_t(x, ws[0], scales[0], zeros[0], **o))
        del packed, wts, wb
    if args.dump:
        res["ptx"] = ptx_counts(args.dump)
    save()
    for name, row in res["shapes"].items():
        print(f"\n{name}: " + ", ".join(f"{vn} {v['us']:.1f}" if "us" in v else f"{vn} err"
                                     for vn, v in row["variants"].items()))
    for kname, c in (res.get("ptx") or {}).items():
        print(kname, c)
    print("ptx entries with mma:", len(res.get("ptx") or {}) - 1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
