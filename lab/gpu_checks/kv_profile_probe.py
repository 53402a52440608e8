"""What the KV-sizing profile costs at start-up and whether a cheaper compile gives the same
answer: jaxengine.model_runner.profile_step_bytes for the Llama-3-8B shape (dummy weights,
default flags) with XLA's defaults and with GEMM autotuning off, each timed, twice, in one
process.

    python -m lab.gpu_checks.kv_profile_probe [preset]
"""

from __future__ import annotations

import time


def main(model: str = "llama-3-8b") -> None:
    from jaxengine.device_memory import size_device_pool

    size_device_pool(0.9)
    import jax.numpy as jnp

    from jaxengine.attention_backend import select_attention_backend
    from jaxengine.config import EngineConfig
    from jaxengine.model_runner import profile_step_bytes
    from jaxengine.models.config import ModelConfig
    from jaxengine.models.loader import dummy_params
    from jaxengine.models.presets import PRESETS

    cfg = ModelConfig.from_hf_dict(PRESETS[model])
    import jax

    budget = 8192 if jax.default_backend() != "cpu" else 512  # the engine's default
    config = EngineConfig(model=model, load_format="dummy", dtype="bfloat16", max_model_len=8192,
                          max_num_batched_tokens=budget)
    graphdef, state = dummy_params(cfg, jnp.bfloat16)
    attention = select_attention_backend(config.attention_backend, cfg, jnp.bfloat16, config.block_size, None,
                                         config.kv_cache_dtype)
    print(f"max_num_batched_tokens {config.max_num_batched_tokens}, max_num_seqs {config.max_num_seqs}")
    for rep in range(2):
        for label, opts in (("default", None), ("autotune_level=0", {"xla_gpu_autotune_level": 0})):
            t0 = time.perf_counter()
            b = profile_step_bytes(config, cfg, graphdef, state, jnp.bfloat16, None, attention, opts)
            print(f"run {rep} {label}: {time.perf_counter() - t0:.2f} s, step peak {b / 2**30:.4f} GiB ({b} bytes)",
                  flush=True)


if __name__ == "__main__":
    import sys

    main(*sys.argv[1:])
