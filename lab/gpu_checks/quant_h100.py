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
  quantization=None / "fp8" / "gptq" (random 4-bit weights, groups of 128, through the kernel)),
  gguf (random weights in Q4_K's form); `_slabs`: the kernel's slab form (models/quantization.SLABS,
  the engine's default; the parts without it turn it off), `_vmm`: SKIP_TEMP command buffers with the VMM allocator: start-up, weight
  bytes, batch-1 decode (128 in / 256 out greedy, median ms/token over 3 runs after one warm-up)
  and its bytes-read roofline, then offline throughput of --num-prompts random 256 in / 256 out
  prompts after a 64-prompt warm-up (w4a16: decode only unless --w4a16-throughput).

    python -m lab.gpu_checks.quant_h100 --out $OUT [--num-prompts 256] [--w4a16-throughput]

Writes $OUT/quant.json (and one JSON per part) and prints a short table. Sized to finish in under
8 minutes on one H100; a part that runs past its time limit is recorded as such.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from jaxengine.device_memory import STABLE_TEMP_FLAG

# engine part -> (quantization, kv_cache_dtype)
ENGINES = {"bf16": (None, "auto"), "fp8": ("fp8", "auto"), "w4a16": ("gptq", "auto"), "fp8kv": (None, "fp8"),
           "gguf": ("gguf", "auto"), "w4a16_slabs": ("gptq", "auto"), "w4a16_slabs_vmm": ("gptq", "auto"),
           "gguf_slabs": ("gguf", "auto"), "gguf_slabs_vmm": ("gguf", "auto"), "bf16_vmm": (None, "auto"),
           "w4a16_splits2x": ("gptq", "auto"),
           "w4a16_splits4x": ("gptq", "auto"),
           "bf16_pdl": (None, "auto"), "fp8_pdl": ("fp8", "auto"), "bf16_nopdl": (None, "auto"),
           "fp8_jaxalloc": ("fp8", "auto"), "w4a16_swapped": ("gptq", "auto"), "fp8kv_oldgrid": (None, "fp8"),
           "w4a16_splitshalf": ("gptq", "auto")}
# engine part -> module constants of models/quantization set in its process (kernel variants)
# (the parts without `_slabs` run the one-dot-per-block form, as the engine did before slabs)
# (`_swapped`: the kernel's swapped form at up to 16 rows, models/quantization.SWAPPED, the default
# since; the other weight-only parts run without it)
PATCHES = {"w4a16": {"SLABS": False, "SWAPPED": False}, "gguf": {"SLABS": False},
           "w4a16_slabs": {"SLABS": True, "SWAPPED": False}, "w4a16_swapped": {"SLABS": True, "SWAPPED": True},
           "w4a16_slabs_vmm": {"SLABS": True}, "gguf_slabs": {"SLABS": True}, "gguf_slabs_vmm": {"SLABS": True},
           "w4a16_splits2x": {"SLABS": True, "KERNEL.TARGET_PROGRAMS": 528},
           "w4a16_splits4x": {"SLABS": True, "KERNEL.TARGET_PROGRAMS": 1056},
           "fp8kv_oldgrid": {"RPA.PREFILL_PROGRAMS_CAPPED": False},
           "w4a16_splitshalf": {"SLABS": True, "KERNEL.TARGET_PROGRAMS": 132}}
# ("RPA." names: the paged attention kernels' module; `fp8kv_oldgrid`: the Triton prefill kernel's
# grid of one program a tile, as before it was capped, on the fp8 cache that runs it for every prefill)
# engine part -> environment of its process: XLA's command buffers updated only where buffers moved
# (docs/design.md, "The launch of a step")
_VMM = {"XLA_PYTHON_CLIENT_ALLOCATOR": "vmm", "XLA_FLAGS": STABLE_TEMP_FLAG}
# `_pdl` / `_nopdl`: XLA's programmatic dependent launch (Hopper: a kernel starts while the one
# before it finishes) turned on / off; the engine still picks its allocator (no update mode set)
_PDL, _NOPDL = {"XLA_FLAGS": "--xla_gpu_enable_pdl=true"}, {"XLA_FLAGS": "--xla_gpu_enable_pdl=false"}
ENVS = {"w4a16_slabs_vmm": _VMM, "gguf_slabs_vmm": _VMM, "bf16_vmm": _VMM, "bf16_pdl": _PDL, "fp8_pdl": _PDL,
        "bf16_nopdl": _NOPDL, "fp8_jaxalloc": {"XLA_PYTHON_CLIENT_ALLOCATOR": "default"}}
TIME_LIMIT_S = {"micro": 170, "micro_fp8": 150, "bf16": 150, "fp8": 200, "w4a16": 110, "fp8kv": 130,
                "gguf": 110, "w4a16_slabs": 110,
                "w4a16_slabs_vmm": 110, "gguf_slabs": 110, "gguf_slabs_vmm": 110, "bf16_vmm": 110,
                "w4a16_splits2x": 110, "w4a16_splits4x": 110, "bf16_pdl": 150, "fp8_pdl": 200, "bf16_nopdl": 150, "fp8_jaxalloc": 200,
                "w4a16_swapped": 110, "fp8kv_oldgrid": 130,
                "w4a16_splitshalf": 110}
PARTS = ("micro", "micro_fp8", *ENGINES)
# fp8-weight kernel configurations (block_n, num_stages, num_warps, splits or None)
FP8_CONFIGS = [(64, 3, 4, None), (128, 3, 4, None), (128, 4, 4, None), (256, 3, 4, None), (128, 3, 8, None),
               (128, 3, 4, 1), (256, 4, 8, None)]
KV_PROMPTS = 500  # 1024/128 prompts for the KV-cache dtype comparison
KV_PARTS = ("fp8kv", "fp8kv_oldgrid")  # the fp8-cache parts: 1024/128 instead of 256/256


# Llama-3-8B's linear shapes (K inputs, N outputs): fused q/k/v, o, fused gate/up, down
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
# weight-only kernel configurations tried at 16 rows (a batch-1 decode step's token bucket):
# (magic-number conversion, block_n, num_stages, num_warps, splits or None)
INT4_CONFIGS = [(m, bn, st, 4, None) for m in (True, False) for bn in (64, 128, 256) for st in (2, 3, 4)] + \
    [(True, 256, 3, 8, None), (True, 128, 3, 4, 1), (True, 128, 3, 4, 2), (True, 128, 3, 4, 4)]


def _per_call(fn, x, ws, repeats: int = 7) -> float:
    """Median seconds per matmul: `fn(x, w)` for each of L different weights (a list), unrolled in
    one compiled program: no dispatch between calls, no slicing copies, and every call reads its
    own weight from memory."""
    import jax

    run = jax.jit(lambda x, ws: [fn(x, w) for w in ws])
    jax.block_until_ready(run(x, ws))
    n = len(ws)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run(x, ws))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) / n


def _put(cells: dict, x, label: str, fn, ws, nbytes: int) -> None:
    """cells[label]: `_per_call`'s time and the weight bytes' rate, or the error of a variant that
    does not lower here (recorded; the others still run)."""
    try:
        t = _per_call(fn, x, ws)
        cells[label] = {"us": 1e6 * t, "weight_GBps": nbytes / t / 1e9}
    except Exception as e:
        cells[label] = {"error": f"{type(e).__name__}: {str(e)[:800]}"}


def micro() -> dict:
    import jax
    import jax.numpy as jnp

    from jaxengine.benchmarks import ceilings
    from jaxengine.models.quantization import fp8_matmul, weight_only_matmul
    from jaxengine.pallas_kernels import weight_only_matmul_gpu as kernel

    res: dict = {"ceilings": ceilings.measure(), "shapes": SHAPES, "timing": "median over 7 runs of one compiled "
                 "lax.map over L distinct weights, divided by L"}
    key = jax.random.key(0)
    for name, (k, n) in SHAPES.items():
        layers = max(4, min(16, int(2e9 // (2 * k * n))))  # about 2 GB of bf16 weights per stack
        kb, kq, kp = jax.random.split(jax.random.fold_in(key, k * n), 3)
        wb = [(0.02 * jax.random.normal(jax.random.fold_in(kb, i), (k, n), jnp.float32)).astype(jnp.bfloat16)
              for i in range(layers)]
        qw = [jnp.clip(16 * jax.random.normal(jax.random.fold_in(kq, i), (n, k), jnp.float32), -448, 448)
              .astype(jnp.float8_e4m3fn) for i in range(layers)]
        qs = jnp.full((n,), 0.02 / 16, jnp.float32)
        packed = [jax.lax.bitcast_convert_type(jax.random.bits(jax.random.fold_in(kp, i), (k // 8, n), jnp.uint32),
                                               jnp.int32) for i in range(layers)]
        scales = jnp.full((k // 128, n), 0.005, jnp.bfloat16)
        zeros = jnp.full((k // 128, n), 8, jnp.uint8)
        i4 = [(p, scales + 0.0001 * i, zeros) for i, p in enumerate(packed)]  # scales read per layer too
        int4_bytes = k * n // 2 + (k // 128) * n * 3
        shape_res: dict = {"K": k, "N": n, "layers_in_stack": layers}
        for rows in (1, 16, 256):
            x = jax.random.normal(jax.random.fold_in(key, rows), (rows, k), jnp.float32).astype(jnp.bfloat16)
            cells: dict = {}
            put = functools.partial(_put, cells, x)

            put("bf16", lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype), wb, 2 * k * n)
            put("fp8", lambda x, w: fp8_matmul(x, w, qs, None), qw, k * n + 4 * n)
            put("int4_reference", lambda x, w: weight_only_matmul(x, *w, 4, 128), i4, int4_bytes)
            configs = INT4_CONFIGS if rows == 16 else [(True, 128, 2, 4, None), (False, 128, 2, 4, None),
                                                       (True, 128, 3, 4, None), (True, 256, 3, 8, None)]
            for mg, bn, st, nw, sp in configs:
                put(f"int4_kernel {'magic' if mg else 'i2f'} bn{bn} st{st} w{nw} s{sp or 'auto'}",
                    lambda x, w, mg=mg, bn=bn, st=st, nw=nw, sp=sp: kernel.weight_only_matmul(
                        x, *w, bits=4, group_size=128, block_n=bn, num_stages=st, num_warps=nw, splits=sp,
                        magic=mg), i4, int4_bytes)
            ok = {lab: c["us"] for lab, c in cells.items() if lab.startswith("int4_kernel") and "us" in c}
            if ok:
                best = min(ok, key=ok.get)
                cells["int4_kernel_best"] = dict(cells[best], config=best)
            shape_res[f"rows_{rows}"] = cells
        hlo = jax.jit(lambda x, w: fp8_matmul(x, w, qs, None)).lower(x[:1], qw[0]).compile().as_text()
        shape_res["fp8_program_calls_cublaslt_f8"] = "f8" in hlo and "cublas$lt" in hlo.lower()
        # the kernel's agreement with the reference, default configuration, 16 rows
        x = jax.random.normal(key, (16, k), jnp.float32).astype(jnp.bfloat16)
        ref = weight_only_matmul(x, packed[0], scales, zeros, 4, 128).astype(jnp.float32)
        try:
            got = kernel.weight_only_matmul(x, packed[0], scales, zeros, bits=4, group_size=128)
            shape_res["int4_kernel_max_abs_err"] = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref)))
        except Exception as e:
            shape_res["int4_kernel_error"] = f"{type(e).__name__}: {str(e)[:800]}"
        shape_res["int4_reference_max_abs"] = float(jnp.max(jnp.abs(ref)))
        res[name] = shape_res
        print(f"micro {name} done", flush=True)
    return res


def micro_fp8() -> dict:
    """One fp8 linear at decode rows: bf16, the W8A8 path (activations quantized, XLA's FP8 GEMM)
    and the fp8-weight kernel (W8A16) at each configuration, timed as `micro` times them."""
    import jax
    import jax.numpy as jnp

    from jaxengine.benchmarks import ceilings
    from jaxengine.models.quantization import fp8_matmul, fp8_matmul_w8a8
    from jaxengine.pallas_kernels import fp8_matmul_gpu as fk

    res: dict = {"ceilings": ceilings.measure(), "shapes": SHAPES, "configs": FP8_CONFIGS}
    key = jax.random.key(1)
    for name, (k, n) in SHAPES.items():
        layers = max(4, min(16, int(2e9 // (2 * k * n))))
        kb, kq = jax.random.split(jax.random.fold_in(key, k * n))
        wb = [(0.02 * jax.random.normal(jax.random.fold_in(kb, i), (k, n), jnp.float32)).astype(jnp.bfloat16)
              for i in range(layers)]
        qw = [jnp.clip(16 * jax.random.normal(jax.random.fold_in(kq, i), (n, k), jnp.float32), -448, 448)
              .astype(jnp.float8_e4m3fn) for i in range(layers)]
        qs = jnp.full((n,), 0.02 / 16, jnp.float32)
        shape_res: dict = {"K": k, "N": n, "layers_in_stack": layers}
        for rows in (1, 16, 64):
            x = jax.random.normal(jax.random.fold_in(key, rows), (rows, k), jnp.float32).astype(jnp.bfloat16)
            cells: dict = {}
            put = functools.partial(_put, cells, x)

            put("bf16", lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype), wb, 2 * k * n)
            put("fp8_w8a8", lambda x, w: fp8_matmul_w8a8(x, w, qs, None), qw, k * n + 4 * n)
            put("fp8_engine", lambda x, w: fp8_matmul(x, w, qs, None), qw, k * n + 4 * n)
            for bn, st, nw, sp in FP8_CONFIGS:
                put(f"fp8_kernel bn{bn} st{st} w{nw} s{sp or 'auto'}",
                    lambda x, w, bn=bn, st=st, nw=nw, sp=sp: fk.fp8_weight_matmul(
                        x, w, qs, block_n=bn, num_stages=st, num_warps=nw, splits=sp), qw, k * n + 4 * n)
            ok = {lab: c["us"] for lab, c in cells.items() if lab.startswith("fp8_kernel") and "us" in c}
            if ok:
                best = min(ok, key=ok.get)
                cells["fp8_kernel_best"] = dict(cells[best], config=best)
            shape_res[f"rows_{rows}"] = cells
            print(f"{name:<8} rows {rows:>3}: " + ", ".join(
                f"{lab} {c['us']:.1f} us" for lab, c in cells.items()
                if lab in ("bf16", "fp8_w8a8", "fp8_engine", "fp8_kernel_best") and "us" in c)
                + f" [{cells.get('fp8_kernel_best', {}).get('config', '')}]", flush=True)
        x = jax.random.normal(key, (16, k), jnp.float32).astype(jnp.bfloat16)
        want = fk.fp8_matmul_reference(x, qw[0], qs).astype(jnp.float32)
        got = fk.fp8_weight_matmul(x, qw[0], qs).astype(jnp.float32)
        shape_res["kernel_max_abs_err"] = float(jnp.max(jnp.abs(got - want)))
        shape_res["reference_max_abs"] = float(jnp.max(jnp.abs(want)))
        res[name] = shape_res
    return res


def engine(kind: str, num_prompts: int, throughput: bool, model: str = "llama-3-8b",
           decode_only: bool = False) -> dict:
    from jaxengine.device_memory import choose_launch_allocator, size_device_pool

    size_device_pool(0.9)  # the pool the engine would size, before the ceilings start the backend
    choose_launch_allocator(1)  # and the allocator it would choose
    import jax

    from jaxengine import LLM
    from jaxengine.benchmarks.common import (SampleRequest, decode_weight_bytes, percentiles, random_requests,
                                             weight_bytes)
    from jaxengine.benchmarks.gpu_suite import measure_ceilings, synthetic_tokenizer
    from jaxengine.benchmarks.latency import run_batch
    from jaxengine.benchmarks.throughput import run_throughput
    from jaxengine.models.presets import PRESETS

    vocab = PRESETS[model]["vocab_size"]
    # in a subprocess: buffers of this process freed before the engine starts may still count as
    # used on the card under the VMM allocator, where the KV cache is sized from NVML
    copy_gbps = measure_ceilings({"copy_bytes": 2 << 30, "matmul_n": 4096})["copy_bandwidth_GBps"]
    import logging

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    from jaxengine.models import quantization

    from jaxengine.pallas_kernels import weight_only_matmul_gpu

    from jaxengine.pallas_kernels import ragged_paged_attention_gpu

    modules = {"KERNEL": weight_only_matmul_gpu, "RPA": ragged_paged_attention_gpu}
    for name, value in PATCHES.get(kind, {}).items():  # "KERNEL." / "RPA.": a kernel's module
        prefix, _, attr = name.rpartition(".")
        setattr(modules[prefix] if prefix else quantization, attr, value)
    t0 = time.perf_counter()
    quant, kv_dtype = ENGINES[kind]
    # decode only: fewer token buckets to compile (batch-1 decode runs the 16-token bucket either way)
    small = dict(max_num_seqs=16, max_num_batched_tokens=512) if decode_only else {}
    llm = LLM(model, load_format="dummy", dtype="bfloat16", quantization=quant, kv_cache_dtype=kv_dtype,
              tokenizer=synthetic_tokenizer(tempfile.mkdtemp(), vocab), **small)
    eng = llm.llm_engine
    res: dict = {"quantization": quant, "kv_cache_dtype": kv_dtype, "patches": PATCHES.get(kind, {}), "engine_args": small,
                 "env": ENVS.get(kind, {}), "startup_s": time.perf_counter() - t0,
                 "compile_s": eng.runner.compile_seconds, "attention": eng.runner.attention_impl,
                 "weight_GiB": weight_bytes(llm) / 2**30, "num_kv_blocks": eng.config.num_kv_blocks,
                 "copy_bandwidth_GBps": copy_gbps, "device": jax.devices()[0].device_kind,
                 # what the engine's launch ran under (device_memory.choose_launch_allocator sets both)
                 "allocator": os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR"), "xla_flags": os.environ.get("XLA_FLAGS")}

    def prompts(i: int) -> list[list[int]]:
        return [q.prompt_token_ids for q in random_requests(1, 128, 256, 0.0, vocab, seed=500 + i)]

    print(f"engine ready after {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
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
    print(f"decode done after {time.perf_counter() - t0:.1f} s: {ms:.2f} ms/token", file=sys.stderr, flush=True)
    if decode_only:
        return res
    if throughput or kind in ("bf16", *KV_PARTS):
        warm = [SampleRequest(q.prompt_token_ids, 16) for q in random_requests(64, 256, 256, 0.0, vocab, seed=20_000)]
        run_throughput(llm, warm)
    if throughput and kind not in KV_PARTS:
        tr = run_throughput(llm, random_requests(num_prompts, 256, 256, 0.0, vocab, seed=100))
        res["throughput_256x256"] = {k: tr[k] for k in ("output_tokens_per_s", "elapsed_s") if k in tr}
        res["throughput_256x256"]["num_prompts"] = num_prompts
        print(f"256/256 done after {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    if kind in ("bf16", *KV_PARTS):  # the KV cache's dtype against the bf16 cache: 1024 in / 128 out
        tr = run_throughput(llm, random_requests(KV_PROMPTS, 1024, 128, 0.0, vocab, seed=200))
        res["throughput_1024x128"] = {k: tr[k] for k in ("output_tokens_per_s", "elapsed_s") if k in tr}
        res["throughput_1024x128"]["num_prompts"] = KV_PROMPTS
    return res


def _child(part: str, args: argparse.Namespace) -> dict:
    """Runs one part in a fresh process (its own GPU memory); its JSON, or why there is none."""
    path = os.path.join(args.out, f"quant_{part}.json")
    cmd = [sys.executable, "-m", "lab.gpu_checks.quant_h100", "--out", args.out, "--part", part,
           "--num-prompts", str(args.num_prompts), "--model", args.model] + \
        (["--w4a16-throughput"] if args.w4a16_throughput else []) + (["--decode-only"] if args.decode_only else [])
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, timeout=TIME_LIMIT_S[part], capture_output=True, text=True,
                              env={**os.environ, **ENVS.get(part, {})})
    except subprocess.TimeoutExpired as e:  # what it printed before the limit says where it was
        tail = (e.stderr or b"")
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return {"error": f"ran past {TIME_LIMIT_S[part]} s", "stderr_tail": tail[-3000:]}
    with open(os.path.join(args.out, f"quant_{part}.log"), "w") as fh:
        fh.write(proc.stderr)
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
        print(f"{'shape':<9}{'rows':>5}" + "".join(f"{v:>16}" for v in ("bf16 us", "fp8 us", "int4 ref us", "int4 best us"))
              + "  best int4 config")
        for name in SHAPES:
            for rows in (1, 16, 256):
                cells = m.get(name, {}).get(f"rows_{rows}", {})
                vals = [cells.get(v, {}).get("us") for v in ("bf16", "fp8", "int4_reference", "int4_kernel_best")]
                print(f"{name:<9}{rows:>5}" + "".join(f"{v:>16.1f}" if v is not None else f"{'-':>16}" for v in vals)
                      + "  " + cells.get("int4_kernel_best", {}).get("config", ""))
    print(f"{'engine':<8}{'weights GiB':>12}{'KV blocks':>10}{'decode ms/tok':>15}{'roofline':>10}"
          f"{'256/256 tok/s':>15}{'1024/128 tok/s':>16}")
    for kind in ENGINES:
        e = res.get(kind, {})
        if "error" in e or not e:
            print(f"{kind:<8} {e.get('error', 'not run')}")
            continue
        d, t, t2 = e["decode_b1"], e.get("throughput_256x256", {}), e.get("throughput_1024x128", {})
        tps = f"{t['output_tokens_per_s']:>15,.0f}" if "output_tokens_per_s" in t else f"{'-':>15}"
        tps2 = f"{t2['output_tokens_per_s']:>16,.0f}" if "output_tokens_per_s" in t2 else f"{'-':>16}"
        print(f"{kind:<8}{e['weight_GiB']:>12.2f}{e['num_kv_blocks']:>10}{d['ms_per_token_median']:>15.2f}"
              f"{d['roofline_fraction']:>10.0%}{tps}{tps2}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--model", default="llama-3-8b", help="a preset (dummy weights)")
    ap.add_argument("--w4a16-throughput", action="store_true", help="also the offline run for the int4 reference")
    ap.add_argument("--decode-only", action="store_true", help="engine parts: batch-1 decode only")
    ap.add_argument("--part", choices=PARTS, help="run one part in this process (used internally)")
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated parts to run, in this order")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.part is not None:
        if args.part == "micro":
            out = micro()
        elif args.part == "micro_fp8":
            out = micro_fp8()
        else:
            import faulthandler  # the Python stacks shortly before the parent's limit: where a slow part was
            faulthandler.dump_traceback_later(TIME_LIMIT_S[args.part] - 10, exit=False)
            weight_only = args.part.startswith(("w4a16", "gguf"))
            out = engine(args.part, args.num_prompts, not weight_only or args.w4a16_throughput, args.model,
                         args.decode_only)
        with open(os.path.join(args.out, f"quant_{args.part}.json"), "w") as fh:
            json.dump(out, fh, indent=1)
        return 0
    res: dict = {"model": f"{args.model} (dummy weights, bf16 activations)", "num_prompts": args.num_prompts}
    t0 = time.perf_counter()
    for part in args.parts.split(","):
        res[part] = _child(part, args)
        print(f"{part}: {res[part].get('error', 'done')} ({time.perf_counter() - t0:.0f} s so far)", flush=True)
        with open(os.path.join(args.out, "quant.json"), "w") as fh:
            json.dump(res, fh, indent=1)
    if "output_tokens_per_s" in res.get("bf16", {}).get("throughput_256x256", {}) and \
            "output_tokens_per_s" in res.get("fp8", {}).get("throughput_256x256", {}):
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
