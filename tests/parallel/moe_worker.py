"""Run in a subprocess with simulated CPU devices: one MoE checkpoint loaded as the engine loads
it on one device, tensor parallel over 2 and expert parallel over 2 (the plan, the sharded load,
the attention backend over the mesh), then greedy decoding through the paged path without the
scheduler; prints one JSON line {mode: {"tokens", "logits", "specs"}}.

    python moe_worker.py CHECKPOINT
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.attention_backend import select_attention_backend
from jaxengine.models.checkpoint import open_checkpoint
from jaxengine.models.config import ModelConfig
from jaxengine.models.loader import load_params
from jaxengine.sharding import LOGICAL_AXES, make_plan
from tests.model_harness import PagedRunner

path = sys.argv[1]
ckpt = open_checkpoint(path)
base = ModelConfig.from_hf_dict(ckpt.hf_config)
prompt = [int(t) for t in np.random.default_rng(0).integers(3, base.vocab_size, size=21)]
out = {}
for mode in ("1", "2", "2ep"):
    cfg, put, mesh, plan = base, None, None, None
    if mode != "1":
        plan = make_plan(base, 2, expert_parallel=mode.endswith("ep"))
        cfg, mesh = plan.model_config(base), plan.mesh
        put = lambda p, arr, plan=plan: jax.device_put(arr, plan.param_sharding(p))  # noqa: E731
    graphdef, state = load_params(ckpt, cfg, jnp.float32, put=put)
    runner = PagedRunner(graphdef, state, cfg, attention=select_attention_backend("auto", cfg, jnp.float32, 16, mesh))
    toks, rows = list(prompt), []
    logits = runner.step([(0, toks, 0)])[0]  # prefill, then one token at a time
    for _ in range(8):
        rows.append(logits[-1].tolist())
        toks.append(int(np.argmax(logits[-1])))
        logits = runner.step([(0, toks, len(toks) - 1)])[0]
    bad = [] if plan is None else [".".join(map(str, p)) for p, v in nnx.to_flat_state(state)
                                   if v.get_value().sharding.spec != plan.spec(LOGICAL_AXES[str(p[-1])])]
    out[mode] = {"tokens": toks[len(prompt):], "logits": rows, "bad_shardings": bad,
                 "specs": {} if plan is None else {".".join(map(str, p)): str(v.get_value().sharding.spec)
                                                  for p, v in nnx.to_flat_state(state) if "experts" in str(p[-1])}}
print(json.dumps(out))
