"""Quantization on one H100: bf16 against fp8 (and the weight-only int4 reference path), Llama-3-8B
shape with dummy weights, each figure beside the ceilings measured in the same run.

Parts, each in its own process (every engine takes most of the GPU memory for its KV cache):
- micro: copy bandwidth and bf16 matmul rate (benchmarks/ceilings.py), then one linear layer of
  K=4096 inputs x N=14336 outputs at 1, 16 and 256 rows: bf16 `jnp.dot`, fp8 (per-token
  activation quantization + e4m3 x e4m3 dot_general + scales, as the model runs it), the fp8 dot
  alone, the int4 group-128 weight-only reference (unpack, dequantize, bf16 dot) and the Pallas
  kernel (pallas_kernels/weight_only_matmul_gpu.py, checked against the reference); each with
  whether the compiled program holds cuBLASLt's FP8 GEMM;
- engine bf16 / fp8 / w4a16: LLM("llama-3-8b", load_format="dummy", dtype="bfloat16",
  quantization=None / "fp8" / "gptq" (random 4-bit weights, groups of 128, through the kernel)): start-up, weight
  bytes, batch-1 decode (128 in / 256 out greedy, median ms/token over 3 runs after one warm-up)
  and its bytes-read roofline, then offline throughput of --num-prompts random 256 in / 256 out
  prompts after a 64-prompt warm-up (w4a16: decode only unless --w4a16-throughput).

    python -m lab.gpu_checks.quant_h100 --out $OUT [--num-prompts 256] [--w4a16-throughput]

Writes $OUT/quant.json (and one JSON per part) and prints a short table. Sized to finish in under
8 minutes on one H100; a part that runs past its time limit is recorded as such.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ENGINES = {"bf16": None, "fp8": "fp8", "w4a16": "gptq"}
TIME_LIMIT_S = {"micro": 75, "bf16": 150, "fp8": 150, "w4a16": 95}  # 470 s in all
K, N, ROWS = 4096, 14336, (1, 16, 256)


def _timed(fn, *args, iters: int = 30) -> float:
    """Median seconds of one call (after a compile and a warm-up call)."""
    import jax

    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def micro() -> dict:
    import jax
    import jax.numpy as jnp

    from jaxengine.benchmarks import ceilings
    from jaxengine.models.quantization import fp8_matmul, quantize_fp8, weight_only_matmul
    from jaxengine.pallas_kernels import weight_only_matmul_gpu as kernel

    res: dict = {"ceilings": ceilings.measure(), "K": K, "N": N}
    key = jax.random.key(0)
    w = (0.02 * jax.random.normal(key, (K, N), jnp.float32)).astype(jnp.bfloat16)
    q = jax.jit(quantize_fp8, static_argnums=1)(w, 1)
    packed = jax.lax.bitcast_convert_type(jax.random.bits(key, (K // 8, N), jnp.uint32), jnp.int32)
    scales = jnp.full((K // 128, N), 0.005, jnp.bfloat16)
    zeros = jnp.full((K // 128, N), 8, jnp.uint8)
    fns = {
        "bf16": (jax.jit(lambda x: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)), 2 * K * N),
        "fp8": (jax.jit(lambda x: fp8_matmul(x, q.qweight, q.scale, None)), K * N),
        "fp8_dot_only": (jax.jit(lambda xq: jax.lax.dot_general(
            xq, q.qweight, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)), K * N),
        "int4_reference": (jax.jit(lambda x: weight_only_matmul(x, packed, scales, zeros, 4, 128)), K * N // 2),
        "int4_kernel": (jax.jit(lambda x: kernel.weight_only_matmul(x, packed, scales, zeros, bits=4, group_size=128)),
                        K * N // 2),
    }
    for rows in ROWS:
        x = jax.random.normal(jax.random.fold_in(key, rows), (rows, K), jnp.float32).astype(jnp.bfloat16)
        xq = x.astype(jnp.float8_e4m3fn)
        out = {}
        for name, (fn, weight_bytes) in fns.items():
            arg = xq if name == "fp8_dot_only" else x
            try:
                s = _timed(fn, arg)
                hlo = fn.lower(arg).compile().as_text()
            except Exception as e:  # a kernel that does not lower here: recorded, the others still run
                out[name] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
                continue
            out[name] = {"us": 1e6 * s, "weight_GBps": weight_bytes / s / 1e9, "TFLOPs": 2 * rows * K * N / s / 1e12,
                         "fp8_gemm_in_hlo": "f8" in hlo and "cublas" in hlo.lower()}
        if "error" not in out["int4_kernel"]:
            ref = fns["int4_reference"][0](x).astype(jnp.float32)
            got = fns["int4_kernel"][0](x).astype(jnp.float32)
            out["int4_kernel"]["max_abs_err_vs_reference"] = float(jnp.max(jnp.abs(got - ref)))
            out["int4_kernel"]["reference_max_abs"] = float(jnp.max(jnp.abs(ref)))
        res[f"rows_{rows}"] = out
    return res


def engine(kind: str, num_prompts: int, throughput: bool, model: str = "llama-3-8b") -> dict:
    import jax

    from jaxengine import LLM
    from jaxengine.benchmarks import ceilings
    from jaxengine.benchmarks.common import (SampleRequest, decode_weight_bytes, percentiles, random_requests,
                                             weight_bytes)
    from jaxengine.benchmarks.gpu_suite import synthetic_tokenizer
    from jaxengine.benchmarks.latency import run_batch
    from jaxengine.benchmarks.throughput import run_throughput
    from jaxengine.models.presets import PRESETS

    vocab = PRESETS[model]["vocab_size"]
    copy_gbps = ceilings.measure(matmul_n=4096)["copy_bandwidth_GBps"]
    t0 = time.perf_counter()
    llm = LLM(model, load_format="dummy", dtype="bfloat16", quantization=ENGINES[kind],
              tokenizer=synthetic_tokenizer(tempfile.mkdtemp(), vocab))
    eng = llm.llm_engine
    res: dict = {"quantization": ENGINES[kind], "startup_s": time.perf_counter() - t0,
                 "compile_s": eng.runner.compile_seconds, "attention": eng.runner.attention_impl,
                 "weight_GiB": weight_bytes(llm) / 2**30, "num_kv_blocks": eng.config.num_kv_blocks,
                 "copy_bandwidth_GBps": copy_gbps, "device": jax.devices()[0].device_kind}

    def prompts(i: int) -> list[list[int]]:
        return [q.prompt_token_ids for q in random_requests(1, 128, 256, 0.0, vocab, seed=500 + i)]

    run_batch(llm, prompts(100), 256)
    runs = [run_batch(llm, prompts(i), 256) for i in range(3)]
    steps = percentiles([g for r in runs for g in r["decode_steps"]])
    ms = 1e3 * steps["median"]
    # bytes one decode step reads: the weights (not the gathered embedding table) plus a KV cache of ~256 tokens
    mc = eng.model_config
    kv_bytes = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 2 * 256
    roofline_ms = 1e3 * (decode_weight_bytes(llm) + kv_bytes) / (copy_gbps * 1e9)
    res["decode_b1"] = {"ms_per_token_median": ms, "ms_per_token_p99": 1e3 * steps["p99"],
                        "roofline_ms": roofline_ms, "roofline_fraction": roofline_ms / ms}
    if throughput:
        warm = [SampleRequest(q.prompt_token_ids, 16) for q in random_requests(64, 256, 256, 0.0, vocab, seed=20_000)]
        run_throughput(llm, warm)
        tr = run_throughput(llm, random_requests(num_prompts, 256, 256, 0.0, vocab, seed=100))
        res["throughput_256x256"] = {k: tr[k] for k in ("output_tokens_per_s", "elapsed_s") if k in tr}
        res["throughput_256x256"]["num_prompts"] = num_prompts
    return res


def _child(part: str, args: argparse.Namespace) -> dict:
    """Runs one part in a fresh process (its own GPU memory); its JSON, or why there is none."""
    path = os.path.join(args.out, f"quant_{part}.json")
    cmd = [sys.executable, "-m", "lab.gpu_checks.quant_h100", "--out", args.out, "--part", part,
           "--num-prompts", str(args.num_prompts), "--model", args.model] + (["--w4a16-throughput"] if args.w4a16_throughput else [])
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, timeout=TIME_LIMIT_S[part], capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return {"error": f"ran past {TIME_LIMIT_S[part]} s"}
    if proc.returncode != 0 or not os.path.exists(path):
        return {"error": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-3000:]}
    with open(path) as fh:
        out = json.load(fh)
    out["wall_s"] = time.perf_counter() - t0
    return out


def _table(res: dict) -> None:
    m = res.get("micro", {})
    if "ceilings" in m:
        c = m["ceilings"]
        print(f"ceilings: copy {c['copy_bandwidth_GBps']:.0f} GB/s, bf16 matmul {c['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
        print(f"{'linear 4096x14336':<18}" + "".join(f"{f'rows {r}':>22}" for r in ROWS))
        for name in ("bf16", "fp8", "fp8_dot_only", "int4_reference", "int4_kernel"):
            cells = [m[f"rows_{r}"][name] for r in ROWS]
            print(f"{name:<18}" + "".join(f"{'error':>22}" if "error" in c else
                                          f"{c['us']:>9.1f} us {c['weight_GBps']:>6.0f} GB/s" for c in cells))
    print(f"{'engine':<8}{'weights GiB':>12}{'decode ms/tok':>15}{'roofline':>10}{'256/256 tok/s':>15}")
    for kind in ENGINES:
        e = res.get(kind, {})
        if "error" in e or not e:
            print(f"{kind:<8} {e.get('error', 'not run')}")
            continue
        d, t = e["decode_b1"], e.get("throughput_256x256", {})
        tps = f"{t['output_tokens_per_s']:>15,.0f}" if "output_tokens_per_s" in t else f"{'-':>15}"
        print(f"{kind:<8}{e['weight_GiB']:>12.2f}{d['ms_per_token_median']:>15.2f}{d['roofline_fraction']:>10.0%}{tps}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--model", default="llama-3-8b", help="a preset (dummy weights)")
    ap.add_argument("--w4a16-throughput", action="store_true", help="also the offline run for the int4 reference")
    ap.add_argument("--part", choices=("micro", *ENGINES), help="run one part in this process (used internally)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.part is not None:
        if args.part == "micro":
            out = micro()
        else:
            out = engine(args.part, args.num_prompts, args.part != "w4a16" or args.w4a16_throughput, args.model)
        with open(os.path.join(args.out, f"quant_{args.part}.json"), "w") as fh:
            json.dump(out, fh, indent=1)
        return 0
    res: dict = {"model": f"{args.model} (dummy weights, bf16 activations)", "num_prompts": args.num_prompts}
    t0 = time.perf_counter()
    for part in ("micro", *ENGINES):
        res[part] = _child(part, args)
        print(f"{part}: {res[part].get('error', 'done')} ({time.perf_counter() - t0:.0f} s so far)", flush=True)
        with open(os.path.join(args.out, "quant.json"), "w") as fh:
            json.dump(res, fh, indent=1)
    if "output_tokens_per_s" in res["bf16"].get("throughput_256x256", {}) and \
            "output_tokens_per_s" in res["fp8"].get("throughput_256x256", {}):
        res["fp8_over_bf16_throughput"] = (res["fp8"]["throughput_256x256"]["output_tokens_per_s"]
                                           / res["bf16"]["throughput_256x256"]["output_tokens_per_s"])
        res["fp8_over_bf16_decode_speedup"] = (res["bf16"]["decode_b1"]["ms_per_token_median"]
                                               / res["fp8"]["decode_b1"]["ms_per_token_median"])
    with open(os.path.join(args.out, "quant.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    _table(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
