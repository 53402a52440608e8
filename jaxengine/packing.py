"""One host-to-device copy per program call: a step's numpy inputs packed into one int32 buffer.

Every numpy argument of a jitted call is its own host-to-device copy, and on a GPU each costs the
host tens of microseconds whatever its size (lab/gpu_checks/gpu_dispatch_check.py measures it;
lab/results/dispatch_h200x2.md). A step's forward inputs (9 arrays) and sampling metadata
(12 arrays) therefore travel as two flat buffers: `pack` concatenates a pytree of 4-byte arrays
(int32, uint32, float32) bit for bit, and the program calls `unpack` with the `Layout` of the
same pytree, which slices the buffer at offsets fixed at trace time and reinterprets the bits.
Each leaf starts at a multiple of 256 bytes: XLA may hand a slice to a kernel as a view into the
buffer, and Mosaic GPU kernels require 256-byte aligned operands.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

ALIGN = 64  # int32 elements: each leaf starts 256 bytes after the previous start, or a multiple


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each leaf of a pytree lives in its packed buffer."""

    treedef: object
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    offsets: tuple[int, ...]
    size: int

    @classmethod
    def of(cls, tree) -> "Layout":
        """The layout of `tree`, whose leaves are arrays or ShapeDtypeStructs of 4-byte dtypes."""
        leaves, treedef = jax.tree.flatten(tree)
        shapes, dtypes, offsets, at = [], [], [], 0
        for leaf in leaves:
            dt = np.dtype(leaf.dtype)
            if dt.itemsize != 4:
                raise ValueError(f"packed inputs must be 4-byte arrays, got {dt} of shape {tuple(leaf.shape)}")
            shapes.append(tuple(leaf.shape))
            dtypes.append(dt)
            offsets.append(at)
            at += _padded(math.prod(leaf.shape))
        return cls(treedef, tuple(shapes), tuple(dtypes), tuple(offsets), at)

    def abstract(self, sharding=None) -> jax.ShapeDtypeStruct:
        """The packed buffer's shape and dtype, for ahead-of-time lowering."""
        return jax.ShapeDtypeStruct((self.size,), jnp.int32, sharding=sharding)


def pack(tree) -> np.ndarray:
    """The leaves of `tree` (numpy, 4-byte dtypes), flattened in pytree order into one int32 array,
    each padded with zeros to a multiple of ALIGN elements (the offsets of `Layout.of`)."""
    flats = [np.ascontiguousarray(leaf).reshape(-1).view(np.int32) for leaf in jax.tree.leaves(tree)]
    # One zeroed buffer written leaf by leaf: per step this runs twice with up to 18 leaves.
    out = np.zeros(sum(_padded(f.size) for f in flats), np.int32)
    at = 0
    for f in flats:
        out[at:at + f.size] = f
        at += _padded(f.size)
    return out


def unpack(flat: jax.Array, layout: Layout):
    """Inside a program: the pytree that `pack` flattened, from its int32 buffer `flat`."""
    if flat.shape != (layout.size,):
        raise ValueError(f"packed buffer has shape {flat.shape}, the layout needs ({layout.size},)")
    leaves = []
    for shape, dt, off in zip(layout.shapes, layout.dtypes, layout.offsets):
        part = flat[off:off + math.prod(shape)]
        if dt != np.int32:
            part = jax.lax.bitcast_convert_type(part, dt)
        leaves.append(part.reshape(shape))
    return jax.tree.unflatten(layout.treedef, leaves)
