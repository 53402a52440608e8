"""One frozen, validated engine configuration, built once from the user's keyword arguments.

Derived values (the number of KV blocks once memory is profiled, the model's context length)
come back as a new config via `dataclasses.replace`, never by mutation.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DTYPES = ("auto", "float32", "float16", "bfloat16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's spellings
# vLLM's `runner` values and its older `task` values (a pooling task implies the pooling runner).
RUNNERS = ("auto", "generate", "pooling")
TASKS = ("auto", "generate", "embed", "classify", "score", "encode", "reward")
ATTENTION_BACKENDS = ("auto", "pallas", "pallas-mosaic", "reference")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # vLLM's names; fp8: e4m3, the checkpoint's KV scales or 1.0
# vLLM's method names (the *_marlin ones are aliases here): models/quant_formats.py
QUANTIZATION_METHODS = ("fp8", "compressed-tensors", "gptq", "gptq_marlin", "awq", "awq_marlin", "gguf")


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return os.path.join(base, "jaxengine", "xla")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF folder, GGUF file, hub id; None: the embedded default
    tokenizer: str | None = None
    revision: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's max_position_embeddings (longrope: its original context)
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: 8192 on accelerators, 512 on CPU
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # None: sized from free device memory
    cpu_kv_cache_bytes: int = 1 << 30  # KV budget when the backend reports no memory (CPU)
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    # vLLM's flag: a mixture-of-experts model's experts are split over the tensor-parallel devices
    # (whole experts per device) instead of each expert's feed-forward width.
    enable_expert_parallel: bool = False
    seed: int = 0
    load_format: str = "auto"
    attention_backend: str = "auto"
    compilation_cache_dir: str | None = dataclasses.field(default_factory=default_cache_dir)
    max_logprobs: int = 20
    # Compile every bucket at start-up (True), or each program on its first use (False). None: ahead
    # on accelerators, lazily on the CPU backend (a short run there needs a few of the programs).
    warmup: bool | None = None
    skip_tokenizer_init: bool = False  # no tokenizer: prompts are token ids, outputs carry no text
    # vLLM's flag, accepted for its users' commands: this engine implements each architecture it
    # serves itself and never runs code that comes with a checkpoint, whatever the value.
    trust_remote_code: bool = False
    # vLLM's arguments, accepted with their meaning here: the runner / task (pooling runs encoder
    # models: jaxengine.pooling), eager mode (XLA always compiles the bucketed programs: nothing is captured that eager
    # mode would skip; its nearest meaning here is lazy compilation: no bucket is compiled ahead),
    # chunked prefill (always on: one token budget serves prefill and decode).
    runner: str = "auto"
    task: str = "auto"
    enforce_eager: bool = False
    enable_chunked_prefill: bool = True
    # LoRA (vLLM's names): adapters per request (LoRARequest), `max_loras` of them on the device at
    # once in slots padded to `max_lora_rank`, `max_cpu_loras` kept on the host (None: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Speculative decoding (vLLM's `speculative_config`: a dict, or its JSON text on the command
    # line), normalised to a jaxengine.spec_decode.SpeculativeConfig; None: off.
    speculative_config: object = None
    # Quantization (vLLM's name and method names): None reads the checkpoint's quantization_config;
    # "fp8" also quantizes a float checkpoint's linear weights at load time (models/quant_formats.py).
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES; auto: the model's dtype

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                     "num_kv_blocks", "tensor_parallel_size", "cpu_kv_cache_bytes", "max_loras", "max_lora_rank",
                     "max_cpu_loras"):
            positive(name)
        if self.dtype in DTYPE_ALIASES:
            object.__setattr__(self, "dtype", DTYPE_ALIASES[self.dtype])
        for name, allowed in (("runner", RUNNERS), ("task", TASKS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.runner == "generate" and self.task not in ("auto", "generate"):
            raise ValueError(f"runner='generate' and task={self.task!r} disagree")
        if self.warmup is not None and not isinstance(self.warmup, bool):
            raise ValueError(f"warmup must be True, False or None (auto), got {self.warmup!r}")
        if self.warmup is True and self.enforce_eager:
            raise ValueError("warmup=True compiles every bucket at start-up; enforce_eager=True compiles each "
                             "program on its first use: pass one of them")
        if not self.enable_chunked_prefill:
            raise ValueError("enable_chunked_prefill=False: chunked prefill is always on in jaxengine (prefill "
                             "and decode share one token budget per step)")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES + tuple(DTYPE_ALIASES))}, got {self.dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.block_size & (self.block_size - 1) or not 8 <= self.block_size <= 256:
            raise ValueError(f"block_size must be a power of two in [8, 256], got {self.block_size}")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError("num_kv_blocks must be at least 2 (block 0 is reserved)")
        from jaxengine.spec_decode import SpeculativeConfig

        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization {self.quantization!r} is not supported; supported: "
                             f"{', '.join(QUANTIZATION_METHODS)}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not 0 <= self.max_logprobs <= 20:
            raise ValueError(f"max_logprobs must be in [0, 20], got {self.max_logprobs}")

    def resolve_warmup(self, backend: str) -> EngineConfig:
        """The config with `warmup` decided: as given; False under enforce_eager; else ahead of
        time on accelerators (no compile after start-up) and lazily on the CPU backend."""
        if self.warmup is not None:
            return self
        return dataclasses.replace(self, warmup=not self.enforce_eager and backend != "cpu")

    @property
    def is_pooling(self) -> bool:
        """runner="pooling" or a pooling task (embed, classify, score, encode)."""
        return self.runner == "pooling" or self.task not in ("auto", "generate")

    @property
    def max_blocks_per_seq(self) -> int:
        assert self.max_model_len is not None
        return -(-self.max_model_len // self.block_size)


def token_buckets(max_num_batched_tokens: int, platform: str = "gpu") -> tuple[int, ...]:
    """Powers of two from 16 up to the budget (the budget itself always included); on the CPU
    also 1, before them. A CPU forward costs about its rows' arithmetic, and a batch-1 decode
    step padded to 16 rows cost SmolLM2 about 110 ms against about 38 ms at 1 row; 2-16 rows
    still share the 16 bucket, which keeps the programs a run compiles few."""
    out, b = [], 16
    while b < max_num_batched_tokens:
        out.append(b)
        b *= 2
    out.append(max_num_batched_tokens)
    if platform == "cpu" and out[0] > 1:
        out.insert(0, 1)
    return tuple(out)


def pick_bucket(buckets: tuple[int, ...], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
