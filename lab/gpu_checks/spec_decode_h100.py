"""Speculative decoding on the GPU (Llama-3-8B shape, dummy bf16 weights): what a speculative step
costs and what it gains at a given acceptance, by batch size; and the throughput cost of having
speculation enabled at batch 256.

Dummy weights make real drafts meaningless, so the drafts are replayed: a plain greedy run
records each prompt's output first (greedy verification reproduces it), then the proposer is
replaced by one that drafts from that record. Three profiles:
- "oracle": the k recorded next tokens (every draft accepted: the ceiling);
- "none": k random tokens (every draft rejected: the cost of failing);
- "measured": the recorded tokens, with the draft after the first `a` replaced by a wrong one,
  `a` drawn per step from the accepted-length distribution measured on the real SmolLM2 on
  copy-heavy prompts (benchmarks/results/spec_decode_smollm2_cpu.json, --accepted-per-pos);
- "empty": no drafts at all (speculation on, nothing proposed: what the synchronous steps cost).
For batch sizes 1..32 (128-token random prompts, 128 greedy tokens): the median step and the
output tokens per second, plain (speculation off: the asynchronous engine) and per profile.
Then 1000 random 256/256 prompts at temperature 1, with speculation configured and without.

    python -m lab.gpu_checks.spec_decode_h100 --out $OUT --k 4 --accepted-per-pos 120,90,70,50 --drafted 150
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

PROMPT_LEN = 128


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--accepted-per-pos", default="", help="accepted drafts by position, from the CPU run")
    ap.add_argument("--drafted", type=int, default=0, help="rows with drafts in the CPU run")
    ap.add_argument("--batches", default="1,2,4,8,16,32")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--dtype", default="bfloat16", help="float32: logits without near-ties broken by rounding, so "
                                                          "replayed drafts verify as recorded")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    import jax

    import jaxengine.engine_core as engine_core
    from jaxengine import LLM, SamplingParams
    from jaxengine.benchmarks import ceilings
    from jaxengine.benchmarks.common import SampleRequest, random_requests
    from jaxengine.benchmarks.gpu_suite import synthetic_tokenizer
    from jaxengine.benchmarks.throughput import run_throughput
    from jaxengine.models.presets import PRESETS

    batches = [int(b) for b in args.batches.split(",")]
    k = args.k
    res: dict = {"commit": args.commit, "jax": jax.__version__, "device": jax.devices()[0].device_kind,
                 "model": f"{args.model} (dummy {args.dtype})", "k": k, "output_len": args.output_len, "batches": batches}
    path = os.path.join(args.out, "spec_decode.json")

    def save() -> None:
        with open(path, "w") as fh:
            json.dump(res, fh, indent=1)

    res["ceilings"] = ceilings.measure() if jax.default_backend() == "gpu" else None
    vocab = PRESETS[args.model]["vocab_size"]
    tmp = "/tmp/spec_tok"
    t0 = time.perf_counter()
    llm = LLM(args.model, load_format="dummy", dtype=args.dtype, tokenizer=synthetic_tokenizer(tmp, vocab),
              speculative_config={"method": "ngram", "num_speculative_tokens": k,
                                  "disable_by_batch_size": max(batches)})
    eng = llm.llm_engine
    core = eng.core
    spec_config = core.spec
    res.update({"startup_s": time.perf_counter() - t0, "compile_s": eng.runner.compile_seconds,
                "num_kv_blocks": eng.config.num_kv_blocks, "attention": eng.runner.attention_impl})
    print(f"start-up {res['startup_s']:.1f} s", flush=True)

    # the accepted-length distribution of the CPU run: P(a = j) from accepted-per-position counts
    per_pos = [int(x) for x in args.accepted_per_pos.split(",")] if args.accepted_per_pos else []
    dist = None
    if per_pos and args.drafted:
        reach = [args.drafted] + per_pos  # rows whose drafts reached position j
        dist = np.array([(reach[j] - (reach[j + 1] if j + 1 < len(reach) else 0)) / args.drafted
                         for j in range(len(reach))])
        dist = dist[: k + 1] / dist[: k + 1].sum()
        res["accepted_length_distribution"] = dist.tolist()

    rng = np.random.default_rng(0)
    record: dict[tuple, list[int]] = {}
    profile = {"name": "oracle"}
    orig = engine_core.ngram_propose

    def replay(tokens, kk, min_n, max_n):
        rec = record.get(tuple(tokens[:PROMPT_LEN]))
        if rec is None:
            return []
        done = len(tokens) - PROMPT_LEN
        true = rec[done: done + kk]
        if profile["name"] == "oracle":
            return true
        if profile["name"] == "empty":
            return []
        if profile["name"] == "none":
            return [int(t) for t in rng.integers(3, vocab, kk)]
        a = int(rng.choice(len(dist), p=dist))
        out = list(true[:a])
        if a < len(true):
            out.append((true[a] + 1) % vocab)  # a wrong draft ends the accepted run
        return out

    engine_core.ngram_propose = replay

    def run(prompts) -> dict:
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        for i, p in enumerate(prompts):
            eng.add_request(f"r{time.perf_counter_ns()}-{i}", {"prompt_token_ids": p}, params)
        steps, outs = [], {}
        while eng.has_unfinished_requests():
            t0 = time.perf_counter()
            got = eng.step()
            steps.append(time.perf_counter() - t0)
            for o in got:
                if o.finished:
                    outs[tuple(o.prompt_token_ids)] = o.outputs[0].token_ids
        elapsed = sum(steps)
        n_tokens = sum(len(v) for v in outs.values())
        return {"outs": outs, "elapsed_s": elapsed, "tok_s": n_tokens / elapsed,
                "step_ms_median": 1e3 * statistics.median(steps), "steps": len(steps)}

    table = {}
    for b in batches:
        prompts = [rng.integers(3, vocab, PROMPT_LEN).tolist() for _ in range(b)]
        core.spec = None  # plain: the asynchronous engine
        run(prompts)  # warm-up
        plain = run(prompts)
        record.update(plain["outs"])
        row = {"plain": {k_: v for k_, v in plain.items() if k_ != "outs"}}
        core.spec = spec_config
        for name in ("oracle", "none", "measured", "empty"):
            if name == "measured" and dist is None:
                continue
            profile["name"] = name
            st = core.spec_stats
            before = (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens)
            x = run(prompts)
            same = all(x["outs"][p] == plain["outs"][p] for p in plain["outs"])
            drafts = st.num_drafts - before[0]
            row[name] = {k_: v for k_, v in x.items() if k_ != "outs"}
            row[name].update(speedup=x["tok_s"] / plain["tok_s"], outputs_equal_plain=same,
                             mean_accepted_length=1 + (st.num_accepted_tokens - before[2]) / max(drafts, 1))
        table[b] = row
        res["by_batch"] = table
        save()
        print(f"batch {b}: plain {plain['tok_s']:.0f} tok/s ({plain['step_ms_median']:.2f} ms/step); "
              + "; ".join(f"{n} {row[n]['speedup']:.2f}x (L {row[n]['mean_accepted_length']:.2f}, "
                          f"{row[n]['step_ms_median']:.2f} ms/step, equal {row[n]['outputs_equal_plain']})"
                          for n in ("oracle", "none", "measured", "empty") if n in row), flush=True)
    engine_core.ngram_propose = orig

    if not args.skip_throughput:
        reqs = random_requests(args.num_prompts, 256, 256, 0.0, vocab, seed=100)
        warm = [SampleRequest(q.prompt_token_ids, 16) for q in random_requests(64, 256, 256, 0.0, vocab, seed=20_000)]
        tp = {}
        for name, cfg in (("off", None), ("ngram_default", spec_config.__class__(num_speculative_tokens=k)),
                          ("off_again", None)):
            core.spec = cfg
            run_throughput(llm, warm)
            tr = run_throughput(llm, reqs)
            tp[name] = tr["output_tokens_per_s"]
            print(f"256/256 x {args.num_prompts}, speculation {name}: {tr['output_tokens_per_s']:,.0f} output tok/s",
                  flush=True)
        tp["loss"] = 1 - tp["ngram_default"] / ((tp["off"] + tp["off_again"]) / 2)
        res["throughput_256x256"] = tp
        save()
        print(f"throughput loss with speculation enabled: {tp['loss']:.1%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
