"""Where the weight-only kernel's time goes on one H100: the same grid, K loop and tiles as
pallas_kernels/weight_only_matmul_gpu.py (int4, groups of 128, 16 rows of x), cut down stage by
stage, each timed over Llama-3-8B's gate/up and down shapes:

- loads: each step loads its [16, block_n] words and XORs them into an int32 accumulator;
- unpack: + shifts, masks and the magic conversion of all 128 values, summed into a float32 tile
  (no dot);
- dequant: + the group scale and zero point, cast to bf16, summed (no dot);
- full: the kernel itself (dot with x).

    python -m lab.gpu_checks.weight_only_stages --out $OUT
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

SHAPES = {"gate_up": (4096, 28672), "down": (14336, 4096), "qkv": (4096, 6144)}
STAGES = ("loads", "unpack", "dequant")


def _stage_kernel(p_ref, s_ref, z_ref, o_ref, *, stage: str, steps: int):
    rows, bn = 16, o_ref.shape[-1]
    first = pl.program_id(1) * steps
    shifts = lax.broadcasted_iota(jnp.int32, (1, 8, 1), 1) * 4

    def body(kb, acc):
        words = p_ref[pl.ds(kb * rows, rows), :]
        if stage == "loads":
            return acc ^ words
        vals = lax.bitcast_convert_type(((words[:, None, :] >> shifts) & 15) | 0x4B000000, jnp.float32)
        if stage == "dequant":
            g = kb
            scale = s_ref[pl.ds(g, 1), :].astype(jnp.float32)[None]
            zero = z_ref[pl.ds(g, 1), :].astype(jnp.float32)[None] + float(1 << 23)
            vals = ((vals - zero) * scale).astype(jnp.bfloat16).astype(jnp.float32)
        return acc + jnp.sum(vals, axis=1)  # [rows, bn]: every value is used

    init = jnp.zeros((rows, bn), jnp.int32 if stage == "loads" else jnp.float32)
    acc = lax.fori_loop(first, first + steps, body, init)
    o_ref[...] = acc.astype(jnp.float32)[None]


@functools.partial(jax.jit, static_argnames=("stage", "block_n", "splits", "num_warps", "num_stages"))
def stage_call(packed, scales, zeros, *, stage: str, block_n: int = 128, splits: int = 2, num_warps: int = 4,
               num_stages: int = 3):
    kw, n = packed.shape
    k = kw * 8
    steps = k // 128 // splits
    return pl.pallas_call(
        functools.partial(_stage_kernel, stage=stage, steps=steps),
        grid=(n // block_n, splits),
        in_specs=[pl.BlockSpec((kw, block_n), lambda j, s: (0, j)),
                  pl.BlockSpec((k // 128, block_n), lambda j, s: (0, j)),
                  pl.BlockSpec((k // 128, block_n), lambda j, s: (0, j))],
        out_specs=pl.BlockSpec((1, 16, block_n), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((splits, 16, n), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"wo_stage_{stage}",
    )(packed, scales, zeros)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    from jaxengine.benchmarks import ceilings
    from jaxengine.pallas_kernels import weight_only_matmul_gpu as kernel
    from lab.gpu_checks.quant_h100 import _put

    res: dict = {"ceilings": ceilings.measure(), "device": jax.devices()[0].device_kind, "jax": jax.__version__}
    key = jax.random.key(2)
    for name, (k, n) in SHAPES.items():
        layers = max(4, min(16, int(2e9 // (2 * k * n))))
        ws = [(jax.lax.bitcast_convert_type(jax.random.bits(jax.random.fold_in(key, i), (k // 8, n), jnp.uint32),
                                            jnp.int32), jnp.full((k // 128, n), 0.01, jnp.bfloat16),
               jnp.full((k // 128, n), 8, jnp.uint8)) for i in range(layers)]
        nbytes = k * n // 2 + (k // 128) * n * 3
        x = jnp.ones((16, k), jnp.bfloat16)
        cells: dict = {}
        k_steps = k // 128
        splits = kernel.pick_splits(n // 128, k_steps)
        for stage in STAGES:
            for st, nw in ((2, 4), (3, 4), (4, 4), (3, 8)):
                _put(cells, x, f"{stage} st{st} w{nw}", lambda x, w, stage=stage, st=st, nw=nw: stage_call(
                    *w, stage=stage, splits=splits, num_warps=nw, num_stages=st), ws, nbytes)
        for st, nw in ((2, 4), (3, 4), (3, 8)):
            _put(cells, x, f"full st{st} w{nw}", lambda x, w, st=st, nw=nw: kernel.weight_only_matmul(
                x, *w, bits=4, group_size=128, num_warps=nw, num_stages=st), ws, nbytes)
        res[name] = {"K": k, "N": n, "splits": splits, "cells": cells}
        print(name, "done", file=sys.stderr, flush=True)
    with open(os.path.join(args.out, "weight_only_stages.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    c = res["ceilings"]
    print(f"ceilings: copy {c['copy_bandwidth_GBps']:.0f} GB/s, bf16 matmul {c['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    for name in SHAPES:
        cells = res[name]["cells"]
        for stage in STAGES + ("full",):
            mine = {lab: v for lab, v in cells.items() if lab.startswith(stage + " ") and "us" in v}
            if not mine:
                errs = [v.get("error", "")[:300] for lab, v in cells.items() if lab.startswith(stage + " ")]
                print(f"{name:<8}{stage:<8} error {errs[:1]}")
                continue
            best = min(mine, key=lambda lab: mine[lab]["us"])
            print(f"{name:<8}{stage:<8}{mine[best]['us']:>8.1f} us {mine[best]['weight_GBps']:>6.0f} GB/s  {best}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
