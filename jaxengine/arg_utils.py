"""Command-line flags for every engine argument, derived from `EngineConfig` (one source of truth)."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from jaxengine.config import (ATTENTION_BACKENDS, DTYPE_ALIASES, DTYPES, KV_CACHE_DTYPES, LOAD_FORMATS, RUNNERS,
                              EngineConfig)

_SKIP = {"model"}  # positional / given by each command

# Help for each `EngineConfig` field's flag. argparse appends the default (see `HelpFormatter`);
# where None stands for something computed, the text says what.
_ENGINE_HELP = {
    "tokenizer": "tokenizer folder or hub id (default: the model's own)",
    "revision": "hub revision (branch, tag or commit) of the model (default: the newest)",
    "dtype": "weights and activations dtype; auto: the checkpoint's (float32 on CPU); half and float are "
             "vLLM's aliases",
    "max_model_len": "longest prompt + output in tokens (default: the model's context length)",
    "max_num_seqs": "most sequences running at once",
    "max_num_batched_tokens": "tokens per engine step, prefill and decode together (default: 8192 on "
                              "accelerators, 512 on CPU)",
    "block_size": "tokens per KV-cache block (a power of two in [8, 256])",
    "gpu_memory_utilization": "share of the device's memory the engine may use (weights + KV cache)",
    "num_kv_blocks": "KV-cache blocks (default: sized from free device memory)",
    "cpu_kv_cache_bytes": "KV-cache budget when the backend reports no memory size (CPU)",
    "enable_prefix_caching": "reuse the KV blocks of prompt prefixes seen before",
    "tensor_parallel_size": "devices one model is sharded over",
    "enable_expert_parallel": "mixture-of-experts models: split the experts over the tensor-parallel devices "
                              "(whole experts per device) instead of each expert's feed-forward width",
    "seed": "engine seed: draws the seeds of requests that give none",
    "load_format": "how to read the weights; dummy: random weights of the model's (or preset's) shape",
    "attention_backend": "attention kernels; auto picks the fastest for the device",
    "compilation_cache_dir": "persistent XLA compilation cache (default: $XDG_CACHE_HOME/jaxengine/xla or "
                             "~/.cache/jaxengine/xla)",
    "max_logprobs": "most logprobs a request may ask for (0..20)",
    "warmup": "compile every bucket at start-up (no compile pauses while serving); --no-warmup compiles each "
              "program on its first use (default: ahead on accelerators, on first use on CPU)",
    "skip_tokenizer_init": "load no tokenizer: prompts are token ids and outputs carry no text",
    "trust_remote_code": "accepted for vLLM's command lines; no checkpoint code is ever run",
    "runner": f"vLLM's runner: {', '.join(RUNNERS)} (pooling: embedding, classification and cross-encoder "
              "models; auto picks pooling for an encoder folder)",
    "task": f"vLLM's older name for the runner: {', '.join(RUNNERS)}",
    "enforce_eager": "vLLM's eager mode; XLA always runs compiled programs, so here it means its nearest "
                     "equivalent: each program is compiled on its first use, none ahead",
    "enable_chunked_prefill": "accepted for vLLM's command lines; chunked prefill is always on",
    "enable_lora": "serve LoRA adapters (Llama, Mistral, Qwen2 and Qwen3 models; one device)",
    "max_loras": "LoRA adapters on the device at once (distinct adapters in one step)",
    "max_lora_rank": "largest LoRA rank served (a power of two up to 512); every device slot is this wide",
    "max_cpu_loras": "LoRA adapters kept loaded on the host, >= max-loras (default: max-loras)",
    "quantization": "quantization method (vLLM's names): fp8 quantizes a float checkpoint's linear weights at load "
                    "time; compressed-tensors, gptq, awq (and the *_marlin aliases) name a quantized checkpoint's "
                    "method (default: the checkpoint's quantization_config, if any)",
    "kv_cache_dtype": "KV cache element type: auto (the model's dtype) or fp8 / fp8_e4m3 (float8 e4m3 with the "
                      "checkpoint's per-layer k/v scales, else 1.0; on a GPU the Triton attention kernels, sm_89+)",
    "speculative_config": 'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 3, '
                          '"prompt_lookup_max": 4, "prompt_lookup_min": 1, "disable_by_batch_size": 16}, or a '
                          'draft model: {"model": PATH, "num_speculative_tokens": 3}',
}
# Flags with a fixed set of values: argparse checks them and --help lists them. (runner and task
# are not here: their pooling values get EngineConfig's explanation instead of argparse's error.)
_ENGINE_CHOICES = {
    "dtype": DTYPES + tuple(DTYPE_ALIASES),
    "load_format": LOAD_FORMATS,
    "attention_backend": ATTENTION_BACKENDS,
    "kv_cache_dtype": KV_CACHE_DTYPES,
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default, unless the help already says what the default is
    (it mentions "default": used where None stands for something computed, e.g. "sized from memory")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS:
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"
        return text


def use_help_formatter(parser: argparse.ArgumentParser) -> None:
    """Sets `HelpFormatter` on `parser` and on every subcommand's parser below it."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                use_help_formatter(sub)


def _base_type(tp) -> type:
    if isinstance(tp, str):
        tp = eval(tp, {"int": int, "float": float, "str": str, "bool": bool, "None": None})  # noqa: S307
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return args[0]
    return tp


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        if f.name in _SKIP:
            continue
        flag = "--" + f.name.replace("_", "-")
        tp = str if f.name == "speculative_config" else _base_type(f.type)  # JSON text
        default = f.default if f.default is not dataclasses.MISSING else None
        help_ = _ENGINE_HELP.get(f.name)
        if tp is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_)
        else:
            group.add_argument(flag, type=tp, default=default, dest=f.name, help=help_,
                               choices=_ENGINE_CHOICES.get(f.name))


def engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    out = {}
    for f in dataclasses.fields(EngineConfig):
        if f.name in _SKIP or not hasattr(args, f.name):
            continue
        out[f.name] = getattr(args, f.name)
    if out.get("compilation_cache_dir") is None:
        out.pop("compilation_cache_dir", None)
    return out


def normalize_flags(argv: list[str]) -> list[str]:
    """vLLM's command lines spell flags either way (`--max-num-seqs`, `--max_num_seqs`): options
    are rewritten with dashes before parsing. Values, and everything after a bare `--`, stay."""
    out: list[str] = []
    for i, a in enumerate(argv):
        if a == "--":
            return out + argv[i:]
        if a.startswith("--") and "_" in a.partition("=")[0]:
            name, eq, value = a.partition("=")
            a = name.replace("_", "-") + eq + value
        out.append(a)
    return out
