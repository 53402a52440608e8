"""N-gram speculative decoding on the real SmolLM2-135M-Instruct (CPU): acceptance on prompts
whose answers copy their input (edit, fix, summarise a given text), and batch-1 speed with and
without speculation, for several draft lengths k.

Greedy, one prompt at a time (batch 1), the chat template, 160 new tokens at most. For each k:
drafts proposed, accepted, the mean accepted length (tokens a drafted step emits), the
distribution of accepted drafts per step, and the wall time against the same prompts without
speculation; the outputs must equal the unspeculated ones token for token.

    python -m lab.spec_acceptance_cpu --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

TEXT = ("The city council met on Tuesday to discuss the new park on Elm Street. After a long debate, "
        "the members agreed to plant two hundred trees, build a playground for children and open a small "
        "library near the north gate. The work will start in the spring and should be finished before the "
        "end of the year. The mayor said that the park will be free for everyone.")
CODE = ("def average(values):\n    total = 0\n    for v in values:\n        total = total + v\n"
        "    return total / len(values)\n\n\ndef largest(values):\n    best = values[0]\n    for v in values:\n"
        "        if v > best:\n            best = v\n    return best\n")
TASKS = [
    f"Fix the spelling mistakes in this text and write it out again in full:\n\n{TEXT.replace('the ', 'teh ', 3)}",
    f"Rewrite this text, replacing 'park' with 'garden' everywhere:\n\n{TEXT}",
    f"Add a docstring to each function and return the whole code:\n\n{CODE}",
    f"Summarise this text in two sentences, keeping its words where you can:\n\n{TEXT}",
    f"Copy this text and put each sentence on its own line:\n\n{TEXT}",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--ks", default="2,3,4,5")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--commit", default="unknown")
    args = ap.parse_args()

    import jax

    from jaxengine import LLM, SamplingParams

    kw = dict(max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=256)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    res: dict = {"commit": args.commit, "jax": jax.__version__, "device": "CPU (2 cores)",
                 "model": "SmolLM2-135M-Instruct (embedded Q4_1 GGUF, float32)", "max_tokens": args.max_tokens,
                 "engine": kw, "tasks": [t.split("\n")[0] for t in TASKS], "runs": {}}

    def timed(llm) -> tuple[list, float]:
        outs, t = [], 0.0
        for task in TASKS:
            t0 = time.perf_counter()
            [o] = llm.chat([{"role": "user", "content": task}], params, use_tqdm=False)
            t += time.perf_counter() - t0
            outs.append(o)
        return outs, t

    plain = LLM(**kw)
    timed(plain)  # warm-up
    base, base_s = timed(plain)
    res["runs"]["plain"] = {"seconds": base_s, "tokens": sum(len(o.outputs[0].token_ids) for o in base)}
    print(f"plain: {base_s:.1f} s for {res['runs']['plain']['tokens']} tokens", flush=True)
    del plain
    for k in [int(x) for x in args.ks.split(",")]:
        llm = LLM(**kw, speculative_config={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
                                            "prompt_lookup_min": 2})
        timed(llm)
        st0 = llm.llm_engine.core.spec_stats
        before = (st0.num_drafts, st0.num_draft_tokens, st0.num_accepted_tokens, list(st0.accepted_per_pos))
        outs, secs = timed(llm)
        st = llm.llm_engine.core.spec_stats
        drafts, draft_tokens, accepted = (st.num_drafts - before[0], st.num_draft_tokens - before[1],
                                          st.num_accepted_tokens - before[2])
        per_pos = [a - b for a, b in zip(st.accepted_per_pos, before[3])]
        same = all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs, base))
        run = {"k": k, "seconds": secs, "speedup": base_s / secs, "rows_with_drafts": drafts,
               "draft_tokens": draft_tokens, "accepted_tokens": accepted,
               "acceptance_rate": accepted / max(draft_tokens, 1), "mean_accepted_length": 1 + accepted / max(drafts, 1),
               "accepted_per_pos": per_pos, "outputs_equal_plain": same,
               "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}
        res["runs"][f"k{k}"] = run
        print(f"k={k}: {secs:.1f} s ({run['speedup']:.2f}x), acceptance {run['acceptance_rate']:.2f}, mean accepted "
              f"length {run['mean_accepted_length']:.2f}, per position {per_pos}, equal {same}", flush=True)
        del llm
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "spec_decode_smollm2_cpu.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
