"""Model architecture config: the frozen dataclass every family's model is built from.

Built from a Hugging Face ``config.json`` dict (or the equivalent read from GGUF metadata) by the
parser of the architecture's family (models/registry.py); a family with fields of its own
subclasses it. The Llama family differs only by flags: ``attention_bias`` (Qwen2), ``qk_norm``
(Qwen3), ``rope_scaling`` (Llama 3.1, Qwen2.5's long-context yarn), ``tie_word_embeddings``
(Llama 3.2, SmolLM2).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Mapping

_DTYPE_NAMES = {"float32", "float16", "bfloat16"}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How rotary frequencies are stretched past the trained context.

    "llama3": Llama 3.1's wavelength-dependent ramp; "linear": positions divided by `factor`;
    "dynamic": NTK-aware base scaling, fixed at the scaled maximum length (as vLLM computes it);
    "yarn": NTK-by-parts interpolation between `beta_fast` and `beta_slow` rotations, with cos
    and sin scaled by the attention factor.
    "longrope" (Phi-3's; "su" is its older name): every frequency divided by its own factor, from
    `short_factor` or `long_factor`, cos and sin scaled by the attention factor. transformers picks
    the list per forward pass by the sequence's length (re-computing the whole cache when a
    sequence grows past `original_max_position_embeddings`); vLLM picks it once, by the engine's
    max_model_len, so that every key in the cache keeps its rotation. This engine does as vLLM:
    `long_context` (set by `ModelConfig.with_max_model_len`) is True when max_model_len exceeds
    `original_max_position_embeddings`, and every position then uses the long factors; the
    default max_model_len of a longrope model is `original_max_position_embeddings` (short
    factors: transformers' numbers for every sequence that fits), as in vLLM.
    """

    rope_type: str  # "llama3" | "linear" | "dynamic" | "yarn" | "longrope"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn only
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None  # None: from factor (and mscale / mscale_all_dim)
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # longrope only (attention_factor above too; None: from factor, unless a list's mscale is given)
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    short_mscale: float | None = None
    long_mscale: float | None = None
    long_context: bool = False  # long_factor at every position (max_model_len > original)


ROPE_TYPES = ("default", "llama3", "linear", "dynamic", "yarn", "longrope", "su")


def _rope_scaling(rs: Mapping, arch: str, max_pos: int) -> RopeScaling | None:
    """The `rope_scaling` (or transformers 5 `rope_parameters`) entry of a config, validated."""
    rtype = rs.get("rope_type") or rs.get("type")
    if rtype in (None, "default"):
        return None
    if rtype not in ROPE_TYPES:
        raise ValueError(f"{arch}: rope_scaling type {rtype!r} is not supported (supported: "
                         f"{', '.join(t for t in ROPE_TYPES if t != 'default')})")
    if rtype in ("longrope", "su"):
        return _longrope(rs, arch, max_pos)
    factor = rs.get("factor")
    if factor is None and rtype == "yarn" and rs.get("original_max_position_embeddings"):
        factor = max_pos / float(rs["original_max_position_embeddings"])
    if factor is None:
        raise ValueError(f"{arch}: rope_scaling of type {rtype!r} needs a 'factor'")
    if rtype == "llama3":
        return RopeScaling("llama3", float(factor), float(rs.get("low_freq_factor", 1.0)),
                           float(rs.get("high_freq_factor", 4.0)),
                           int(rs.get("original_max_position_embeddings", 8192)))
    if rtype == "yarn":
        opt = lambda k: float(rs[k]) if rs.get(k) is not None else None  # noqa: E731
        return RopeScaling("yarn", float(factor),
                           original_max_position_embeddings=int(rs.get("original_max_position_embeddings") or max_pos),
                           beta_fast=float(rs.get("beta_fast") or 32.0), beta_slow=float(rs.get("beta_slow") or 1.0),
                           attention_factor=opt("attention_factor"), mscale=opt("mscale"),
                           mscale_all_dim=opt("mscale_all_dim"), truncate=bool(rs.get("truncate", True)))
    return RopeScaling(rtype, float(factor), original_max_position_embeddings=max_pos)


def _longrope(rs: Mapping, arch: str, max_pos: int) -> RopeScaling:
    """A longrope entry: both factor lists and the original context are required; `factor`
    defaults to max_position_embeddings / original_max_position_embeddings (as in transformers)."""
    for key in ("short_factor", "long_factor", "original_max_position_embeddings"):
        if not rs.get(key):
            raise ValueError(f"{arch}: rope_scaling of type 'longrope' needs {key!r}")
    original = int(rs["original_max_position_embeddings"])
    opt = lambda k: float(rs[k]) if rs.get(k) is not None else None  # noqa: E731
    return RopeScaling("longrope", opt("factor") or max_pos / original, original_max_position_embeddings=original,
                       attention_factor=opt("attention_factor"), short_factor=tuple(map(float, rs["short_factor"])),
                       long_factor=tuple(map(float, rs["long_factor"])), short_mscale=opt("short_mscale"),
                       long_mscale=opt("long_mscale"))


def hf_field(cfg: Mapping, key: str) -> object:
    """A field the model's math needs: absent (or null) is a ValueError naming the architecture."""
    if cfg.get(key) is None:
        arch = (cfg.get("architectures") or ["?"])[0]
        raise ValueError(f"{arch}: config.json lacks {key!r}")
    return cfg[key]


def hf_eos_ids(cfg: Mapping) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    return tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())


def hf_dtype(cfg: Mapping) -> str:
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    return dtype if dtype in _DTYPE_NAMES else "float32"


def hf_rope(cfg: Mapping, arch: str, max_pos: int) -> tuple[float, RopeScaling | None]:
    """(rope theta, scaling) from `rope_theta` / `rope_scaling`, or transformers 5's `rope_parameters`."""
    rs = cfg.get("rope_scaling") or None
    rope_params = cfg.get("rope_parameters") or None
    rope_theta = cfg.get("rope_theta")
    if rope_params and isinstance(rope_params, Mapping):
        rope_theta = rope_params.get("rope_theta", rope_theta)
        if rope_params.get("rope_type", "default") != "default" and not rs:
            rs = rope_params
    longrope = rs and (rs.get("rope_type") or rs.get("type")) in ("longrope", "su")
    if longrope and cfg.get("original_max_position_embeddings"):
        # Phi-3 states the original context beside max_position_embeddings; it wins (as in transformers)
        rs = {**rs, "original_max_position_embeddings": cfg["original_max_position_embeddings"]}
    return float(rope_theta if rope_theta is not None else 10000.0), (_rope_scaling(rs, arch, max_pos) if rs else None)


def scaled_max_positions(max_pos: int, scaling: RopeScaling | None) -> int:
    """The context a scaled rope serves, as vLLM derives it: yarn stretches its original length by
    `factor`, linear and dynamic the config's; llama3 configs already state the long length."""
    if scaling is None or scaling.rope_type == "llama3":
        return max_pos
    if scaling.rope_type == "longrope":  # the config's max_position_embeddings is the long context
        return max_pos
    base = scaling.original_max_position_embeddings if scaling.rope_type == "yarn" else max_pos
    return max(max_pos, int(base * scaling.factor))


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
    norm_eps: float = 1e-6  # the norms' epsilon (RMSNorm or LayerNorm)
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3)
    sliding_window: int | None = None
    # Rotary positions turn only the first int(H * factor) dimensions of each head (Phi-4-mini: 0.75).
    partial_rotary_factor: float = 1.0
    torch_dtype: str = "float32"
    hidden_act: str = "silu"  # the MLP's activation (HF names: silu, gelu, gelu_new, relu, ...)
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
        rd = self.rotary_dim
        if self.partial_rotary_factor != 1.0 and not (0 < rd <= self.head_dim and rd % 2 == 0):
            raise ValueError(f"{self.architecture}: partial_rotary_factor={self.partial_rotary_factor} gives "
                             f"{self.rotary_dim} rotary dimensions of head_dim={self.head_dim} (needs an even number)")
        rs = self.rope_scaling
        if rs is not None and rs.rope_type == "longrope":
            for name in ("short_factor", "long_factor"):
                if len(getattr(rs, name)) != self.rotary_dim // 2:
                    raise ValueError(f"{self.architecture}: rope_scaling {name} has {len(getattr(rs, name))} "
                                     f"entries; the {self.rotary_dim} rotary dimensions need {self.rotary_dim // 2}")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def default_max_model_len(self) -> int:
        """The context the engine serves when max_model_len is not given: max_position_embeddings,
        except for longrope, whose default is its original context (vLLM's: short factors, no
        degradation on the lengths most requests have; a larger max_model_len selects the long ones)."""
        rs = self.rope_scaling
        if rs is not None and rs.rope_type == "longrope":
            return min(rs.original_max_position_embeddings, self.max_position_embeddings)
        return self.max_position_embeddings

    def with_max_model_len(self, max_model_len: int) -> "ModelConfig":
        """The model as an engine of this context length builds it: longrope's factor list is
        chosen once, by the context (RopeScaling), so cached keys never change rotation."""
        rs = self.rope_scaling
        if rs is None or rs.rope_type != "longrope":
            return self
        long = max_model_len > rs.original_max_position_embeddings
        return dataclasses.replace(self, rope_scaling=dataclasses.replace(rs, long_context=long))

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
    def attention_soft_cap(self) -> float | None:
        """The tanh cap on attention scores where some layer has one (Gemma 2; a family's config
        overrides this), read by the attention kernel choice as `sliding_window` is."""
        return None

    @property
    def kv_window(self) -> int | None:
        """The window every layer attends within, when all of them do: a sequence's KV blocks
        wholly before it can be freed. None where some layer attends to the whole context (a
        family with per-layer windows overrides this)."""
        return self.sliding_window

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
        """From a Hugging Face config.json dict, by the family of its architecture. An
        architecture this engine does not implement, or a config without a field the math needs,
        is a ValueError naming both."""
        from jaxengine.models.registry import get_family  # the registry imports the models

        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry")
        return get_family(archs[0]).config(cfg)

    @classmethod
    def from_json_file(cls, path: str | Path) -> "ModelConfig":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read model config {path}: {e}") from e
        return cls.from_hf_dict(data)
