"""Run in a subprocess with simulated CPU devices: greedy outputs and parameter shardings at each
tensor-parallel size given, for each checkpoint given; prints one JSON line
{checkpoint: {tp: result}}. One process serves every checkpoint, so the interpreter, JAX and the
tokenizer start once. The KV-sizing profile's step bytes are measured only for checkpoints run at
TP=1 too (None otherwise).

    python tp_worker.py CHECKPOINT TP[,TP ...] [CHECKPOINT TP[,TP ...] ...]
"""

import json
import sys

from flax import nnx

from jaxengine import LLM, SamplingParams
from jaxengine.model_runner import profile_step_bytes
from jaxengine.sharding import LOGICAL_AXES
from jaxengine import model_runner
from jaxengine.config import token_buckets

# Tensor parallelism is a GPU configuration: the GPU's token buckets (16 and up), without the CPU's
# one-row bucket, which every engine here would compile a second forward for (the batch's last rows
# finish alone), on simulated devices
model_runner.token_buckets = lambda n, platform="gpu": token_buckets(n)

args = sys.argv[1:]
assert args and len(args) % 2 == 0, __doc__
jobs = [(args[i], [int(s) for s in args[i + 1].split(",")]) for i in range(0, len(args), 2)]
prompts = [{"prompt_token_ids": list(range(5 + i, 40 + 3 * i))} for i in range(4)]
out = {}
for path, sizes in jobs:
    res = out[path] = {}
    for tp in sizes:
        # one token bucket (16): prompts of 35-41 tokens are prefilled in chunks, mixed with decodes
        llm = LLM(path, tensor_parallel_size=tp, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16,
                  num_kv_blocks=64, compilation_cache_dir=None)
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5),
                            use_tqdm=False)
        r = llm.llm_engine.runner
        bad, kv = [], None
        if r.plan is not None:
            for p, v in nnx.to_flat_state(r.state):
                want = r.plan.spec(LOGICAL_AXES[str(p[-1])])
                got = v.get_value().sharding.spec
                if tuple(got) != tuple(want) and not (all(x is None for x in got) and all(x is None for x in want)):
                    bad.append((".".join(map(str, p)), str(got), str(want)))
            kv = r.kv_caches[0][0].sharding.spec
        res[tp] = {"tokens": [o.outputs[0].token_ids for o in outs],
                   "top5": [[sorted(d) for d in o.outputs[0].logprobs] for o in outs], "bad_shardings": bad,
                   "kv_spec": str(kv), "kv_heads": llm.llm_engine.model_config.num_kv_heads,
                   "kv_shard_heads": r.kv_caches[0][0].addressable_shards[0].data.shape[1],
                   # the KV-sizing profile (one more compile of the step): only where a TP=1 run
                   # of the checkpoint gives it something to be compared with
                   "step_bytes": profile_step_bytes(r.config, r.model_config, r.graphdef, r.state, r.dtype, r.plan,
                                                   r.attention) if 1 in sizes else None}
        del llm
print(json.dumps(out))
