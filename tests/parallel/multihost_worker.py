"""One process of a (possibly multi-host) offline run: greedy outputs for fixed prompts, printed as
one JSON line by rank 0.

    python multihost_worker.py CHECKPOINT NUM_HOSTS RANK COORDINATOR
"""

import json
import sys

import jax

from jaxengine import distributed

path, num_hosts, rank, coordinator = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
distributed.initialize(distributed.MultiHostConfig(num_hosts, rank, coordinator))

from jaxengine import LLM, SamplingParams  # noqa: E402

from tests.parallel.multihost_common import ENGINE_KW, MAX_TOKENS, PROMPTS  # noqa: E402
from jaxengine import model_runner  # noqa: E402
from jaxengine.config import token_buckets  # noqa: E402

# A multi-host run is a GPU configuration: the GPU's token buckets (one, 16, as multihost_common
# says), without the CPU's one-row bucket, which would compile a second forward (the batch's last
# rows finish alone)
model_runner.token_buckets = lambda n, platform="gpu": token_buckets(n)

llm = LLM(path, tensor_parallel_size=jax.device_count(), **ENGINE_KW)
outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                    SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True), use_tqdm=False)
if distributed.is_leader():
    print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "texts": [o.outputs[0].text for o in outs],
                      "devices": jax.device_count(), "processes": jax.process_count()}))
