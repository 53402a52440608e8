"""Seconds to trace and to lower one forward bucket's program (no XLA compile), on the CPU: what
calling the decoder layers through one jitted function (models/layer_call.py) saves per program
at start-up. Builds the engine with dummy weights and no warm-up, then traces and lowers its
forward program the way ModelRunner._compile_forward does, three times.

    python -m lab.probes.trace_lower_probe [--model smollm2-135m] [--tokens 16]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp

    from jaxengine import LLM
    from jaxengine.benchmarks.gpu_suite import synthetic_tokenizer
    from jaxengine.model_runner import Layout, _abstract, _flat, _forward, abstract_inputs
    from jaxengine.models.presets import PRESETS

    vocab = PRESETS[args.model]["vocab_size"]
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", warmup=False, num_kv_blocks=64, max_num_seqs=16,
              max_model_len=512, max_num_batched_tokens=256, tokenizer=synthetic_tokenizer(tempfile.mkdtemp(), vocab))
    r = llm.llm_engine.runner
    t = args.tokens
    for i in range(3):
        layout = Layout.of(abstract_inputs(t, r.rows_for(t), r.config.max_blocks_per_seq))
        fn = jax.jit(_flat(_forward, r.graphdef, r.param_treedef, layout=layout, attention=r.attention, lora_rank=0),
                     donate_argnums=(1,), out_shardings=r._fwd_out)
        prev = jax.ShapeDtypeStruct((r.config.max_num_seqs,), jnp.int32, sharding=r._rep)
        a = [r._params_abs, _abstract(r.kv_caches), layout.abstract(r._rep), prev]
        t0 = time.perf_counter()
        traced = fn.trace(*a)
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
        text = lowered.as_text()
        print(f"{args.model} T={t} run {i}: trace {t1 - t0:.3f} s, lower {t2 - t1:.3f} s, "
              f"{len(text) / 1e6:.2f} MB of StableHLO, {text.count('func.func')} functions, "
              f"{text.count('call @')} calls", flush=True)


if __name__ == "__main__":
    main()
