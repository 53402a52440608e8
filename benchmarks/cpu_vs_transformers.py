"""CPU benchmark: `LLM.generate` against transformers' batched `generate` on the real SmolLM2.

Same prompts (32, mixed lengths), same number of new tokens (64, eos ignored), float32, greedy (the
tokens of both are compared prompt by prompt),
in the same process. Compilation is done before timing (as the engine does at start-up); both
sides get one untimed warm-up run on 4 other prompts (so the engine's prefix cache holds nothing of
the timed prompts). Writes JSON + Markdown to benchmarks/results/.

    python benchmarks/cpu_vs_transformers.py [--num-prompts 32] [--output-len 64]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np

WORDS = ("the quick brown fox jumps over a lazy dog while seven clever owls watch from an old oak tree "
         "near the quiet river under a pale autumn moon").split()


def make_prompts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, 120, size=n)
    return [" ".join(rng.choice(WORDS, size=int(k))) for k in lengths]


def run_ours(prompts: list[str], output_len: int, max_num_seqs: int) -> tuple[float, list[list[int]], float]:
    from jaxengine import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(dtype="float32", max_model_len=512, max_num_seqs=max_num_seqs, max_num_batched_tokens=1024)
    startup = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(make_prompts(4, seed=1), params, use_tqdm=False)  # warm-up (other prompts: no prefix-cache hits)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    return dt, [list(o.outputs[0].token_ids) for o in outs], startup


def run_transformers(prompts: list[str], output_len: int) -> tuple[float, list[list[int]]]:
    import torch
    import transformers

    from jaxengine.default_model import DEFAULT_MODEL_FILE, default_model_path

    path = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=DEFAULT_MODEL_FILE)
    tok.padding_side = "left"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=DEFAULT_MODEL_FILE, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    kw = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=tok.pad_token_id or 2)
    with torch.no_grad():
        warm = tok(make_prompts(4, seed=1), return_tensors="pt", padding=True)
        model.generate(**warm, **kw)
        batch = tok(prompts, return_tensors="pt", padding=True)
        t0 = time.perf_counter()
        out = model.generate(**batch, **kw)
        dt = time.perf_counter() - t0
    return dt, out[:, batch["input_ids"].shape[1]:].tolist()


def compare_outputs(ours: list[list[int]], ref: list[list[int]]) -> dict:
    """Greedy tokens of both engines, prompt by prompt: how many agree on every token, and where
    the others first differ (float32 on both sides; only summation order differs, so a near-tie
    can flip a late token)."""
    first_diff = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), None) for o, r in zip(ours, ref)]
    return {"identical": sum(d is None for d in first_diff), "prompts": len(ours),
            "first_divergence": sorted(d for d in first_diff if d is not None)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    prompts = make_prompts(args.num_prompts)
    ours_s, ours_ids, startup = run_ours(prompts, args.output_len, args.num_prompts)
    ref_s, ref_ids = run_transformers(prompts, args.output_len)
    ours_toks, ref_toks = sum(map(len, ours_ids)), sum(map(len, ref_ids))
    same = compare_outputs(ours_ids, ref_ids)

    import jax
    import torch
    import transformers
    result = {
        "benchmark": "cpu_smollm2_generate", "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized, float32)",
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor()},
        "versions": {"jax": jax.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
        "params": {"num_prompts": args.num_prompts, "output_len": args.output_len, "greedy": True,
                   "prompt_lengths": "4-120 words, seed 0"},
        "jaxengine": {"seconds": ours_s, "output_tokens": ours_toks, "output_tok_per_s": ours_toks / ours_s,
                      "startup_seconds": startup},
        "transformers": {"seconds": ref_s, "output_tokens": ref_toks, "output_tok_per_s": ref_toks / ref_s},
        "speedup": ref_s / ours_s,
        "greedy_outputs": same,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cpu_smollm2_vs_transformers.json"), "w") as f:
        json.dump(result, f, indent=2)
    table = ("| engine | seconds | output tokens | output tok/s |\n|---|---|---|---|\n"
             f"| jaxengine `LLM.generate` | {ours_s:.2f} | {ours_toks} | {ours_toks / ours_s:.1f} |\n"
             f"| transformers `generate` (batched) | {ref_s:.2f} | {ref_toks} | {ref_toks / ref_s:.1f} |\n\n"
             f"Speed-up: {ref_s / ours_s:.2f}x ({args.num_prompts} prompts, {args.output_len} new tokens, "
             f"float32, {os.cpu_count()} CPU cores; jax {jax.__version__}, torch {torch.__version__}).\n"
             f"Greedy outputs: {same['identical']}/{same['prompts']} prompts token-for-token identical"
             + (f"; the others first differ at new tokens {same['first_divergence']}" if same["first_divergence"] else "")
             + ".\n")
    with open(os.path.join(args.out, "cpu_smollm2_vs_transformers.md"), "w") as f:
        f.write(table)
    print(table)


if __name__ == "__main__":
    main()
