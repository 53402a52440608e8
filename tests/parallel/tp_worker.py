"""Run in a subprocess with 4 simulated CPU devices: greedy outputs and parameter shardings at
TP = 1, 2, 4 for the checkpoint given as argv[1]; prints one JSON line."""

import sys, json
import jax
path = sys.argv[1]
from jaxengine import LLM, SamplingParams
from jaxengine.sharding import LOGICAL_AXES
from flax import nnx
res = {}
prompts = [{"prompt_token_ids": list(range(5 + i, 40 + 3 * i))} for i in range(4)]
for tp in (1, 2, 4):
    llm = LLM(path, tensor_parallel_size=tp, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
              num_kv_blocks=64, compilation_cache_dir=None)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5), use_tqdm=False)
    r = llm.llm_engine.runner
    bad = []
    if r.plan is not None:
        for p, v in nnx.to_flat_state(r.state):
            want = r.plan.spec(LOGICAL_AXES[str(p[-1])])
            got = v.get_value().sharding.spec
            if tuple(got) != tuple(want) and not (all(x is None for x in got) and all(x is None for x in want)):
                bad.append((".".join(map(str, p)), str(got), str(want)))
        kv = r.kv_caches[0][0].sharding.spec
    else:
        kv = None
    res[tp] = {"tokens": [o.outputs[0].token_ids for o in outs],
               "top5": [[sorted(d) for d in o.outputs[0].logprobs] for o in outs], "bad_shardings": bad, "kv_spec": str(kv)}
print(json.dumps(res))
