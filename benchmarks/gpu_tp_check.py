"""Tensor parallelism on a multi-GPU host: TP=2 against TP=1 on a tiny random checkpoint
(greedy tokens), then Llama-3-8B shape (dummy weights) batch-1 decode and offline throughput at
TP=1 and TP=2, with the ceilings measured in the same run. JSON to $OUT, a table printed last.

    python benchmarks/gpu_tp_check.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.ceilings import measure  # noqa: E402


def tiny_checkpoint(path: str) -> str:
    import torch
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def run_engine(model: str, tp: int, **kw):
    from jaxengine import LLM
    t0 = time.perf_counter()
    llm = LLM(model, tensor_parallel_size=tp, skip_tokenizer_init=True, **kw)
    return llm, time.perf_counter() - t0


def main() -> None:
    from jaxengine import SamplingParams
    out_dir = os.environ.get("OUT", ".")
    res: dict = {"jax": jax.__version__, "devices": [d.device_kind for d in jax.devices()]}
    res["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                       capture_output=True, text=True).stdout.strip()
    res["ceilings_gpu0"] = measure()
    prompts = [{"prompt_token_ids": list(range(10 + i, 60 + 7 * i))} for i in range(8)]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=5)
    with tempfile.TemporaryDirectory() as d:
        path = tiny_checkpoint(os.path.join(d, "tiny"))
        toks = {}
        for tp in (1, 2):
            llm, _ = run_engine(path, tp, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256,
                                num_kv_blocks=256, dtype="float32")
            toks[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
            del llm
    res["tiny_tp2_equals_tp1"] = toks[1] == toks[2]
    print("tiny TP2 == TP1:", res["tiny_tp2_equals_tp1"], flush=True)
    rng = np.random.default_rng(0)
    for tp in (1, 2):
        llm, startup = run_engine("llama-3-8b", tp, load_format="dummy", dtype="bfloat16", max_model_len=2048,
                                  max_num_seqs=256, max_num_batched_tokens=2048)
        eng = llm.llm_engine
        p = {"prompt_token_ids": list(range(100, 132))}
        llm.generate(p, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
        o = llm.generate(p, SamplingParams(max_tokens=128, temperature=0, ignore_eos=True), use_tqdm=False)[0]
        ms = (o.metrics.last_token_time - o.metrics.first_token_time) / 127 * 1e3
        batch = [{"prompt_token_ids": rng.integers(0, 32000, size=256).tolist()} for _ in range(256)]
        t0 = time.perf_counter()
        outs = llm.generate(batch, SamplingParams(max_tokens=128, temperature=0, ignore_eos=True), use_tqdm=False)
        dt = time.perf_counter() - t0
        n = sum(len(x.outputs[0].token_ids) for x in outs)
        res[f"tp{tp}"] = {"startup_s": startup, "decode_b1_ms": ms, "decode_b1_tok_s": 1e3 / ms,
                          "throughput_256x256_128_out_tok_s": n / dt, "kv_blocks": eng.config.num_kv_blocks}
        print(f"tp{tp}", res[f"tp{tp}"], flush=True)
        del llm, eng
    with open(os.path.join(out_dir, "tp_h200x2.json"), "w") as f:
        json.dump(res, f, indent=2)
    c = res["ceilings_gpu0"]
    print(f"\n| figure | TP=1 | TP=2 |\n|---|---|---|")
    print(f"| batch-1 decode ms/token | {res['tp1']['decode_b1_ms']:.2f} | {res['tp2']['decode_b1_ms']:.2f} |")
    print(f"| throughput 256 x (256 in, 128 out) output tok/s | {res['tp1']['throughput_256x256_128_out_tok_s']:.0f} | "
          f"{res['tp2']['throughput_256x256_128_out_tok_s']:.0f} |")
    print(f"| ceilings (GPU 0) | copy {c['copy_bandwidth_GBps']:.0f} GB/s, bf16 {c['bf16_matmul_TFLOPs']:.0f} TFLOP/s | |")
    print(f"| tiny TP=2 tokens == TP=1 | {res['tiny_tp2_equals_tp1']} | |")


if __name__ == "__main__":
    main()
