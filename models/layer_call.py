"""Decoder layers applied through one jitted function, so that a forward program traces each kind
of layer once instead of once per layer.

A model's forward is a Python loop over its layers; unrolled, every layer is traced to a jaxpr
again, and with a few dozen layers and a program per token bucket that Python work (under one
interpreter lock, while the compiles run in threads) is much of a cold start. Here a layer is
split into its graph definition (static, equal for layers built alike) and its state, and applied
by one `jax.jit` function: JAX caches the trace by the graph definition and the abstract
arguments, so the second layer on reuses the first's jaxpr. The function is inlined into the
caller's jaxpr (`inline=True`): the program lowered and compiled is the unrolled loop's, op for
op. (Kept as calls instead, lowering is cheaper still, but XLA then fused the residual stream
differently at the layer boundaries on the CPU.) Layers that differ (a sliding-window layer beside
a global one) have other graph definitions and are traced once each.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx


def _merged_call(graphdef: nnx.GraphDef, state: nnx.State, static: tuple, args: tuple):
    layer = nnx.merge(graphdef, state)
    return layer(*_join(args, static))


_apply = jax.jit(_merged_call, static_argnums=(0, 2), inline=True)


def _join(args: tuple, static: tuple) -> tuple:
    """The call's arguments in order: `static` holds (position, value) pairs of the static ones."""
    out = list(args)
    for i, value in static:
        out.insert(i, value)
    return tuple(out)


def call_layer(layer: nnx.Module, *args, static: tuple[int, ...] = ()):
    """`layer(*args)` through the shared jitted function; `static`: positions of arguments that
    are not arrays (hashable objects, such as the attention backend), passed as static."""
    graphdef, state = nnx.split(layer)
    dyn = tuple(a for i, a in enumerate(args) if i not in static)
    fixed = tuple((i, args[i]) for i in sorted(static))
    return _apply(graphdef, state, fixed, dyn)
