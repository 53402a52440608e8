"""Tensor parallelism: one mesh, logical axis names on every parameter, one rules table.

Mesh axes ("data", "model"). Parameters are named by the trailing path of their NNX state entry;
LOGICAL_AXES gives each one logical axis name per dimension, and RULES maps logical names to mesh
axes: q/k/v and gate/up column-parallel, o/down row-parallel, embedding and LM head
vocab-parallel, the KV cache sharded over KV heads (each KV head repeated when there are fewer KV
heads than devices, so every device holds the one its query heads read). The model under a plan
is built from `plan.model_config(cfg)`: KV heads repeated as needed, and q/k/v and gate/up as
separate parameters (only the parts have rules: column shards of a fused weight would mix them).
XLA (GSPMD) inserts the collectives; the attention call, which Pallas cannot auto-partition, runs
under `shard_map` over the heads (jaxengine.attention_backend).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxengine.models.config import ModelConfig

# Logical axes per parameter (by the last one or two entries of its state path).
LOGICAL_AXES: dict[str, tuple[str | None, ...]] = {
    "embed_tokens": ("vocab", None),  # VD
    "lm_head": (None, "vocab"),  # DV
    "q_proj": (None, "heads", None),  # DNH
    "k_proj": (None, "kv_heads", None),  # DKH
    "v_proj": (None, "kv_heads", None),  # DKH
    "o_proj": ("heads", None, None),  # NHD
    "q_bias": ("heads", None),
    "k_bias": ("kv_heads", None),
    "v_bias": ("kv_heads", None),
    "gate_proj": (None, "ffn"),  # DF
    "up_proj": (None, "ffn"),  # DF
    "down_proj": ("ffn", None),  # FD
    "weight": (None,),  # every norm's scale (model, per-layer and q/k norms): replicated
    "bias": (None,),  # LayerNorm shifts: replicated
    "embed_positions": (None, None),  # learned positions (GPT-2, OPT): replicated
    "o_bias": (None,),  # added after the row-parallel o_proj's reduction
    "up_bias": ("ffn",),
    "down_bias": (None,),
    "project_in": (None, None),  # OPT's embedding-width projections: replicated
    "project_out": (None, None),
}
KV_CACHE_AXES: tuple[str | None, ...] = (None, "kv_heads", None, None)  # [B, K, P, H]
RULES: dict[str, str] = {"vocab": "model", "heads": "model", "kv_heads": "model", "ffn": "model"}


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """Where every array of the engine lives for a given model and tensor_parallel_size."""

    mesh: Mesh
    rules: dict[str, str | None]
    kv_head_replicas: int = 1  # copies of each KV head (tensor_parallel_size > num_kv_heads)

    @property
    def tp(self) -> int:
        return self.mesh.shape["model"]

    def spec(self, logical: tuple[str | None, ...]) -> PartitionSpec:
        return PartitionSpec(*(self.rules.get(a) if a else None for a in logical))

    def model_config(self, cfg: ModelConfig) -> ModelConfig:
        """The model this plan shards: each KV head repeated `kv_head_replicas` times, and q/k/v
        and gate/up as separate parameters."""
        return cfg.with_kv_head_replicas(self.kv_head_replicas).with_split_projections()

    def param_sharding(self, path: tuple) -> NamedSharding:
        name = str(path[-1])
        if name not in LOGICAL_AXES:
            raise KeyError(f"no logical axes for parameter {'.'.join(map(str, path))} (a model under "
                           "tensor parallelism is built from plan.model_config(cfg))")
        return NamedSharding(self.mesh, self.spec(LOGICAL_AXES[name]))

    def kv_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(KV_CACHE_AXES))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())


def make_plan(cfg: ModelConfig, tensor_parallel_size: int, devices: list | None = None) -> ShardingPlan:
    """Validates the split and builds the mesh over the first `tensor_parallel_size` devices.

    When `tensor_parallel_size` is a multiple of the KV heads, the plan's `kv_head_replicas` says
    how often each KV head is repeated. The model is built from `plan.model_config(cfg)`.
    """
    tp = tensor_parallel_size
    devices = list(devices if devices is not None else jax.devices())
    if tp > len(devices):
        raise ValueError(f"tensor_parallel_size={tp} exceeds the {len(devices)} available devices")
    if cfg.num_heads % tp:
        raise ValueError(f"num_heads={cfg.num_heads} is not divisible by tensor_parallel_size={tp}")
    replicas = 1
    if cfg.num_kv_heads % tp:
        if tp % cfg.num_kv_heads:
            raise ValueError(f"num_kv_heads={cfg.num_kv_heads} and tensor_parallel_size={tp}: one must divide "
                             "the other (KV heads are split over the devices, or repeated so each has one)")
        replicas = tp // cfg.num_kv_heads
    if cfg.intermediate_size % tp:
        raise ValueError(f"intermediate_size={cfg.intermediate_size} is not divisible by tensor_parallel_size={tp}")
    rules: dict[str, str | None] = dict(RULES)
    if cfg.vocab_size % tp:
        rules["vocab"] = None  # an indivisible vocabulary stays replicated
    mesh = Mesh(np.asarray(devices[:tp]).reshape(1, tp), ("data", "model"))
    return ShardingPlan(mesh, rules, replicas)
