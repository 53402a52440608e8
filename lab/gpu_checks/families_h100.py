"""Model families on the GPU: their attention shapes checked against the reference, then each
family's batch-1 decode (share of the bytes-read roofline) and offline 256/256 throughput,
beside Llama-3-8B, in one process tree.

1. Kernel check: the Pallas GPU attention (through `AttentionBackend.attend`, as the models call
   it) against the jnp reference on ragged batches of decode rows and prefill chunks for the
   families' attention shapes: Gemma 2 (head 256, window + soft cap), Gemma 3 local/global
   (head 256, window / none), Phi-3 (head 96, padded to 128 in the cache).
2. Per model (a fresh subprocess each: start-up counted cold), dummy bf16 weights, engine
   defaults: start-up; batch-1 decode, 128 in / 256 out greedy, median step of 3 batches after one
   warm-up batch; its roofline = (weight bytes read + KV bytes at the mean context) / the copy
   bandwidth measured in the same process; offline throughput, 1000 random prompts of 256 in /
   256 out, temperature 1, ignore_eos, detokenized, after a 64-prompt warm-up.

    python -m lab.gpu_checks.families_h100 --out $OUT --models llama-3-8b phi-3-mini gemma-2-9b
    python -m lab.gpu_checks.families_h100 --report $OUT --json F.json --md F.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def kernel_check() -> list[dict]:
    """Max |pallas - reference| per attention shape, bf16, with its tolerance."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxengine.attention_backend import AttentionBackend, select_attention_backend
    from jaxengine.models.attention import AttentionMetadata
    from jaxengine.models.config import ModelConfig
    from jaxengine.models.presets import PRESETS
    from jaxengine.pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
    from tests.kernels.batch_factory import make_batch

    shapes = [  # name, heads, kv heads, head size, window, soft cap
        ("gemma-2 local (window 32, soft cap 50)", 16, 8, 256, 32, 50.0),
        ("gemma-2 global (soft cap 50)", 16, 8, 256, None, 50.0),
        ("gemma-3 local (window 32)", 4, 1, 256, 32, None),
        ("phi-3 (head 96)", 32, 32, 96, None, None),
        ("phi-3 windowed (head 96, window 48)", 32, 32, 96, 48, None),
    ]
    rows = []
    for name, n, k, h, window, cap in shapes:
        cfg = ModelConfig.from_hf_dict(dict(PRESETS["llama-3-8b"], num_attention_heads=n, num_key_value_heads=k,
                                            head_dim=h, hidden_size=n * h, sliding_window=window))
        backend = select_attention_backend("auto", cfg, jnp.bfloat16, 16)
        ref = AttentionBackend("reference", "jnp reference", ragged_paged_attention_reference,
                               cache_head_dim=backend.cache_head_dim)
        hc = backend.kv_head_dim(h)
        rng = np.random.default_rng(0)
        for label, q_lens, ctx in (("mixed", [1, 1, 37, 130], [90, 300, 0, 70]), ("decode", [1] * 6, [5, 40, 90, 130, 200, 260])):
            b = make_batch(rng, q_lens=q_lens, ctx_lens=ctx, num_heads=n, num_kv_heads=k, head_dim=hc,
                           block_size=16, dtype=jnp.bfloat16, pad_slots=1, pad_tokens=3)
            t = b.q.shape[0]
            q = b.q[..., :h]
            kn = jnp.asarray(rng.standard_normal((t, k, h)), jnp.bfloat16)
            vn = jnp.asarray(rng.standard_normal((t, k, h)), jnp.bfloat16)
            # this step's tokens go to fresh slots at the end of each sequence's context
            slots = np.zeros(t, np.int32)
            qsl, bt, lens = np.asarray(b.query_start_loc), np.asarray(b.block_tables), np.asarray(b.kv_lens)
            for s in range(len(q_lens)):
                for j in range(q_lens[s]):
                    pos = lens[s] - q_lens[s] + j
                    slots[qsl[s] + j] = bt[s, pos // 16] * 16 + pos % 16
            md = AttentionMetadata(jnp.asarray(slots), b.kv_lens, b.block_tables, b.query_start_loc, b.num_seqs)
            kw = dict(sm_scale=h ** -0.5, sliding_window=window, soft_cap=cap)
            got, _ = jax.jit(lambda *a: backend.attend(*a, **kw))(q, kn, vn, (b.k_cache, b.v_cache), md)
            want, _ = jax.jit(lambda *a: ref.attend(*a, **kw))(q, kn, vn, (b.k_cache, b.v_cache), md)
            live = int(qsl[len(q_lens)])
            err = float(jnp.max(jnp.abs(got[:live].astype(jnp.float32) - want[:live].astype(jnp.float32))))
            rows.append({"shape": name, "batch": label, "kernel": backend.description, "max_abs_err": err,
                         "tolerance": 3e-2, "ok": err <= 3e-2})
            print(f"kernel check {name} [{label}]: {backend.description}: max |err| {err:.2e}", flush=True)
    return rows


def measure_model(model: str, out: str, num_prompts: int = 1000) -> None:
    """One model's figures, saved after each stage to OUT/<model>.json."""
    import jax

    from jaxengine import LLM
    from jaxengine.benchmarks import ceilings
    from jaxengine.benchmarks.common import (SampleRequest, decode_weight_bytes, percentiles, random_requests,
                                             weight_bytes)
    from jaxengine.benchmarks.gpu_suite import synthetic_tokenizer
    from jaxengine.benchmarks.latency import run_batch
    from jaxengine.benchmarks.throughput import run_throughput
    from jaxengine.model_runner import kv_bytes_per_block
    from jaxengine.models.presets import PRESETS

    path = os.path.join(out, f"{model}.json")
    r: dict = {"model": model, "jax": jax.__version__, "device": jax.devices()[0].device_kind}

    def save() -> None:
        with open(path, "w") as f:
            json.dump(r, f, indent=1)

    r["ceilings"] = ceilings.measure()
    vocab = PRESETS[model]["vocab_size"]
    t0 = time.perf_counter()
    llm = LLM(model, load_format="dummy", dtype="bfloat16", tokenizer=synthetic_tokenizer(tempfile.mkdtemp(), vocab))
    eng = llm.llm_engine
    mc = eng.model_config
    kv_tok = kv_bytes_per_block(mc, eng.config.block_size, eng.runner.dtype,
                                eng.runner.attention.kv_head_dim(mc.head_dim)) / eng.config.block_size
    r.update({"startup_s": time.perf_counter() - t0, "attention": eng.runner.attention_impl,
              "max_model_len": eng.config.max_model_len, "max_num_seqs": eng.config.max_num_seqs,
              "max_num_batched_tokens": eng.config.max_num_batched_tokens, "num_kv_blocks": eng.config.num_kv_blocks,
              "weight_bytes": weight_bytes(llm), "decode_weight_bytes": decode_weight_bytes(llm),
              "kv_bytes_per_token": kv_tok,
              "shape": {"layers": mc.num_layers, "hidden": mc.hidden_size, "heads": mc.num_heads,
                        "kv_heads": mc.num_kv_heads, "head_dim": mc.head_dim, "vocab": mc.vocab_size,
                        "tied_embeddings": mc.tie_word_embeddings}})
    print(f"[{model}] start-up {r['startup_s']:.1f} s; {r['attention']}", flush=True)
    save()

    def prompts(i: int) -> list[list[int]]:
        return [q.prompt_token_ids for q in random_requests(1, 128, 256, 0.0, vocab, seed=500 + i)]

    run_batch(llm, prompts(100), 256)
    runs = [run_batch(llm, prompts(i), 256) for i in range(3)]
    steps = percentiles([g for x in runs for g in x["decode_steps"]])
    step_bytes = r["decode_weight_bytes"] + (128 + 256 / 2) * kv_tok
    roof_ms = 1e3 * step_bytes / (r["ceilings"]["copy_bandwidth_GBps"] * 1e9)
    r["decode_b1"] = {"input_len": 128, "output_len": 256, "batches": 3,
                      "ms_per_token_median": 1e3 * steps["median"], "ms_per_token_p99": 1e3 * steps["p99"],
                      "step_bytes": step_bytes, "roofline_ms": roof_ms,
                      "share_of_roofline": roof_ms / (1e3 * steps["median"])}
    print(f"[{model}] batch-1 decode {1e3 * steps['median']:.2f} ms/token, roofline {roof_ms:.2f} ms "
          f"({r['decode_b1']['share_of_roofline']:.1%})", flush=True)
    save()
    warm = [SampleRequest(q.prompt_token_ids, 16) for q in random_requests(64, 256, 256, 0.0, vocab, seed=20_000)]
    run_throughput(llm, warm)
    tr = run_throughput(llm, random_requests(num_prompts, 256, 256, 0.0, vocab, seed=100))
    t = tr["engine_timing"]
    tr["ms_per_step"] = 1e3 * t["step_s"] / max(t["steps"], 1)
    tr["num_prompts"] = num_prompts
    r["throughput_256x256"] = tr
    print(f"[{model}] throughput {tr['output_tokens_per_s']:.0f} output tok/s, {t['steps']} steps of "
          f"{tr['ms_per_step']:.2f} ms", flush=True)
    save()


def report(folder: str, json_path: str | None, md_path: str | None, commit: str) -> None:
    runs = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".json") and name != "kernels.json":
            runs[name[:-5]] = json.load(open(os.path.join(folder, name)))
    kernels = json.load(open(os.path.join(folder, "kernels.json"))) if os.path.exists(
        os.path.join(folder, "kernels.json")) else []
    any_run = next(iter(runs.values()))
    c = any_run["ceilings"]
    lines = [f"# Model families on one {any_run['device']} (jax {any_run['jax']}, code {commit})", "",
             "Dummy bf16 weights, engine defaults. Batch-1 decode: 128 in / 256 out greedy, median step of 3 "
             "batches; roofline = (weight bytes read + KV bytes at the mean context) / copy bandwidth, "
             "both measured in the model's own process. Throughput: 1000 random prompts, 256 in / 256 out, "
             "temperature 1, ignore_eos, detokenized.", "",
             "| model | attention | start-up s | weights read GB | batch-1 ms/token | roofline ms | share | "
             "256/256 output tok/s | ms/step | copy GB/s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for model, r in runs.items():
        d, tp = r.get("decode_b1", {}), r.get("throughput_256x256", {})
        lines.append(f"| {model} | {r['attention']} | {r['startup_s']:.1f} | {r['decode_weight_bytes'] / 1e9:.2f} | "
                     f"{d.get('ms_per_token_median', float('nan')):.2f} | {d.get('roofline_ms', float('nan')):.2f} | "
                     f"{d.get('share_of_roofline', float('nan')):.1%} | {tp.get('output_tokens_per_s', float('nan')):,.0f} | "
                     f"{tp.get('ms_per_step', float('nan')):.2f} | {r['ceilings']['copy_bandwidth_GBps']:.0f} |")
    lines += ["", f"Ceilings of the first process: copy {c['copy_bandwidth_GBps']:.0f} GB/s, bf16 matmul "
                  f"{c['bf16_matmul_TFLOPs']:.1f} TFLOP/s."]
    if kernels:
        lines += ["", "Attention of the families' shapes, Pallas GPU against the jnp reference (bf16):", "",
                  "| shape | batch | kernel | max abs error | within 3e-2 |", "|---|---|---|---|---|"]
        lines += [f"| {k['shape']} | {k['batch']} | {k['kernel']} | {k['max_abs_err']:.2e} | {k['ok']} |" for k in kernels]
    text = "\n".join(lines) + "\n"
    print(text)
    if md_path:
        open(md_path, "w").write(text)
    if json_path:
        json.dump({"commit": commit, "runs": runs, "kernel_check": kernels}, open(json_path, "w"), indent=1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--models", nargs="+", default=["llama-3-8b", "phi-3-mini", "gemma-2-9b"])
    ap.add_argument("--one", default=None, help="(internal) measure this model in this process")
    ap.add_argument("--kernels", action="store_true", help="(internal) the kernel check in this process")
    ap.add_argument("--report", default=None, help="a folder of results: print the table")
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--num-prompts", type=int, default=1000)
    args = ap.parse_args()
    if args.report:
        report(args.report, args.json, args.md, args.commit)
        return 0
    os.makedirs(args.out, exist_ok=True)
    if args.one:
        measure_model(args.one, args.out, args.num_prompts)
        return 0
    if args.kernels:
        json.dump(kernel_check(), open(os.path.join(args.out, "kernels.json"), "w"), indent=1)
        return 0
    # each part in its own process: one holds the GPU's memory until it exits
    subprocess.run([sys.executable, "-m", "lab.gpu_checks.families_h100", "--kernels", "--out", args.out], check=False)
    for model in args.models:
        subprocess.run([sys.executable, "-m", "lab.gpu_checks.families_h100", "--one", model, "--out", args.out,
                        "--num-prompts", str(args.num_prompts)], check=False)
    report(args.out, None, os.path.join(args.out, "families.md"), args.commit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
