"""Tensor parallelism on a multi-GPU host, with the profile that explains the step time.

1. Correctness: greedy tokens of a tiny random Llama at TP=2 (and TP=2 with one KV head, so each
   KV head is repeated on both devices) against TP=1.
2. Llama-3-8B shape (dummy weights, bf16) at TP=1 and TP=2:
   - batch-1 decode through the engine (ms/token), with the engine's host / device-wait split;
   - the forward program alone at batch 1 (decode row, context 512, token bucket 16), timed with
     the device synchronised each call: what the device needs per step;
   - the host time of one `dispatch` (input building, sampling metadata, the launch);
   - the collectives in the compiled TP forward (from its optimised HLO), and one all-reduce of a
     step's activations [16, 4096] bf16 timed alone: the per-layer price of tensor parallelism;
   - offline throughput, 256 prompts x (256 in, 128 out).
Ceilings (copy bandwidth, bf16 matmul) measured on GPU 0 in the same run. JSON and the optimised
HLO to $OUT; a table printed last.

    python lab/gpu_checks/gpu_tp_check.py
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxengine.benchmarks.ceilings import measure  # noqa: E402


def tiny_checkpoint(path: str, kv_heads: int) -> str:
    import torch
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=kv_heads, max_position_embeddings=512)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def run_engine(model: str, tp: int, **kw):
    from jaxengine import LLM
    t0 = time.perf_counter()
    llm = LLM(model, tensor_parallel_size=tp, skip_tokenizer_init=True, **kw)
    return llm, time.perf_counter() - t0


def _sync_timing(fn, n: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def forward_alone_ms(runner, context: int = 512, t: int = 16, n: int = 50) -> float:
    """One decode row over `context` tokens in token bucket `t`, device synchronised per call."""
    from jaxengine.input_batch import StepInputs
    from jaxengine.models.attention import AttentionMetadata
    from jaxengine.packing import pack
    r, m, bs = runner.rows_for(t), runner.config.max_blocks_per_seq, runner.config.block_size
    nblk = -(-context // bs)
    block_tables = np.zeros((r, m), np.int32)
    block_tables[0, :nblk] = np.arange(1, nblk + 1)
    kv_lens = np.zeros(r, np.int32)
    kv_lens[0] = context
    qsl = np.ones(r + 1, np.int32)
    qsl[0] = 0
    slot = np.zeros(t, np.int32)
    slot[0] = nblk * bs - 1 if context % bs == 0 else (nblk - 1) * bs + context % bs - 1
    positions = np.zeros(t, np.int32)
    positions[0] = context - 1
    inputs = StepInputs(np.full(t, 7, np.int32), positions,
                        AttentionMetadata(slot, kv_lens, block_tables, qsl, np.ones(1, np.int32)),
                        np.zeros(r, np.int32), np.full(t, -1, np.int32))
    fwd, packed = runner._get_forward(t), pack(inputs)

    def call():
        runner.kv_caches, logits, _ = fwd(runner.param_leaves, runner.kv_caches, packed, runner._no_prev)
        logits.block_until_ready()
    return _sync_timing(call, n) * 1e3


def dispatch_host_ms(engine, n: int = 30) -> tuple[float, float, float]:
    """Batch-1 decode: (median host ms until `dispatch` returns, ms per engine step, ms per step
    waiting for the device)."""
    from jaxengine import SamplingParams
    runner = engine.runner
    orig, host = runner.dispatch, []

    def timed(*a, **k):
        t0 = time.perf_counter()
        h = orig(*a, **k)
        host.append(time.perf_counter() - t0)
        return h
    runner.dispatch = timed
    try:
        engine.timing.update(steps=0, device_wait_s=0.0, step_s=0.0)
        engine.add_request("timing", {"prompt_token_ids": list(range(100, 164))},
                           SamplingParams(max_tokens=n + 8, temperature=0, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        runner.dispatch = orig
    tm = engine.timing
    return float(np.median(host[4:]) * 1e3), (tm["step_s"] / tm["steps"]) * 1e3, (tm["device_wait_s"] / tm["steps"]) * 1e3


def collectives(hlo: str) -> dict[str, int]:
    out = {}
    for op in ("all-reduce-start", "all-reduce", "all-gather-start", "all-gather", "reduce-scatter",
               "collective-permute", "all-to-all"):
        out[op] = len(re.findall(rf"= [^=]*? {op}\(", hlo))
    return out


def allreduce_ms(tp: int, shape=(16, 4096), n: int = 200) -> float:
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jaxengine.attention_backend import shard_map
    mesh = Mesh(np.asarray(jax.devices()[:tp]).reshape(tp), ("model",))
    x = jax.device_put(jnp.ones((tp,) + shape, jnp.bfloat16), NamedSharding(mesh, P("model")))
    f = jax.jit(shard_map(lambda a: jax.lax.psum(a, "model"), mesh=mesh, in_specs=P("model"), out_specs=P("model")))

    def loop():
        y = x
        for _ in range(10):
            y = f(y)
        y.block_until_ready()
    return _sync_timing(loop, n // 10) / 10 * 1e3


def engine_settings(smoke: bool) -> tuple[str, dict, int]:
    """(model, engine settings, prompts in the throughput run): the Llama-3-8B shape with the H100
    suite's settings, or on the CPU (--smoke, XLA_FLAGS=--xla_force_host_platform_device_count=2)
    a 2-layer cut of it that runs the same code paths."""
    if not smoke:
        return "llama-3-8b", dict(max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=2048), 256
    from jaxengine.models.presets import PRESETS
    PRESETS["tp-smoke"] = dict(PRESETS["llama-3-8b"], hidden_size=256, intermediate_size=512,
                               num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=2)
    return "tp-smoke", dict(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=64, num_kv_blocks=256), 8


def engine_figures(llm, n_batch: int) -> dict:
    """Batch-1 decode ms/token (128 greedy tokens after a warm-up), its host / device-wait split per
    step, and offline throughput over `n_batch` random prompts x (256 in, 128 out)."""
    from jaxengine import SamplingParams
    eng = llm.llm_engine
    p = {"prompt_token_ids": list(range(100, 132))}
    llm.generate(p, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    o = llm.generate(p, SamplingParams(max_tokens=128, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    ms = (o.metrics.last_token_time - o.metrics.first_token_time) / 127 * 1e3
    disp, step, wait = dispatch_host_ms(eng)
    rng = np.random.default_rng(0)
    batch = [{"prompt_token_ids": rng.integers(0, 32000, size=256).tolist()} for _ in range(n_batch)]
    eng.timing.update(steps=0, device_wait_s=0.0, step_s=0.0)
    t0 = time.perf_counter()
    outs = llm.generate(batch, SamplingParams(max_tokens=128, temperature=0, ignore_eos=True), use_tqdm=False)
    dt = time.perf_counter() - t0
    tm = dict(eng.timing)
    steps = max(tm["steps"], 1)
    return {"decode_b1_ms": ms, "decode_b1_tok_s": 1e3 / ms, "b1_dispatch_host_ms": disp, "b1_step_ms": step,
            "b1_device_wait_ms": wait,
            "throughput_256x256_128_out_tok_s": sum(len(x.outputs[0].token_ids) for x in outs) / dt,
            "throughput_steps": tm["steps"],
            "throughput_host_ms_per_step": (tm["step_s"] - tm["device_wait_s"]) / steps * 1e3,
            "throughput_wait_ms_per_step": tm["device_wait_s"] / steps * 1e3}


def main() -> None:
    from jaxengine import SamplingParams
    out_dir = os.environ.get("OUT", ".")
    res: dict = {"jax": jax.__version__, "devices": [d.device_kind for d in jax.devices()]}
    smoke = "--smoke" in sys.argv
    if not smoke:
        res["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                           capture_output=True, text=True).stdout.strip()
    res["ceilings_gpu0"] = measure(32 << 20, 256) if smoke else measure()
    prompts = [{"prompt_token_ids": list(range(10 + i, 60 + 7 * i))} for i in range(8)]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=5)
    with tempfile.TemporaryDirectory() as d:
        for kv in (4, 1):
            path = tiny_checkpoint(os.path.join(d, f"tiny{kv}"), kv)
            toks = {}
            for tp in (1, 2):
                llm, _ = run_engine(path, tp, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256,
                                    num_kv_blocks=256, dtype="float32")
                toks[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
                del llm
            res[f"tiny_kv{kv}_tp2_equals_tp1"] = toks[1] == toks[2]
            print(f"tiny (KV heads {kv}) TP2 == TP1:", toks[1] == toks[2], flush=True)
    res["allreduce_16x4096_bf16_ms"] = allreduce_ms(2)
    print("all-reduce [16, 4096] bf16 over 2 GPUs:", res["allreduce_16x4096_bf16_ms"], "ms", flush=True)
    model, kw, n_batch = engine_settings(smoke)
    for tp in (1, 2):
        llm, startup = run_engine(model, tp, load_format="dummy", dtype="bfloat16", **kw)
        eng = llm.llm_engine
        fig = engine_figures(llm, n_batch)
        fwd = forward_alone_ms(eng.runner)
        hlo = eng.runner._get_forward(16).as_text()
        with open(os.path.join(out_dir, f"forward_t16_tp{tp}.hlo.txt"), "w") as f:
            f.write(hlo)
        res[f"tp{tp}"] = dict(fig, startup_s=startup, forward_alone_b1_ctx512_ms=fwd,
                              collectives_forward_t16=collectives(hlo), kv_blocks=eng.config.num_kv_blocks)
        print(f"tp{tp}", res[f"tp{tp}"], flush=True)
        del llm, eng
    weights = 8.03e9 * 2  # Llama-3-8B bf16
    res["single_gpu_weight_roofline_ms"] = weights / (res["ceilings_gpu0"]["copy_bandwidth_GBps"] * 1e9) * 1e3
    with open(os.path.join(out_dir, "tp_h200x2.json"), "w") as f:
        json.dump(res, f, indent=2)
    c = res["ceilings_gpu0"]
    print("\n| figure | TP=1 | TP=2 |\n|---|---|---|")
    for key, label in (("decode_b1_ms", "batch-1 decode ms/token (engine)"),
                       ("forward_alone_b1_ctx512_ms", "forward program alone, batch 1, ms"),
                       ("b1_dispatch_host_ms", "dispatch host ms (batch 1)"),
                       ("b1_device_wait_ms", "device wait ms per step (batch 1)"),
                       ("throughput_256x256_128_out_tok_s", "throughput 256 x (256 in, 128 out) output tok/s"),
                       ("throughput_host_ms_per_step", "throughput host ms per step"),
                       ("startup_s", "start-up s")):
        print(f"| {label} | {res['tp1'][key]:.2f} | {res['tp2'][key]:.2f} |")
    print(f"| collectives in forward (TP=2) | | {res['tp2']['collectives_forward_t16']} |")
    print(f"| all-reduce [16,4096] bf16 ms | | {res['allreduce_16x4096_bf16_ms']:.4f} |")
    print(f"| ceilings (GPU 0) | copy {c['copy_bandwidth_GBps']:.0f} GB/s, bf16 {c['bf16_matmul_TFLOPs']:.0f} TFLOP/s | |")
    print(f"| tiny TP=2 tokens == TP=1 (KV heads 4 / 1) | {res['tiny_kv4_tp2_equals_tp1']} / {res['tiny_kv1_tp2_equals_tp1']} | |")


if __name__ == "__main__":
    main()
