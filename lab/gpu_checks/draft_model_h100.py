"""Draft-model speculative decoding on the GPU: Llama-3-8B shape target, Llama-3.2-1B shape draft
(dummy bf16 weights): what a speculative step costs with the draft's programs, what it gains at a
given acceptance, by batch size; and the throughput of 256/256 x N with the draft configured
against the target alone.

Random weights make the draft's tokens meaningless, so its programs run as they would (catch-up,
k draft decode steps) and the drafts it returns are then replaced (recorded as written, so the
catch-up does what it would for real drafts). Profiles:
- "draft": the draft's own tokens (random: nearly always rejected, the cost of failing);
- "oracle": the k recorded next tokens of a plain greedy run (every draft accepted: the ceiling);
- "measured": the recorded tokens, wrong after the first `a`, `a` drawn per step from the
  accepted-length distribution of a real pair measured on the CPU (--accepted-per-pos, --drafted);
- "rate<x>": the same with each draft accepted with probability x until the first rejection
  (--rates: an acceptance rate assumed, to draw the speed-up against acceptance).
For batch sizes (128-token random prompts, 128 greedy tokens): median step, output tok/s, speed-up
over the asynchronous engine without speculation, outputs equal to plain.

    python -m lab.gpu_checks.draft_model_h100 --out $OUT --k 3 --accepted-per-pos 80,60,45 --drafted 100
"""

from __future__ import annotations

import argparse
import gc
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
    ap.add_argument("--draft", default="llama-3.2-1b")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--accepted-per-pos", default="")
    ap.add_argument("--drafted", type=int, default=0)
    ap.add_argument("--rates", default="0.5,0.7,0.9")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--tp-len", type=int, default=256, help="input and output length of the throughput run")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--dtype", default="bfloat16", help="float32: logits without near-ties broken by rounding, so "
                                                          "recorded tokens verify as recorded (oracle, rate profiles)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    import jax

    from jaxengine import LLM, SamplingParams
    from jaxengine.benchmarks import ceilings
    from jaxengine.benchmarks.common import SampleRequest, random_requests
    from jaxengine.benchmarks.gpu_suite import synthetic_tokenizer
    from jaxengine.benchmarks.throughput import run_throughput
    from jaxengine.models.presets import PRESETS

    batches = [int(b) for b in args.batches.split(",")]
    rates = [f"rate{float(x)}" for x in args.rates.split(",") if x]
    k = args.k
    res: dict = {"commit": args.commit, "jax": jax.__version__, "device": jax.devices()[0].device_kind,
                 "target": f"{args.model} (dummy {args.dtype})", "draft": f"{args.draft} (dummy {args.dtype})", "k": k,
                 "output_len": args.output_len, "batches": batches}
    path = os.path.join(args.out, f"draft_model_{args.dtype}.json")

    def save() -> None:
        with open(path, "w") as fh:
            json.dump(res, fh, indent=1)

    res["ceilings"] = ceilings.measure() if jax.default_backend() == "gpu" else None
    vocab = PRESETS[args.model]["vocab_size"]
    tok = synthetic_tokenizer("/tmp/draft_tok", vocab)
    tp: dict = {}
    if not args.skip_throughput:  # the target alone first, in its own engine (all the memory is its)
        n = args.tp_len
        reqs = random_requests(args.num_prompts, n, n, 0.0, vocab, seed=100)
        warm = [SampleRequest(q.prompt_token_ids, 16) for q in random_requests(64, n, n, 0.0, vocab, seed=20_000)]
        plain_llm = LLM(args.model, load_format="dummy", tokenizer=tok)
        tp["num_kv_blocks_plain"] = plain_llm.llm_engine.config.num_kv_blocks
        run_throughput(plain_llm, warm)
        tp["plain"] = run_throughput(plain_llm, reqs)["output_tokens_per_s"]
        print(f"{args.tp_len}/{args.tp_len} x {args.num_prompts} without a draft: {tp['plain']:,.0f} output tok/s", flush=True)
        del plain_llm
        gc.collect()
    t0 = time.perf_counter()
    llm = LLM(args.model, load_format="dummy", tokenizer=tok, dtype=args.dtype,
              speculative_config={"model": args.draft, "num_speculative_tokens": k,
                                  "disable_by_batch_size": max(batches)})
    eng = llm.llm_engine
    core, draft = eng.core, eng.runner.draft
    spec_config = core.spec
    res.update({"startup_s": time.perf_counter() - t0, "compile_s": eng.runner.compile_seconds,
                "num_kv_blocks_with_draft": eng.config.num_kv_blocks, "attention": eng.runner.attention_impl})
    print(f"start-up {res['startup_s']:.1f} s, {eng.config.num_kv_blocks} KV blocks with the draft", flush=True)

    per_pos = [int(x) for x in args.accepted_per_pos.split(",")] if args.accepted_per_pos else []
    dist = None
    if per_pos and args.drafted:
        reach = [args.drafted] + per_pos
        dist = np.array([(reach[j] - (reach[j + 1] if j + 1 < len(reach) else 0)) / args.drafted
                         for j in range(len(reach))])
        dist = dist[: k + 1] / dist[: k + 1].sum()
        res["accepted_length_distribution"] = dist.tolist()

    rng = np.random.default_rng(0)
    record: dict[tuple, list[int]] = {}
    profile = {"name": "draft"}
    real_propose = draft.propose

    propose_s: list[float] = []

    def propose(rows):
        t0 = time.perf_counter()
        out = real_propose(rows)  # the draft's programs run as they would (and are waited for)
        propose_s.append(time.perf_counter() - t0)
        if profile["name"] == "draft":
            return out
        new = []
        for (req, n, _), d in zip(rows, out):
            rec = record.get(tuple(req.prompt_token_ids[:PROMPT_LEN]))
            if rec is None:
                new.append(d)
                continue
            done = len(req.output_token_ids)
            true = list(rec[done: done + n])
            if profile["name"] != "oracle":
                if profile["name"] == "measured":
                    a = int(rng.choice(len(dist), p=dist))
                else:  # rate<x>: each draft accepted with probability x, up to the first rejection
                    x, a = float(profile["name"][4:]), 0
                    while a < n and rng.random() < x:
                        a += 1
                if a < len(true):
                    true = true[:a] + [(true[a] + 1) % vocab] + true[a + 1:]
            true = (true + d)[:n]
            req.draft_written = true[:-1]  # as if the draft had written these
            new.append(true)
        return new

    draft.propose = propose

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
        core.spec = None
        run(prompts)  # warm-up
        plain = run(prompts)
        record.update(plain["outs"])
        row = {"plain": {k_: v for k_, v in plain.items() if k_ != "outs"}}
        core.spec = spec_config
        names = ["draft", "oracle"] + (["measured"] if dist is not None else []) + rates
        for name in names:
            profile["name"] = name
            st = core.spec_stats
            before = (st.num_drafts, st.num_accepted_tokens)
            propose_s.clear()
            x = run(prompts)
            drafts = st.num_drafts - before[0]
            row[name] = {k_: v for k_, v in x.items() if k_ != "outs"}
            row[name]["propose_ms_median"] = 1e3 * statistics.median(propose_s) if propose_s else None
            row[name].update(speedup=x["tok_s"] / plain["tok_s"],
                             outputs_equal_plain=all(x["outs"][p] == plain["outs"][p] for p in plain["outs"]),
                             mean_accepted_length=1 + (st.num_accepted_tokens - before[1]) / max(drafts, 1))
        table[b] = row
        res["by_batch"] = table
        save()
        print(f"batch {b}: plain {plain['tok_s']:.0f} tok/s ({plain['step_ms_median']:.2f} ms/step); "
              + "; ".join(f"{n} {row[n]['speedup']:.2f}x (L {row[n]['mean_accepted_length']:.2f}, "
                          f"{row[n]['step_ms_median']:.2f} ms/step, propose {row[n]['propose_ms_median']:.2f} ms, "
                          f"equal {row[n]['outputs_equal_plain']})"
                          for n in names), flush=True)
    draft.propose = real_propose

    if not args.skip_throughput:
        tp["draft_configured"] = None
        # the defaults a user gets (the verify programs were compiled for disable_by_batch_size = max(batches))
        core.spec = spec_config.__class__(model=args.draft, method="draft_model", num_speculative_tokens=k,
                                          disable_by_batch_size=spec_config.disable_by_batch_size)
        run_throughput(llm, warm)
        tp["draft_configured"] = run_throughput(llm, reqs)["output_tokens_per_s"]
        tp["catch_up_tokens"] = draft.num_catch_up_tokens
        tp["loss"] = 1 - tp["draft_configured"] / tp["plain"]
        res[f"throughput_{args.tp_len}x{args.tp_len}"] = tp
        save()
        print(f"{args.tp_len}/{args.tp_len} x {args.num_prompts}: plain {tp['plain']:,.0f}, draft configured {tp['draft_configured']:,.0f} "
              f"output tok/s (loss {tp['loss']:.1%})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
