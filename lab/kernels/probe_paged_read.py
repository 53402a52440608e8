"""Probe (Hopper GPU): how fast can the Mosaic decode kernel's K/V copies run with no compute?

The decode kernel's memory warpgroup streams a row's K and V pages by TMA, one copy per page of
P keys ([P, H] of one KV head: 4 KB at P = 16, H = 128, bf16), `stages` steps of `block_kv`
keys in flight. This probe keeps exactly that (the same `load_kv_step`, the same swizzled
buffers, the same table-row copy) and replaces the compute warpgroup with one that only waits
for each step and frees it. Its time is the floor of the kernel's copy side for a batch shape:
the kernel's time minus it is what compute, the split merge and the stores add.

Work: CTA (kh, w) of a (K, W) grid reads `keys` keys of KV head kh from the pages of table row
w; a batch x context decode call with C splits per row is W = batch x C, keys = context / C.
Page orders: "random" (a permutation of the pool, as the bench's tables) or "sequential"
(consecutive block ids per row). Every call of a timed chain reads its own blocks where the
pool allows, so the data come from HBM, as in the bench. The decode kernel itself is timed on
the same rows in the same run (decode_only, Mosaic decode kernel, with the shape's splits).

    python lab/kernels/probe_paged_read.py --out DIR   # GPU; prints a table last
    python lab/kernels/probe_paged_read.py --lower     # lower for CUDA only (any host)

On the H100 (jax 0.11.2; `kernels_h100_mosaic_v12.json` runs 1-2, in git history: see
lab/results/HISTORY.md) the copies of 8 x 1024 alone took 13.7-14.2 us (78-80% of the copy
rate), as fast from 64 CTAs as from 128, and within 0.3 us for every pipeline tried; sequential
pages were 0.7-1.5 us faster. The decode kernel's split count follows from it (`num_splits`:
half the SMs).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from lab.kernels import bench_paged_attention as bench  # noqa: E402  (maps jaxengine.*)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402
from jaxlib.mlir import ir  # noqa: E402
from jaxlib.mlir.dialects import llvm  # noqa: E402

from lab.kernels import ragged_paged_attention_mgpu_decode as dec  # noqa: E402
from lab.kernels.ragged_paged_attention_mgpu_decode import DecodeTiling, Tiling  # noqa: E402
from jaxengine.pallas_kernels.ragged_paged_attention_mgpu import (  # noqa: E402
    load_kv_step, mma_transforms)

# (name, batch, context, splits): the decode kernel's CTAs for these rows are K x batch x splits.
SHAPES = [("1x2048", 1, 2048, 8), ("1x8192", 1, 8192, 8), ("8x1024", 8, 1024, 2),
          ("8x2048", 8, 2048, 2), ("8x8192", 8, 8192, 2),
          ("8x1024s1", 8, 1024, 1), ("8x2048s1", 8, 2048, 1), ("8x8192s1", 8, 8192, 1)]
PIPELINES = [(128, 2), (64, 4), (128, 3), (64, 2)]  # (block_kv, stages)


def spin(cycles: int) -> None:
    """Busy-waits about `cycles` SM clock cycles (every thread of the warpgroup)."""
    if cycles <= 0:
        return

    @plgpu.inline_mgpu()
    def wait(ctx):
        del ctx
        llvm.inline_asm(
            ir.Type.parse("!llvm.void"), [],
            "{ .reg .u64 t0, t1; .reg .pred p; mov.u64 t0, %clock64; "
            f"SPIN${{:uid}}: mov.u64 t1, %clock64; sub.u64 t1, t1, t0; "
            f"setp.lt.u64 p, t1, {int(cycles)}; @p bra SPIN${{:uid}}; }}",
            "", has_side_effects=True)

    wait()


# The decode kernel's compute per 128-key step at 8 x 1024 (v17-v18 profiles), in SM cycles:
# K held through Q.K^T, then the softmax, then V held through P.V.
HOLD_CYCLES = (400, 630, 700)


def parse_hold(spec: str) -> tuple[str, tuple[int, int, int]]:
    """A `--holds` entry as (schedule, cycles): "0" every slot freed at once; "N" (a number)
    HOLD_CYCLES x N, serial; "oC" the overlapped schedule (`paged_read`) with its combined
    P.V + next Q.K^T hold of C cycles (the first Q.K^T and the softmax as HOLD_CYCLES'); "tC"
    two consumers on alternate steps, each holding its slots HOLD_CYCLES, then a merge of C
    cycles after both (`paged_read`'s "two" schedule: (merge, 0, 0) beside HOLD_CYCLES)."""
    try:
        if spec.startswith("o"):
            return "overlap", (HOLD_CYCLES[0], HOLD_CYCLES[1], int(spec[1:]))
        if spec.startswith("t"):
            return "two", (int(spec[1:]), 0, 0)
        return "serial", tuple(int(c * float(spec)) for c in HOLD_CYCLES)
    except ValueError:
        raise ValueError(f"a hold is a number, o<cycles> or t<cycles>, got {spec!r}") from None


def copy_scratch(h: int, dtype, m: int, p: int, *, bkv: int, stages: int) -> tuple:
    """The decode kernel's copy-side scratch, for `pl.run_scoped`: K and V stages (swizzled as
    the kernel's), a whole table row of `m` block ids, then the barriers: K and V landed (one
    arrival per page of P keys), the table row landed, K and V freed."""
    transforms = mma_transforms(h, dtype)
    pages = bkv // p
    return (plgpu.SMEM((stages, bkv, h), dtype, transforms=transforms),
            plgpu.SMEM((stages, bkv, h), dtype, transforms=transforms),
            plgpu.SMEM((m,), jnp.int32),
            plgpu.Barrier(num_arrivals=pages, num_barriers=stages),
            plgpu.Barrier(num_arrivals=pages, num_barriers=stages),
            plgpu.Barrier(num_arrivals=dec.bt_row_copies(m, pages)),
            plgpu.Barrier(num_arrivals=1, num_barriers=stages),
            plgpu.Barrier(num_arrivals=1, num_barriers=stages))


def hold_label(spec: str) -> str:
    """A `--holds` entry's suffix in the result keys: "" (0), ":hold" (1), ":holdN",
    ":overlapC", ":twoC"."""
    schedule, _ = parse_hold(spec)
    if schedule != "serial":
        return f":{schedule}{spec[1:]}"
    return "" if spec == "0" else ":hold" if spec == "1" else f":hold{spec}"


def paged_read(k_cache, v_cache, table, *, keys: int, bkv: int, stages: int,
               cluster: str = "none", hold: tuple[int, int, int] = (0, 0, 0),
               schedule: str = "serial"):
    """Reads `keys` keys of every KV head from the pages of each table row, as the decode
    kernel's memory warpgroup does; returns 8 rows of K of each CTA's last step.

    cluster: "none"; "heads": the K CTAs of one table row (its KV heads, which read slices of
    the same blocks) launched as one cluster, so that they run in one GPC; "rows": the CTAs
    of one KV head launched in clusters of up to 8 rows (the same launch, no shared blocks).
    hold: cycles the consumer holds each step's K before freeing it, then waits before its V
    wait, then holds V (`HOLD_CYCLES`: the decode kernel's Q.K^T, softmax and P.V); zeros:
    every slot freed as soon as it lands.
    schedule: "serial" (as the kernel: wait K, hold[0], free K, hold[1], wait V, hold[2],
    free V) or "overlap" (the next step's Q.K^T issued beside this step's P.V: wait K_0,
    hold[0], free K_0; per step i: hold[1] (the softmax), wait V_i and K_i+1, hold[2] (both
    products), free both) or "two" (two consumer warpgroups, each taking every other step with
    the serial schedule's HOLD_CYCLES; after both, the first spins hold[0] cycles: the merge of
    their partial results). Needs stages even for "two" (each consumer keeps its own slots)."""
    if schedule not in ("serial", "overlap", "two"):
        raise ValueError(f"schedule must be 'serial', 'overlap' or 'two', got {schedule!r}")
    if schedule == "two" and stages % 2:
        raise ValueError(f"schedule 'two' needs an even number of stages, got {stages}")
    consumers = 2 if schedule == "two" else 1
    _, k, p, h = k_cache.shape
    w_rows, m = table.shape
    pages, steps = bkv // p, keys // bkv
    # the kernel's whole-row table fetch
    assert keys % bkv == 0 and m >= keys // p and dec.bt_row_copies(m, pages), (keys, bkv, m)
    dtype = k_cache.dtype
    rows_c = min(8, w_rows)
    if cluster not in ("none", "heads", "rows"):
        raise ValueError(f"cluster must be 'none', 'heads' or 'rows', got {cluster!r}")
    if cluster == "rows" and w_rows % rows_c:
        raise ValueError(f"cluster='rows' needs the rows ({w_rows}) in whole clusters of 8")

    def body(k_ref, v_ref, bt_ref, out_ref, k_smem, v_smem, bt_smem, k_bars, v_bars, bt_bar,
             k_free, v_free, done_bar):
        if cluster == "heads":
            kh, w = lax.axis_index("kvc"), lax.axis_index("walker")
        elif cluster == "rows":
            kh = lax.axis_index("kv")
            w = lax.axis_index("walker") * rows_c + lax.axis_index("rowc")
        else:
            kh, w = lax.axis_index("kv"), lax.axis_index("walker")
        wg = lax.axis_index("wg")

        def serial_step(st, cycles):
            """One step in slot `st` as the kernel takes it: wait for K, hold it, free it, spin
            (the softmax), wait for V, hold it, free it (`cycles`: the three spins)."""
            plgpu.barrier_wait(k_bars.at[st])
            spin(cycles[0])
            plgpu.barrier_arrive(k_free.at[st])
            spin(cycles[1])
            plgpu.barrier_wait(v_bars.at[st])
            spin(cycles[2])
            plgpu.barrier_arrive(v_free.at[st])

        def consume_serial():
            pl.loop(0, steps)(lambda i: serial_step(lax.rem(i, stages), hold))

        def consume_overlapped():
            plgpu.barrier_wait(k_bars.at[0])
            spin(hold[0])
            plgpu.barrier_arrive(k_free.at[0])

            @pl.loop(0, steps)
            def _(i):
                st, nxt = lax.rem(i, stages), lax.rem(i + 1, stages)
                more = i + 1 < steps
                spin(hold[1])
                plgpu.barrier_wait(v_bars.at[st])
                pl.when(more)(lambda: plgpu.barrier_wait(k_bars.at[nxt]))
                spin(hold[2])
                plgpu.barrier_arrive(v_free.at[st])
                pl.when(more)(lambda: plgpu.barrier_arrive(k_free.at[nxt]))

        def consume_alternate(j):
            """Consumer j of two: steps j, j + 2, ..., each with the serial holds."""
            pl.loop(0, (steps - j + 1) // 2)(
                lambda n: serial_step(lax.rem(2 * n + j, stages), HOLD_CYCLES))

        if consumers == 2:
            @pl.when(wg == 1)
            def _second():
                consume_alternate(1)
                plgpu.barrier_arrive(done_bar)

        @pl.when(wg == 0)
        def _consumer():
            if consumers == 2:
                consume_alternate(0)
                plgpu.barrier_wait(done_bar)
                spin(hold[0])
            else:
                (consume_serial if schedule == "serial" else consume_overlapped)()
            plgpu.copy_smem_to_gmem(k_smem.at[(steps - 1) % stages, pl.ds(0, 8)],
                                    out_ref.at[kh, w])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == consumers)
        def _memory():
            dec.copy_table_row(bt_ref, w, bt_smem, bt_bar, m)
            plgpu.barrier_wait(bt_bar)

            @pl.loop(0, steps)
            def _(step):
                blks = [bt_smem[step * pages + jj] for jj in range(pages)]
                load_kv_step(k_ref, v_ref, k_smem, v_smem, k_bars, v_bars, k_free, v_free,
                             blks=blks, kh=kh, n=step, slot=lax.rem(step, stages), p=p,
                             stages=stages)

    def entry(k_ref, v_ref, bt_ref, out_ref):
        pl.run_scoped(
            lambda *scoped: body(k_ref, v_ref, bt_ref, out_ref, *scoped),
            *copy_scratch(h, dtype, m, p, bkv=bkv, stages=stages),
            plgpu.Barrier(num_arrivals=1),  # "two": the second consumer is done
            collective_axes="wg")

    threads = {"num_threads": consumers + 1, "thread_name": "wg"}
    if cluster == "heads":
        mesh = plgpu.Mesh(grid=(w_rows,), grid_names=("walker",), cluster=(k,),
                          cluster_names=("kvc",), **threads)
    elif cluster == "rows":
        mesh = plgpu.Mesh(grid=(k, w_rows // rows_c), grid_names=("kv", "walker"),
                          cluster=(rows_c,), cluster_names=("rowc",), **threads)
    else:
        mesh = plgpu.Mesh(grid=(k, w_rows), grid_names=("kv", "walker"), **threads)
    return pl.kernel(
        entry, out_type=jax.ShapeDtypeStruct((k, w_rows, 8, h), dtype), mesh=mesh,
        name=f"probe_paged_read_{cluster}")(k_cache, v_cache, table)


def tables_for(rng, num_blocks: int, rows: int, used: int, n_sets: int, order: str) -> list:
    """n_sets tables [rows, M] of disjoint block ids (1.. ; 0 is the null block), `used` ids
    per row, M rounded up to a multiple of 32 (whole 128-byte table copies) with zeros."""
    ids = np.arange(1, num_blocks, dtype=np.int32)
    if order == "random":
        ids = rng.permutation(ids)
    n_sets = max(1, min(n_sets, len(ids) // (rows * used)))
    m = -(-used // 32) * 32
    tables = []
    for j in range(n_sets):
        t = np.zeros((rows, m), np.int32)
        t[:, :used] = ids[j * rows * used:(j + 1) * rows * used].reshape(rows, used)
        tables.append(jnp.asarray(t))
    return tables


def chain(reps: int, fn):
    @jax.jit
    def f(kc, vc, tables):
        return [fn(kc, vc, tables[i % len(tables)]) for i in range(reps)]
    return f


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/probe_out"))
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--shapes", default="", help="comma-separated names of SHAPES (all: empty)")
    ap.add_argument("--pipelines", default="",
                    help="comma-separated BKVxSTAGES of PIPELINES (all: empty)")
    ap.add_argument("--holds", default="0",
                    help="comma-separated consumer holds: 0 (free at once), 1 (HOLD_CYCLES), "
                         "N (HOLD_CYCLES x N: 0.5 prices a step twice as fast, 10 checks that "
                         "the spin waits), oC (the overlapped schedule, C cycles for P.V "
                         "beside the next Q.K^T), tC (two consumers on alternate steps, a "
                         "merge of C cycles after both)")
    ap.add_argument("--clusters", default="none",
                    help="comma-separated cluster launches of the probe: none, heads, rows")
    ap.add_argument("--lower", action="store_true", help="lower one probe for CUDA and stop")
    args = ap.parse_args()
    if args.lower:
        kc = jnp.zeros((64, 8, 16, 128), jnp.bfloat16)
        for keys, bkv, stages, m, cl in ((512, 128, 2, 32, "none"), (256, 64, 4, 32, "heads"),
                                         (4096, 128, 3, 256, "rows")):
            table = jnp.zeros((16, m), jnp.int32)
            jax.jit(lambda k, v, t: paged_read(k, v, t, keys=keys, bkv=bkv, stages=stages,
                                               cluster=cl)
                    ).trace(kc, kc, table).lower(lowering_platforms=("cuda",))
        print("lowered")
        return
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    timer, res = bench.probe_start(args.iters, reps=args.reps, rows=[])
    copy_bps = res["ceilings"]["copy_bytes_per_s"]
    num_blocks = 65536  # 2 x 2 GiB of bf16 K/V at K 8, P 16, H 128
    pool = bench.make_pool(num_blocks, with_transposed=False)
    rng = np.random.default_rng(0)
    k_heads, p = bench.N_KV, bench.BLOCK
    for name, batch, ctx, splits in SHAPES:
        if args.shapes and name not in args.shapes.split(","):
            continue
        w_rows, keys = batch * splits, ctx // splits
        nbytes = k_heads * w_rows * keys * bench.HEAD_DIM * 2 * 2
        n_sets = bench.n_sets_for(nbytes, args.reps)
        row = {"shape": name, "batch": batch, "ctx": ctx, "splits": splits,
               "ctas": k_heads * w_rows, "keys_per_cta": keys, "kv_bytes": nbytes,
               "floor_us": nbytes / copy_bps * 1e6, "probe": {}}
        for order in ("random", "sequential"):
            tables = tuple(tables_for(rng, num_blocks, w_rows, keys // p, n_sets, order))
            for (bkv, stages), cluster, held in itertools.product(
                    PIPELINES, args.clusters.split(","), args.holds.split(",")):
                schedule, hold = parse_hold(held)
                if order == "sequential" and (bkv, stages) != (128, 2):
                    continue
                if args.pipelines and f"{bkv}x{stages}" not in args.pipelines.split(","):
                    continue
                key = (f"{order}:{bkv}x{stages}" + ("" if cluster == "none" else f":{cluster}")
                       + hold_label(held))
                try:
                    fn = chain(args.reps, lambda kc, vc, t, bkv=bkv, stages=stages,
                               cluster=cluster, hold=hold, schedule=schedule: paged_read(
                                   kc, vc, t, keys=keys, bkv=bkv, stages=stages,
                                   cluster=cluster, hold=hold, schedule=schedule))
                    t = timer(fn, (pool.k, pool.v, tables))
                    us = bench._ms(t) * 1e3 / args.reps
                    row["probe"][key] = {"us": us, "frac_of_copy": nbytes / (us * 1e-6) / copy_bps,
                                         "n_sets": len(tables), "timing": t}
                except Exception as e:  # noqa: BLE001
                    row["probe"][key] = {"error": repr(e)[:500]}
        # The decode kernel on the same rows (decode_only, default decode tiling).
        try:
            step = bench.build_step(rng, pool, [1] * batch, [ctx - 1] * batch, n_sets=n_sets)
            tiling = Tiling(mosaic_decode=DecodeTiling(splits=splits))
            f = bench.chain_ours(args.reps, tiling, False, decode="mosaic", decode_only=True)
            t = timer(f, bench.chain_args(step, pool))
            us = bench._ms(t) * 1e3 / args.reps
            row["decode_kernel"] = {"us": us, "frac_of_copy": nbytes / (us * 1e-6) / copy_bps,
                                    "tiling": repr(tiling.mosaic_decode), "timing": t}
        except Exception as e:  # noqa: BLE001
            row["decode_kernel"] = {"error": repr(e)[:500]}
        bench.log("row", json.dumps(row)[:600])
        res["rows"].append(row)
    res["elapsed_s"] = time.time() - t0
    with open(os.path.join(args.out, "probe_paged_read.json"), "w") as fh:
        json.dump(res, fh, indent=1, default=str)
    keys = sorted({k for r in res["rows"] for k in r["probe"]})
    print("\nshape | floor us | decode kernel us | " + " | ".join(keys))
    for r in res["rows"]:
        cells = [f"{r['probe'][k]['us']:.2f} ({r['probe'][k]['frac_of_copy']:.0%})"
                 if "us" in r["probe"].get(k, {}) else "-" for k in keys]
        dk = r.get("decode_kernel", {})
        dks = f"{dk['us']:.2f} ({dk['frac_of_copy']:.0%})" if "us" in dk else "err"
        print(f"{r['shape']} | {r['floor_us']:.2f} | {dks} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
