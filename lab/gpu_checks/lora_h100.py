"""LoRA on the GPU: the cost of serving many adapters in one batch, base and adapters in one engine.

One engine (Llama-3-8B shape, dummy bf16 weights, engine defaults, enable_lora with max_loras=8,
max_lora_rank=16) and 8 random rank-16 adapters on all seven projections (q/k/v/o, gate/up/down):

- batch-1 decode, 128 in / 256 out greedy: median step without an adapter, then with one;
- offline throughput, 1000 random prompts of 256 in / 256 out, temperature 1, ignore_eos, after a
  64-prompt warm-up: without adapters (the base program), then with prompt i on adapter i % 8
  (every step mixes all eight).

    python -m lab.gpu_checks.lora_h100 --out $OUT [--num-prompts 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

TARGETS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapter(folder: str, cfg: dict, rank: int, seed: int) -> None:
    """A random PEFT LoRA adapter of rank `rank` on all seven projections of a Llama config."""
    from safetensors.numpy import save_file

    d, f = cfg["hidden_size"], cfg["intermediate_size"]
    h = cfg.get("head_dim") or d // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * h, cfg["num_key_value_heads"] * h
    dims = {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
            "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(cfg["num_hidden_layers"]):
        for block, names in TARGETS.items():
            for name in names:
                d_in, d_out = dims[name]
                base = f"base_model.model.model.layers.{i}.{block}.{name}"
                tensors[f"{base}.lora_A.weight"] = (rng.standard_normal((rank, d_in)) * 0.01).astype(np.float32)
                tensors[f"{base}.lora_B.weight"] = (rng.standard_normal((d_out, rank)) * 0.01).astype(np.float32)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as fh:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none", "task_type": "CAUSAL_LM",
                   "target_modules": [n for names in TARGETS.values() for n in names]}, fh)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--model", default="llama-3-8b", help="a preset (dummy weights)")
    ap.add_argument("--skip-decode", action="store_true", help="only the throughput runs")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    import jax

    from jaxengine import LLM
    from jaxengine.benchmarks import ceilings
    from jaxengine.benchmarks.common import SampleRequest, percentiles, random_requests
    from jaxengine.benchmarks.gpu_suite import synthetic_tokenizer
    from jaxengine.benchmarks.latency import run_batch
    from jaxengine.benchmarks.throughput import run_throughput
    from jaxengine.lora import LoRARequest
    from jaxengine.models.presets import PRESETS

    res: dict = {"commit": args.commit, "jax": jax.__version__, "device": jax.devices()[0].device_kind,
                 "model": f"{args.model} (dummy bf16)", "adapters": 8, "rank": 16, "targets": "q,k,v,o,gate,up,down"}
    path = os.path.join(args.out, "lora.json")

    def save() -> None:
        with open(path, "w") as fh:
            json.dump(res, fh, indent=1)

    res["ceilings"] = ceilings.measure() if jax.default_backend() == "gpu" else None
    cfg = PRESETS[args.model]
    tmp = tempfile.mkdtemp()
    t0 = time.perf_counter()
    adapters = []
    for i in range(8):
        folder = os.path.join(tmp, f"adapter{i}")
        write_adapter(folder, cfg, 16, i)
        adapters.append(LoRARequest(f"adapter{i}", i + 1, folder))
    res["adapter_write_s"] = time.perf_counter() - t0
    vocab = cfg["vocab_size"]
    t0 = time.perf_counter()
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", tokenizer=synthetic_tokenizer(tmp, vocab),
              enable_lora=True, max_loras=8, max_lora_rank=16)
    eng = llm.llm_engine
    res.update({"startup_s": time.perf_counter() - t0, "attention": eng.runner.attention_impl,
                "num_kv_blocks": eng.config.num_kv_blocks, "max_num_seqs": eng.config.max_num_seqs,
                "max_num_batched_tokens": eng.config.max_num_batched_tokens, "compile_s": eng.runner.compile_seconds})
    print(f"start-up {res['startup_s']:.1f} s (compile {res['compile_s']:.1f} s)", flush=True)
    save()

    def prompts(i: int) -> list[list[int]]:
        return [q.prompt_token_ids for q in random_requests(1, 128, 256, 0.0, vocab, seed=500 + i)]

    def decode(lora) -> dict:
        orig = eng.add_request

        def add(rid, prompt, params=None, arrival_time=None, lora_request=None):  # run_batch adds directly
            return orig(rid, prompt, params, arrival_time, lora_request=lora)
        eng.add_request = add
        try:
            run_batch(llm, prompts(100), 256)
            runs = [run_batch(llm, prompts(i), 256) for i in range(3)]
        finally:
            eng.add_request = orig
        steps = percentiles([g for x in runs for g in x["decode_steps"]])
        return {"ms_per_token_median": 1e3 * steps["median"], "ms_per_token_p99": 1e3 * steps["p99"]}

    if not args.skip_decode:
        res["decode_b1"] = {"base": decode(None), "adapter": decode(adapters[0])}
        b, a = res["decode_b1"]["base"]["ms_per_token_median"], res["decode_b1"]["adapter"]["ms_per_token_median"]
        res["decode_b1"]["overhead"] = a / b - 1
        print(f"batch-1 decode: base {b:.2f} ms/token, one adapter {a:.2f} ms/token ({a / b - 1:+.1%})", flush=True)
        save()

    # Host time inside the runner's dispatch (building inputs, the program calls) per step: where
    # a host-paced loop spends what the device does not wait for.
    runner = eng.runner
    dispatch_s = [0.0, 0]
    orig_dispatch = runner.dispatch

    def timed_dispatch(*a, **kw):
        t0 = time.perf_counter()
        try:
            return orig_dispatch(*a, **kw)
        finally:
            dispatch_s[0] += time.perf_counter() - t0
            dispatch_s[1] += 1
    runner.dispatch = timed_dispatch

    def throughput(with_lora: bool) -> dict:
        reqs = random_requests(args.num_prompts, 256, 256, 0.0, vocab, seed=100)
        warm = [SampleRequest(q.prompt_token_ids, 16) for q in random_requests(64, 256, 256, 0.0, vocab, seed=20_000)]
        orig = llm.generate

        def gen(p, sp, use_tqdm=False, **kw):
            loras = [adapters[i % 8] for i in range(len(p))] if with_lora else None
            return orig(p, sp, use_tqdm=use_tqdm, lora_request=loras, **kw)
        llm.generate = gen
        try:
            run_throughput(llm, warm)
            dispatch_s[0], dispatch_s[1] = 0.0, 0
            tr = run_throughput(llm, reqs)
        finally:
            llm.generate = orig
        t = tr["engine_timing"]
        tr["ms_per_step"] = 1e3 * t["step_s"] / max(t["steps"], 1)
        tr["dispatch_ms_per_step"] = 1e3 * dispatch_s[0] / max(dispatch_s[1], 1)
        print(f"{'8 adapters' if with_lora else 'base'}: {tr['output_tokens_per_s']:,.0f} tok/s, "
              f"{tr['ms_per_step']:.1f} ms/step, dispatch {tr['dispatch_ms_per_step']:.2f} ms/step", flush=True)
        return tr

    res["throughput_256x256"] = {"base": throughput(False)}
    save()
    res["throughput_256x256"]["8_adapters"] = throughput(True)
    tb = res["throughput_256x256"]["base"]["output_tokens_per_s"]
    tl = res["throughput_256x256"]["8_adapters"]["output_tokens_per_s"]
    res["throughput_256x256"]["ratio"] = tl / tb
    print(f"256/256 x {args.num_prompts}: base {tb:,.0f} output tok/s, 8 adapters {tl:,.0f} ({tl / tb:.1%})", flush=True)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
