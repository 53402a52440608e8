"""LoRA on the device: adapter deltas for a batch whose tokens use different adapters.

Each target projection W (q, k, v, o, gate, up, down) of each layer holds every device slot's
adapter side by side: A [in, S*R] and B [S*R, out] (S = max_loras slots, R = max_lora_rank; an
adapter of smaller rank is zero-padded, its scaling folded into B). A token's slot (0: no adapter)
becomes a [S*R] mask that keeps only its adapter's R columns, so for the whole batch

    y = x W + ((x A) * mask) B

is two thin matmuls per projection, one program whatever mix of adapters the step holds; loading
an adapter writes its slot's columns and never recompiles (jaxengine/lora.py keeps the host side).

Legend: T tokens, S slots, R rank.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoRALayer:
    """One layer's adapters and the step's token mask."""

    mask: jax.Array  # [T, S*R] 1 where a column belongs to the token's adapter
    weights: dict[str, tuple[jax.Array, jax.Array]]  # target -> (A [in, S*R], B [S*R, out])

    def delta(self, target: str, x: jax.Array) -> jax.Array:
        """x [T, in] -> the adapters' [T, out] addition to projection `target`."""
        a, b = self.weights[target]
        return ((x @ a) * self.mask.astype(x.dtype)) @ b


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoRAInputs:
    """What a forward with adapters takes: the step's mask and every layer's slot arrays."""

    mask: jax.Array  # [T, S*R]
    layers: list[dict[str, tuple[jax.Array, jax.Array]]]

    def layer(self, i: int) -> LoRALayer:
        return LoRALayer(self.mask, self.layers[i])


def token_mask(slots: jax.Array, num_slots: int, rank: int) -> jax.Array:
    """slots [T] int32 (0: none, 1..S) -> [T, S*R] float32 mask of each token's adapter columns."""
    onehot = (slots[:, None] == jnp.arange(1, num_slots + 1)[None, :]).astype(jnp.float32)  # [T, S]
    return jnp.repeat(onehot, rank, axis=1)


def target_shapes(hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int
                  ) -> dict[str, tuple[int, int]]:
    """(in, out) of each target projection, flattened."""
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate), "down_proj": (intermediate, hidden)}
