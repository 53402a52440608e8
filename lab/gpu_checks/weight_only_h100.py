"""The weight-only kernel (pallas_kernels/weight_only_matmul_gpu.py) on one H100, by conversion and
weight form, at a decode step's rows, beside bf16 and the ceilings measured in the same run.

Forms: int4 in groups of 128 with integer zero points (GPTQ / AWQ / compressed-tensors W4A16), Q4_K's
form (4-bit, groups of 32, float minimums), Q8_0's (8-bit, groups of 32, zero 128). Conversions:
`i2f` (int-to-float convert per value), `magic` (the float32 2^23 OR), `post` (values made bf16 by
an OR, scale and zero applied to the dot's sums). Llama-3-8B's four linear shapes, 1 and 16 rows;
each time is one compiled program running the layer over 4-16 distinct weights back to back
(lab/gpu_checks/quant_h100._per_call), so every call reads its weight from memory. The best
configuration of each (conversion, form) is kept, and its error against the reference.

    python -m lab.gpu_checks.weight_only_h100 --out $OUT
    python -m lab.gpu_checks.weight_only_h100 --out $OUT --layouts   # kernel layouts (below)

Writes $OUT/weight_only.json and prints a short table. `--layouts` instead times the kernel's
step layouts for int4 groups of 128 and Q4_K's form (magic conversion): 128 rows a step (the
default), 64 or 32 rows a step, and slabs (one dot per value position of the words, x's columns
permuted), each over three configurations, into $OUT/weight_only_layouts.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# form -> (bits, group, float minimums)
FORMS = {"int4_g128": (4, 128, False), "q4k_g32": (4, 32, True), "q8_g32": (8, 32, False)}
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
# (block_n, num_stages, num_warps); the first is the engine's default
CONFIGS_WIDE = [(128, 2, 4), (128, 3, 4), (128, 4, 4), (256, 3, 4), (256, 3, 8), (64, 3, 4), (128, 3, 8)]
CONFIGS_NARROW = [(128, 2, 4), (128, 3, 4), (256, 3, 8)]


def _weights(jax, jnp, key, k: int, n: int, bits: int, group: int, float_min: bool, layers: int):
    per = 32 // bits
    out = []
    for i in range(layers):
        packed = jax.lax.bitcast_convert_type(jax.random.bits(jax.random.fold_in(key, i), (k // per, n), jnp.uint32),
                                              jnp.int32)
        scales = jnp.full((k // group, n), 0.005 + 0.0001 * i, jnp.bfloat16)
        zeros = jnp.full((k // group, n), 0.04, jnp.bfloat16) if float_min else \
            jnp.full((k // group, n), 1 << (bits - 1), jnp.uint8)
        out.append((packed, scales, zeros))
    nbytes = k * n * bits // 8 + (k // group) * n * (4 if float_min else 3)
    return out, nbytes


def micro() -> dict:
    import jax
    import jax.numpy as jnp

    from jaxengine.benchmarks import ceilings
    from jaxengine.pallas_kernels import weight_only_matmul_gpu as kernel
    from lab.gpu_checks.quant_h100 import _put

    res: dict = {"ceilings": ceilings.measure(), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                 "forms": FORMS, "shapes": SHAPES,
                 "timing": "median over 7 runs of one compiled program over L distinct weights, divided by L"}
    key = jax.random.key(0)
    for name, (k, n) in SHAPES.items():
        layers = max(4, min(16, int(2e9 // (2 * k * n))))
        wb = [(0.02 * jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.float32)).astype(jnp.bfloat16)
              for i in range(layers)]
        shape_res: dict = {"K": k, "N": n, "layers_in_stack": layers}
        for rows in (1, 16):
            x = jax.random.normal(jax.random.fold_in(key, rows), (rows, k), jnp.float32).astype(jnp.bfloat16)
            cells: dict = {}
            _put(cells, x, "bf16", lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype),
                 wb, 2 * k * n)
            for form, (bits, group, fmin) in FORMS.items():
                ws, nbytes = _weights(jax, jnp, jax.random.fold_in(key, bits * group), k, n, bits, group, fmin, layers)
                convs = ["magic", "post"] if bits == 4 else ["magic"]
                if form == "int4_g128":
                    convs.append("i2f")
                for conv in convs:
                    wide = rows == 16 and form == "int4_g128" and conv != "i2f"
                    for bn, st, nw in (CONFIGS_WIDE if wide else CONFIGS_NARROW):
                        opts = dict(bits=bits, group_size=group, float_min=fmin, block_n=bn, num_stages=st,
                                    num_warps=nw, magic=conv != "i2f", post_scale=conv == "post")
                        _put(cells, x, f"{form} {conv} bn{bn} st{st} w{nw}",
                             lambda x, w, o=opts: kernel.weight_only_matmul(x, *w, **o), ws, nbytes)
                    mine = {lab: c["us"] for lab, c in cells.items() if lab.startswith(f"{form} {conv} ") and "us" in c}
                    if mine:
                        best = min(mine, key=mine.get)
                        cells[f"{form} {conv} best"] = dict(cells[best], config=best)
                        # error of this conversion against the reference, engine's default configuration
                        p, s, z = ws[0]
                        ref = kernel.weight_only_matmul_reference(x, p, s, z, bits, group, fmin).astype(jnp.float32)
                        got = kernel.weight_only_matmul(x, p, s, z, bits=bits, group_size=group, float_min=fmin,
                                                        magic=conv != "i2f", post_scale=conv == "post")
                        cells[f"{form} {conv} best"]["max_abs_err"] = float(jnp.max(jnp.abs(got.astype(jnp.float32)
                                                                                            - ref)))
                        cells[f"{form} {conv} best"]["ref_max_abs"] = float(jnp.max(jnp.abs(ref)))
            shape_res[f"rows_{rows}"] = cells
            print(f"{name} rows {rows} done", file=sys.stderr, flush=True)
        res[name] = shape_res
    return res


LAYOUTS = {"bk128": {}, "bk64": {"block_k_rows": 64}, "bk32": {"block_k_rows": 32}, "slabs": {"slabs": True}}


def layouts() -> dict:
    import jax
    import jax.numpy as jnp

    from jaxengine.benchmarks import ceilings
    from jaxengine.pallas_kernels import weight_only_matmul_gpu as kernel
    from lab.gpu_checks.quant_h100 import _put

    res: dict = {"ceilings": ceilings.measure(), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                 "layouts": LAYOUTS, "shapes": SHAPES}
    key = jax.random.key(1)
    for name, (k, n) in SHAPES.items():
        layers = max(4, min(16, int(2e9 // (2 * k * n))))
        shape_res: dict = {}
        for rows in (1, 16):
            x = jax.random.normal(jax.random.fold_in(key, rows), (rows, k), jnp.float32).astype(jnp.bfloat16)
            cells: dict = {}
            for form in ("int4_g128", "q4k_g32"):
                bits, group, fmin = FORMS[form]
                ws, nbytes = _weights(jax, jnp, jax.random.fold_in(key, group), k, n, bits, group, fmin, layers)
                for lay, extra in LAYOUTS.items():
                    if extra.get("block_k_rows", 0) > group or (lay == "slabs" and group < 128):
                        continue
                    for bn, st, nw in CONFIGS_NARROW + [(64, 3, 4)]:
                        opts = dict(bits=bits, group_size=group, float_min=fmin, block_n=bn, num_stages=st,
                                    num_warps=nw, **extra)
                        _put(cells, x, f"{form} {lay} bn{bn} st{st} w{nw}",
                             lambda x, w, o=opts: kernel.weight_only_matmul(x, *w, **o), ws, nbytes)
                    mine = {lab: c["us"] for lab, c in cells.items() if lab.startswith(f"{form} {lay} ") and "us" in c}
                    if mine:
                        best = min(mine, key=mine.get)
                        p, s, z = ws[0]
                        ref = kernel.weight_only_matmul_reference(x, p, s, z, bits, group, fmin).astype(jnp.float32)
                        got = kernel.weight_only_matmul(x, p, s, z, bits=bits, group_size=group, float_min=fmin, **extra)
                        cells[f"{form} {lay} best"] = dict(cells[best], config=best, max_abs_err=float(
                            jnp.max(jnp.abs(got.astype(jnp.float32) - ref))))
            shape_res[f"rows_{rows}"] = cells
            print(f"{name} rows {rows} done", file=sys.stderr, flush=True)
        res[name] = shape_res
    return res


def _layout_table(res: dict) -> None:
    c = res["ceilings"]
    print(f"ceilings: copy {c['copy_bandwidth_GBps']:.0f} GB/s, bf16 matmul {c['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    cols = [f"{f} {lay}" for f in ("int4_g128", "q4k_g32") for lay in LAYOUTS if not (f == "q4k_g32" and lay in
                                                                                        ("bk64", "slabs"))]
    print(f"{'shape':<8}{'rows':>5}  " + "  ".join(f"{cl:>16}" for cl in cols) + "   (us; GB/s of weights)")
    for name in SHAPES:
        for rows in (1, 16):
            cells = res[name][f"rows_{rows}"]
            vals = [f"{cells[cl + ' best']['us']:>8.1f} {cells[cl + ' best']['weight_GBps']:>6.0f}"
                    if "us" in cells.get(cl + " best", {}) else f"{'-':>15}" for cl in cols]
            print(f"{name:<8}{rows:>5}  " + "  ".join(vals))


def _table(res: dict) -> None:
    c = res["ceilings"]
    print(f"ceilings: copy {c['copy_bandwidth_GBps']:.0f} GB/s, bf16 matmul {c['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    cols = ["bf16"] + [f"{f} {cv}" for f in FORMS for cv in (["magic", "post", "i2f"] if f == "int4_g128" else
                                                              ["magic", "post"] if FORMS[f][0] == 4 else ["magic"])]
    print(f"{'shape':<8}{'rows':>5}  " + "  ".join(f"{cl:>15}" for cl in cols) + "   (us; best config; GB/s of weights)")
    for name in SHAPES:
        for rows in (1, 16):
            cells = res[name][f"rows_{rows}"]
            vals = []
            for cl in cols:
                cell = cells.get(cl if cl == "bf16" else cl + " best", {})
                vals.append(f"{cell['us']:>7.1f} {cell['weight_GBps']:>6.0f}" if "us" in cell else f"{'-':>15}")
            print(f"{name:<8}{rows:>5}  " + "  ".join(vals))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--layouts", action="store_true", help="time the kernel's step layouts instead")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    if args.layouts:
        res = layouts()
        res["wall_s"] = time.perf_counter() - t0
        with open(os.path.join(args.out, "weight_only_layouts.json"), "w") as fh:
            json.dump(res, fh, indent=1)
        _layout_table(res)
        return 0
    res = micro()
    res["wall_s"] = time.perf_counter() - t0
    with open(os.path.join(args.out, "weight_only.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    _table(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
