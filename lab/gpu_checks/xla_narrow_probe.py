"""Narrow weights through XLA's own GEMM fusions on the GPU: int4 / int8 / fp8 weights stored in
JAX's narrow dtypes and converted inside the graph, at decode rows, against bf16 and the
project's Pallas kernels (weight_only_matmul_gpu, fp8_matmul_gpu).

The question (benchmarks/results/weight_only_h100.md): the Pallas weight-only kernel moves its
packed bytes at 0.2-0.7 TB/s, its loads alone at 0.6-1.3 TB/s. XLA's Triton GEMM emitter fuses
converts of narrow operands (s4, s8, f8) into the GEMM it tiles and autotunes itself; if that
reads the narrow weight near the copy rate, the engine can hand XLA the weight in jnp.int4 /
float8 and keep no kernel of its own for decode rows.

    python -m lab.gpu_checks.xla_narrow_probe --out $OUT    # prints a table, writes xla_narrow.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
GROUP = 128


def _fusions(compiled_text: str) -> dict:
    """What the compiled program runs: Triton GEMM fusions, cuBLAS calls, other fusions."""
    return {"triton_gemm": len(re.findall(r'"kind":"__triton[a-z_]*"', compiled_text)),
            "cublas": len(re.findall(r'custom_call_target="__cublas', compiled_text)),
            "fusions": len(re.findall(r"\bfusion\(", compiled_text))}


def per_call(fn, x, ws, repeats: int = 7) -> tuple[float, str]:
    """Median seconds per call of `fn(x, w)` over the distinct weights `ws`, unrolled in one
    compiled program, and that program's compiled text."""
    import jax
    import numpy as np

    run = jax.jit(lambda x, ws: [fn(x, w) for w in ws])
    jax.block_until_ready(run(x, ws))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run(x, ws))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) / len(ws), run.lower(x, ws).compile().as_text()


def int4_layers(key, k: int, n: int) -> tuple[list, list, list, object]:
    """Distinct weights of one K x N linear, as many as fit ~2 GB of bf16 (4-16): bf16 weights,
    random int4 words packed along K ([K / 8, N] int32), group-128 bf16 scales, and the zero points
    (8, shared); the weight-only kernel sweeps' inputs."""
    import jax
    import jax.numpy as jnp

    g, bf = k // GROUP, jnp.bfloat16
    layers = max(4, min(16, int(2e9 // (2 * k * n))))
    ks = jax.random.split(jax.random.fold_in(key, k * n), 3)
    wb = [(0.02 * jax.random.normal(jax.random.fold_in(ks[0], i), (k, n), jnp.float32)).astype(bf)
          for i in range(layers)]
    packed = [jax.lax.bitcast_convert_type(jax.random.bits(jax.random.fold_in(ks[2], i), (k // 8, n), jnp.uint32),
                                           jnp.int32) for i in range(layers)]
    gs = [jnp.full((g, n), 0.005 + 1e-4 * i, bf) for i in range(layers)]
    return wb, packed, gs, jnp.full((g, n), 8, jnp.uint8)


def probe(rows_list: tuple[int, ...], only: tuple[str, ...] = (), hlo_dir: str | None = None) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxengine.benchmarks import ceilings
    from jaxengine.models.quantization import fp8_matmul_w8a8
    from jaxengine.pallas_kernels import fp8_matmul_gpu as fk
    from jaxengine.pallas_kernels import weight_only_matmul_gpu as wk

    res: dict = {"ceilings": ceilings.measure(), "shapes": SHAPES, "group": GROUP,
                 "timing": "median of 7 runs of one compiled program over L distinct weights, divided by L"}
    print(f"ceilings: {res['ceilings']}", flush=True)
    key = jax.random.key(0)
    bf = jnp.bfloat16
    for name, (k, n) in SHAPES.items():
        g = k // GROUP
        layers = max(4, min(16, int(2e9 // (2 * k * n))))
        ks = jax.random.split(jax.random.fold_in(key, k * n), 4)
        wb = [(0.02 * jax.random.normal(jax.random.fold_in(ks[0], i), (k, n), jnp.float32)).astype(bf)
              for i in range(layers)]
        s4 = [jax.random.randint(jax.random.fold_in(ks[1], i), (k, n), -8, 8, jnp.int32).astype(jnp.int4)
              for i in range(layers)]
        s8 = [jax.random.randint(jax.random.fold_in(ks[1], i), (k, n), -128, 128, jnp.int32).astype(jnp.int8)
              for i in range(layers)]
        f8_nk = [jnp.clip(16 * jax.random.normal(jax.random.fold_in(ks[2], i), (n, k), jnp.float32), -448, 448)
                 .astype(jnp.float8_e4m3fn) for i in range(layers)]
        f8_kn = [w.T for w in f8_nk]
        gs = [jnp.full((g, n), 0.005 + 1e-4 * i, bf) for i in range(layers)]
        gz = [jnp.full((g, n), 0.5, bf) for _ in range(layers)]
        cs = jnp.full((n,), 0.005, bf)
        fs = jnp.full((n,), 0.02 / 16, jnp.float32)
        packed = [jax.lax.bitcast_convert_type(jax.random.bits(jax.random.fold_in(ks[3], i), (k // 8, n),
                                                               jnp.uint32), jnp.int32) for i in range(layers)]
        pz = jnp.full((g, n), 8, jnp.uint8)
        i4_bytes, i8_bytes = k * n // 2 + g * n * 4, k * n + g * n * 4

        def dot(x, w):
            return jnp.dot(x, w, preferred_element_type=jnp.float32)

        def grouped3(x, w, s, z=None):  # w [G, GROUP, N] narrow: the group scale broadcast along a
            v = w.astype(bf)  # dimension of its own, and the dot contracting (G, GROUP) with no reshape
            v = v - z[:, None, :] if z is not None else v
            return jax.lax.dot_general(x.reshape(x.shape[0], g, GROUP), v * s[:, None, :],
                                       (((1, 2), (0, 1)), ((), ())), preferred_element_type=jnp.float32)

        def grouped(w, s, z=None):  # [K, N] narrow -> bf16 weight with group scales (and zeros)
            v = w.astype(bf).reshape(g, GROUP, n)
            v = v - z[:, None, :] if z is not None else v
            return (v * s[:, None, :]).reshape(k, n)

        variants = {
            "bf16": (lambda x, w: dot(x, w).astype(bf), wb, 2 * k * n),
            "xla_s4_channel": (lambda x, w: (dot(x, w.astype(bf)) * cs).astype(bf), s4, k * n // 2),
            "xla_s4_g128": (lambda x, w: dot(x, grouped(w[0], w[1])).astype(bf), list(zip(s4, gs)), i4_bytes),
            "xla_s4_g128_zero": (lambda x, w: dot(x, grouped(w[0], w[1], w[2])).astype(bf),
                                 list(zip(s4, gs, gz)), i4_bytes + g * n * 2),
            "xla_s4_g128_3d": (lambda x, w: grouped3(x, w[0], w[1]).astype(bf),
                               [(w.reshape(g, GROUP, n), sc) for w, sc in zip(s4, gs)], i4_bytes),
            "xla_s4_g128_3d_zero": (lambda x, w: grouped3(x, w[0], w[1], w[2]).astype(bf),
                                    [(w.reshape(g, GROUP, n), sc, z) for w, sc, z in zip(s4, gs, gz)],
                                    i4_bytes + g * n * 2),
            "xla_s8_g128_3d": (lambda x, w: grouped3(x, w[0], w[1]).astype(bf),
                               [(w.reshape(g, GROUP, n), sc) for w, sc in zip(s8, gs)], i8_bytes),
            "xla_s8_channel": (lambda x, w: (dot(x, w.astype(bf)) * cs).astype(bf), s8, k * n),
            "xla_s8_g128": (lambda x, w: dot(x, grouped(w[0], w[1])).astype(bf), list(zip(s8, gs)), i8_bytes),
            "xla_f8_kn": (lambda x, w: (dot(x, w.astype(bf)) * fs).astype(bf), f8_kn, k * n),
            "xla_f8_nk": (lambda x, w: (jax.lax.dot_general(x, w.astype(bf), (((1,), (1,)), ((), ())),
                                                            preferred_element_type=jnp.float32) * fs).astype(bf),
                          f8_nk, k * n),
            "pallas_int4_slabs": (lambda x, w: wk.weight_only_matmul(x, w[0], w[1], pz, bits=4, group_size=GROUP,
                                                                     slabs=True),
                                  list(zip(packed, gs)), i4_bytes),
            "pallas_fp8": (lambda x, w: fk.fp8_weight_matmul(x, w, fs), f8_nk, k * n),
            "w8a8": (lambda x, w: fp8_matmul_w8a8(x, w, fs, None), f8_nk, k * n),
        }
        shape_res: dict = {"K": k, "N": n, "layers_in_stack": layers}
        for rows in rows_list:
            x = jax.random.normal(jax.random.fold_in(key, rows), (rows, k), jnp.float32).astype(bf)
            cells: dict = {}
            for label, (fn, ws, nbytes) in variants.items():
                if only and label not in only:
                    continue
                try:
                    t, text = per_call(fn, x, ws)
                    cells[label] = {"us": 1e6 * t, "weight_GBps": nbytes / t / 1e9, **_fusions(text)}
                    if hlo_dir:  # the optimized program of one call, to read what XLA made of it
                        one = jax.jit(fn).lower(x, ws[0]).compile().as_text()
                        with open(os.path.join(hlo_dir, f"{name}_{rows}_{label}.hlo.txt"), "w") as f:
                            f.write(one)
                except Exception as e:  # recorded; the other variants still run
                    cells[label] = {"error": f"{type(e).__name__}: {str(e)[:600]}"}
            shape_res[f"rows_{rows}"] = cells
            print(f"{name:<8} rows {rows:>3}: " + ", ".join(
                f"{lab} {c['us']:.1f} us ({c['weight_GBps']:.0f} GB/s, tg {c['triton_gemm']} cb {c['cublas']})"
                if "us" in c else f"{lab} ERR" for lab, c in cells.items()), flush=True)
        # agreement of the grouped int4 form with a float32 reference, 16 rows
        x = jax.random.normal(key, (16, k), jnp.float32).astype(bf)
        want = jnp.dot(x.astype(jnp.float32), (s4[0].astype(jnp.float32).reshape(g, GROUP, n)
                                               * gs[0].astype(jnp.float32)[:, None, :]).reshape(k, n))
        got = jax.jit(lambda x, w, s: dot(x, grouped(w, s)))(x, s4[0], gs[0])
        shape_res["s4_g128_max_abs_err"] = float(jnp.max(jnp.abs(got - want)))
        shape_res["s4_g128_ref_max_abs"] = float(jnp.max(jnp.abs(want)))
        res[name] = shape_res
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rows", default="1,16,64,256")
    ap.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    ap.add_argument("--hlo", action="store_true", help="also write each variant's optimized HLO under "
                    "OUT/hlo (tar it: the device returns at most 8 files)")
    args = ap.parse_args()
    hlo_dir = os.path.join(args.out, "hlo") if args.hlo else None
    if hlo_dir:
        os.makedirs(hlo_dir, exist_ok=True)
    res = probe(tuple(int(r) for r in args.rows.split(",")), tuple(v for v in args.only.split(",") if v), hlo_dir)
    import jax

    res["device"] = str(jax.devices()[0].device_kind)
    res["jax"] = jax.__version__
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "xla_narrow.json"), "w") as f:
        json.dump(res, f, indent=1)
    labels = list(next(v for k, v in res["gate_up"].items() if k.startswith("rows_")))
    print("\n| shape | rows | " + " | ".join(labels) + " |")
    print("|---|---|" + "---|" * len(labels))
    for name in SHAPES:
        for key, cells in res[name].items():
            if key.startswith("rows_"):
                print(f"| {name} | {key[5:]} | " + " | ".join(
                    f"{cells[lab]['us']:.1f}" if "us" in cells.get(lab, {}) else "err" for lab in labels) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
