"""Where a long prompt's time goes on the CPU: SmolLM2-135M's prefill pieces, jaxengine against PyTorch.

Two tables, float32, on this machine's cores:
  linears    the model's linear shapes at one 512-token chunk: XLA's dot (jitted `x @ w`) against
             `torch.matmul`, GFLOP/s (best of 20);
  attention  one 512-row chunk of a single sequence after `ctx - 512` tokens of context (SmolLM2's
             heads: 9 query, 3 KV, head dim 64; 16-token blocks): the engine's CPU paged attention
             (`ragged_paged_attention_cpu`, its one-sequence path) against
             `torch.nn.functional.scaled_dot_product_attention` over the same keys with the chunk's
             causal mask, GFLOP/s counted on the causal work (4 * rows * (ctx - rows / 2) * heads * dim;
             best of 5).

    python -m lab.cpu_prefill_probe [--contexts 512,3584,7168] [--out lab/results/cpu_prefill_probe.json]

Two more tables: the engine's attention over a chunk as row blocks (each over its own causal
range), and torch's SDPA over a whole prompt in one causal pass against the same prompt in
512-row chunks.

On the 2-core Intel Xeon of 2026-11-28 this showed the linears at parity with PyTorch and the
attention at about half of its rate (60-85 against ~130 GFLOP/s), which is what the one-sequence
path's unmasked steps and longer key steps then changed (benchmarks/results/
cpu_smollm2_vs_transformers.md).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import numpy as np

LINEARS = {"q / o": (576, 576), "k / v": (576, 192), "gate / up": (576, 1536), "down": (1536, 576)}


def _best(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def linears(rows: int = 512) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import torch

    out = []
    rng = np.random.default_rng(0)
    dot = jax.jit(lambda a, b: a @ b)
    for name, (k, n) in LINEARS.items():
        a, b = rng.standard_normal((rows, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
        ja, jb, ta, tb = jnp.asarray(a), jnp.asarray(b), torch.from_numpy(a), torch.from_numpy(b)
        flop = 2 * rows * k * n
        tj = _best(lambda: dot(ja, jb).block_until_ready(), 20)
        tt = _best(lambda: torch.matmul(ta, tb), 20)
        out.append({"linear": name, "rows": rows, "k": k, "n": n, "jax_gflops": flop / tj / 1e9,
                    "torch_gflops": flop / tt / 1e9})
    return out


def attention(contexts: list[int], rows: int = 512) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import torch

    from jaxengine.pallas_kernels.ragged_paged_attention import ragged_paged_attention_cpu

    n, k, h, p = 9, 3, 64, 16
    rng = np.random.default_rng(0)
    fn = jax.jit(functools.partial(ragged_paged_attention_cpu, sm_scale=h ** -0.5))
    out = []
    for ctx in contexts:
        blocks = -(-ctx // p) + 1
        q = rng.standard_normal((rows, n, h), dtype=np.float32)
        kc = rng.standard_normal((blocks, k, p, h), dtype=np.float32)
        vc = rng.standard_normal((blocks, k, p, h), dtype=np.float32)
        table = np.zeros((1, blocks), np.int32)
        table[0, :blocks - 1] = np.arange(1, blocks)  # block 0 is the null block
        args = (jnp.asarray(q), jnp.asarray(kc), jnp.asarray(vc), jnp.asarray([ctx], jnp.int32),
                jnp.asarray(table), jnp.asarray([0, rows], jnp.int32), jnp.asarray([1], jnp.int32))
        tj = _best(lambda: fn(*args).block_until_ready(), 5)
        # the same keys, laid out for torch: [1, heads, keys, dim], the KV heads repeated per group
        keys = kc[1:].transpose(1, 0, 2, 3).reshape(k, -1, h)[:, :ctx]
        vals = vc[1:].transpose(1, 0, 2, 3).reshape(k, -1, h)[:, :ctx]
        tq = torch.from_numpy(q.transpose(1, 0, 2))[None]
        tk = torch.from_numpy(np.repeat(keys, n // k, axis=0))[None]
        tv = torch.from_numpy(np.repeat(vals, n // k, axis=0))[None]
        mask = torch.ones(rows, ctx, dtype=torch.bool).tril(ctx - rows)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        tt = _best(lambda: sdpa(tq, tk, tv, attn_mask=mask), 5)
        ref = sdpa(tq, tk, tv, attn_mask=mask)[0].numpy().transpose(1, 0, 2)
        err = float(np.abs(np.asarray(fn(*args)) - ref).max())
        flop = 4 * rows * (ctx - rows / 2) * n * h
        out.append({"rows": rows, "context": ctx, "jaxengine_ms": 1e3 * tj, "torch_sdpa_ms": 1e3 * tt,
                    "jaxengine_gflops": flop / tj / 1e9, "torch_gflops": flop / tt / 1e9, "max_abs_diff": err})
    return out


def one_pass(prompt: int = 7168, chunk: int = 512, repeats: int = 3) -> dict:
    """torch SDPA over a whole prompt (is_causal, one call) against the same prompt in chunks of
    `chunk` rows (each over its context with the chunk's causal mask, as a chunked prefill
    attends), one layer of SmolLM2's heads; best of `repeats`, the two alternating."""
    import torch
    import torch.nn.functional as F

    n, k, h = 9, 3, 64
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, n, prompt, h, generator=g)
    kr = torch.randn(1, k, prompt, h, generator=g).repeat_interleave(n // k, 1)
    vr = torch.randn(1, k, prompt, h, generator=g).repeat_interleave(n // k, 1)

    def full():
        F.scaled_dot_product_attention(q, kr, vr, is_causal=True)

    def chunked():
        for lo in range(0, prompt, chunk):
            hi = lo + chunk
            mask = torch.ones(chunk, hi, dtype=torch.bool).tril(lo)
            F.scaled_dot_product_attention(q[:, :, lo:hi], kr[:, :, :hi], vr[:, :, :hi], attn_mask=mask)

    best = {"one_pass_s": float("inf"), "chunked_s": float("inf")}
    full(), chunked()
    for _ in range(repeats):
        for key, fn in (("one_pass_s", full), ("chunked_s", chunked)):
            t0 = time.perf_counter()
            fn()
            best[key] = min(best[key], time.perf_counter() - t0)
    return {"prompt": prompt, "chunk": chunk, **best}


def row_blocks(contexts: list[int], rows: int = 512, blocks=(512, 256, 128), repeats: int = 5) -> list[dict]:
    """The engine's one-sequence attention over a 512-row chunk run whole, or as row blocks of
    `blocks` rows each attending over its own causal range (smaller score blocks per key step):
    ms, best of `repeats`, the forms alternating."""
    import jax
    import jax.numpy as jnp

    from jaxengine.pallas_kernels.ragged_paged_attention import _one_sequence_attention

    n, k, h, p = 9, 3, 64, 16
    rng = np.random.default_rng(1)

    def blocked(q, kc, vc, kv_lens, table, ns, *, rb):
        outs = []
        for b in range(rows // rb):  # block b's last row is the chunk's row (b + 1) * rb - 1
            outs.append(_one_sequence_attention(q[b * rb:(b + 1) * rb], kc, vc, kv_lens - (rows - (b + 1) * rb),
                                                table, jnp.asarray([0, rb], jnp.int32), ns, sm_scale=h ** -0.5,
                                                soft_cap=None, sliding_window=None, chunk_blocks=32))
        return jnp.concatenate(outs, 0)

    out = []
    for ctx in contexts:
        blocks_n = -(-ctx // p) + 1
        table = np.zeros((1, blocks_n), np.int32)
        table[0, :blocks_n - 1] = np.arange(1, blocks_n)
        args = (jnp.asarray(rng.standard_normal((rows, n, h), dtype=np.float32)),
                jnp.asarray(rng.standard_normal((blocks_n, k, p, h), dtype=np.float32)),
                jnp.asarray(rng.standard_normal((blocks_n, k, p, h), dtype=np.float32)),
                jnp.asarray([ctx], jnp.int32), jnp.asarray(table), jnp.asarray([1], jnp.int32))
        fns = {rb: jax.jit(functools.partial(blocked, rb=rb)) for rb in blocks}
        ref = np.asarray(fns[blocks[0]](*args))
        best = {rb: float("inf") for rb in blocks}
        for rb, fn in fns.items():
            fn(*args).block_until_ready()
        for _ in range(repeats):
            for rb, fn in fns.items():
                t0 = time.perf_counter()
                fn(*args).block_until_ready()
                best[rb] = min(best[rb], time.perf_counter() - t0)
        diff = max(float(np.abs(np.asarray(fn(*args)) - ref).max()) for fn in fns.values())
        out.append({"context": ctx, "rows": rows, "ms_by_row_block": {rb: 1e3 * t for rb, t in best.items()},
                    "max_abs_diff": diff})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="512,3584,7168")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import jax
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    contexts = [int(c) for c in args.contexts.split(",")]
    res = {"cpu_count": os.cpu_count(), "jax": jax.__version__, "torch": torch.__version__,
           "linears": linears(), "attention": attention(contexts), "row_blocks": row_blocks(contexts[1:]),
           "torch_one_pass": one_pass()}
    print("| linear (512 rows) | K x N | jax GFLOP/s | torch GFLOP/s |\n|---|---|---|---|")
    for r in res["linears"]:
        print(f"| {r['linear']} | {r['k']} x {r['n']} | {r['jax_gflops']:.0f} | {r['torch_gflops']:.0f} |")
    print("\n| context | jaxengine ms (GFLOP/s) | torch SDPA ms (GFLOP/s) | max abs diff |\n|---|---|---|---|")
    for r in res["attention"]:
        print(f"| {r['context']} | {r['jaxengine_ms']:.1f} ({r['jaxengine_gflops']:.0f}) | "
              f"{r['torch_sdpa_ms']:.1f} ({r['torch_gflops']:.0f}) | {r['max_abs_diff']:.1e} |")
    print("\n| context | the chunk's attention as row blocks of: ms |\n|---|---|")
    for r in res["row_blocks"]:
        print(f"| {r['context']} | " + ", ".join(f"{rb} rows {ms:.1f}" for rb, ms in r["ms_by_row_block"].items())
              + f" (max abs diff {r['max_abs_diff']:.1e}) |")
    o = res["torch_one_pass"]
    print(f"\ntorch SDPA, one layer of a {o['prompt']}-token prompt: one causal pass {o['one_pass_s']:.3f} s, "
          f"in {o['chunk']}-row chunks {o['chunked_s']:.3f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
