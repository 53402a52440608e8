"""Draft-model speculative decoding on the real SmolLM2-135M-Instruct (CPU): acceptance of a
self-speculative draft (the target's own first N layers, final norm and head: early exit
without training), batch-1 time against the target alone, outputs compared token for token.

The only real model on these machines is the embedded SmolLM2, so the draft is cut from it:
the GGUF is dequantized by transformers, the first N decoder layers are kept, and the result is
saved with `save_pretrained` beside the full model (both float32). Prompts: the n-gram run's
copy-heavy tasks (lab/spec_acceptance_cpu.py) and five open-ended chat prompts, greedy, batch 1.

    python -m lab.draft_acceptance_cpu --layers 10,16,22 --k 3 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from lab.spec_acceptance_cpu import TASKS

OPEN = [
    "Write a short poem about the sea.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me three tips for learning to cook.",
    "What is the capital of France, and what is it known for?",
    "Describe a typical day of a farmer in spring.",
]


def make_drafts(workdir: str, layers: list[int]) -> dict[int, str]:
    """The embedded model as an HF folder, and one folder per N with its first N layers."""
    import torch
    import transformers

    from jaxengine.default_model import default_model_path

    src = default_model_path()
    d, f = os.path.dirname(src), os.path.basename(src)
    out = {n: os.path.join(workdir, f"smollm2-first{n}") for n in layers}
    if all(os.path.exists(os.path.join(p, "config.json")) for p in out.values()):
        return out
    g = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    cfg = g.config
    if hasattr(cfg, "quantization_config"):  # dequantized weights: saved as plain float32
        del cfg.quantization_config
    state = g.state_dict()
    for n, path in out.items():
        c = transformers.AutoConfig.for_model(**{**cfg.to_dict(), "num_hidden_layers": n})
        m = transformers.AutoModelForCausalLM.from_config(c, dtype=torch.float32)
        m.load_state_dict({k: v for k, v in state.items() if k in m.state_dict()})
        m.save_pretrained(path)
        tok.save_pretrained(path)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--layers", default="10,16,22")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--workdir", default="/tmp/jaxengine_drafts")
    ap.add_argument("--commit", default="unknown")
    args = ap.parse_args()

    import jax

    from jaxengine import LLM, SamplingParams

    layers = [int(x) for x in args.layers.split(",")]
    drafts = make_drafts(args.workdir, layers)
    kw = dict(max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=256)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    prompts = {"copy": TASKS, "open": OPEN}
    res: dict = {"commit": args.commit, "jax": jax.__version__, "device": "CPU (2 cores)",
                 "target": "SmolLM2-135M-Instruct (embedded Q4_1 GGUF, float32), 30 layers",
                 "draft": "the target's first N layers + its final norm and tied head (no training)",
                 "k": args.k, "max_tokens": args.max_tokens, "engine": kw, "prompts": prompts, "runs": {}}

    def timed(llm) -> dict[str, tuple[list, float]]:
        out = {}
        for name, ps in prompts.items():
            outs, t = [], 0.0
            for p in ps:
                t0 = time.perf_counter()
                [o] = llm.chat([{"role": "user", "content": p}], params, use_tqdm=False)
                t += time.perf_counter() - t0
                outs.append(o.outputs[0].token_ids)
            out[name] = (outs, t)
        return out

    plain = LLM(**kw)
    timed(plain)  # warm-up
    base = timed(plain)
    res["runs"]["plain"] = {name: {"seconds": t, "tokens": sum(map(len, o))} for name, (o, t) in base.items()}
    print("plain:", {n: f"{t:.1f} s" for n, (_, t) in base.items()}, flush=True)
    del plain
    for n in layers:
        llm = LLM(**kw, speculative_config={"model": drafts[n], "num_speculative_tokens": args.k})
        llm.chat([{"role": "user", "content": OPEN[0]}], params, use_tqdm=False)  # warm-up
        core = llm.llm_engine.core
        run = {}
        for name in prompts:
            st = core.spec_stats
            before = (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens, list(st.accepted_per_pos))
            t0 = time.perf_counter()
            got = []
            for p in prompts[name]:
                [o] = llm.chat([{"role": "user", "content": p}], params, use_tqdm=False)
                got.append(o.outputs[0].token_ids)
            secs = time.perf_counter() - t0
            st = core.spec_stats
            drafted, draft_tokens, accepted = (st.num_drafts - before[0], st.num_draft_tokens - before[1],
                                               st.num_accepted_tokens - before[2])
            run[name] = {"seconds": secs, "speedup": base[name][1] / secs, "rows_with_drafts": drafted,
                         "draft_tokens": draft_tokens, "accepted_tokens": accepted,
                         "acceptance_rate": accepted / max(draft_tokens, 1),
                         "mean_accepted_length": 1 + accepted / max(drafted, 1),
                         "accepted_per_pos": [a - b for a, b in zip(st.accepted_per_pos, before[3])],
                         "outputs_equal_plain": got == base[name][0], "tokens": sum(map(len, got))}
            print(f"first {n} layers, {name}: acceptance {run[name]['acceptance_rate']:.2f}, mean accepted length "
                  f"{run[name]['mean_accepted_length']:.2f}, {secs:.1f} s ({run[name]['speedup']:.2f}x), "
                  f"equal {run[name]['outputs_equal_plain']}", flush=True)
        res["runs"][f"first{n}"] = run
        del llm
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "draft_model_smollm2_cpu.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
