"""Run in a subprocess with simulated CPU devices: greedy outputs of a batch mixing two LoRA adapters
and a row without one, at each tensor-parallel size given; prints one JSON line {tp: result}.

    python lora_tp_worker.py CHECKPOINT ADAPTER_1 ADAPTER_2 TP[,TP ...]
"""

import json
import sys

from jaxengine import LLM, SamplingParams
from jaxengine.lora import LoRARequest
from jaxengine import model_runner
from jaxengine.config import token_buckets

# Tensor parallelism is a GPU configuration: the GPU's token buckets (16 and up), without the CPU's
# one-row bucket, which every engine here would compile a second forward for (the batch's last rows
# finish alone), on simulated devices
model_runner.token_buckets = lambda n, platform="gpu": token_buckets(n)

path, a1, a2, sizes = sys.argv[1:5]
prompts = [{"prompt_token_ids": list(range(5 + i, 30 + 3 * i))} for i in range(3)]
loras = [None, LoRARequest("one", 1, a1), LoRARequest("two", 2, a2)]
out = {}
for tp in [int(s) for s in sizes.split(",")]:
    llm = LLM(path, tensor_parallel_size=tp, enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=128,
              max_num_seqs=4, max_num_batched_tokens=16, num_kv_blocks=64, compilation_cache_dir=None)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=5),
                        use_tqdm=False, lora_request=loras)
    r = llm.llm_engine.runner
    layer = r.lora_layers[0]
    out[tp] = {"tokens": [o.outputs[0].token_ids for o in outs],
               "top5": [[sorted(d) for d in o.outputs[0].logprobs] for o in outs],
               "specs": {k: list(v.sharding.spec) for k, v in layer.items()} if tp > 1 else {}}
    del llm
print(json.dumps(out))
