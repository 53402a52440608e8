"""Engine-level check of the Mosaic GPU prefill kernel on a Hopper GPU.

The same dummy-weight model is run three times over the same prompts: attention_backend
"pallas" (Triton kernels), "pallas" again (does the path reproduce itself?), and
"pallas-mosaic". Greedy decoding with the top-5 log-probabilities at every position. With random
weights the logits are nearly flat over the vocabulary, so tiny numerical differences between
two kernels flip near-ties and the sequences part; the check is therefore the one of the tensor
parallel tests: at the first position where two runs differ, each run's token is in the other's
top-5, and the log-probabilities of the shared top-5 tokens agree closely.

    python lab/gpu_checks/gpu_mosaic_engine_check.py [PRESET] [--tensor-parallel-size N]
        (writes $OUT/mosaic_engine_check.json; with N > 1 the attention runs per device under
        shard_map, so the kernels see N times fewer heads)
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from jaxengine import LLM, SamplingParams


def _compare(a: dict, b: dict) -> dict:
    """Per prompt: equal sequences, first divergence, each token in the other's top-5 there."""
    rows = []
    for i in range(len(a["tokens"])):
        ta, tb = a["tokens"][i], b["tokens"][i]
        div = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        j = 0 if div is None else div  # positions up to div have the same prefix
        la, lb = a["top5"][i][j], b["top5"][i][j]
        common = set(la) & set(lb)
        rows.append({
            "equal": div is None, "first_divergence": div,
            "each_in_other_top5": div is None or (ta[div] in lb and tb[div] in la),
            "top5_overlap_at_divergence": len(common),
            "max_logprob_diff": max((abs(la[k] - lb[k]) for k in common), default=None)})
    n = len(rows)
    divs = [r["first_divergence"] for r in rows if r["first_divergence"] is not None]
    return {"prompts": n, "identical": sum(r["equal"] for r in rows),
            "first_token_equal": sum(r["first_divergence"] != 0 for r in rows),
            "each_in_other_top5": sum(r["each_in_other_top5"] for r in rows),
            "median_first_divergence": float(np.median(divs)) if divs else None,
            "max_logprob_diff": max((r["max_logprob_diff"] or 0.0) for r in rows),
            "rows": rows}


def main() -> None:
    rng = np.random.default_rng(0)
    lens = [1024, 700, 333, 64, 1500, 9] + [int(x) for x in rng.integers(16, 1600, size=42)]
    prompts = [{"prompt_token_ids": rng.integers(0, 32000, size=n).tolist()} for n in lens]
    sp = SamplingParams(max_tokens=24, temperature=0, logprobs=5, ignore_eos=True)
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="llama-3-8b")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    args = ap.parse_args()
    model, tp = args.model, args.tensor_parallel_size
    runs = {}
    for name, backend in (("triton", "pallas"), ("triton_again", "pallas"),
                          ("mosaic", "pallas-mosaic")):
        llm = LLM(model, load_format="dummy", dtype="bfloat16", max_model_len=2048,
                  max_num_seqs=32, max_num_batched_tokens=2048, num_kv_blocks=4096,
                  attention_backend=backend, tensor_parallel_size=tp)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        runs[name] = {"impl": llm.llm_engine.runner.attention_impl,
                      "tokens": [list(o.outputs[0].token_ids) for o in outs],
                      "top5": [[{int(k): float(v.logprob) for k, v in pos.items()}
                                for pos in o.outputs[0].logprobs] for o in outs]}
        del llm
    path = os.path.join(os.environ.get("OUT", "."), "mosaic_engine_check.json")
    with open(path, "w") as f:  # the raw runs first, should the comparison fail
        json.dump(runs, f)
    out = {"model": model, "tensor_parallel_size": tp, "prompt_lens": lens, "max_tokens": sp.max_tokens,
           "impls": {k: v["impl"] for k, v in runs.items()},
           "triton_vs_triton_again": _compare(runs["triton"], runs["triton_again"]),
           "triton_vs_mosaic": _compare(runs["triton"], runs["mosaic"]),
           "tokens": {k: v["tokens"] for k, v in runs.items()}}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print("\n| pair | prompts | identical | first token equal | each in other's top-5 at divergence "
          "| median first divergence | max |logprob diff| there |\n|---|---:|---:|---:|---:|---:|---:|")
    for pair in ("triton_vs_triton_again", "triton_vs_mosaic"):
        c = out[pair]
        print(f"| {pair} | {c['prompts']} | {c['identical']} | {c['first_token_equal']} | "
              f"{c['each_in_other_top5']} | {c['median_first_divergence']} | {c['max_logprob_diff']:.3f} |")


if __name__ == "__main__":
    main()
