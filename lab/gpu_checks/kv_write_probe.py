"""The KV-cache write alone: XLA's scatter of a step's new keys and values into the paged cache,
as `write_kv` spells it, beside variants that might let XLA write faster.

Lead (benchmarks/results/step_trace_h100.md, 2026-11-27): in the Llama-3-8B shape's 2048-token
steps the two scatter fusions take ~22 us a layer each for 4 MB of keys (about 190 GB/s), 1.4 ms a
step; in the SmolLM2 shape's 256-row decode step 0.17 of 2.04 ms.

    python -m lab.gpu_checks.kv_write_probe --out $OUT     # prints a table, writes kv_write_probe.json

Each variant writes keys and values of T tokens (K kv heads x H) into caches [N, K, P, H] at
distinct random slots, LOOP times inside one program (the caches carried, so XLA updates them in
place); the time is the program's wall time over LOOP, the best of 5. Every variant's caches are
checked equal to the reference's (the [N, P, K, H] layout after transposing back).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

LOOP = 20


def variants():
    import jax.numpy as jnp

    def plain(kc, vc, k, v, blk, off):
        return kc.at[blk, :, off].set(k), vc.at[blk, :, off].set(v)

    def unique(kc, vc, k, v, blk, off):
        return (kc.at[blk, :, off].set(k, unique_indices=True), vc.at[blk, :, off].set(v, unique_indices=True))

    def in_bounds(kc, vc, k, v, blk, off):
        return (kc.at[blk, :, off].set(k, mode="promise_in_bounds"),
                vc.at[blk, :, off].set(v, mode="promise_in_bounds"))

    def both(kc, vc, k, v, blk, off):
        return (kc.at[blk, :, off].set(k, unique_indices=True, mode="promise_in_bounds"),
                vc.at[blk, :, off].set(v, unique_indices=True, mode="promise_in_bounds"))

    def flat_rows(kc, vc, k, v, blk, off):  # one index per (token, head) row of H values
        n, kh, p, h = kc.shape
        rows = ((blk[:, None] * kh + jnp.arange(kh)[None, :]) * p + off[:, None]).reshape(-1)
        kf = kc.reshape(n * kh * p, h).at[rows].set(k.reshape(-1, h), unique_indices=True, mode="promise_in_bounds")
        vf = vc.reshape(n * kh * p, h).at[rows].set(v.reshape(-1, h), unique_indices=True, mode="promise_in_bounds")
        return kf.reshape(kc.shape), vf.reshape(vc.shape)
    def kernel(kc, vc, k, v, blk, off):  # lab/kernels/kv_write_gpu.py (interpret mode off the GPU)
        from lab.kernels.kv_write_gpu import write_kv_kernel
        import jax
        slots = blk * kc.shape[2] + off
        return write_kv_kernel(kc, vc, k, v, slots, interpret=jax.default_backend() != "gpu")
    return {"write_kv as is": (plain, False), "unique_indices": (unique, False),
            "promise_in_bounds": (in_bounds, False), "unique + in bounds": (both, False),
            "flat rows, unique + in bounds": (flat_rows, False), "Pallas kernel (lab)": (kernel, False)}


def layout_npkh():
    """The bound a token-contiguous cache layout [N, P, K, H] would give (2 KB a token)."""
    def npkh(kc, vc, k, v, blk, off):
        return (kc.at[blk, off].set(k, unique_indices=True, mode="promise_in_bounds"),
                vc.at[blk, off].set(v, unique_indices=True, mode="promise_in_bounds"))
    return npkh


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tokens", default="256,2048")
    ap.add_argument("--blocks", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=8, help="kv heads (Llama-3-8B: 8; SmolLM2-135M: 3)")
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp

    n, kh, p, h = args.blocks, args.heads, 16, args.head_dim
    rng = np.random.default_rng(0)
    rows = []
    for t in (int(x) for x in args.tokens.split(",")):
        slots = rng.permutation(np.arange(p, n * p))[:t].astype(np.int32)  # block 0 is the null block
        blk, off = jnp.asarray(slots // p), jnp.asarray(slots % p)
        k = jnp.asarray(rng.standard_normal((t, kh, h)), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((t, kh, h)), jnp.bfloat16)
        cases = {name: fn for name, (fn, _) in variants().items()}
        cases["layout [N, P, K, H] (bound)"] = layout_npkh()
        ref = None
        for name, fn in cases.items():
            npkh = name.startswith("layout")

            def run(kc, vc, k, v, fn=fn):
                def body(i, c):
                    s = (i + 1).astype(k.dtype)
                    return fn(c[0], c[1], k * s, v * s, blk, off)
                return jax.lax.fori_loop(0, LOOP, body, (kc, vc))
            prog = jax.jit(run, donate_argnums=(0, 1))
            shape = (n, p, kh, h) if npkh else (n, kh, p, h)
            kc, vc = jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16)
            kc, vc = jax.block_until_ready(prog(kc, vc, k, v))
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                kc, vc = jax.block_until_ready(prog(kc, vc, k, v))
                best = min(best, time.perf_counter() - t0)
            got = np.asarray(jnp.swapaxes(kc, 1, 2) if npkh else kc)[slots // p, :, slots % p]
            if ref is None:
                ref = got
            equal = bool(np.array_equal(got, ref))
            us = best / LOOP * 1e6
            moved = 2 * t * kh * h * 2  # keys and values written (bf16)
            rows.append({"tokens": t, "variant": name, "us_per_write": round(us, 2), "GBps": round(moved / us / 1e3, 1),
                         "equal_to_reference": equal})
            print(rows[-1], flush=True)
            del kc, vc
    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "blocks": n, "kv_heads": kh,
           "block_size": p, "head_dim": h, "loop": LOOP, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "kv_write_probe.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"\n{out['device']}, jax {out['jax']}; caches [{n}, {kh}, {p}, {h}] bf16, keys and values written {LOOP}x "
          f"a program\n| tokens | variant | us a write (k and v) | GB/s | equal |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['variant']} | {r['us_per_write']:.1f} | {r['GBps']:.0f} | {r['equal_to_reference']} |")


if __name__ == "__main__":
    main()


def write_kv_duplicate_safe(k_cache, v_cache, k, v, slot_mapping):
    """write_kv as it was before `unique_indices` (XLA's duplicate-safe scatter), for engine A/Bs:
    step_trace.py --patch attention_backend.write_kv=@lab.gpu_checks.kv_write_probe:write_kv_duplicate_safe"""
    from jaxengine.pallas_kernels.ragged_paged_attention import _to_cache

    p = k_cache.shape[2]
    blk, off = slot_mapping // p, slot_mapping % p
    return (k_cache.at[blk, :, off].set(_to_cache(k, k_cache.dtype)),
            v_cache.at[blk, :, off].set(_to_cache(v, v_cache.dtype)))
