"""LoRA on the device: adapter deltas for a batch whose tokens use different adapters.

Each target projection W (q, k, v, o, gate, up, down) of each layer holds every device slot's
adapter side by side: A [in, S*R] and B [S*R, out] (S = max_loras slots, R = max_lora_rank; an
adapter of smaller rank is zero-padded, its scaling folded into B). A token's slot (0: no adapter)
becomes a [S*R] mask that keeps only its adapter's R columns, so for the whole batch

    y = x W + ((x A) * mask) B

is two thin matmuls per projection, one program whatever mix of adapters the step holds; loading
an adapter writes its slot's columns and never recompiles (jaxengine/lora.py keeps the host side).

Thin matmuls cost a launch each more than their flops, so projections that read the same input
share one A matmul (q, k and v: `qkv_a`; gate and up: `gu_a`) and projections of equal shapes share
one batched B matmul (k and v: `kv_b`; gate and up: `gu_b`): nine matmuls a layer instead of
fourteen. Every array keeps its own output axis, so tensor parallelism splits B (column-parallel
q/k/v/gate/up) or A (row-parallel o/down) on an axis of its own.

Legend: T tokens, S slots, R rank, G stacked projections.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Where each target's A and B live in a layer's arrays: (A array, index along its stacked column
# blocks), (B array, index along its stacked leading axis, or None for an unstacked B).
LAYOUT: dict[str, tuple[tuple[str, int], tuple[str, int | None]]] = {
    "q_proj": (("qkv_a", 0), ("q_b", None)),
    "k_proj": (("qkv_a", 1), ("kv_b", 0)),
    "v_proj": (("qkv_a", 2), ("kv_b", 1)),
    "o_proj": (("o_a", 0), ("o_b", None)),
    "gate_proj": (("gu_a", 0), ("gu_b", 0)),
    "up_proj": (("gu_a", 1), ("gu_b", 1)),
    "down_proj": (("down_a", 0), ("down_b", None)),
}


def layer_shapes(hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int,
                 slots: int, rank: int) -> dict[str, tuple[int, ...]]:
    """Shapes of one layer's LoRA arrays (see LAYOUT)."""
    q, kv, sr = num_heads * head_dim, num_kv_heads * head_dim, slots * rank
    return {"qkv_a": (hidden, 3 * sr), "q_b": (sr, q), "kv_b": (2, sr, kv), "o_a": (q, sr), "o_b": (sr, hidden),
            "gu_a": (hidden, 2 * sr), "gu_b": (2, sr, intermediate), "down_a": (intermediate, sr),
            "down_b": (sr, hidden)}


# Axis each array splits over the devices under tensor parallelism (None: replicated).
TP_AXIS: dict[str, int | None] = {"qkv_a": None, "q_b": 1, "kv_b": 2, "o_a": 0, "o_b": None, "gu_a": None,
                                  "gu_b": 2, "down_a": 0, "down_b": None}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoRALayer:
    """One layer's adapters and the step's token mask."""

    mask: jax.Array  # [T, S*R] 1 where a column belongs to the token's adapter
    arrays: dict[str, jax.Array]  # layer_shapes' arrays

    def _masked(self, xa: jax.Array, groups: int) -> jax.Array:
        """[T, G*S*R] -> [G, T, S*R] with every column outside the token's adapter zeroed."""
        t, sr = self.mask.shape
        return jnp.moveaxis(xa.reshape(t, groups, sr), 1, 0) * self.mask.astype(xa.dtype)[None]

    def qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [T, D] -> the q, k and v deltas [T, N*H], [T, K*H], [T, K*H]."""
        xa = self._masked(x @ self.arrays["qkv_a"], 3)  # [3, T, SR]
        kv = jnp.einsum("GTR,GRO->GTO", xa[1:], self.arrays["kv_b"])
        return xa[0] @ self.arrays["q_b"], kv[0], kv[1]

    def o(self, x: jax.Array) -> jax.Array:
        """x [T, N*H] -> the o delta [T, D]."""
        return self._masked(x @ self.arrays["o_a"], 1)[0] @ self.arrays["o_b"]

    def gate_up(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [T, D] -> the gate and up deltas [T, F] each."""
        gu = jnp.einsum("GTR,GRO->GTO", self._masked(x @ self.arrays["gu_a"], 2), self.arrays["gu_b"])
        return gu[0], gu[1]

    def down(self, h: jax.Array) -> jax.Array:
        """h [T, F] -> the down delta [T, D]."""
        return self._masked(h @ self.arrays["down_a"], 1)[0] @ self.arrays["down_b"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoRAInputs:
    """What a forward with adapters takes: the step's mask and every layer's slot arrays."""

    mask: jax.Array  # [T, S*R]
    layers: list[dict[str, jax.Array]]

    def layer(self, i: int) -> LoRALayer:
        return LoRALayer(self.mask, self.layers[i])


def token_mask(slots: jax.Array, num_slots: int, rank: int) -> jax.Array:
    """slots [T] int32 (0: none, 1..S) -> [T, S*R] float32 mask of each token's adapter columns."""
    onehot = (slots[:, None] == jnp.arange(1, num_slots + 1)[None, :]).astype(jnp.float32)  # [T, S]
    return jnp.repeat(onehot, rank, axis=1)


def write_slot(arrays: list[dict[str, jax.Array]], adapter: list[dict[str, tuple[jax.Array, jax.Array]]],
               slot: jax.Array, num_slots: int) -> list[dict[str, jax.Array]]:
    """The layers' arrays with slot `slot` (1..S) holding `adapter` (per layer, target -> (A [in, R],
    B [R, out]), rank-padded, scaling folded into B). `slot` may be traced: one program serves
    every slot."""
    out = []
    for layer, new in zip(arrays, adapter):
        layer = dict(layer)
        for target, ((a_name, a_idx), (b_name, b_idx)) in LAYOUT.items():
            a_new, b_new = new[target]
            r = a_new.shape[1]
            col = (slot - 1) * r
            a = layer[a_name]
            layer[a_name] = jax.lax.dynamic_update_slice(a, a_new.astype(a.dtype), (0, a_idx * num_slots * r + col))
            b = layer[b_name]
            if b_idx is None:
                layer[b_name] = jax.lax.dynamic_update_slice(b, b_new.astype(b.dtype), (col, 0))
            else:
                layer[b_name] = jax.lax.dynamic_update_slice(b, b_new.astype(b.dtype)[None], (b_idx, col, 0))
        out.append(layer)
    return out
