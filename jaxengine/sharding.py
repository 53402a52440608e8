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

Mixture-of-experts layers (models/moe.py) hold their experts stacked, [E, D, F] and [E, F, D]: by
default each expert's F is split like a dense MLP's (gate/up column-, down row-parallel); with
expert parallelism (`make_plan(..., expert_parallel=True)`) the E axis is split instead, each
device holding whole experts. The router is replicated. The layer itself runs under `shard_map`.
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
    "router": (None, None),  # DE, replicated: every device routes every token
    "experts_gate": ("experts", None, "expert_ffn"),  # EDF
    "experts_up": ("experts", None, "expert_ffn"),  # EDF
    "experts_down": ("experts", "expert_ffn", None),  # EFD
}
KV_CACHE_AXES: tuple[str | None, ...] = (None, "kv_heads", None, None)  # [B, K, P, H]
RULES: dict[str, str] = {"vocab": "model", "heads": "model", "kv_heads": "model", "ffn": "model",
                         "expert_ffn": "model"}
EXPERT_PARALLEL_RULES: dict[str, str | None] = {"experts": "model", "expert_ffn": None}


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """Where every array of the engine lives for a given model and tensor_parallel_size."""

    mesh: Mesh
    rules: dict[str, str | None]
    kv_head_replicas: int = 1  # copies of each KV head (tensor_parallel_size > num_kv_heads)
    expert_parallel: bool = False  # MoE experts split over the devices (else each expert's F)

    @property
    def tp(self) -> int:
        return self.mesh.shape["model"]

    def spec(self, logical: tuple[str | None, ...]) -> PartitionSpec:
        return PartitionSpec(*(self.rules.get(a) if a else None for a in logical))

    def model_config(self, cfg: ModelConfig) -> ModelConfig:
        """The model this plan shards: each KV head repeated `kv_head_replicas` times, q/k/v
        and gate/up as separate parameters, and (expert parallelism) MoE layers told so."""
        cfg = cfg.with_kv_head_replicas(self.kv_head_replicas).with_split_projections()
        return cfg.with_expert_parallel() if self.expert_parallel else cfg

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


def make_plan(cfg: ModelConfig, tensor_parallel_size: int, devices: list | None = None, *,
              expert_parallel: bool = False) -> ShardingPlan:
    """Validates the split and builds the mesh over the first `tensor_parallel_size` devices.

    When `tensor_parallel_size` is a multiple of the KV heads, the plan's `kv_head_replicas` says
    how often each KV head is repeated. `expert_parallel`: an MoE model's experts are split over
    the devices instead of each expert's F. The model is built from `plan.model_config(cfg)`.
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
    _check_experts(cfg, tp, expert_parallel)
    if expert_parallel:
        rules.update(EXPERT_PARALLEL_RULES)
    if cfg.vocab_size % tp:
        rules["vocab"] = None  # an indivisible vocabulary stays replicated
    mesh = Mesh(np.asarray(devices[:tp]).reshape(1, tp), ("data", "model"))
    return ShardingPlan(mesh, rules, replicas, expert_parallel)


def _check_experts(cfg: ModelConfig, tp: int, expert_parallel: bool) -> None:
    experts = getattr(cfg, "num_experts", 0)  # MoE configs only (models/moe.py)
    if expert_parallel and not experts:
        raise ValueError(f"enable_expert_parallel: {cfg.architecture} has no experts (mixture-of-experts "
                         "models only)")
    if experts and expert_parallel and experts % tp:
        raise ValueError(f"num_experts={experts} is not divisible by tensor_parallel_size={tp} "
                         "(expert parallelism gives every device the same number of experts)")
    if experts and not expert_parallel and cfg.moe_intermediate_size % tp:
        raise ValueError(f"moe_intermediate_size={cfg.moe_intermediate_size} is not divisible by "
                         f"tensor_parallel_size={tp} (or split the experts: enable_expert_parallel)")
