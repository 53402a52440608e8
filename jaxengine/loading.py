"""Start-up: from an `EngineConfig` to a model on the device and a KV-cache size.

`load_model` opens the model (an HF folder, a GGUF file, a hub id, or a preset shape with dummy
weights), completes the config from it (context length, token budget), places the weights
(sharded over the mesh under tensor parallelism), chooses the attention backend and sizes the KV
pool from the device memory left after the weights and one profiled step. The engine then builds
its runner, scheduler and output processor from the result.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import logging
import os

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.attention_backend import AttentionBackend, select_attention_backend
from jaxengine.config import EngineConfig
from jaxengine.default_model import default_model_path
from jaxengine.device_memory import choose_launch_allocator, free_for_kv_and_step, size_device_pool
from jaxengine.distributed import agree_min
from jaxengine.draft_model import LoadedDraft
from jaxengine.model_runner import kv_bytes_per_block, profile_step_bytes
from jaxengine.models import kv_scales
from jaxengine.models.config import ModelConfig
from jaxengine.models.loader import dummy_params, load_params, resolve_dtype
from jaxengine.models.presets import PRESETS
from jaxengine.models.quant_formats import check_model, gguf_kept_linears, resolve_quantization
from jaxengine.program_bundle import ProgramBundle, open_bundle
from jaxengine.sharding import ShardingPlan, make_plan
from jaxengine.startup import StartupTimings

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """What start-up hands to the engine."""

    config: EngineConfig  # completed: max_model_len, max_num_batched_tokens, num_kv_blocks set
    model_config: ModelConfig  # as the model was built (KV heads repeated / projections split under TP)
    dtype: jnp.dtype
    graphdef: nnx.GraphDef
    state: nnx.State  # the weights, on the device (sharded under TP)
    attention: AttentionBackend
    plan: ShardingPlan | None  # None on one device
    tokenizer: object | None  # a transformers tokenizer; None with skip_tokenizer_init or none found
    eos_token_ids: tuple[int, ...]
    draft: LoadedDraft | None = None  # speculative decoding's draft model
    bundle: ProgramBundle | None = None  # serialized executables of earlier starts (None: cache off)


def load_model(config: EngineConfig, timings: StartupTimings | None = None) -> LoadedModel:
    """`timings`: the start's record (jaxengine.startup); its phases are filled in here."""
    timings = timings if timings is not None else StartupTimings.begin(config.compilation_cache_dir)
    if config.trust_remote_code:
        logger.info("trust_remote_code: accepted, but no code from a checkpoint is ever run; "
                    "jaxengine implements the architectures it serves")
    if config.enforce_eager:
        logger.info("enforce_eager: the engine still runs compiled programs, one per token bucket (XLA has no "
                    "eager step); each is compiled on its first use, none ahead")
    enable_compilation_cache(config.compilation_cache_dir)
    size_device_pool(config.gpu_memory_utilization)
    if choose_launch_allocator(config.tensor_parallel_size):
        logger.info("GPU allocator: JAX's VMM allocator with XLA's SKIP_TEMP command-buffer updates "
                    "(XLA_PYTHON_CLIENT_ALLOCATOR=default keeps JAX's own)")
    with timings.phase("device_init"):
        config = config.resolve_warmup(jax.default_backend())
    with timings.phase("weight_load"):
        model_config, ckpt, tokenizer = _open_model(config)
    from jaxengine.models.registry import CLASSIFIER_ARCHITECTURES
    if model_config.architecture in CLASSIFIER_ARCHITECTURES and not config.is_pooling:
        raise ValueError(f"{model_config.architecture} is a classifier, not a text generator: load it with "
                         "runner='pooling' (LLM.classify / score, the server's /classify)")
    config = derive_config(config, model_config)
    model_config = model_config.with_max_model_len(config.max_model_len)  # longrope: short or long factors
    if model_config.rope_scaling is not None and model_config.rope_scaling.rope_type == "longrope":
        logger.info("longrope: %s factors at every position (max_model_len %d, original context %d)",
                    "long" if model_config.rope_scaling.long_context else "short", config.max_model_len,
                    model_config.rope_scaling.original_max_position_embeddings)
    dtype = resolve_dtype(config.dtype, model_config)
    if jax.process_count() > 1 and config.tensor_parallel_size != jax.device_count():
        raise ValueError(f"across {jax.process_count()} processes, tensor_parallel_size must span every device "
                         f"of the job: {jax.device_count()}, got {config.tensor_parallel_size}")
    if config.enable_expert_parallel and not getattr(model_config, "num_experts", 0):
        raise ValueError(f"enable_expert_parallel: {model_config.architecture} has no experts (mixture-of-experts "
                         "models only)")
    plan = make_plan(model_config, config.tensor_parallel_size, expert_parallel=config.enable_expert_parallel) \
        if config.tensor_parallel_size > 1 else None
    if plan is not None:
        if plan.kv_head_replicas > 1:
            logger.info("each of the %d KV heads is repeated on %d devices", model_config.num_kv_heads,
                        plan.kv_head_replicas)
        model_config = plan.model_config(model_config)  # KV heads repeated, projections split
        logger.info("tensor parallel over %d devices (mesh %s)%s", plan.tp, dict(plan.mesh.shape),
                    ", experts split over them" if plan.expert_parallel else "")
    from jaxengine.models.gguf_reader import GGUFCheckpoint

    quant = resolve_quantization(config.quantization, ckpt.hf_config if ckpt is not None else None,
                                 dummy=ckpt is None or config.load_format == "dummy",
                                 gguf=isinstance(ckpt, GGUFCheckpoint))
    if quant is not None:
        check_model(quant, model_config.architecture, config.tensor_parallel_size)
        # act-order: each projection has its own input permutation; GGUF: the parts of a fused
        # projection stored in different forms. Either way no fused q/k/v, gate/up.
        if quant.act_order or (quant.method == "gguf" and quant.from_checkpoint and gguf_kept_linears(ckpt)[1]):
            model_config = model_config.with_split_projections()
        logger.info("quantization: %s", quant.label)
    with timings.phase("weight_load"):
        if ckpt is None or config.load_format == "dummy":
            graphdef, state = dummy_params(model_config, dtype, seed=config.seed,
                                           sharding_of=plan.param_sharding if plan is not None else None,
                                           quantization=quant)
        else:
            put = (lambda path, arr: jax.device_put(arr, plan.param_sharding(path))) if plan is not None else None
            graphdef, state = load_params(ckpt, model_config, dtype, put=put, quantization=quant)
        tokenizer = _resolve(tokenizer)
        spec = config.speculative_config
        draft = load_draft(config, model_config, dtype) if spec is not None and spec.method == "draft_model" else None
    timings.weights_loaded()
    scales = _kv_scales(config, model_config, ckpt)
    attention = select_attention_backend(config.attention_backend, model_config, dtype, config.block_size,
                                         plan.mesh if plan is not None else None, config.kv_cache_dtype, scales)
    draft_bytes = 0 if draft is None else kv_bytes_per_block(
        draft.model_config, config.block_size, dtype, draft.attention.kv_head_dim(draft.model_config.head_dim))
    with timings.phase("kv_sizing"):
        bundle = open_bundle(config, model_config, dtype, attention, plan, state)
        blocks = bundle.stored_num_kv_blocks() if bundle is not None and config.num_kv_blocks is None else None
        timings.kv_blocks_from_bundle = blocks is not None
        if blocks is None:
            blocks = num_kv_blocks(config, model_config, dtype, graphdef, state, attention, plan, draft_bytes)
            if bundle is not None and config.num_kv_blocks is None:
                bundle.store_num_kv_blocks(blocks)
        if bundle is not None:
            bundle.bind(blocks)
    config = dataclasses.replace(config, num_kv_blocks=blocks)
    eos = tuple(model_config.eos_token_id)
    if not eos and tokenizer is not None and tokenizer.eos_token_id is not None:
        eos = (tokenizer.eos_token_id,)
    return LoadedModel(config, model_config, dtype, graphdef, state, attention, plan, tokenizer, eos, draft, bundle)


def _kv_scales(config: EngineConfig, model_config: ModelConfig, ckpt) -> kv_scales.KVScales | None:
    """An fp8 cache's per-layer scales from the checkpoint (models/kv_scales.py), or None: 1.0.
    As vLLM: the checkpoint's scales apply only to an fp8 cache, and an fp8 cache without them
    runs at 1.0 with a warning."""
    from jaxengine.models.gguf_reader import GGUFCheckpoint

    real = ckpt is not None and config.load_format != "dummy"  # weights read from a checkpoint
    named = real and not isinstance(ckpt, GGUFCheckpoint)  # with Hugging Face tensor names
    if config.kv_cache_dtype == "auto":
        if named and kv_scales.has_kv_scales(ckpt):
            logger.info("the checkpoint's KV-cache scales are not used: kv_cache_dtype='auto' keeps the cache in "
                        "the model's dtype (kv_cache_dtype='fp8' applies them)")
        return None
    found = kv_scales.read_kv_scales(ckpt, model_config.num_layers) if named else None
    if found is None:
        if real:
            logger.warning("fp8 KV cache with scale 1.0: the checkpoint stores no k_scale / v_scale; keys or values "
                           "beyond +-448 are clipped")
        return None
    logger.info("fp8 KV cache: the checkpoint's scales, %s", kv_scales.describe(found))
    return found


def load_draft(config: EngineConfig, target: ModelConfig, dtype: jnp.dtype) -> LoadedDraft:
    """Speculative decoding's draft model (speculative_config.model), on the device in the
    target's dtype: a checkpoint as the target's are opened, or with load_format="dummy" a preset
    name. Its vocabulary must be the target's (it proposes the target's token ids)."""
    source = config.speculative_config.model
    if config.tensor_parallel_size > 1:
        raise ValueError("speculative_config: a draft model runs with tensor_parallel_size=1 only; "
                         'use {"method": "ngram"} under tensor parallelism')
    if config.is_pooling:
        raise ValueError("speculative_config: speculative decoding is for text generation, not pooling")
    if target.kv_window is not None:
        raise ValueError(f"speculative_config: a draft model is not supported for {target.architecture} with a "
                         "sliding window (the target's KV blocks outside the window are freed)")
    mc, ckpt = _open_source(source, config, None, None)
    if mc.vocab_size > target.vocab_size:
        raise ValueError(f"speculative_config: the draft model's vocabulary ({mc.vocab_size} tokens) is larger than "
                         f"the target's ({target.vocab_size}); the draft must share the target's tokenizer")
    if mc.max_position_embeddings < config.max_model_len:
        raise ValueError(f"speculative_config: the draft model's max_position_embeddings ({mc.max_position_embeddings}) "
                         f"is below max_model_len ({config.max_model_len})")
    mc = mc.with_max_model_len(config.max_model_len)
    if ckpt is None or config.load_format == "dummy":
        graphdef, state = dummy_params(mc, dtype, seed=config.seed + 1)
    else:
        graphdef, state = load_params(ckpt, mc, dtype)
    attention = select_attention_backend(config.attention_backend, mc, dtype, config.block_size, None)
    return LoadedDraft(source, mc, graphdef, state, attention)


def enable_compilation_cache(path: str | None) -> None:
    """JAX's persistent compilation cache in `path` (None: off)."""
    if not path:
        return
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def _open_model(config: EngineConfig):
    """(model config, checkpoint or None, tokenizer or None) for the configured model; the
    tokenizer of a checkpoint comes as a Future (`_resolve` waits for it)."""
    from jaxengine.models.checkpoint import load_hf_tokenizer  # heavy imports only here

    mc, ckpt = _open_source(config.model or default_model_path(), config, config.revision, config.tokenizer)
    if ckpt is None:
        tok = load_hf_tokenizer(config.tokenizer) if config.tokenizer and not config.skip_tokenizer_init else None
        return mc, None, tok
    tokenizer = None
    if not config.skip_tokenizer_init:
        # The tokenizer (mostly transformers' imports, in Python) loads beside the weights (mostly
        # numpy and device copies): on a small machine the two overlap.
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        tokenizer = pool.submit(ckpt.load_tokenizer)
        pool.shutdown(wait=False)
    return mc, ckpt, tokenizer


def _open_source(source: str, config: EngineConfig, revision: str | None, tokenizer: str | None):
    """(model config, checkpoint) of a model source: with load_format="dummy", a preset name
    gives its config and no checkpoint; anything else is opened as a checkpoint."""
    from jaxengine.models.checkpoint import open_checkpoint

    if config.load_format == "dummy" and source in PRESETS:
        return ModelConfig.from_hf_dict(PRESETS[source]), None
    ckpt = open_checkpoint(source, revision=revision, tokenizer=tokenizer)
    return ModelConfig.from_hf_dict(ckpt.hf_config), ckpt


def _resolve(tokenizer):
    """The tokenizer, once its loading thread is done (its errors are raised here)."""
    return tokenizer.result() if isinstance(tokenizer, concurrent.futures.Future) else tokenizer


def derive_config(config: EngineConfig, mc: ModelConfig) -> EngineConfig:
    """The config with the model's context length and the platform's token budget filled in."""
    max_len = config.max_model_len or mc.default_max_model_len  # longrope: its original context, as in vLLM
    if max_len > mc.max_position_embeddings:
        raise ValueError(f"max_model_len={max_len} exceeds the model's max_position_embeddings="
                         f"{mc.max_position_embeddings}")
    budget = config.max_num_batched_tokens or (512 if jax.default_backend() == "cpu" else 8192)
    if budget < config.max_num_seqs and config.max_num_batched_tokens is not None:
        raise ValueError(f"max_num_batched_tokens={budget} must be >= max_num_seqs={config.max_num_seqs}")
    return dataclasses.replace(config, max_model_len=max_len, max_num_batched_tokens=budget)


def num_kv_blocks(config: EngineConfig, mc: ModelConfig, dtype: jnp.dtype, graphdef, state,
                  attention: AttentionBackend, plan: ShardingPlan | None = None, draft_bytes_per_block: int = 0) -> int:
    """Blocks that fit in free device memory (or the CPU budget), never more than useful.
    `draft_bytes_per_block`: a draft model's KV of one block, which every block also holds.

    On accelerators: gpu_memory_utilization of the card (`jaxengine.device_memory`),
    minus what is in use after the weights, minus the profiled peak of one step of the largest bucket.
    """
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    # per device: the KV heads are split over the tensor-parallel devices
    per_block = (kv_bytes_per_block(mc, config.block_size, attention.kv_dtype(dtype), attention.kv_head_dim(mc.head_dim))
                 // config.tensor_parallel_size + draft_bytes_per_block)
    most_useful = config.max_num_seqs * config.max_blocks_per_seq + 1
    jax.block_until_ready(state)  # the weights' initialisers done and their temporaries freed
    gc.collect()
    free = free_for_kv_and_step(jax.local_devices()[0], config.gpu_memory_utilization)
    if free is not None:
        free, source = free
        # GEMM autotuning off for the profile's compile: the buffer assignment came out the same to
        # the byte for the Llama-3-8B shape on the H100, in about half the compile time
        # (lab/gpu_checks/kv_profile_probe.py); the warm-up's compile of that bucket autotunes.
        fast = {"xla_gpu_autotune_level": 0} if jax.default_backend() == "gpu" else None
        step = profile_step_bytes(config, mc, graphdef, state, dtype, plan, attention, fast)
        if step is None:  # no buffer analysis: a rough bound (activations, logits, sampler copies)
            t, r = config.max_num_batched_tokens, min(config.max_num_batched_tokens, config.max_num_seqs)
            step = 2 * (t * (4 * mc.hidden_size + 3 * mc.intermediate_size) * jnp.dtype(dtype).itemsize
                        + 4 * r * mc.vocab_size * 4)
        n = int((free - step) // per_block)
        logger.info("KV cache: %.2f GiB free after weights (%s), %.2f GiB profiled step peak",
                    free / 2**30, source, step / 2**30)
    elif jax.default_backend() == "cpu":
        n = int(config.cpu_kv_cache_bytes // per_block)
    else:  # e.g. the VMM allocator, which reports no memory statistics, without NVML to ask
        raise ValueError(f"the {jax.default_backend()} backend reports no device memory statistics, so the KV "
                         "cache cannot be sized from gpu_memory_utilization: give num_kv_blocks (--num-kv-blocks), "
                         "or install nvidia-ml-py")
    n = agree_min(min(n, most_useful))  # every process of a multi-host job allocates the same pool
    if (n - 1) * config.block_size < config.max_model_len:
        raise ValueError(
            f"the KV cache holds {max(n - 1, 0) * config.block_size} tokens, fewer than max_model_len="
            f"{config.max_model_len}; lower max_model_len, or raise gpu_memory_utilization / num_kv_blocks")
    return n
