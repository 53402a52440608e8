"""Where the host time of a SmolLM2-shape decode step's launch goes: the engine's own compiled
forward and sampler replayed on captured arguments, beside programs that isolate one cost each
(the numpy input's copy, the ~270 argument buffers, the command buffer's kernel nodes).

    python -m lab.gpu_checks.launch_parts --out $OUT     # prints a table, writes launch_parts.json

Each line times N back-to-back calls (host time per call, p50/p10 of perf_counter around the call;
the device is synchronized every 16 calls so the queue stays short).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np


def timed(fn, n: int = 240, sync=None) -> dict:
    ts = []
    for i in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
        if sync is not None and i % 16 == 15:
            sync()
    q = np.percentile(np.array(ts[n // 4:]) * 1e3, [10, 50, 90])
    return {"p10_ms": round(float(q[0]), 4), "p50_ms": round(float(q[1]), 4), "p90_ms": round(float(q[2]), 4)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rows", type=int, default=256, help="decode rows (a token bucket)")
    args = ap.parse_args()
    from jaxengine.device_memory import size_device_pool

    size_device_pool(0.9)
    import jax
    import jax.numpy as jnp

    from jaxengine import LLM
    from jaxengine.benchmarks.common import random_requests
    from jaxengine.benchmarks.gpu_suite import synthetic_tokenizer
    from jaxengine.benchmarks.throughput import run_throughput

    llm = LLM("smollm2-135m", load_format="dummy", dtype="bfloat16", max_model_len=2048, max_num_seqs=256,
              max_num_batched_tokens=2048, tokenizer=synthetic_tokenizer(tempfile.mkdtemp(), 49152))
    runner = llm.llm_engine.runner
    captured: dict[str, tuple] = {}
    orig_fwd, orig_samp = runner._get_forward, runner._get_sampler

    def cap_fwd(t):
        fn = orig_fwd(t)

        def call(*a):
            if t == args.rows:
                captured["fwd"] = (fn, tuple(np.array(x) if isinstance(x, np.ndarray) else x for x in a))
            return fn(*a)
        return call

    def cap_samp(*v):
        fn = orig_samp(*v)

        def call(*a):
            if v[0] == args.rows:
                captured["samp"] = (fn, tuple(np.array(x) if isinstance(x, np.ndarray) else x for x in a))
            return fn(*a)
        return call
    runner._get_forward, runner._get_sampler = cap_fwd, cap_samp
    run_throughput(llm, random_requests(args.rows, 256, 64 if args.rows == 256 else 8, 0.0, 49152, seed=3))
    runner._get_forward, runner._get_sampler = orig_fwd, orig_samp
    fwd, (params, _kv, packed, prev) = captured["fwd"]
    samp, (logits, packed_md, sprev) = captured["samp"]
    state = {"kv": runner.kv_caches}
    results: dict[str, dict] = {}

    def sync():
        jax.block_until_ready(state["kv"])

    def engine_fwd():
        state["kv"], lg, _ = fwd(params, state["kv"], packed, prev)
        state["logits"] = lg
    results[f"forward t={args.rows}, numpy input (as the engine)"] = timed(engine_fwd, sync=sync)
    packed_dev = jax.device_put(packed)

    def fwd_dev():
        state["kv"], lg, _ = fwd(params, state["kv"], packed_dev, prev)
    results[f"forward t={args.rows}, input already on device"] = timed(fwd_dev, sync=sync)

    def fwd_put():
        state["kv"], lg, _ = fwd(params, state["kv"], jax.device_put(packed), prev)
    results[f"forward t={args.rows}, device_put of the input, then the call"] = timed(fwd_put, sync=sync)
    results[f"sampler r={args.rows}, numpy metadata (as the engine)"] = timed(lambda: samp(state["logits"], packed_md, sprev),
                                                                    sync=sync)
    md_dev = jax.device_put(packed_md)
    results[f"sampler r={args.rows}, metadata on device"] = timed(lambda: samp(state["logits"], md_dev, sprev), sync=sync)
    results["device_put of the packed input alone"] = timed(lambda: jax.device_put(packed), sync=sync)

    # the same ~270 argument buffers (60 KV donated) into a program of one small kernel
    trivial = jax.jit(lambda p, kv, x, pv: (kv, x.sum() + pv[0]), donate_argnums=(1,)).lower(
        params, state["kv"], packed_dev, prev).compile()

    def trivial_call():
        state["kv"], _ = trivial(params, state["kv"], packed_dev, prev)
    results[f"one-kernel program, the forward's {len(params)} + {2 * len(state['kv'])} buffers"] = timed(
        trivial_call, sync=sync)
    one = jax.jit(lambda x: x.sum()).lower(packed_dev).compile()
    results["one-kernel program, one buffer"] = timed(lambda: one(packed_dev), sync=sync)
    x0 = jnp.ones((256, 576), jnp.bfloat16)
    for n in (64, 372):
        def chain(x, n=n):
            for _ in range(n):
                x = jax.lax.optimization_barrier(jnp.sin(x) * 1.0001)
            return x
        c = jax.jit(chain).lower(x0).compile()
        kernels = c.as_text().count("fusion(") if hasattr(c, "as_text") else -1
        results[f"chain of {n} small kernels, one buffer (HLO fusions {kernels})"] = timed(lambda c=c: c(x0), sync=sync)
    dev = jax.devices()[0]
    out = {"device": dev.device_kind, "jax": jax.__version__, "allocator": os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR"),
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "params": len(params), "kv_arrays": 2 * len(state["kv"]),
           "packed_bytes": int(packed.nbytes), "results": results}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "launch_parts.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"\n{dev.device_kind}, jax {jax.__version__}, allocator {out['allocator']}, XLA_FLAGS {out['xla_flags']!r}")
    print("| call | host ms p10 | p50 | p90 |\n|---|---|---|---|")
    for k, v in results.items():
        print(f"| {k} | {v['p10_ms']:.3f} | {v['p50_ms']:.3f} | {v['p90_ms']:.3f} |")


if __name__ == "__main__":
    main()
