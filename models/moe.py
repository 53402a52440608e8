"""Mixture-of-experts decoders: Mixtral (Jiang et al., 2024) and Qwen3-MoE (Qwen Team, 2025).

Llama's decoder (models/llama.py: attention, norms, rope; Qwen3-MoE adds Qwen3's q/k norm) with
the feed-forward replaced, in the sparse layers, by E experts of which each token uses k:

    p = router(x)  (float32 logits [T, E])
    Mixtral:    top-k logits, softmax over those k
    Qwen3-MoE:  softmax over all E, top-k, renormalised to sum 1 iff norm_topk_prob
    y = sum_j  p_j * down_e(act(gate_e(x)) * up_e(x)),  e = the token's j-th expert

(Mixtral's rule equals Qwen3-MoE's with renormalisation; both are written out as the families
state them.) Qwen3-MoE keeps the dense MLP (intermediate_size) in `mlp_only_layers` and in layers
whose index + 1 is not a multiple of `decoder_sparse_step`.

The layer has fixed shapes under jit. The T*k (token, expert) pairs are sorted by expert (argsort
of the flattened ids), the token rows gathered in that order, group sizes counted per expert,
and gate/up and down run as grouped matmuls (pallas_kernels/grouped_matmul.py) over the stacked
expert weights: gate/up [E, D, F] (one fused [E, D, 2F] on one device, as the dense MLP fuses
them), down [E, F, D]. The rows are then put back in token order and summed with their routing
weights. The bucket's padding rows (after the step's real tokens) are left out: they would
otherwise read experts no real token uses.
At decode (at most 256 rows) on an sm_80+ GPU the grouped matmul reads only the experts that
rows were routed to (the gathered kernel, pallas_kernels/grouped_matmul_gpu.py); the other paths
read every expert's weight.

Parallelism (jaxengine/sharding.py places the weights; the layer runs under `jax.shard_map` over
the mesh's "model" axis, which the engine's attention backend carries):
- tensor parallel (default): every device holds every expert's slice of F (gate/up columns,
  down rows), computes all T*k rows on its slice, and a psum adds the partial outputs;
- expert parallel (`enable_expert_parallel`): every device holds E / n whole experts. Each
  device routes all tokens (the router is replicated), sorts the pairs routed to its own experts
  first, runs the grouped matmuls over its experts only (pairs routed elsewhere sit past the
  groups' total and come out zero), and a psum over the axis adds each token's contributions from
  every device. Tokens are not exchanged all-to-all: every device sees every token (they are
  replicated between layers anyway), and the psum is the one collective, as in the tensor-parallel
  case.

Legend: T tokens, D model, E experts, F expert ffn, M = T*k sorted rows.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxengine.models import llama
from jaxengine.models import weights as w
from jaxengine.models.attention import Attention, AttentionMetadata, KVCache
from jaxengine.models.config import ModelConfig, hf_field
from jaxengine.models.layers import MLP, RMSNorm, activation
from jaxengine.models.lora import LoRALayer
from jaxengine.pallas_kernels.grouped_matmul import grouped_matmul

if TYPE_CHECKING:
    from jaxengine.attention_backend import AttentionBackend

MIXTRAL, QWEN3_MOE = "MixtralForCausalLM", "Qwen3MoeForCausalLM"


@dataclasses.dataclass(frozen=True)
class MoeConfig(ModelConfig):
    """`intermediate_size` is the dense layers' F (Qwen3-MoE's mlp_only_layers); the experts'
    is `moe_intermediate_size`."""

    num_experts: int = 8  # E
    num_experts_per_tok: int = 2  # k
    moe_intermediate_size: int = 0  # each expert's F
    norm_topk_prob: bool = True  # renormalise the top-k probabilities to sum 1 (Mixtral: always)
    sparse_layers: tuple[bool, ...] = ()  # per layer: experts (True) or the dense MLP
    expert_parallel: bool = False  # experts split over the devices (else each expert's F)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_experts <= 0 or not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"{self.architecture}: num_experts_per_tok={self.num_experts_per_tok} must be in "
                             f"[1, num_experts={self.num_experts}]")
        if self.moe_intermediate_size <= 0:
            raise ValueError(f"{self.architecture}: moe_intermediate_size must be positive, "
                             f"got {self.moe_intermediate_size}")
        if len(self.sparse_layers) != self.num_layers:
            raise ValueError(f"{self.architecture}: sparse_layers names {len(self.sparse_layers)} layers, "
                             f"the model has {self.num_layers}")

    def with_expert_parallel(self) -> "MoeConfig":
        return dataclasses.replace(self, expert_parallel=True)

    def num_params(self) -> int:
        """All parameters (every expert, not the ones a token uses)."""
        d, n_sparse = self.hidden_size, sum(self.sparse_layers)
        experts = self.num_experts * 3 * d * self.moe_intermediate_size + d * self.num_experts
        return super().num_params() + n_sparse * (experts - 3 * d * self.intermediate_size)


def config_from_hf(cfg: Mapping) -> MoeConfig:
    """Mixtral and Qwen3-MoE config.json -> MoeConfig. Training-only fields (router_aux_loss_coef,
    output_router_logits, router_jitter_noise) are ignored."""
    arch = cfg["architectures"][0]
    base = llama.config_from_hf(cfg)
    layers = base.num_layers
    experts = int(cfg.get("num_local_experts") or hf_field(cfg, "num_experts"))
    if arch == MIXTRAL:
        sliding = cfg.get("sliding_window")  # Mixtral attends within it whenever it is set
        return MoeConfig(**{**_fields(base), "sliding_window": int(sliding) if sliding else None},
                         num_experts=experts, num_experts_per_tok=int(cfg.get("num_experts_per_tok", 2)),
                         moe_intermediate_size=base.intermediate_size, norm_topk_prob=True,
                         sparse_layers=(True,) * layers)
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in cfg.get("mlp_only_layers") or ()}
    return MoeConfig(**_fields(base), num_experts=experts,
                     num_experts_per_tok=int(hf_field(cfg, "num_experts_per_tok")),
                     moe_intermediate_size=int(hf_field(cfg, "moe_intermediate_size")),
                     norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                     sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)))


def _fields(c: ModelConfig) -> dict:
    return {f.name: getattr(c, f.name) for f in dataclasses.fields(ModelConfig)}


# -- routing and the expert computation -------------------------------------------------------
def route(logits: jax.Array, k: int, norm_topk_prob: bool, softmax_of_topk: bool) -> tuple[jax.Array, jax.Array]:
    """Router logits [T, E] (float32) -> (weights [T, k] float32, expert ids [T, k] int32).
    softmax_of_topk: Mixtral's rule (softmax over the k largest logits); else softmax over all E,
    top-k, renormalised iff norm_topk_prob (Qwen3-MoE)."""
    if softmax_of_topk:
        top, ids = jax.lax.top_k(logits, k)
        return jax.nn.softmax(top, axis=-1), ids.astype(jnp.int32)
    top, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
    if norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top, ids.astype(jnp.int32)


def expert_ffn(x: jax.Array, weights: jax.Array, ids: jax.Array, gate: jax.Array, up: jax.Array | None, down: jax.Array,
               first_expert: jax.Array | int, act, num_tokens: jax.Array | int | None = None) -> jax.Array:
    """One device's share of the experts' output [T, D] (float32), for the experts it holds:
    gate/up [El, D, F'], down [El, F', D] are experts first_expert .. first_expert + El - 1 (all
    of them, or a slice of F under tensor parallelism); up None: gate is gate and up fused,
    [El, D, 2F] (gate columns first). Pairs routed to other experts add nothing.
    `num_tokens`: rows from it on are the bucket's padding; their pairs are left out (zero
    output), so they neither read experts no real token uses nor add matmul rows."""
    t, k = ids.shape
    n_local = gate.shape[0]
    local = ids.reshape(-1) - first_expert  # [M]
    mine = (local >= 0) & (local < n_local)
    if num_tokens is not None:
        mine &= jnp.repeat(jnp.arange(t) < num_tokens, k)
    key = jnp.where(mine, local, n_local)  # pairs of other devices' experts sort last
    order = jnp.argsort(key, stable=True)  # [M]
    sizes = jnp.zeros((n_local + 1,), jnp.int32).at[key].add(1)[:n_local]  # [El]
    xs = x[order // k]  # [M, D]
    if up is None:  # gate is gate and up fused, [El, D, 2F]
        g, u = jnp.split(grouped_matmul(xs, gate, sizes), 2, axis=-1)
    else:
        g, u = grouped_matmul(xs, gate, sizes), grouped_matmul(xs, up, sizes)
    h = act(g) * u  # [M, F']
    ys = grouped_matmul(h, down, sizes)  # [M, D]; rows past sum(sizes) are zero
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    y = ys[inverse].reshape(t, k, -1).astype(jnp.float32)  # back in (token, j) order
    wts = jnp.where(mine, weights.reshape(-1), 0.0).reshape(t, k, 1)
    return jnp.sum(y * wts, axis=1)


class SparseMoeBlock(nnx.Module):
    """Router + stacked experts (module docstring)."""

    def __init__(self, cfg: MoeConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        d, f, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        init = nnx.initializers.normal(0.02)
        self.router = nnx.Param(init(rngs.params(), (d, e), dtype))  # DE
        self.fused = cfg.fused_projections  # gate and up as one [E, D, 2F] (one grouped matmul); split under TP
        if self.fused:
            self.experts_gate_up = nnx.Param(init(rngs.params(), (e, d, 2 * f), dtype))  # ED(F+F)
        else:
            self.experts_gate = nnx.Param(init(rngs.params(), (e, d, f), dtype))  # EDF
            self.experts_up = nnx.Param(init(rngs.params(), (e, d, f), dtype))  # EDF
        self.experts_down = nnx.Param(init(rngs.params(), (e, f, d), dtype))  # EFD
        self.k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.softmax_of_topk = cfg.architecture == MIXTRAL
        self.expert_parallel = cfg.expert_parallel
        self.act = activation(cfg.hidden_act, cfg.architecture)

    def __call__(self, x: jax.Array, mesh: jax.sharding.Mesh | None = None,
                 num_tokens: jax.Array | None = None) -> jax.Array:
        """x [T, D] -> [T, D]. `mesh`: the tensor-parallel mesh (None on one device);
        `num_tokens` (int32 []): rows from it on are padding, left out of the experts."""
        router, down = self.router[...], self.experts_down[...]
        if self.fused:  # one device: expert_ffn takes the fused weight, `up` unused
            gate, up = self.experts_gate_up[...], None
        else:
            gate, up = self.experts_gate[...], self.experts_up[...]
        num_tokens = jnp.asarray(x.shape[0] if num_tokens is None else num_tokens, jnp.int32)
        sharded = mesh is not None and mesh.shape["model"] > 1

        def local(x, num_tokens, router, gate, up, down):
            logits = jnp.einsum("TD,DE->TE", x.astype(jnp.float32), router.astype(jnp.float32))
            weights, ids = route(logits, self.k, self.norm_topk_prob, self.softmax_of_topk)
            first = jax.lax.axis_index("model") * gate.shape[0] if sharded and self.expert_parallel else 0
            y = expert_ffn(x, weights, ids, gate, up, down, first, self.act, num_tokens).astype(x.dtype)
            return jax.lax.psum(y, "model") if sharded else y  # partial sums in the model dtype

        if not sharded:
            return local(x, num_tokens, router, gate, up, down)
        assert not self.fused, "a model under a plan is built with split projections (plan.model_config)"
        from jaxengine.attention_backend import shard_map

        wspec = (P("model", None, None),) * 3 if self.expert_parallel else \
            (P(None, None, "model"), P(None, None, "model"), P(None, "model", None))
        return shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), *wspec), out_specs=P())(
            x, num_tokens, router, gate, up, down)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: MoeConfig, dtype: jnp.dtype, rngs: nnx.Rngs, index: int):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype)
        self.sparse = cfg.sparse_layers[index]
        self.mlp = SparseMoeBlock(cfg, dtype, rngs) if self.sparse else MLP(cfg, dtype, rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, kv: KVCache, md: AttentionMetadata,
                 attention: AttentionBackend, lora: LoRALayer | None = None) -> tuple[jax.Array, KVCache]:
        assert lora is None, "the engine refuses LoRA for MoE models"
        h, kv = self.self_attn(self.input_layernorm(x), positions, kv, md, attention)
        x = x + h
        h = self.post_attention_layernorm(x)
        if self.sparse:  # the step's real tokens come first; the bucket's padding after them
            return x + self.mlp(h, attention.mesh, md.query_start_loc[md.num_seqs[0]]), kv
        return x + self.mlp(h), kv


class ForCausalLM(llama.ForCausalLM):
    decoder_layer = DecoderLayer


# -- checkpoint names ---------------------------------------------------------------------------
# A rule with an `expert` group fills slice `expert` of a stacked [E, ...] parameter (the loader
# stacks them: models/loader.py).
_LAYER = llama._LAYER
_MIXTRAL_EXPERT = _LAYER + r"block_sparse_moe\.experts\.(?P<expert>\d+)\."
_QWEN_EXPERT = _LAYER + r"mlp\.experts\.(?P<expert>\d+)\."
MIXTRAL_WEIGHTS: tuple[w.WeightRule, ...] = llama.WEIGHTS + (
    w.rule(_LAYER + r"block_sparse_moe\.gate\.weight", ("mlp", "router"), w.transpose),
    w.rule(_MIXTRAL_EXPERT + r"w1\.weight", ("mlp", "experts_gate"), w.transpose),
    w.rule(_MIXTRAL_EXPERT + r"w3\.weight", ("mlp", "experts_up"), w.transpose),
    w.rule(_MIXTRAL_EXPERT + r"w2\.weight", ("mlp", "experts_down"), w.transpose),
)
QWEN3_MOE_WEIGHTS: tuple[w.WeightRule, ...] = llama.WEIGHTS + (
    w.rule(_LAYER + r"mlp\.gate\.weight", ("mlp", "router"), w.transpose),
    w.rule(_QWEN_EXPERT + r"gate_proj\.weight", ("mlp", "experts_gate"), w.transpose),
    w.rule(_QWEN_EXPERT + r"up_proj\.weight", ("mlp", "experts_up"), w.transpose),
    w.rule(_QWEN_EXPERT + r"down_proj\.weight", ("mlp", "experts_down"), w.transpose),
)
IGNORED = llama.IGNORED
