"""Can the residual add and the next RMSNorm be one kernel at a batch-1 decode step's 16 rows?

In the 16-token program XLA splits the o and down GEMMs along K (split-K 8) and sums the partial
products in a reduce fusion that also adds the residual; the RMSNorm that follows is a second
reduction, so it is its own kernel: three kernels (GEMM, sum + add, norm) where the math needs
two. Here the split is written in the program instead (the GEMM as a dot batched over K chunks,
its partial products added as slices), so the sum is elementwise and can join the norm's
fusion. Times chains of L layers' "h += x @ W; x = norm(h)" over distinct weights (more bytes
than the L2 holds), o's shape and down's (with the SiLU-gated product as down's input), XLA's
dot against the written split at S chunks, and XLA's dot compiled without split-K
(`xla_gpu_experimental_force_split_k=1`):
CUPTI kernel time and kernel count per layer.

    python -m lab.gpu_checks.split_fuse_probe --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    from jax.experimental.mosaic.gpu import profiler

    from jaxengine.benchmarks import ceilings

    t, nl = args.rows, args.layers
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": t, "layers": nl,
           "ceilings": ceilings.measure(), "cases": {}}

    def norm(h, g):
        hf = h.astype(jnp.float32)
        return (g.astype(jnp.float32) * (hf * jax.lax.rsqrt(jnp.mean(hf * hf, -1, keepdims=True) + 1e-5))).astype(h.dtype)

    def mm(x, w, split):
        if not split:
            return jnp.dot(x, w, preferred_element_type=jnp.float32)
        k, n = w.shape
        p = jnp.einsum("tsk,skn->stn", x.reshape(t, split, k // split), w.reshape(split, k // split, n),
                       preferred_element_type=jnp.float32)
        out = p[0]
        for i in range(1, split):
            out = out + p[i]
        return out

    def chain_o(h, x, ws, g, split):
        for w in ws:
            h = (h.astype(jnp.float32) + mm(x, w, split)).astype(h.dtype)
            x = norm(h, g)
        return h, x

    def chain_down(h, gus, ws, g, split):
        outs = []
        for gu, w in zip(gus, ws):
            gate, up = jnp.split(gu, 2, axis=-1)
            a = jax.nn.silu(gate) * up
            h = (h.astype(jnp.float32) + mm(a, w, split)).astype(h.dtype)
            outs.append(norm(h, g))
        return h, outs

    key = jax.random.PRNGKey(0)
    bf = jnp.bfloat16
    d, f = 4096, 14336
    h0 = jax.random.normal(key, (t, d), jnp.float32).astype(bf)
    x0 = jax.random.normal(jax.random.fold_in(key, 1), (t, d), jnp.float32).astype(bf)
    g = jnp.ones((d,), bf)
    wo = [(0.02 * jax.random.normal(jax.random.fold_in(key, 10 + i), (d, d), jnp.float32)).astype(bf) for i in range(nl)]
    wd = [(0.02 * jax.random.normal(jax.random.fold_in(key, 30 + i), (f, d), jnp.float32)).astype(bf)
          for i in range(max(2, nl // 2))]
    gus = [jax.random.normal(jax.random.fold_in(key, 50 + i), (t, 2 * f), jnp.float32).astype(bf) for i in range(len(wd))]

    def measure(fn, fargs, layers):
        out = jax.block_until_ready(fn(*fargs))
        best = None
        for _ in range(5):
            _, ts = profiler.measure(fn, aggregate=False)(*fargs)
            tot = sum(ms for _, ms in ts) * 1e3 / layers
            if best is None or tot < best[0]:
                by = {}
                for name, ms in ts:
                    by[name[:40]] = by.get(name[:40], 0.0) + ms * 1e3 / layers
                best = (tot, len(ts) / layers, by)
        return out, {"us": best[0], "kernels_per_layer": best[1], "kernels": best[2]}

    for case, fn, fargs, layers in (("o", chain_o, (h0, x0, wo, g), nl), ("down", chain_down, (h0, gus, wd, g), len(wd))):
        ref = None
        for split in (0, "nosplitk", 4, 8):
            opts = {"xla_gpu_experimental_force_split_k": 1} if split == "nosplitk" else {}
            jitted = jax.jit(lambda *a, s=split: fn(*a, 0 if s == "nosplitk" else s))
            out, r = measure(jitted.lower(*fargs).compile(compiler_options=opts), fargs, layers)
            hs = out[0].astype(jnp.float32)
            if ref is None:
                ref = hs
            r["max_abs_diff_vs_xla"] = float(jnp.max(jnp.abs(hs - ref)))
            r["ref_max"] = float(jnp.max(jnp.abs(ref)))
            res["cases"][f"{case}_split{split}"] = r
            print(case, split, json.dumps(r)[:600], flush=True)
    with open(os.path.join(args.out, "split_fuse.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    print("\ncase: us a layer, kernels a layer (split 0 = XLA's dot)")
    for name, r in res["cases"].items():
        print(f"{name}: {r['us']:.2f} us, {r['kernels_per_layer']:.2f} kernels, diff {r['max_abs_diff_vs_xla']:.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
