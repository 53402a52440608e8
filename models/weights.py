"""Checkpoint-name tables: how each family's tensors become its parameters.

A family lists `WeightRule`s: a regular expression over the Hugging Face tensor name (the first
group, when there is one, is the layer index) and the parameters the tensor fills, each with a
layout transform from the checkpoint's layout to the model's. A rule with a group named `expert`
fills one slice of a stacked [E, ...] parameter (an MoE layer's experts: models/moe.py); the
loader stacks the slices. One tensor may fill several
parameters (GPT-2's fused `c_attn` fills q, k and v); the loader fuses parts back together where
the model holds them fused (`FUSED`). Every shape is checked by the loader, not here.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import jax
import numpy as np

from jaxengine.models.config import ModelConfig

Path = tuple[str | int, ...]
Transform = Callable[[np.ndarray, ModelConfig], np.ndarray]


@dataclasses.dataclass(frozen=True)
class WeightRule:
    pattern: str  # regex over the whole tensor name; group 1, if any, is the layer index; (?P<expert>...)
    targets: tuple[tuple[Path, Transform], ...]  # (parameter path, below the layer when indexed; transform)

    @property
    def compiled(self) -> re.Pattern:
        return _compile(self.pattern)


def rule(pattern: str, path: Path, transform: Transform) -> WeightRule:
    """A tensor that fills one parameter."""
    return WeightRule(pattern, ((path, transform),))


_CACHE: dict[str, re.Pattern] = {}


def _compile(pattern: str) -> re.Pattern:
    if pattern not in _CACHE:
        _CACHE[pattern] = re.compile(pattern + r"$")
    return _CACHE[pattern]


# Parameters a model holds fused when ModelConfig.fused_projections (one matmul instead of several;
# split under tensor parallelism, and jaxengine.sharding has rules for the parts only):
# fused name -> (its parts, in order; the axis they are concatenated along).
FUSED: dict[str, tuple[tuple[str, ...], int]] = {
    "qkv_proj": (("q_proj", "k_proj", "v_proj"), 1),  # [D, N + 2K, H]
    "gate_up_proj": (("gate_proj", "up_proj"), 1),  # [D, 2F]
    "experts_gate_up": (("experts_gate", "experts_up"), 1),  # [E, D, 2F]; the axis within one expert's [D, 2F]
}


# -- layout transforms: Hugging Face layout -> ours ---------------------------------------------
def same(w: np.ndarray, c: ModelConfig) -> np.ndarray:
    return w


def transpose(w: np.ndarray, c: ModelConfig) -> np.ndarray:
    """torch Linear [out, in] -> ours [in, out]."""
    return w.T


def heads_in(n_attr: str) -> Transform:
    """Linear [heads*H, D] -> ours [D, heads, H]."""
    def f(w: np.ndarray, c: ModelConfig) -> np.ndarray:
        return w.T.reshape(c.hidden_size, getattr(c, n_attr), c.head_dim)
    return f


def heads_bias(n_attr: str) -> Transform:
    return lambda b, c: b.reshape(getattr(c, n_attr), c.head_dim)


def kv_heads_in(w: np.ndarray, c: ModelConfig) -> np.ndarray:
    """Linear [K*H, D] -> ours [D, K * replicas, H], each KV head repeated in place."""
    w = w.T.reshape(c.hidden_size, c.checkpoint_kv_heads, c.head_dim)
    return np.repeat(w, c.kv_head_replicas, axis=1) if c.kv_head_replicas > 1 else w


def kv_heads_bias(b: np.ndarray, c: ModelConfig) -> np.ndarray:
    b = b.reshape(c.checkpoint_kv_heads, c.head_dim)
    return np.repeat(b, c.kv_head_replicas, axis=0) if c.kv_head_replicas > 1 else b


def o_proj(w: np.ndarray, c: ModelConfig) -> np.ndarray:
    """Linear [D, N*H] -> ours [N, H, D]."""
    return w.T.reshape(c.num_heads, c.head_dim, c.hidden_size)


def flatten_paths(tree: dict, prefix: Path = ()) -> dict[Path, object]:
    """A nested dict of parameters -> {path tuple: leaf}."""
    out: dict[Path, object] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten_paths(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


def set_path(tree: dict, path: Path, value: object) -> None:
    """Sets the leaf at `path` of a nested dict."""
    for k in path[:-1]:
        tree = tree[k]
    tree[path[-1]] = value


class ShapeOnlyRngs:
    """Stands in for nnx.Rngs while the abstract model is traced: every initializer gets the same
    key, as only shapes and dtypes are kept. nnx.Rngs would split a fresh key, under tracing, for
    each of the model's parameters (most of the abstract model's build time)."""

    def __init__(self):
        self._key = jax.random.key(0)

    def params(self) -> jax.Array:
        return self._key
