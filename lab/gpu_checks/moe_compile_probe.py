"""Why does the engine's compile of Qwen3-30B-A3B's prefill buckets not finish on the H100?

On 2026-11-26 the qwen3-30b-a3b preset started (dummy weights) but XLA's compile of its first
prefill program (128 tokens, lazily compiled) was still running after 190 s ("Very slow
compile?"); compiling every bucket ahead, 33 of 41 programs were done in 22 s and the rest did not
finish in 4 minutes. This probe lowers and compiles the model's forward (abstract weights: nothing
is allocated) at one token bucket for several layer counts and variants, and prints the seconds
of each: whether compile time grows with the layers (one compile per Mosaic kernel call site?)
and which variant removes it:

- auto: the engine's path (above 256 rows on Hopper: jax's bundled Mosaic grouped matmul);
- unjitted: auto with the Mosaic kernel called unjitted (each call site lowered on its own);
- ragged_dot: `lax.ragged_dot` for every grouped matmul;
- gathered: the Triton-lowered gathered kernel for every grouped matmul;
- no_triton_gemm: auto, compiled with xla_gpu_enable_triton_gemm=false (what fixed fp8's stall).

    python -m lab.gpu_checks.moe_compile_probe [--tokens 128] [--layers 1,2,4] [--variants auto,ragged_dot,no_triton_gemm]

Each (variant, layers) runs in its own process with a time limit, so a stall costs only that.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time


def one(variant: str, layers: int, tokens: int) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxengine import model_runner as mr
    from jaxengine.attention_backend import select_attention_backend
    from jaxengine.input_batch import abstract_inputs
    from jaxengine.models import moe
    from jaxengine.models.config import ModelConfig
    from jaxengine.models.loader import abstract_model
    from jaxengine.models.presets import PRESETS
    from jaxengine.packing import Layout
    from jaxengine.pallas_kernels import grouped_matmul as gm

    if variant in ("ragged_dot", "gathered"):
        moe.grouped_matmul = functools.partial(gm.grouped_matmul, impl=variant)
    if variant == "unjitted":  # each call site lowers its own copy of the Mosaic kernel (before 2026-11-27)
        gm._mgpu = gm._mgpu_call
    mc = ModelConfig.from_hf_dict(dict(PRESETS["qwen3-30b-a3b"], num_hidden_layers=layers)).with_max_model_len(1024)
    graphdef, state = abstract_model(mc, jnp.bfloat16)
    attention = select_attention_backend("auto", mc, jnp.bfloat16, 16)
    rows = min(tokens, 256)
    layout = Layout.of(abstract_inputs(tokens, rows, 64))
    kv = jax.ShapeDtypeStruct((1024, mc.num_kv_heads, 16, attention.kv_head_dim(mc.head_dim)), jnp.bfloat16)
    fn = jax.jit(functools.partial(mr._forward, graphdef, layout=layout, attention=attention), donate_argnums=(1,))
    t0 = time.perf_counter()
    lowered = fn.trace(state, [(kv, kv)] * layers, layout.abstract(None),
                       jax.ShapeDtypeStruct((256,), jnp.int32)).lower()
    t1 = time.perf_counter()
    opts = {"xla_gpu_enable_triton_gemm": False} if variant == "no_triton_gemm" else None
    lowered.compile(compiler_options=opts)
    t2 = time.perf_counter()
    return {"variant": variant, "layers": layers, "tokens": tokens, "attention": attention.name,
            "lower_s": t1 - t0, "compile_s": t2 - t1, "mosaic_calls": lowered.as_text().count("mosaic_gpu")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--layers", default="1,2,4")
    ap.add_argument("--variants", default="auto,ragged_dot,no_triton_gemm")
    ap.add_argument("--limit", type=float, default=120.0, help="seconds one (variant, layers) may take")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        variant, layers = args.one.split(":")
        print(json.dumps(one(variant, int(layers), args.tokens)), flush=True)
        return 0
    results = []
    for variant in args.variants.split(","):
        for layers in map(int, args.layers.split(",")):
            cmd = [sys.executable, "-m", "lab.gpu_checks.moe_compile_probe", "--one", f"{variant}:{layers}",
                   "--tokens", str(args.tokens)]
            t0 = time.perf_counter()
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.limit)
                last = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
                r = json.loads(last[-1]) if last else {"variant": variant, "layers": layers,
                                                       "error": p.stderr[-600:]}
            except subprocess.TimeoutExpired:
                r = {"variant": variant, "layers": layers, "error": f"over {args.limit:.0f} s"}
            r["process_s"] = time.perf_counter() - t0
            results.append(r)
            print(r, flush=True)
            with open(os.path.join(args.out, "moe_compile_probe.json"), "w") as fh:
                json.dump(results, fh, indent=1)
    print(f"\n| variant | layers | lower s | compile s | process s |\n|---|---|---|---|---|")
    for r in results:
        print(f"| {r['variant']} | {r['layers']} | {r.get('lower_s', float('nan')):.1f} | "
              f"{r.get('compile_s', float('nan')):.1f} | {r['process_s']:.1f} {r.get('error', '')[:80]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
