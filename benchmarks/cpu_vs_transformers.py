"""CPU benchmark: `LLM.generate` against transformers on the real SmolLM2, float32, greedy, in one process.

Three figures (`--modes`, all by default):
  batch32  the same prompts (32, mixed lengths), 64 new tokens each (eos ignored), against
           transformers' batched `generate`; the tokens of both are compared prompt by prompt.
  batch1   one short prompt, 64 new tokens, `LLM()` with its defaults (max_model_len 8192) against
           transformers' `generate` at batch 1: decode tok/s of each.
  long     a ~7,000-token prompt (token ids, so both read the same ones): the engine's time to the
           first token (`generate` with max_tokens=1) against one transformers forward over it.
Compilation is done before timing; every side gets an untimed warm-up on other prompts of the same
shape (so the engine's prefix cache holds nothing of the timed prompts), and the engine's compiles
during the timed runs are counted (expected 0). Each figure records the load average beside it.
Writes JSON + Markdown to benchmarks/results/.

    python benchmarks/cpu_vs_transformers.py [--modes batch32,batch1,long] [--num-prompts 32]
        [--output-len 64] [--long-len 7000]
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


def _load() -> str:
    return "load average %.2f %.2f %.2f" % os.getloadavg()


def _compiles() -> int:
    from jaxengine.compile_monitor import compile_count
    return compile_count()


def run_ours(prompts: list[str], output_len: int, max_num_seqs: int) -> tuple[float, list[list[int]], float, dict]:
    from jaxengine import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(dtype="float32", max_model_len=512, max_num_seqs=max_num_seqs, max_num_batched_tokens=1024)
    startup = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    # Warm-up on other tokens (no prefix-cache hits) in prompts of the timed ones' lengths: the same
    # schedule, so the same token buckets are compiled.
    lens = [len(llm.llm_engine.tokenize(p)) for p in prompts]
    pool = [t for p in make_prompts(4 * len(prompts), seed=1) for t in llm.llm_engine.tokenize(p)]
    starts = np.cumsum([0] + lens[:-1])
    assert len(pool) >= sum(lens)
    warm = [{"prompt_token_ids": pool[s:s + n]} for s, n in zip(starts, lens)]
    llm.generate(warm, params, use_tqdm=False)
    c0, load = _compiles(), _load()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    info = {"compiles_timed": _compiles() - c0, "load": load}
    del llm
    return dt, [list(o.outputs[0].token_ids) for o in outs], startup, info


def _hf_model():
    import torch
    import transformers

    from jaxengine.default_model import DEFAULT_MODEL_FILE, default_model_path

    path = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=DEFAULT_MODEL_FILE)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=DEFAULT_MODEL_FILE, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return tok, model


def run_transformers(prompts: list[str], output_len: int) -> tuple[float, list[list[int]], str]:
    import torch

    tok, model = _hf_model()
    tok.padding_side = "left"
    kw = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=tok.pad_token_id or 2)
    with torch.no_grad():
        warm = tok(make_prompts(4, seed=1), return_tensors="pt", padding=True)
        model.generate(**warm, **kw)
        batch = tok(prompts, return_tensors="pt", padding=True)
        load = _load()
        t0 = time.perf_counter()
        out = model.generate(**batch, **kw)
        dt = time.perf_counter() - t0
    return dt, out[:, batch["input_ids"].shape[1]:].tolist(), load


def long_prompt_ids(n: int, seed: int) -> list[int]:
    """n token ids of word soup (the tokenizer's ids of random words, cut to n)."""
    from jaxengine.default_model import DEFAULT_MODEL_FILE, default_model_path
    import transformers

    path = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=DEFAULT_MODEL_FILE)
    rng = np.random.default_rng(seed)
    ids = tok(" ".join(rng.choice(WORDS, size=n)))["input_ids"]
    assert len(ids) >= n
    return ids[:n]


def run_ours_default(short_prompt: str, output_len: int, long_ids: list[int] | None) -> dict:
    """`LLM()` with its defaults (float32): batch-1 decode of one short prompt, and the time to the
    first token of a long prompt (warmed up on a 1024-token prompt: same token bucket)."""
    from jaxengine import LLM, SamplingParams

    llm = LLM(dtype="float32")
    eng = llm.llm_engine
    res = {"max_model_len": eng.config.max_model_len, "max_num_batched_tokens": eng.config.max_num_batched_tokens,
           "num_kv_blocks": eng.config.num_kv_blocks, "token_buckets": list(eng.runner.token_buckets),
           "attention": eng.runner.attention_impl}
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(make_prompts(1, seed=3), params, use_tqdm=False)  # warm-up
    c0, load = _compiles(), _load()
    t0 = time.perf_counter()
    out = llm.generate([short_prompt], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    res["batch1"] = {"seconds": dt, "tokens": len(out[0].outputs[0].token_ids), "token_ids": list(out[0].outputs[0].token_ids),
                     "prompt_tokens": len(out[0].prompt_token_ids), "compiles_timed": _compiles() - c0, "load": load}
    if long_ids is not None:
        one = SamplingParams(temperature=0, max_tokens=1)
        warm = long_prompt_ids(1024, seed=5)
        llm.generate([{"prompt_token_ids": warm}], one, use_tqdm=False)
        c0, load = _compiles(), _load()
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": long_ids}], one, use_tqdm=False)
        dt = time.perf_counter() - t0
        res["long"] = {"seconds": dt, "first_token": out[0].outputs[0].token_ids[0], "compiles_timed": _compiles() - c0,
                       "load": load}
    del llm
    return res


def run_transformers_default(short_prompt: str, output_len: int, long_ids: list[int] | None) -> dict:
    import torch

    tok, model = _hf_model()
    kw = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=tok.pad_token_id or 2)
    res = {}
    with torch.no_grad():
        model.generate(**tok(make_prompts(1, seed=3), return_tensors="pt"), **kw)  # warm-up
        batch = tok([short_prompt], return_tensors="pt")
        load = _load()
        t0 = time.perf_counter()
        out = model.generate(**batch, **kw)
        dt = time.perf_counter() - t0
        ids = out[0, batch["input_ids"].shape[1]:].tolist()
        res["batch1"] = {"seconds": dt, "tokens": len(ids), "token_ids": ids, "load": load}
        if long_ids is not None:
            model(torch.tensor([long_prompt_ids(1024, seed=5)]))  # warm-up
            x = torch.tensor([long_ids])
            load = _load()
            t0 = time.perf_counter()
            logits = model(x).logits[0, -1]
            dt = time.perf_counter() - t0
            res["long"] = {"seconds": dt, "first_token": int(logits.argmax()), "load": load}
    return res


def compare_outputs(ours: list[list[int]], ref: list[list[int]]) -> dict:
    """Greedy tokens of both engines, prompt by prompt: how many agree on every token, and where
    the others first differ (float32 on both sides; only summation order differs, so a near-tie
    can flip a late token)."""
    first_diff = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), None) for o, r in zip(ours, ref)]
    return {"identical": sum(d is None for d in first_diff), "prompts": len(ours),
            "first_divergence": sorted(d for d in first_diff if d is not None)}


def _verdict(met: bool, what: str) -> str:
    return f"Target ({what}): **{'met' if met else 'not met'}.**"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="batch32,batch1,long")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--long-len", type=int, default=7000)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    modes = set(args.modes.split(","))
    import jax
    import torch
    import transformers
    result = {
        "benchmark": "cpu_smollm2_generate", "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized, float32)",
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor(),
                    "cpu": _cpu_name()},
        "versions": {"jax": jax.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
        "commit": _commit(),
    }
    md = []
    env = (f"float32, {os.cpu_count()} CPU cores ({result['machine']['cpu']}); jax {jax.__version__}, "
           f"torch {torch.__version__}, transformers {transformers.__version__}; commit {result['commit']}")
    if "batch32" in modes:
        prompts = make_prompts(args.num_prompts)
        ours_s, ours_ids, startup, info = run_ours(prompts, args.output_len, args.num_prompts)
        ref_s, ref_ids, ref_load = run_transformers(prompts, args.output_len)
        ours_toks, ref_toks = sum(map(len, ours_ids)), sum(map(len, ref_ids))
        same = compare_outputs(ours_ids, ref_ids)
        result["batch32"] = {
            "params": {"num_prompts": args.num_prompts, "output_len": args.output_len, "greedy": True,
                       "prompt_lengths": "4-120 words, seed 0",
                       "engine": "max_model_len=512, max_num_seqs=num_prompts, max_num_batched_tokens=1024"},
            "jaxengine": {"seconds": ours_s, "output_tokens": ours_toks, "output_tok_per_s": ours_toks / ours_s,
                          "startup_seconds": startup, **info},
            "transformers": {"seconds": ref_s, "output_tokens": ref_toks, "output_tok_per_s": ref_toks / ref_s,
                             "load": ref_load},
            "speedup": ref_s / ours_s, "greedy_outputs": same}
        md.append(
            f"## {args.num_prompts} prompts x {args.output_len} new tokens\n\n"
            "| engine | seconds | output tokens | output tok/s |\n|---|---|---|---|\n"
            f"| jaxengine `LLM.generate` | {ours_s:.2f} | {ours_toks} | {ours_toks / ours_s:.1f} |\n"
            f"| transformers `generate` (batched) | {ref_s:.2f} | {ref_toks} | {ref_toks / ref_s:.1f} |\n\n"
            f"Speed-up: {ref_s / ours_s:.2f}x ({args.num_prompts} prompts of 4-120 words, {args.output_len} new "
            f"tokens, eos ignored). Engine compiles during the timed run: {info['compiles_timed']}. "
            f"Greedy outputs: {same['identical']}/{same['prompts']} prompts token-for-token identical"
            + (f"; the others first differ at new tokens {same['first_divergence']}" if same["first_divergence"] else "")
            + f". ({info['load']} before ours, {ref_load} before transformers.)\n\n"
            + _verdict(ref_s / ours_s > 1, "above 1x") + "\n")
    if modes & {"batch1", "long"}:
        short = make_prompts(1, seed=2)[0]
        long_ids = long_prompt_ids(args.long_len, seed=4) if "long" in modes else None
        ours = run_ours_default(short, args.output_len, long_ids)
        ref = run_transformers_default(short, args.output_len, long_ids)
        b_o, b_r = ours.pop("batch1"), ref["batch1"]
        same = compare_outputs([b_o.pop("token_ids")], [b_r.pop("token_ids")])
        o_tps, r_tps = b_o["tokens"] / b_o["seconds"], b_r["tokens"] / b_r["seconds"]
        result["engine_defaults"] = {k: v for k, v in ours.items() if k != "long"}
        result["batch1"] = {"params": {"prompt_tokens": b_o["prompt_tokens"], "output_len": args.output_len,
                                       "engine": "LLM(dtype='float32'), its defaults otherwise"},
                            "jaxengine": {**b_o, "output_tok_per_s": o_tps},
                            "transformers": {**b_r, "output_tok_per_s": r_tps},
                            "ratio": o_tps / r_tps, "greedy_outputs": same}
        d = result["engine_defaults"]
        md.append(
            f"## Batch 1: one prompt ({b_o['prompt_tokens']} tokens), {args.output_len} new tokens\n\n"
            "| engine | seconds | tok/s |\n|---|---|---|\n"
            f"| jaxengine `LLM(dtype=\"float32\").generate` | {b_o['seconds']:.2f} | {o_tps:.1f} |\n"
            f"| transformers `generate` | {b_r['seconds']:.2f} | {r_tps:.1f} |\n\n"
            f"Ratio: {o_tps / r_tps:.2f}x. Engine defaults on this CPU: max_model_len {d['max_model_len']}, "
            f"max_num_batched_tokens {d['max_num_batched_tokens']}, {d['num_kv_blocks']} KV blocks, token buckets "
            f"{d['token_buckets']}, attention {d['attention']}. Engine compiles during the timed run: "
            f"{b_o['compiles_timed']}. Greedy tokens identical: {'yes' if same['identical'] else 'no'}. "
            f"({b_o['load']} before ours, {b_r['load']} before transformers.)\n\n"
            + _verdict(o_tps >= r_tps, "at least transformers' tok/s") + "\n")
        if long_ids is not None:
            l_o, l_r = ours["long"], ref["long"]
            result["long_prompt"] = {"params": {"prompt_tokens": len(long_ids)}, "jaxengine": l_o, "transformers": l_r,
                                     "ratio": l_o["seconds"] / l_r["seconds"]}
            md.append(
                f"## Long prompt: {len(long_ids)} tokens, time to the first token\n\n"
                "| engine | seconds | first token |\n|---|---|---|\n"
                f"| jaxengine `generate` (max_tokens=1) | {l_o['seconds']:.2f} | {l_o['first_token']} |\n"
                f"| transformers, one forward | {l_r['seconds']:.2f} | {l_r['first_token']} |\n\n"
                f"Ratio: {l_o['seconds'] / l_r['seconds']:.2f}x transformers' time. Engine compiles during the timed "
                f"run: {l_o['compiles_timed']}. ({l_o['load']} before ours, {l_r['load']} before transformers.)\n\n"
                + _verdict(l_o["seconds"] <= 1.5 * l_r["seconds"], "at most 1.5x transformers' forward") + "\n")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cpu_smollm2_vs_transformers.json"), "w") as f:
        json.dump(result, f, indent=2)
    text = f"# SmolLM2-135M-Instruct on the CPU: jaxengine against transformers\n\n{env}.\n\n" + "\n".join(md)
    with open(os.path.join(args.out, "cpu_smollm2_vs_transformers.md"), "w") as f:
        f.write(text)
    print(text)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def _commit() -> str:
    import subprocess
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
