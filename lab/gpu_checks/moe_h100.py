"""Mixture-of-experts on one H100: the grouped matmul alone, then the qwen3-30b-a3b preset in the engine.

1. Grouped matmul (pallas_kernels/grouped_matmul.py), bf16, for both models' expert shapes:
   Mixtral-8x7B (E=8, k=2, D=4096, F=14336) and Qwen3-30B-A3B (E=128, k=8, D=2048, F=768), at
   1, 4, 16, 256 and 2048 tokens (M = tokens * k rows, each token routed to k distinct random
   experts), for the fused gate/up product [M, D] x [E, D, 2F] (the engine's layout on one GPU)
   and the down product [M, F] x [E, F, D];
   `jax.lax.ragged_dot` against jax's bundled Mosaic kernel (ragged_dot_mgpu) at two tilings and,
   at the decode shapes (1, 4, 16 tokens), the gathered kernel (grouped_matmul_gpu.py: reads only
   the experts hit), in the same run, each output checked against ragged_dot's. Timing: one jitted
   chain of back-to-back calls cycling through WEIGHT_SETS distinct weight sets and routings
   (DECODE_ROUNDS times at decode shapes), 5 chains queued then one wait, best of 3, divided by
   the calls: a decode call is shorter than one dispatch from Python, and a set's experts hit are
   out of L2 when it comes round again. The floor of each call is the bytes it must move (every
   expert hit: K * N * 2 bytes each, plus the rows read and written; mean over the sets) over the
   copy bandwidth measured in the same run (a 2 GiB device copy, bytes read + written);
   "% floor" is floor time / measured time.
2. Engine, qwen3-30b-a3b preset, dummy bf16 weights (the grouped matmul as the engine picks it):
   batch-1 decode ms/token (128 in / 128 out, greedy; its floor: the weights one decode token reads,
   attention, router, k experts a layer and the LM head, over the copy bandwidth) and offline
   throughput (random 256 in / 256 out prompts, temperature 1, ignore_eos, after a warm-up).

Writes $OUT/moe_h100.json (after each part) and prints a short table. About 8-10 minutes; the
kernels alone (--skip-engine) about 4.

    python -m lab.gpu_checks.moe_h100 --out $OUT [--num-prompts 500] [--skip-engine] [--skip-kernels]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

import numpy as np

SHAPES = {  # model -> (E, k, D, F)
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
}
TOKENS = (1, 4, 16, 256, 2048)
DECODE_TOKENS = (1, 4, 16)  # the shapes that also time the gathered kernel
WEIGHT_SETS = 8  # distinct weight sets a timed chain cycles through (the experts hit leave L2)
# A chain calls each weight set once (DECODE_ROUNDS = 1). Calls that share an operand are not
# independent work for XLA: identical calls are merged (CSE), and products of one weight with
# different x are merged into one product (the second and third H100 runs had ragged_dot, and a
# plain read summed twice, at up to twice the speed the bytes allow); the Pallas kernels are not
# merged.
DECODE_ROUNDS = 1
BF16 = 2  # bytes
HEADER = (f"{'model':14s} {'matmul':7s} {'tokens':>6s} {'hit':>5s} {'floor ms':>9s} {'ragged_dot ms (% floor)':>24s} "
          f"{'mgpu best ms (% floor)':>33s} gathered ms (% floor)")


def routed_sizes(tokens: int, e: int, k: int, seed: int) -> np.ndarray:
    """Group sizes [E] of `tokens` tokens, each routed to k distinct random experts."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((tokens, e)), axis=1)[:, :k]
    return np.bincount(ids.ravel(), minlength=e).astype(np.int32)


def floor_bytes(sizes: np.ndarray, m: int, k_dim: int, n_dim: int) -> int:
    """Bytes a grouped matmul must move: each expert hit read once, the rows read and written."""
    return int((sizes > 0).sum()) * k_dim * n_dim * BF16 + m * k_dim * BF16 + m * n_dim * BF16


def _chain(impl_kwargs: dict, rounds: int):
    """One jitted call that runs the grouped matmul once per (round, weight set), back to back:
    a decode-sized call takes 5-20 us on the GPU, about a tenth of what one dispatch from Python
    costs, so calls timed one by one measure the host. The sets differ (weights, routing, rows),
    so a call does not find its experts in L2 from the call before."""
    import jax

    from jaxengine.pallas_kernels.grouped_matmul import grouped_matmul

    def run(xs, ws, ss):
        return tuple(grouped_matmul(x if r == 0 else x + r / 64, w, s, **impl_kwargs)
                     for r in range(rounds) for x, w, s in zip(xs, ws, ss))

    return jax.jit(run)


def time_read(nbytes: float, rounds: int) -> float:
    """Seconds of one plain XLA read of `nbytes` (a sum over a bf16 array), chained over
    WEIGHT_SETS distinct arrays as the grouped matmuls are: what a single kernel reading a decode
    call's bytes reaches at this size (launch, ramp and tail included)."""
    import jax
    import jax.numpy as jnp

    from jaxengine.benchmarks.ceilings import _time

    arrs = [jnp.full((int(nbytes) // BF16,), i + 1, jnp.bfloat16) for i in range(WEIGHT_SETS)]
    fn = jax.jit(lambda arrs: tuple(jnp.sum(a + r, dtype=jnp.float32) for r in range(rounds) for a in arrs))
    t = _time(fn, arrs, iters=5, repeats=3) / (rounds * WEIGHT_SETS)
    del arrs
    return t


def time_impls(xs, ws, ss, floor_s: float, tilings: list, gathered: bool, rounds: int) -> dict:
    """ragged_dot, the bundled kernel at each tiling and (decode shapes) the gathered kernel, each
    output checked against ragged_dot's; ms per grouped matmul of a chain of calls."""
    import jax.numpy as jnp

    from jaxengine.benchmarks.ceilings import _time
    from jaxengine.pallas_kernels import grouped_matmul_gpu as gk
    from jaxengine.pallas_kernels.grouped_matmul import mgpu_applies

    calls = rounds * len(ws)
    ref_fn = _chain({"impl": "ragged_dot"}, rounds)
    refs = [o.astype(jnp.float32) for o in ref_fn(xs, ws, ss)[:len(ws)]]
    t = _time(ref_fn, xs, ws, ss, iters=5, repeats=3) / calls
    row: dict = {"calls_per_chain": calls, "ragged_dot_ms": 1e3 * t, "ragged_dot_pct_floor": floor_s / t,
                 "mgpu_best": None}

    def measure(tag: str, kwargs: dict) -> float | None:
        fn = _chain(kwargs, rounds)
        try:
            outs = fn(xs, ws, ss)[:len(ws)]
            rel = max(float(jnp.max(jnp.abs(o.astype(jnp.float32) - r))) / (float(jnp.max(jnp.abs(r))) or 1.0)
                      for o, r in zip(outs, refs))
            t = _time(fn, xs, ws, ss, iters=5, repeats=3) / calls
        except Exception as ex:  # a lowering or launch failure is a result too
            row[f"{tag}_error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
            return None
        row.update({f"{tag}_ms": 1e3 * t, f"{tag}_pct_floor": floor_s / t, f"{tag}_max_rel_err": rel})
        return t

    for i, tiling in enumerate(tilings):
        if not mgpu_applies(xs[0], ws[0], tiling):
            row[f"mgpu{i}_error"] = "constraints do not hold"
            continue
        t = measure(f"mgpu{i}", {"impl": "mgpu", "tiling": tiling})
        if t is not None and (row["mgpu_best"] is None or 1e3 * t < row["mgpu_best"]["ms"]):
            row["mgpu_best"] = {"tiling": i, "ms": 1e3 * t, "pct_floor": floor_s / t}
    if gathered:
        if gk.supported(xs[0], ws[0]):
            measure("gathered", {"impl": "gathered"})
        else:
            row["gathered_error"] = "constraints do not hold"
    return row


def time_grouped(copy_bps: float, tilings: list, models: list[str], tokens_list: list[int], rows: list,
                 gathered_all: bool,
                 save) -> list[dict]:
    import jax
    import jax.numpy as jnp

    for model in models:
        e, k, d, f = SHAPES[model]
        key = jax.random.key(0)

        def weights(shape, salt):
            return [(0.02 * jax.random.normal(jax.random.fold_in(key, 100 * salt + i), shape, jnp.float32)
                     ).astype(jnp.bfloat16) for i in range(WEIGHT_SETS)]

        # gate and up fused, as the engine holds them on one GPU: [E, D, 2F]
        w_gate, w_down = weights((e, d, 2 * f), 1), weights((e, f, d), 2)
        for tokens in tokens_list:
            sizes_np = [routed_sizes(tokens, e, k, seed=100 * tokens + i) for i in range(WEIGHT_SETS)]
            ss = [jnp.asarray(s) for s in sizes_np]
            m = tokens * k
            decode = tokens in DECODE_TOKENS
            for name, ws in (("gate_up", w_gate), ("down", w_down)):
                k_dim, n_dim = ws[0].shape[1], ws[0].shape[2]
                xs = [jax.random.normal(jax.random.fold_in(key, 10 * m + i), (m, k_dim), jnp.float32
                                        ).astype(jnp.bfloat16) for i in range(WEIGHT_SETS)]
                nbytes = float(np.mean([floor_bytes(s, m, k_dim, n_dim) for s in sizes_np]))
                floor_s = nbytes / copy_bps
                row = {"model": model, "matmul": name, "tokens": tokens, "rows": m,
                       "experts_hit": float(np.mean([(s > 0).sum() for s in sizes_np])),
                       "floor_bytes": nbytes, "floor_ms": 1e3 * floor_s}
                row.update(time_impls(xs, ws, ss, floor_s, tilings, gathered=decode or gathered_all,
                                      rounds=DECODE_ROUNDS if decode else 1))
                if decode:
                    t_read = time_read(nbytes, DECODE_ROUNDS)
                    row.update({"plain_read_ms": 1e3 * t_read, "plain_read_pct_floor": floor_s / t_read})
                rows.append(row)
                save()
                print(_line(row), flush=True)
        del w_gate, w_down
    return rows


def _line(r: dict) -> str:
    mg = r["mgpu_best"]
    best = f"{mg['ms']:8.3f} ({mg['pct_floor']:6.1%}) tiling {mg['tiling']}" if mg else "n/a"
    ga = (f"{r['gathered_ms']:8.3f} ({r['gathered_pct_floor']:6.1%})" if "gathered_ms" in r
          else r.get("gathered_error", "-")[:60])
    rd = f"{r['ragged_dot_ms']:8.3f} ({r['ragged_dot_pct_floor']:6.1%})"
    pr = f"   plain read {r['plain_read_ms']:.3f} ({r['plain_read_pct_floor']:.1%})" if "plain_read_ms" in r else ""
    return (f"{r['model']:14s} {r['matmul']:7s} {r['tokens']:6d} {r['experts_hit']:5.1f} {r['floor_ms']:9.3f} "
            f"{rd:>24s} {best:>33s} {ga}{pr}")


def decode_floor_bytes(mc, context: int) -> int:
    """Weight + KV bytes one batch-1 decode token reads: attention, norms, router and the k experts
    of each sparse layer (the dense MLP of a dense one), the LM head; the embedding row is negligible."""
    d, h = mc.hidden_size, mc.head_dim
    attn = d * h * (2 * mc.num_heads + 2 * mc.num_kv_heads)
    total = 0
    for sparse in mc.sparse_layers:
        ffn = (mc.num_experts_per_tok * 3 * d * mc.moe_intermediate_size + d * mc.num_experts) if sparse \
            else 3 * d * mc.intermediate_size
        total += attn + ffn + 2 * d
    total += mc.vocab_size * d + d
    kv = mc.num_layers * 2 * mc.num_kv_heads * h * context
    return (total + kv) * BF16


def engine_part(args, copy_bps: float, res: dict, save) -> None:
    from jaxengine import LLM
    from jaxengine.benchmarks.common import SampleRequest, percentiles, random_requests
    from jaxengine.benchmarks.gpu_suite import synthetic_tokenizer
    from jaxengine.benchmarks.latency import run_batch
    from jaxengine.benchmarks.throughput import run_throughput
    from jaxengine.models.presets import PRESETS

    model = "qwen3-30b-a3b"
    vocab = PRESETS[model]["vocab_size"]
    tmp = tempfile.mkdtemp()
    t0 = time.perf_counter()
    llm = LLM(model, load_format="dummy", dtype="bfloat16", tokenizer=synthetic_tokenizer(tmp, vocab),
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=256, max_model_len=1024,
              enforce_eager=args.lazy)
    eng = llm.llm_engine
    out = res["engine"] = {"model": f"{model} (dummy bf16)", "startup_s": time.perf_counter() - t0,
                           "compile_s": eng.runner.compile_seconds, "attention": eng.runner.attention_impl,
                           "num_kv_blocks": eng.config.num_kv_blocks,
                           "max_num_batched_tokens": eng.config.max_num_batched_tokens}
    print(f"engine start-up {out['startup_s']:.1f} s (compile {out['compile_s']:.1f} s), "
          f"{out['num_kv_blocks']} KV blocks", flush=True)
    save()

    def prompts(i: int) -> list[list[int]]:
        return [q.prompt_token_ids for q in random_requests(1, 128, 128, 0.0, vocab, seed=500 + i)]

    run_batch(llm, prompts(100), 128)
    before = dict(eng.timing)
    runs = [run_batch(llm, prompts(i), 128) for i in range(2)]
    after = eng.timing
    n = max(after["steps"] - before["steps"], 1)  # host vs device: is batch-1 decode waiting on the host?
    timing = {"steps": n, "step_ms": 1e3 * (after["step_s"] - before["step_s"]) / n,
              "device_wait_ms": 1e3 * (after["device_wait_s"] - before["device_wait_s"]) / n}
    steps = percentiles([g for x in runs for g in x["decode_steps"]])
    floor_s = decode_floor_bytes(eng.model_config, 192) / copy_bps
    out["decode_b1"] = {"ms_per_token_median": 1e3 * steps["median"], "ms_per_token_p99": 1e3 * steps["p99"],
                        "floor_ms": 1e3 * floor_s, "pct_floor": floor_s / steps["median"], "engine_timing": timing}
    print(f"batch-1 decode {out['decode_b1']['ms_per_token_median']:.2f} ms/token, floor "
          f"{out['decode_b1']['floor_ms']:.2f} ms ({out['decode_b1']['pct_floor']:.1%}); engine step "
          f"{timing['step_ms']:.2f} ms of which device wait {timing['device_wait_ms']:.2f}", flush=True)
    save()
    if args.skip_throughput:
        return
    warm = [SampleRequest(q.prompt_token_ids, 16) for q in random_requests(64, 256, 256, 0.0, vocab, seed=20_000)]
    run_throughput(llm, warm)
    tr = run_throughput(llm, random_requests(args.num_prompts, 256, 256, 0.0, vocab, seed=100))
    t = tr["engine_timing"]
    tr["ms_per_step"] = 1e3 * t["step_s"] / max(t["steps"], 1)
    out["throughput_256x256"] = tr
    print(f"offline 256/256 x {args.num_prompts}: {tr['output_tokens_per_s']:,.0f} output tok/s, "
          f"{tr['ms_per_step']:.1f} ms/step", flush=True)
    save()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--num-prompts", type=int, default=500)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--models", default=",".join(SHAPES), help="kernel shapes of these models (comma-separated)")
    ap.add_argument("--lazy", action="store_true", help="engine: compile each bucket on first use (enforce_eager)")
    ap.add_argument("--skip-throughput", action="store_true", help="engine: batch-1 decode only")
    ap.add_argument("--dump-after", type=float, default=0, help="dump every thread's stack after this many seconds")
    ap.add_argument("--no-mgpu", action="store_true", help="leave the bundled Mosaic kernel out")
    ap.add_argument("--gathered-all", action="store_true", help="time the gathered kernel at prefill shapes too")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="token counts (comma-separated)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.dump_after:
        import faulthandler

        faulthandler.dump_traceback_later(args.dump_after, exit=False)

    from jaxengine.device_memory import size_device_pool

    size_device_pool(0.9)  # the pool the engine would size, before this process starts the backend
    import jax

    from jaxengine.benchmarks.ceilings import copy_bandwidth, matmul_rate
    from jaxengine.pallas_kernels.grouped_matmul import MgpuTiling

    tilings = [] if args.no_mgpu else [MgpuTiling(), MgpuTiling(block_m=128, block_n=128, block_k=64,
                                                                 max_concurrent_steps=4, grid_block_n=2)]
    res: dict = {"commit": args.commit, "jax": jax.__version__, "device": jax.devices()[0].device_kind,
                 "tilings": [vars(t) for t in tilings], "weight_sets": WEIGHT_SETS, "decode_rounds": DECODE_ROUNDS}
    path = os.path.join(args.out, "moe_h100.json")

    def save() -> None:
        with open(path, "w") as fh:
            json.dump(res, fh, indent=1)

    copy_bps = copy_bandwidth(2 << 30)
    res["copy_bandwidth_GBps"] = copy_bps / 1e9
    res["bf16_matmul_TFLOPs"] = matmul_rate() / 1e12
    print(f"{res['device']}, jax {res['jax']}: copy bandwidth {copy_bps / 1e9:.0f} GB/s (read + write)", flush=True)
    save()
    if not args.skip_kernels:
        print(HEADER, flush=True)
        try:
            res["grouped_matmul"] = []
            time_grouped(copy_bps, tilings, args.models.split(","), [int(t) for t in args.tokens.split(",")],
                         res["grouped_matmul"], args.gathered_all, save)
        except Exception:
            res["grouped_matmul_error"] = traceback.format_exc()[-2000:]
            print(res["grouped_matmul_error"], flush=True)
        save()
    if not args.skip_engine:
        try:
            engine_part(args, copy_bps, res, save)
        except Exception:
            res["engine_error"] = traceback.format_exc()[-2000:]
            print(res["engine_error"], flush=True)
        save()
    print(f"\nwrote {path}")
    print(HEADER)
    for r in res.get("grouped_matmul", []):
        print(_line(r))
    if "engine" in res and "decode_b1" in res["engine"]:
        e = res["engine"]
        print(f"qwen3-30b-a3b batch-1 decode {e['decode_b1']['ms_per_token_median']:.2f} ms/token "
              f"({e['decode_b1']['pct_floor']:.1%} of floor)"
              + (f"; offline {e['throughput_256x256']['output_tokens_per_s']:,.0f} output tok/s"
                 if "throughput_256x256" in e else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
