"""Does the KV-sizing profile need every layer? The profiled step bytes (model_runner.
profile_step_bytes: one step of the largest token bucket, beyond weights and KV) with the model's
own layer count against the same model cut to 1, 2 and 4 layers. If they agree, the cold start can
compile a cut program for the profile (seconds) instead of the whole one (issue #33).

    python -m lab.profile_layers_probe [--model llama-3-8b] [--max-num-batched-tokens 8192]

Run on the GPU for a figure that sizes a KV cache; the CPU reports XLA's CPU buffer assignment.
On this 2-core CPU (2026-11-26), smollm2-135m at 512 tokens: 562.1 / 576.8 / 606.3 / 989.0 MiB with
1 / 2 / 4 / 30 layers (compile 2.5 / 2.7 / 2.9 / 6.7 s). That grows by about twice a layer's
weights per layer, so the CPU's figure still counts the weight arguments once; on the H100 the same
function reported 1.85 GiB for Llama-3-8B at 8192 tokens (15 GiB of weights), so its accounting
differs there.

On the H100 (2026-11-26, llama-3-8b at 8192 tokens): 1875.3 / 1879.7 / 1880.2 / 1887.3 MiB with
1 / 2 / 4 / 32 layers (compile 11.4 / 6.0 / 6.8 / 10.3 s): the cut and the whole agree within
12 MiB. The engine then profiled a 2-layer cut plus a margin, and a cold start of
`jaxengine generate` measured in the same call took longer with it: kv_sizing 8.76 s against
12.86 s, but the warm-up that followed 50.53 s against 43.10 s (total 64.42 against 60.81 s). The
whole-model profile compiles the largest bucket's forward, and the warm-up's compile of that
bucket reuses its autotuning in the same process; the cut's compile leaves it nothing to reuse.
The cut was reverted."""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    args = ap.parse_args()

    from jaxengine.attention_backend import select_attention_backend
    from jaxengine.config import EngineConfig
    from jaxengine.model_runner import profile_step_bytes
    from jaxengine.models.config import ModelConfig
    from jaxengine.models.loader import abstract_model
    from jaxengine.models.presets import PRESETS

    full = ModelConfig.from_hf_dict(PRESETS[args.model]).with_max_model_len(2048)
    config = EngineConfig(max_model_len=2048, max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=256,
                          block_size=16)
    dtype = jnp.bfloat16
    for layers in sorted({1, 2, 4, full.num_layers}):
        mc = dataclasses.replace(full, num_layers=layers)
        graphdef, state = abstract_model(mc, dtype)
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), state)
        attention = select_attention_backend("auto", mc, dtype, config.block_size)
        t0 = time.perf_counter()
        b = profile_step_bytes(config, mc, graphdef, state, dtype, None, attention)
        print(f"{args.model} with {layers:>2} layers: profiled step {b / 2**20:9.1f} MiB "
              f"(compile {time.perf_counter() - t0:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
