"""LoRA adapters, host side: requests, limits, reading PEFT folders, and slot bookkeeping.

How the pieces fit, following one request that names an adapter:

1. The user passes ``LoRARequest(lora_name, lora_int_id, lora_path)`` with a prompt (vLLM's
   fields). ``lora_int_id`` (>= 1) is the adapter's identity everywhere below.
2. ``LoRAManager.add`` reads the folder once with ``load_adapter``: ``adapter_config.json`` is
   checked against what this engine serves (plain LoRA on the seven linear layers of a decoder
   layer, no biases, no DoRA, no per-layer selection), every tensor is mapped to (layer, target)
   and its shape checked against the base model. The result, ``LoRAWeights``, holds per layer and
   target ``A [in, r]`` and ``B [r, out]`` in float32 with the scaling (``lora_alpha / r``, or
   ``lora_alpha / sqrt(r)`` with rsLoRA) folded into B, so the device computes
   ``y += (x @ A) @ B`` and nothing else. Host copies are kept in LRU order, at most
   ``LoRAConfig.max_cpu_loras`` of them.
3. While the scheduler builds a step it asks ``LoRAManager.slot_for(request)`` for the device slot
   of each adapter the step uses. Slot 0 means "no adapter" (its arrays stay zero); slots
   1..max_loras hold adapters. An adapter already in a slot keeps it (``(slot, None)``); otherwise
   the manager picks a free slot or the least recently used one not pinned by this step and returns
   ``(slot, weights)``: the caller writes ``stack_for_slot(weights, ...)`` into that slot. Adapters
   placed for the step are pinned until ``unpin_all()`` (called once the step is built or run), so
   one step never evicts an adapter another of its requests needs.
4. The device side holds, per layer and target, slot arrays of fixed shapes (one slot: A
   ``[in, max_lora_rank]``, B ``[max_lora_rank, out]``) and a slot index per token.
   ``stack_for_slot`` gives every target of every layer at one slot's shapes, zero-padded in rank
   and all zeros for targets the adapter lacks, so writing a slot never changes a shape.

Layouts: ``in`` and ``out`` are flattened as the model's einsums see them (``target_dims``):
q ``D -> N*H``, k/v ``D -> K*H``, o ``N*H -> D``, gate/up ``D -> F``, down ``F -> D``. Where the
model repeats KV heads (``ModelConfig.kv_head_replicas``), k/v's B is repeated the same way.

Everything here is numpy and plain Python: no device, tested in milliseconds.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

from jaxengine.models.checkpoint import _read_json, _SafetensorsFile
from jaxengine.models.config import ModelConfig

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# Modules of the base model an adapter may not adapt (for messages and regex checks).
_UNSUPPORTED_MODULES = ("model.embed_tokens", "lm_head")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's saved names: base_model.model.model.layers.{i}.{self_attn|mlp}.{target}.lora_{A|B}.weight
_TENSOR_NAME = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")

LayerWeights = dict[str, tuple[np.ndarray, np.ndarray]]  # target -> (A [in, r], B [r, out])


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """One adapter a request runs with (vLLM's fields, in vLLM's order)."""

    lora_name: str  # the adapter's name (served as a model name by the server)
    lora_int_id: int  # >= 1, unique per adapter; the key of every table below
    lora_path: str = ""  # folder with adapter_config.json and adapter_model.safetensors
    base_model_name: str | None = None  # informative only

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest: lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest: lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"LoRARequest: lora_path must be a string, got {type(self.lora_path).__name__}")
        if self.base_model_name is not None and not isinstance(self.base_model_name, str):
            raise ValueError(f"LoRARequest: base_model_name must be a string or None, got "
                             f"{type(self.base_model_name).__name__}")

    # vLLM's aliases
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Engine-level LoRA limits (vLLM's names)."""

    max_loras: int = 1  # adapters resident on the device at once (slots 1..max_loras; slot 0 = none)
    max_lora_rank: int = 16  # slot arrays are padded to this rank
    max_cpu_loras: int | None = None  # adapters kept on the host (LRU); None: max_loras

    def __post_init__(self) -> None:
        if isinstance(self.max_loras, bool) or not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise ValueError(f"LoRAConfig: max_loras must be an integer >= 1, got {self.max_loras!r}")
        r = self.max_lora_rank
        if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= 512 or r & (r - 1):
            raise ValueError(f"LoRAConfig: max_lora_rank must be a power of two from 1 to 512, got {r!r}")
        c = self.max_cpu_loras
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < self.max_loras):
            raise ValueError(f"LoRAConfig: max_cpu_loras ({c!r}) must be an integer >= max_loras "
                             f"({self.max_loras})")

    @property
    def cpu_loras(self) -> int:
        """How many adapters the host keeps: max_cpu_loras, or max_loras when that is None."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


@dataclasses.dataclass(frozen=True)
class LoRAWeights:
    """One adapter, ready for the device: per layer, per target, A [in, r] and B [r, out] float32
    numpy with the scaling (lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora) folded into B;
    `out` flattened (q: N*H, k/v: K*H, o: D, gate/up: F, down: D) and `in` flattened likewise
    (o: N*H, down: F, others: D)."""

    name: str
    int_id: int
    rank: int
    layers: tuple[LayerWeights, ...]  # len == num_layers; targets the adapter lacks are absent

    def targets(self) -> frozenset[str]:
        """Every target some layer of the adapter adapts."""
        return frozenset(t for layer in self.layers for t in layer)


def target_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """target -> (in, out) as the model's matmuls see them (the shapes of a slot's A and B)."""
    d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nh, kh = cfg.num_heads * h, cfg.num_kv_heads * h
    return {"q_proj": (d, nh), "k_proj": (d, kh), "v_proj": (d, kh), "o_proj": (nh, d),
            "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}


def _checkpoint_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """target_dims with k/v's out as the adapter stores it (KV heads before any replication)."""
    dims = target_dims(cfg)
    kh = cfg.checkpoint_kv_heads * cfg.head_dim
    return {**dims, "k_proj": (cfg.hidden_size, kh), "v_proj": (cfg.hidden_size, kh)}


# -- adapter_config.json ------------------------------------------------------------------------
def _refuse(where: str, field: str, why: str) -> ValueError:
    return ValueError(f"LoRA adapter {where}: {field} {why}")


def _check_config(cfg: Mapping, where: str, model_config: ModelConfig, lora_config: LoRAConfig) -> tuple[int, float]:
    """Validates an adapter_config.json dict; returns (rank, scaling folded into B)."""
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise _refuse(where, "peft_type", f"is {peft_type!r}; only 'LORA' adapters are supported")
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise _refuse(where, "r", f"must be a positive integer, got {r!r}")
    if r > lora_config.max_lora_rank:
        raise _refuse(where, "r", f"= {r} exceeds max_lora_rank={lora_config.max_lora_rank}; "
                                  "raise max_lora_rank")
    alpha = cfg.get("lora_alpha", 8)  # PEFT's default
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise _refuse(where, "lora_alpha", f"must be a number, got {alpha!r}")
    if cfg.get("bias", "none") != "none":
        raise _refuse(where, "bias", f"is {cfg['bias']!r}; only 'none' is supported (biases are not adapted)")
    for field, what in (("use_dora", "DoRA (use_dora=true) is not supported"),
                        ("fan_in_fan_out", "fan_in_fan_out=true (Conv1D layouts) is not supported"),
                        ("lora_bias", "lora_bias=true (a bias on lora_B) is not supported")):
        if cfg.get(field):
            raise ValueError(f"LoRA adapter {where}: {what}")
    for field in ("modules_to_save", "layers_to_transform", "layers_pattern", "rank_pattern", "alpha_pattern",
                  "target_parameters"):
        if cfg.get(field):
            raise _refuse(where, field, f"is set ({cfg[field]!r}); adapters with {field} are not supported")
    _config_targets(cfg.get("target_modules"), where, model_config)
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return r, float(scale)


def _config_targets(target_modules: object, where: str, model_config: ModelConfig) -> frozenset[str]:
    """The targets target_modules names (a list, a regex matched against full module names as
    PEFT does, or "all-linear"); a module outside LORA_TARGETS is a ValueError."""
    if target_modules == "all-linear":
        return frozenset(LORA_TARGETS)
    if isinstance(target_modules, str):
        try:
            pattern = re.compile(target_modules)
        except re.error as e:
            raise _refuse(where, "target_modules", f"is not a valid regular expression: {e}") from e
        bad = [m for m in _UNSUPPORTED_MODULES if pattern.fullmatch(m)]
        if bad:
            raise _refuse(where, "target_modules", f"{target_modules!r} matches {bad}: not supported "
                                                   f"(supported: {', '.join(LORA_TARGETS)})")
        names = {t: [f"model.layers.{i}.{_PARENT[t]}.{t}" for i in range(model_config.num_layers)]
                 for t in LORA_TARGETS}
        found = frozenset(t for t, ms in names.items() if any(pattern.fullmatch(m) for m in ms))
        if not found:
            raise _refuse(where, "target_modules", f"{target_modules!r} matches none of the supported modules "
                                                   f"({', '.join(LORA_TARGETS)})")
        return found
    if not isinstance(target_modules, (list, tuple)) or not target_modules:
        raise _refuse(where, "target_modules", f"must be a list of module names, a regex string or "
                                               f"'all-linear', got {target_modules!r}")
    found = set()
    for m in target_modules:
        leaf = str(m).rsplit(".", 1)[-1]
        if leaf not in LORA_TARGETS:
            raise _refuse(where, "target_modules", f"names {m!r}: not supported (supported: "
                                                   f"{', '.join(LORA_TARGETS)})")
        found.add(leaf)
    return frozenset(found)


# -- reading an adapter -------------------------------------------------------------------------
def _adapter_files(path: str) -> tuple[Path, Path]:
    folder = Path(path).expanduser()
    if not path or not folder.is_dir():
        raise ValueError(f"LoRA adapter folder {path!r} does not exist (lora_path must be a local folder "
                         f"holding {CONFIG_FILE} and {WEIGHTS_FILE})")
    if not (folder / CONFIG_FILE).is_file():
        raise ValueError(f"LoRA adapter folder {folder} has no {CONFIG_FILE}")
    if not (folder / WEIGHTS_FILE).is_file():
        if (folder / "adapter_model.bin").is_file():
            raise ValueError(f"LoRA adapter folder {folder} holds adapter_model.bin (a PyTorch pickle), which is "
                             f"not supported: save the adapter as {WEIGHTS_FILE} (PEFT's save_pretrained "
                             "with safe_serialization=True)")
        raise ValueError(f"LoRA adapter folder {folder} has no {WEIGHTS_FILE}")
    if (folder / "new_embeddings.safetensors").is_file():
        raise ValueError(f"LoRA adapter folder {folder} adds token embeddings (new_embeddings.safetensors), "
                         "which are not supported")
    return folder / CONFIG_FILE, folder / WEIGHTS_FILE


def _map_tensor(name: str, where: str, num_layers: int) -> tuple[int, str, str]:
    """A PEFT tensor name -> (layer, target, "A" | "B"), or a ValueError naming it."""
    m = _TENSOR_NAME.fullmatch(name)
    if m is None:
        raise ValueError(f"LoRA adapter {where}: cannot map tensor {name!r} (expected names like "
                         "base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight)")
    layer, parent, target, ab = int(m[1]), m[2], m[3], m[4]
    if target not in LORA_TARGETS or _PARENT[target] != parent:
        raise ValueError(f"LoRA adapter {where}: tensor {name!r} adapts {parent}.{target}: not supported "
                         f"(supported: {', '.join(LORA_TARGETS)})")
    if layer >= num_layers:
        raise ValueError(f"LoRA adapter {where}: tensor {name!r} is for layer {layer}, but the base model has "
                         f"{num_layers} layers")
    return layer, target, ab


def load_adapter(request: LoRARequest, model_config: ModelConfig, lora_config: LoRAConfig) -> LoRAWeights:
    """Reads a PEFT adapter folder into LoRAWeights (see the class). Anything this engine cannot
    serve exactly is a ValueError naming the field or tensor: nothing is dropped silently."""
    config_path, weights_path = _adapter_files(request.lora_path)
    where = f"{request.lora_name!r} ({request.lora_path})"
    rank, scale = _check_config(_read_json(config_path, what="LoRA adapter config"), where, model_config,
                                lora_config)
    st = _SafetensorsFile(weights_path)
    parts: dict[tuple[int, str], dict[str, tuple[str, np.ndarray]]] = collections.defaultdict(dict)
    dims = _checkpoint_dims(model_config)
    for name in st.entries:
        layer, target, ab = _map_tensor(name, where, model_config.num_layers)
        d_in, d_out = dims[target]
        want = (rank, d_in) if ab == "A" else (d_out, rank)
        shape = st.entries[name][1]
        if shape != want:
            raise ValueError(f"LoRA adapter {where}: tensor {name!r} has shape {shape}, but the base model "
                             f"({model_config.architecture}) with r={rank} needs {want}")
        parts[(layer, target)][ab] = (name, st.read(name))
    if not parts:
        raise ValueError(f"LoRA adapter {where}: {weights_path.name} holds no LoRA tensors")
    layers: list[LayerWeights] = [{} for _ in range(model_config.num_layers)]
    for (layer, target), ab in sorted(parts.items()):
        if len(ab) != 2:
            (have, (name, _)), = ab.items()
            missing = "B" if have == "A" else "A"
            raise ValueError(f"LoRA adapter {where}: tensor {name!r} has no lora_{missing} partner")
        a = np.asarray(ab["A"][1], np.float32).T  # [in, r]
        b = np.asarray(ab["B"][1], np.float32).T * np.float32(scale)  # [r, out]
        if target in ("k_proj", "v_proj") and model_config.kv_head_replicas > 1:
            # each KV head repeated in place, as models/weights.kv_heads_in does for the base weight
            kc, h = model_config.checkpoint_kv_heads, model_config.head_dim
            b = np.repeat(b.reshape(rank, kc, h), model_config.kv_head_replicas, axis=1).reshape(rank, -1)
        layers[layer][target] = (np.ascontiguousarray(a), np.ascontiguousarray(b))
    return LoRAWeights(request.lora_name, request.lora_int_id, rank, tuple(layers))


def stack_for_slot(weights: LoRAWeights, model_config: ModelConfig, max_rank: int) -> list[LayerWeights]:
    """Per layer, ALL seven targets at the slot's fixed shapes: A [in, max_rank], B [max_rank, out]
    float32, the adapter's rank zero-padded and targets it lacks all zeros (x @ 0 adds nothing)."""
    if weights.rank > max_rank:
        raise ValueError(f"LoRA adapter {weights.name!r}: rank {weights.rank} exceeds max_lora_rank={max_rank}")
    if len(weights.layers) != model_config.num_layers:
        raise ValueError(f"LoRA adapter {weights.name!r} has {len(weights.layers)} layers; the model has "
                         f"{model_config.num_layers}")
    dims = target_dims(model_config)
    out: list[LayerWeights] = []
    for layer in weights.layers:
        slot: LayerWeights = {}
        for target, (d_in, d_out) in dims.items():
            a = np.zeros((d_in, max_rank), np.float32)
            b = np.zeros((max_rank, d_out), np.float32)
            if target in layer:
                la, lb = layer[target]
                assert la.shape == (d_in, weights.rank) and lb.shape == (weights.rank, d_out), (target, la.shape,
                                                                                                lb.shape)
                a[:, :weights.rank], b[:weights.rank] = la, lb
            slot[target] = (a, b)
        out.append(slot)
    return out


# -- bookkeeping --------------------------------------------------------------------------------
class LoRAManager:
    """Host bookkeeping: which adapters are loaded on the host (LRU, max_cpu_loras) and which sit
    in which device slot (LRU over max_loras slots; slot 0 is reserved for "no adapter", so slots
    are 1..max_loras).

    Invariants: every adapter in a slot has a host copy (evicting a host copy frees its slot); an
    adapter pinned by the step being built is never evicted from its slot or from the host.
    """

    def __init__(self, model_config: ModelConfig, lora_config: LoRAConfig):
        self.model_config = model_config
        self.lora_config = lora_config
        # int_id -> (request, weights); insertion order is load order
        self._host: dict[int, tuple[LoRARequest, LoRAWeights]] = {}
        self._host_lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest first
        self._slots: collections.OrderedDict[int, int] = collections.OrderedDict()  # int_id -> slot, oldest first
        self._pinned: set[int] = set()
        self._requests: dict[int, LoRARequest] = {}  # every adapter added and not removed (reloadable)

    def add(self, request: LoRARequest) -> LoRAWeights:
        """The host copy of this adapter, loaded on first use (marks it recently used). Loading one
        beyond max_cpu_loras evicts the least recently used unpinned copy, preferring one not in a
        slot; ValueError when the adapter cannot be loaded (load_adapter) or when its int_id is
        already taken by another adapter."""
        known = self._host.get(request.lora_int_id)
        if known is not None:
            old = known[0]
            if (old.lora_name, old.lora_path) != (request.lora_name, request.lora_path):
                raise ValueError(f"lora_int_id {request.lora_int_id} already names adapter {old.lora_name!r} "
                                 f"({old.lora_path}); each adapter needs its own lora_int_id")
            self._host_lru.move_to_end(request.lora_int_id)
            return known[1]
        weights = load_adapter(request, self.model_config, self.lora_config)
        self._requests[request.lora_int_id] = request
        while len(self._host) >= self.lora_config.cpu_loras:
            self._evict_host()
        self._host[request.lora_int_id] = (request, weights)
        self._host_lru[request.lora_int_id] = None
        return weights

    def _evict_host(self) -> None:
        """Drops the least recently used unpinned host copy, one not in a slot if there is one."""
        candidates = [i for i in self._host_lru if i not in self._pinned]
        if not candidates:
            raise RuntimeError(f"max_cpu_loras={self.lora_config.cpu_loras} is too small: every adapter on the "
                               "host is used by the step being built")
        idle = [i for i in candidates if i not in self._slots]
        self._drop_host((idle or candidates)[0])

    def remove(self, lora_int_id: int) -> bool:
        """Forgets the adapter (unloads it: `slot_for_id` no longer finds it); False if unknown."""
        known = self._requests.pop(lora_int_id, None) is not None
        return self._drop_host(lora_int_id) or known

    def _drop_host(self, lora_int_id: int) -> bool:
        """Drops the adapter's host copy and frees its slot (it can be loaded again from its
        request); False if it has no host copy."""
        if lora_int_id not in self._host:
            return False
        del self._host[lora_int_id]
        del self._host_lru[lora_int_id]
        self._slots.pop(lora_int_id, None)
        self._pinned.discard(lora_int_id)
        return True

    def can_place(self, lora_int_id: int) -> bool:
        """Whether slot_for could give this adapter a slot now without raising: it is resident,
        a slot is free, or some resident adapter is not pinned (for a scheduler deciding whether a
        request fits the step)."""
        if lora_int_id in self._slots or len(self._slots) < self.lora_config.max_loras:
            return True
        return any(i not in self._pinned for i in self._slots)

    def slot_for(self, request: LoRARequest) -> tuple[int, LoRAWeights | None]:
        """The device slot (1..max_loras) for this adapter, which is then pinned for the step.

        (slot, None): already resident (marked recently used). (slot, weights): placed in a free
        slot, or in the least recently used slot whose adapter the step has not pinned; the caller
        writes `stack_for_slot(weights, ...)` there before the step runs. RuntimeError when every
        slot holds an adapter pinned by the step (max_loras is too small for it)."""
        i = request.lora_int_id
        if i in self._slots:
            self.add(request)  # checks the id names the same adapter; touches the host LRU
            self._slots.move_to_end(i)
            self._pinned.add(i)
            return self._slots[i], None
        if not self.can_place(i):
            raise RuntimeError(f"max_loras={self.lora_config.max_loras} is too small for the step: every slot "
                               f"holds an adapter the step uses, and {request.lora_name!r} needs one too")
        self._pinned.add(i)  # before add(): loading may evict host copies, never this one
        try:
            weights = self.add(request)
        except Exception:
            self._pinned.discard(i)
            raise
        used = set(self._slots.values())
        free = [s for s in range(1, self.lora_config.max_loras + 1) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next(v for v in self._slots if v not in self._pinned)
            slot = self._slots.pop(victim)
        self._slots[i] = slot
        return slot, weights

    def slot_for_id(self, lora_int_id: int) -> tuple[int, LoRAWeights | None]:
        """`slot_for` by the adapter's id (an adapter added earlier, its host copy reloaded if it
        was evicted); ValueError for an adapter removed or never added."""
        request = self._requests.get(lora_int_id)
        if request is None:
            raise ValueError(f"LoRA adapter {lora_int_id} is not loaded (removed, or never added)")
        return self.slot_for(request)

    def pin(self, int_ids: Iterable[int]) -> None:
        """Adapters the step being built uses: neither their slot nor their host copy is evicted
        until unpin_all()."""
        self._pinned.update(int_ids)

    def unpin_all(self) -> None:
        self._pinned.clear()

    def resident(self) -> dict[int, int]:
        """int_id -> slot of every adapter on the device."""
        return dict(self._slots)

    def list(self) -> list[LoRARequest]:
        """The adapters added and not removed, in load order."""
        return list(self._requests.values())

    def on_host(self) -> list[int]:
        """Ids of the adapters with a host copy, in load order (at most max_cpu_loras)."""
        return list(self._host)
