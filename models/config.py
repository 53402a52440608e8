"""Model architecture config: one frozen dataclass for every supported family.

Built from a Hugging Face ``config.json`` dict (or the equivalent read from GGUF metadata).
Families differ only by flags: ``attention_bias`` (Qwen2), ``qk_norm`` (Qwen3),
``rope_scaling`` (Llama 3.1), ``tie_word_embeddings`` (Llama 3.2, SmolLM2).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Mapping

_DTYPE_NAMES = {"float32", "float16", "bfloat16"}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 style frequency scaling ("llama3"); "linear" scales positions."""

    rope_type: str  # "llama3" | "linear"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int  # F
    num_layers: int
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3)
    sliding_window: int | None = None
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    # Each checkpoint KV head is stored this many times in a row (num_kv_heads counts the copies):
    # tensor parallelism over more devices than the model has KV heads gives every device one.
    kv_head_replicas: int = 1
    # q/k/v as one [D, N + 2K, H] parameter and gate/up as one [D, 2F]: one matmul each instead of
    # three and two. Tensor parallelism needs them split (False), because column shards of a fused
    # weight would mix its parts; the loader fuses the checkpoint's separate tensors when True.
    fused_projections: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model config: num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.torch_dtype not in _DTYPE_NAMES:
            raise ValueError(f"model config: unsupported torch_dtype {self.torch_dtype!r}")

    @property
    def checkpoint_kv_heads(self) -> int:
        return self.num_kv_heads // self.kv_head_replicas

    def with_kv_head_replicas(self, replicas: int) -> "ModelConfig":
        """The same model with every KV head repeated `replicas` times (a query head keeps reading
        a copy of its own KV head, since the copies of head j sit at j*replicas ... j*replicas+replicas-1)."""
        return dataclasses.replace(self, num_kv_heads=self.checkpoint_kv_heads * replicas, kv_head_replicas=replicas)

    def with_split_projections(self) -> "ModelConfig":
        """The same model with q/k/v and gate/up as separate parameters (for tensor parallelism)."""
        return dataclasses.replace(self, fused_projections=False)

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def num_params(self) -> int:
        d, f, v, h = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        attn = d * h * (self.num_heads * 2 + self.checkpoint_kv_heads * 2)
        layer = attn + 3 * d * f + 2 * d
        return v * d * (1 if self.tie_word_embeddings else 2) + self.num_layers * layer + d

    @classmethod
    def from_hf_dict(cls, cfg: Mapping) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry")
        arch = archs[0]
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or hidden // heads
        rope_scaling = None
        rs = cfg.get("rope_scaling") or None
        rope_params = cfg.get("rope_parameters") or None  # transformers >= 5 spelling
        rope_theta = cfg.get("rope_theta")
        if rope_params and isinstance(rope_params, Mapping):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default" and not rs:
                rs = rope_params
        if rs:
            rtype = rs.get("rope_type") or rs.get("type")
            if rtype == "llama3":
                rope_scaling = RopeScaling(
                    "llama3", float(rs["factor"]), float(rs.get("low_freq_factor", 1.0)),
                    float(rs.get("high_freq_factor", 4.0)),
                    int(rs.get("original_max_position_embeddings", 8192)))
            elif rtype == "linear":
                rope_scaling = RopeScaling("linear", float(rs["factor"]))
            elif rtype not in (None, "default"):
                raise ValueError(f"unsupported rope_scaling type {rtype!r} (supported: llama3, linear)")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        if dtype not in _DTYPE_NAMES:
            dtype = "float32"
        use_sw = cfg.get("use_sliding_window", arch.startswith("Mistral"))
        sliding = cfg.get("sliding_window") if use_sw else None
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch.startswith("Qwen2"))),
            qk_norm=arch.startswith("Qwen3"),
            sliding_window=int(sliding) if sliding else None,
            torch_dtype=dtype,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos_ids,
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> "ModelConfig":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read model config {path}: {e}") from e
        return cls.from_hf_dict(data)
