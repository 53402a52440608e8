"""Probe (Hopper GPU): what a decode call costs before and after its K/V stream.

The copy-only probe (`probe_paged_read.py`) timed the decode kernel's K/V copies alone. Its
times fit `fixed + bytes / rate` with the rate at ~3.2 TB/s and `fixed` ~3 us whatever the bytes
or the CTA count (64 or 128). This probe takes that intercept apart, in one run, with kernels
of the decode kernel's grid at batch 8 (64 CTAs: K = 8 KV heads x 8 rows, two warpgroups):

- `xla_tiny`: one small XLA elementwise kernel;
- `triton_copy_N`: a Pallas kernel lowered by Triton (the bundled kernel's path) copying one
  small tile in each of N programs; `_fence`: with the fence every Mosaic GPU kernel starts
  with (after its barriers' initialisation) run before the copy. These two run as dependent
  chains behind optimisation barriers: identical or elementwise calls would otherwise be
  merged by XLA into fewer kernels (each row lists its kernels per chain);
- `empty`: a Mosaic kernel of the decode grid doing nothing, without and with the decode
  kernel's shared memory and barriers (`empty_smem`); also one CTA (`empty_1cta`), one
  warpgroup per CTA (`empty_1wg`) and clusters of 8 CTAs (`empty_cluster8`, batch 1's grid);
- `table`: the memory warpgroup's first round trip only (the table row by TMA, waited for);
- `table_scalar`: the same ids read as scalars from global memory instead (one load per page of
  the first step);
- `steps:N`: the copy-only probe's kernel with N steps of 128 keys per CTA (N = 1, 2, 4, 8, 16);
- `decode:N`: the decode kernel itself (decode-only call, one split) at context 128 x N.

    python lab/kernels/probe_fixed_cost.py --out DIR   # GPU; prints a table last
    python lab/kernels/probe_fixed_cost.py --lower     # lower for CUDA only (any host)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from lab.kernels import bench_paged_attention as bench  # noqa: E402  (maps jaxengine.*)
from lab.kernels import probe_paged_read as probe  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from lab.kernels import ragged_paged_attention_mgpu_decode as dec  # noqa: E402
from lab.kernels.ragged_paged_attention_mgpu_decode import DecodeTiling, Tiling  # noqa: E402

BKV, STAGES = 128, 2
_MBARRIER_INIT_FENCE = "fence.mbarrier_init.release.cluster;"  # the start of every Mosaic kernel
FIXED_MODES = ("empty", "empty_1cta", "empty_1wg", "empty_cluster8", "empty_smem", "table",
               "table_scalar")
STEPS = (1, 2, 4, 8, 16)


def fixed_kernel(k_cache, table, *, mode: str):
    """A kernel of the decode grid (K x W CTAs, two warpgroups) that does only the part named
    by `mode` (FIXED_MODES): "empty" nothing; "empty_1cta" nothing in one CTA; "empty_1wg"
    nothing with one warpgroup per CTA; "empty_cluster8" nothing in clusters of 8 CTAs (batch
    1's 8 splits); "empty_smem" nothing beside the decode kernel's shared memory and barriers;
    "table" / "table_scalar" the first step's block ids by the table row's TMA / by scalar
    loads. Returns [K, W, 8] int32 (the ids read; the "empty" modes leave it unwritten)."""
    _, k, _, h = k_cache.shape
    w_rows, m = table.shape
    pages = BKV // k_cache.shape[2]
    dtype = k_cache.dtype
    grid, cluster = (k, w_rows), {}
    if mode == "empty_1cta":
        grid = (1, 1)
    elif mode == "empty_cluster8":
        grid, cluster = (k, w_rows // 8), {"cluster": (8,), "cluster_names": ("split",)}
    mesh = plgpu.Mesh(grid=grid, grid_names=("kv", "walker"),
                      num_threads=1 if mode == "empty_1wg" else 2, thread_name="wg", **cluster)
    out_type = jax.ShapeDtypeStruct((k, w_rows, 8), jnp.int32)

    if mode.startswith("empty") and mode != "empty_smem":
        def entry(bt_ref, out_ref):
            del bt_ref, out_ref
        return pl.kernel(entry, out_type=out_type, mesh=mesh, name=f"probe_{mode}")(table)

    def body(bt_ref, out_ref, k_smem, v_smem, bt_smem, k_bars, v_bars, bt_bar, k_free, v_free,
             ids_smem):
        del k_smem, v_smem, k_bars, v_bars, k_free, v_free
        kh = lax.axis_index("kv")
        w = lax.axis_index("walker")
        wg = lax.axis_index("wg")
        if mode == "empty_smem":
            return

        @pl.when(wg == 1)
        def _memory():
            if mode == "table":
                dec.copy_table_row(bt_ref, w, bt_smem, bt_bar, m)
                plgpu.barrier_wait(bt_bar)
                ids = [bt_smem[jj] for jj in range(8)]
            else:  # table_scalar: the first step's ids straight from global memory
                ids = [bt_ref[w, jj] for jj in range(pages)][:8]
            for jj, v in enumerate(ids):
                ids_smem[jj] = v + kh
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(ids_smem, out_ref.at[kh, w])
            plgpu.wait_smem_to_gmem(0)

    def entry(bt_ref, out_ref):
        pl.run_scoped(
            lambda *scoped: body(bt_ref, out_ref, *scoped),
            *probe.copy_scratch(h, dtype, m, k_cache.shape[2], bkv=BKV, stages=STAGES),
            plgpu.SMEM((8,), jnp.int32),
            collective_axes="wg")

    return pl.kernel(entry, out_type=out_type, mesh=mesh, name=f"probe_{mode}")(table)


def triton_kernel(x, *, programs: int, asm: str = ""):
    """A Pallas kernel lowered by Triton (as the bundled kernel is) that copies one [8, 128]
    float32 tile per program: the launch floor of that path, for comparison. asm: PTX run
    (once per element) before the copy, e.g. the fence Mosaic GPU kernels begin with."""
    def body(x_ref, o_ref):
        val = x_ref[...]
        if asm:
            from jax.experimental.pallas import triton as pltriton
            [val] = pltriton.elementwise_inline_asm(
                asm + " mov.b32 $0, $1;", args=[val], constraints="=r,r", pack=1,
                result_shape_dtypes=[jax.ShapeDtypeStruct(val.shape, val.dtype)])
        o_ref[...] = val

    return pl.pallas_call(
        body, grid=(programs,), in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), name="probe_triton")(x)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/probe_fixed"))
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", default=",".join(map(str, STEPS)),
                    help="comma-separated steps per CTA for the copy-only and decode rows")
    ap.add_argument("--lower", action="store_true", help="lower every probe kernel for CUDA")
    args = ap.parse_args()
    k_heads, p = bench.N_KV, bench.BLOCK
    if args.lower:
        kc = jnp.zeros((64, k_heads, p, bench.HEAD_DIM), jnp.bfloat16)
        table = jnp.zeros((args.batch, 32), jnp.int32)
        for mode in FIXED_MODES:
            jax.jit(lambda kc_, t_, mode=mode: fixed_kernel(kc_, t_, mode=mode)).trace(
                kc, table).lower(lowering_platforms=("cuda",))
        from tests.kernels.cuda_target import abstract_h100
        with abstract_h100():
            jax.jit(lambda x: triton_kernel(x, programs=64, asm=_MBARRIER_INIT_FENCE)).trace(
                jax.ShapeDtypeStruct((512, 128), jnp.float32)).lower(
                    lowering_platforms=("cuda",))
        print("lowered")
        return
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    timer, res = bench.probe_start(args.iters, reps=args.reps,
                                   batch=args.batch, grid=[k_heads, args.batch],
                                   tiling=f"{BKV}x{STAGES}", rows={})
    copy_bps = res["ceilings"]["copy_bytes_per_s"]
    num_blocks = 65536
    pool = bench.make_pool(num_blocks, with_transposed=False)
    rng = np.random.default_rng(0)

    def record(name, fn, fargs, nbytes=0, kernels=False):
        """Times `fn` (a chain of args.reps calls) into res["rows"][name]; with `kernels`, also
        each kernel's time and count (`breakdown`)."""
        try:
            t = timer(fn, fargs)
            us = bench._ms(t) * 1e3 / args.reps
            row = {"us": us, "kv_bytes": nbytes, "timing": t}
            if nbytes:
                row["frac_of_copy"] = nbytes / (us * 1e-6) / copy_bps
            if kernels:
                row["kernels"] = breakdown(fn, fargs)
        except Exception as e:  # noqa: BLE001
            row = {"error": repr(e)[:500]}
        res["rows"][name] = row
        bench.log(name, json.dumps(row, default=str)[:300])

    def breakdown(fn, fargs):
        """Per-call CUPTI time and count of each kernel name (the chain's kernels / reps)."""
        if timer.profiler is None:
            return None
        _, ts = timer.profiler.measure(fn, aggregate=False)(*fargs)
        out = {}
        for kname, kms in ts or []:
            us, n = out.get(kname[:60], (0.0, 0))
            out[kname[:60]] = (us + kms * 1e3 / args.reps, n + 1)
        return {k: {"us_per_call": us, "kernels_per_chain": n} for k, (us, n) in out.items()}

    def dependent_chain(op):
        """reps calls of `op`, each on the previous one's result, with an optimisation
        barrier between them: XLA can neither merge nor fuse them (one kernel each)."""
        def f(x):
            for _ in range(args.reps):
                x = lax.optimization_barrier(op(x))
            return x
        return jax.jit(f)

    x = jnp.ones((1024,), jnp.float32)
    tiny = dependent_chain(lambda v: v * 1.0001)
    record("xla_tiny", tiny, (x,), kernels=True)
    for (programs, fence) in ((1, ""), (64, ""), (1, _MBARRIER_INIT_FENCE),
                              (64, _MBARRIER_INIT_FENCE)):
        xt = jnp.ones((8 * programs, 128), jnp.float32)
        fn = dependent_chain(lambda v, programs=programs, fence=fence: triton_kernel(
            v, programs=programs, asm=fence))
        record(f"triton_copy_{programs}" + ("_fence" if fence else ""), fn, (xt,),
               kernels=True)
    tables = tuple(probe.tables_for(rng, num_blocks, args.batch, 16 * BKV // p, 8, "random"))
    for mode in FIXED_MODES:
        fn = probe.chain(args.reps, lambda kc, vc, t, mode=mode: fixed_kernel(kc, t, mode=mode))
        record(mode, fn, (pool.k, pool.v, tables), kernels=True)
    for n in [int(x) for x in args.steps.split(",") if x]:
        keys = n * BKV
        nbytes = k_heads * args.batch * keys * bench.HEAD_DIM * 2 * 2
        n_sets = bench.n_sets_for(nbytes, args.reps)
        tabs = tuple(probe.tables_for(rng, num_blocks, args.batch, keys // p, n_sets, "random"))
        record(f"steps:{n}", probe.chain(args.reps, lambda kc, vc, t, keys=keys: probe.paged_read(
            kc, vc, t, keys=keys, bkv=BKV, stages=STAGES)), (pool.k, pool.v, tabs), nbytes)
        step = bench.build_step(rng, pool, [1] * args.batch, [keys - 1] * args.batch,
                                n_sets=n_sets)
        f = bench.chain_ours(args.reps, Tiling(mosaic_decode=DecodeTiling(splits=1)), False,
                             decode="mosaic", decode_only=True)
        record(f"decode:{n}", f, bench.chain_args(step, pool), nbytes)
    # fixed + bytes / rate over the copy-only rows
    pts = [(r["kv_bytes"], r["us"]) for name, r in res["rows"].items()
           if name.startswith("steps:") and "us" in r]
    if len(pts) >= 2:
        b, u = np.array(pts, float).T
        slope, icpt = np.polyfit(b, u, 1)
        res["copy_fit"] = {"fixed_us": icpt, "rate_TBps": 1 / (slope * 1e-6) / 1e12}
    res["elapsed_s"] = time.time() - t0
    with open(os.path.join(args.out, "probe_fixed_cost.json"), "w") as fh:
        json.dump(res, fh, indent=1, default=str)
    print("\nprobe | us | KV MB | % of copy | kernels (per call, count per chain)")
    for name, r in res["rows"].items():
        if "us" in r:
            frac = f"{r['frac_of_copy']:.0%}" if "frac_of_copy" in r else "-"
            kern = "; ".join(f"{k}: {v['us_per_call']:.3f} us x {v['kernels_per_chain']}"
                             for k, v in (r.get("kernels") or {}).items())
            print(f"{name} | {r['us']:.2f} | {r['kv_bytes'] / 1e6:.1f} | {frac} | {kern}")
        else:
            print(f"{name} | error {r['error'][:200]}")
    if "copy_fit" in res:
        print("copy-only fit: fixed {fixed_us:.2f} us, rate {rate_TBps:.2f} TB/s".format(
            **res["copy_fit"]))


if __name__ == "__main__":
    main()
