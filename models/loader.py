"""Builds a model's parameters from a checkpoint (or at random for `load_format="dummy"`).

Loading is table-driven and lives outside the model classes: each Hugging Face tensor name maps to
a parameter path plus a layout transform. Every shape is checked, and missing and unexpected
tensors are reported together by name.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.models.config import ModelConfig
from jaxengine.models.kv_scales import ATTENTION_SCALE
from jaxengine.models.quant_formats import QuantizedCheckpoint, QuantScheme, dummy_quantized, quantize_on_device
from jaxengine.models.quantization import concat_outputs, is_quantized, with_model_shape
from jaxengine.models.registry import Family, get_family, get_model_class
from jaxengine.models.weights import FUSED, Path, ShapeOnlyRngs, Transform, flatten_paths, set_path

logger = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}


def _fused_path(path: Path, expected: dict) -> Path | None:
    """The fused parameter that `path` (a part of it) belongs to in this model, if any."""
    fused = _FUSED_OF.get(str(path[-1]))
    if fused is None or path in expected or path[:-1] + (fused,) not in expected:
        return None
    return path[:-1] + (fused,)


_FUSED_OF = {part: fused for fused, (parts, _) in FUSED.items() for part in parts}


def param_paths(name: str, family: Family) -> list[tuple[Path, Transform, int | None]]:
    """HF tensor name -> the (parameter path in the NNX state, layout transform, expert index) it
    fills; [] if none. The expert index (a rule's `expert` group) is the slice of a stacked
    [E, ...] parameter the tensor fills; None for a whole parameter."""
    for r in family.weights:
        m = r.compiled.match(name)
        if m:
            layer = ("model", "layers", int(m.group(1))) if m.groups() else ()
            expert = m.groupdict().get("expert")
            return [(layer + path, fn, None if expert is None else int(expert)) for path, fn in r.targets]
    return []


class _ExpertStacks:
    """Stacked [E, ...] parameters filled one expert (and, for a fused parameter, one part) at a
    time: each in a preallocated host array of the model's dtype, placed (and dropped from the
    host) as soon as its last slice arrives, so only the stacks of the layers being read are held."""

    def __init__(self, expected: dict, dtype: jnp.dtype, put: Callable[[Path, np.ndarray], jax.Array]):
        self.expected, self.dtype, self.put = expected, np.dtype(dtype), put
        self.open: dict[Path, tuple[np.ndarray, set[tuple[int, int]], tuple[str, ...]]] = {}  # still filling
        self.finished: dict[Path, jax.Array] = {}  # placed
        self.targets: set[Path] = set()  # every stacked parameter that some tensor filled

    def add(self, name: str, path: Path, expert: int, arr: np.ndarray | None, raw_shape: tuple) -> str | None:
        """Fills expert `expert` of `path` (a part of a fused stack where the model holds one);
        returns an error text, or None."""
        target, parts, axis = path, (str(path[-1]),), 0
        fused = _FUSED_OF.get(str(path[-1]))
        if path not in self.expected and fused is not None:
            target = path[:-1] + (fused,)
            parts, axis = FUSED[fused]
        want = tuple(self.expected[target].shape)
        part_shape = tuple(n // len(parts) if i == axis else n for i, n in enumerate(want[1:]))
        if arr is None or expert >= want[0] or tuple(arr.shape) != part_shape:
            return f"{name}: checkpoint shape {raw_shape} does not fit expert {expert} of parameter {want}"
        self.targets.add(target)
        if target not in self.open:
            self.open[target] = (np.empty(want, self.dtype), set(), parts)
        stack, filled, _ = self.open[target]
        part = parts.index(str(path[-1]))
        width = part_shape[axis]
        index = (expert,) + (slice(None),) * axis + (slice(part * width, (part + 1) * width),)
        stack[index] = arr
        filled.add((expert, part))
        if len(filled) == want[0] * len(parts):
            self.finished[target] = self.put(target, self.open.pop(target)[0])
        return None

    def missing(self) -> list[str]:
        """Expert slices never read, by parameter (or part) and index."""
        return [f"{'.'.join(map(str, p[:-1] + (part,)))}[expert {e}]" for p, (stack, filled, parts) in self.open.items()
                for e in range(stack.shape[0]) for i, part in enumerate(parts) if (e, i) not in filled]


READ_AHEAD = 4  # tensors read from the checkpoint ahead of the one being placed


def _read_ahead(checkpoint, names: list[str]):
    """`checkpoint.get_tensor` of each name in order, the next READ_AHEAD read meanwhile on one
    thread (file reads release the GIL)."""
    with ThreadPoolExecutor(1, thread_name_prefix="jaxengine-read") as pool:
        pending = [pool.submit(checkpoint.get_tensor, n) for n in names[:READ_AHEAD]]
        for i in range(len(names)):
            if i + READ_AHEAD < len(names):
                pending.append(pool.submit(checkpoint.get_tensor, names[i + READ_AHEAD]))
            yield pending[i].result()
            pending[i] = None  # the caller holds the array now


def resolve_dtype(dtype: str, cfg: ModelConfig) -> jnp.dtype:
    if dtype == "auto":
        return DTYPES[cfg.torch_dtype]
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def abstract_model(cfg: ModelConfig, dtype: jnp.dtype):
    """(graphdef, abstract state) without allocating any weights."""
    cls = get_model_class(cfg.architecture)
    abstract = nnx.eval_shape(lambda: cls(cfg, dtype, rngs=ShapeOnlyRngs()))
    return nnx.split(abstract)


def load_params(checkpoint, cfg: ModelConfig, dtype: jnp.dtype, *,
                put: Callable[[Path, np.ndarray], jax.Array] | None = None,
                quantization: QuantScheme | None = None):
    """Reads every tensor of `checkpoint` into a new state; returns (graphdef, state).

    `put(path, array)` places one parameter on device(s) (default: `jax.device_put`), so a
    sharded placement can load each tensor straight into its shards. The next tensors are read on
    a thread while one is placed (file reads and device copies then overlap). A fused parameter
    (q/k/v, gate/up) is joined and placed as soon as its last part is read, so the host holds the
    parts of one layer at a time. `quantization`: the linear weights are read from the scheme's
    tensors (a quantized checkpoint) or quantized once placed (fp8 at load time); see
    models/quant_formats.py.
    """
    graphdef, abs_state = abstract_model(cfg, dtype)
    pure = nnx.to_pure_dict(abs_state)
    expected = flatten_paths(pure)
    plain_put = put or (lambda path, arr: jax.device_put(arr))

    def put(path: Path, arr):
        if is_quantized(arr):
            return jax.tree.map(lambda a: plain_put(path, a), arr)
        return quantize_on_device(path, plain_put(path, arr), quantization)

    def join_fused(path: Path, got: dict[str, tuple[str, np.ndarray]]) -> str | None:
        """Places a fused parameter from all its parts (in order along its axis); an error text or None."""
        parts, axis = FUSED[str(path[-1])]
        want = tuple(expected[path].shape)
        pieces = [got[p][1] for p in parts]
        try:
            if any(is_quantized(a) for a in pieces):
                arr = with_model_shape(concat_outputs(pieces), str(path[-1]), want, dtype)
            else:
                arr = np.concatenate(pieces, axis)
        except ValueError:
            arr = None
        if arr is None or tuple(arr.shape) != want:
            shapes = ", ".join(f"{got[p][0]} {tuple(got[p][1].shape)}" for p in parts)
            return f"{shapes}: do not fit fused parameter {want}"
        set_path(pure, path, put(path, arr if is_quantized(arr) else np.asarray(arr).astype(dtype, copy=False)))
        return None

    if quantization is not None and quantization.from_checkpoint:
        checkpoint = QuantizedCheckpoint(checkpoint, quantization, cfg)
    unexpected, bad_shapes, seen = [], [], set()
    parts_read: dict[Path, dict[str, tuple[str, np.ndarray]]] = {}  # fused path -> part -> (name, array)
    family = get_family(cfg.architecture)
    ignored = re.compile(family.ignored + r"$")
    stacks = _ExpertStacks(expected, dtype, put)
    to_read = []  # (name, hits, experts) of every tensor the model takes
    for name in checkpoint.tensor_names():
        if ignored.match(name) or ATTENTION_SCALE.search(name):  # KV scales: read by models/kv_scales.py
            continue
        hits = param_paths(name, family)
        experts = {path: expert for path, _, expert in hits}
        hits = [(path, fn, _fused_path(path, expected)) for path, fn, _ in hits]
        if not hits or any(path not in expected and fused is None for path, _, fused in hits):
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue  # some tied checkpoints still store the head
            unexpected.append(name)
            continue
        to_read.append((name, hits, experts))
    for (name, hits, experts), raw in zip(to_read, _read_ahead(checkpoint, [n for n, _, _ in to_read])):
        raw = raw if is_quantized(raw) else np.asarray(raw)
        for path, fn, fused in hits:
            try:
                arr = raw if is_quantized(raw) else fn(raw, cfg)  # quantized: flat (K, N), no layout change
            except ValueError:
                arr = None
            if experts[path] is not None:
                error = stacks.add(name, path, experts[path], arr, tuple(raw.shape))
                if error:
                    bad_shapes.append(error)
                seen.add(fused or path)  # incomplete stacks are reported by their missing experts
                continue
            if fused is not None and arr is not None:
                got = parts_read.setdefault(fused, {})
                got[str(path[-1])] = (name, arr)  # shape checked once whole
                if len(got) == len(FUSED[str(fused[-1])][0]):  # joined at once: the parts are freed
                    error = join_fused(fused, parts_read.pop(fused))
                    if error:
                        bad_shapes.append(error)
                    seen.add(fused)
                continue
            want = tuple(expected[fused or path].shape)
            if is_quantized(arr):
                try:
                    arr = with_model_shape(arr, str(path[-1]), want, dtype)
                except (KeyError, ValueError) as e:
                    bad_shapes.append(f"{name}: {e}")
                    continue
            elif arr is None or tuple(arr.shape) != want:
                bad_shapes.append(f"{name}: checkpoint shape {tuple(raw.shape)} does not fit parameter {want}")
                continue
            set_path(pure, path, put(path, arr if is_quantized(arr) else np.asarray(arr).astype(dtype, copy=False)))
            seen.add(path)
    missing_parts = []
    for path in [p for p in expected if str(p[-1]) in FUSED and p not in stacks.targets and p not in seen]:
        got = parts_read.pop(path, {})
        missing_parts += [".".join(map(str, path[:-1] + (p,))) for p in FUSED[str(path[-1])][0] if p not in got]
        seen.add(path)  # reported by its parts' names
    for path, arr in stacks.finished.items():
        set_path(pure, path, arr)
    missing = [".".join(map(str, p)) for p in expected if p not in seen] + missing_parts + stacks.missing()
    if missing or unexpected or bad_shapes:
        parts = []
        if missing:
            parts.append(f"missing tensors for parameters: {', '.join(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors: {', '.join(unexpected)}")
        if bad_shapes:
            parts.append("shape mismatches: " + "; ".join(bad_shapes))
        raise ValueError(f"checkpoint {getattr(checkpoint, 'path', '?')} does not match "
                         f"{cfg.architecture}: " + " | ".join(parts))
    nnx.replace_by_pure_dict(abs_state, pure)
    return graphdef, abs_state


def dummy_params(cfg: ModelConfig, dtype: jnp.dtype, *, seed: int = 0,
                 sharding_of: Callable[[tuple], jax.sharding.Sharding] | None = None,
                 quantization: QuantScheme | None = None):
    """Random weights of the right shapes, made on device (for benchmarks of big shapes);
    `quantization`: linear weights in the scheme's form (models/quant_formats.dummy_quantized).

    `sharding_of(path)` places each parameter: it is generated in place, each device computing
    only its shard (the values do not depend on the placement), never whole on one device first,
    which with one process per GPU would have to reach the other processes' devices."""
    graphdef, abs_state = abstract_model(cfg, dtype)
    pure = nnx.to_pure_dict(abs_state)
    key, qkey = jax.random.key(seed), jax.random.key(seed + 1)
    kinds = {}
    for path, sds in flatten_paths(pure).items():
        kinds[path] = (tuple(sds.shape), jnp.dtype(dtype), "ones" if path[-1] == "weight" else "normal",  # norms are ones
                       sharding_of(path) if sharding_of is not None else None)
    distinct = list(dict.fromkeys(kinds.values()))
    with ThreadPoolExecutor(max_workers=min(len(distinct), os.cpu_count() or 1) or 1) as pool:
        list(pool.map(lambda kind: _dummy_fn(*kind), distinct))  # compiled side by side, not one after another
    for i, path in enumerate(kinds):
        value = _dummy_fn(*kinds[path])(jax.random.fold_in(key, i))
        set_path(pure, path, dummy_quantized(path, value, quantization, jax.random.fold_in(qkey, i)))
    nnx.replace_by_pure_dict(abs_state, pure)
    return graphdef, abs_state


@functools.lru_cache(maxsize=None)
def _dummy_fn(shape: tuple[int, ...], dtype: jnp.dtype, fill: str, sharding) -> Callable[[jax.Array], jax.Array]:
    """One compiled generator per distinct (shape, dtype, fill, placement): a model has a handful."""
    def make(key):
        if fill == "ones":
            return jnp.ones(shape, dtype)
        return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    return jax.jit(make, out_shardings=sharding).lower(jax.eval_shape(lambda: jax.random.key(0))).compile()
