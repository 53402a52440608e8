"""Per-layer KV-cache scales stored in a checkpoint, for an fp8 KV cache (`kv_cache_dtype="fp8"`).

An FP8 checkpoint calibrated for an fp8 KV cache (llm-compressor's `kv_cache_scheme`, ModelOpt,
Quark, or the older AutoFP8 form) stores one scale per layer for the keys and one for the values:
the cache holds k / k_scale and v / v_scale in e4m3, and attention reads them back multiplied by
the scales. The names vLLM reads, all accepted here:

- `<layer>.self_attn.k_scale`, `<layer>.self_attn.v_scale` (compressed-tensors);
- `<layer>.self_attn.kv_scale` (one scale for both, AutoFP8);
- `<layer>.self_attn.k_proj.output_scale`, `<layer>.self_attn.v_proj.output_scale` (Quark);
- `<layer>.self_attn.k_proj.k_scale`, `<layer>.self_attn.v_proj.v_scale` (ModelOpt).

Each must be one positive finite number; every layer needs both (a checkpoint with some layers'
scales and not others is refused, naming them). `q_scale` / `prob_scale` (FP8 attention arithmetic)
are not used: the kernels attend in bf16 / f32 whatever the cache holds.
"""

from __future__ import annotations

import math
import re

import numpy as np

# (layer index, what it scales: k / v / kv) of a per-layer KV scale tensor
_SCALE = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\."
                    r"(?:(k|v|kv)_scale|(k|v)_proj\.output_scale|(k)_proj\.k_scale|(v)_proj\.v_scale)$")
# every tensor that scales attention rather than holding a weight (ignored by the weight loader)
ATTENTION_SCALE = re.compile(r"\.(k_scale|v_scale|q_scale|prob_scale|kv_scale)$|_proj\.output_scale$")

KVScales = tuple[tuple[float, float], ...]  # (k_scale, v_scale) of each layer


def has_kv_scales(ckpt) -> bool:
    """Whether the checkpoint stores any per-layer KV scale (names only; nothing is read)."""
    return any(_SCALE.search(name) for name in ckpt.tensor_names())


def read_kv_scales(ckpt, num_layers: int) -> KVScales | None:
    """The checkpoint's (k_scale, v_scale) per layer, or None when it stores none. ValueError
    for a scale that is not one positive finite number, a layer index past the model's, or
    scales for some layers only."""
    found: dict[int, dict[str, float]] = {}
    path = getattr(ckpt, "path", "?")
    for name in ckpt.tensor_names():
        m = _SCALE.search(name)
        if m is None:
            continue
        layer, kind = int(m.group(1)), next(g for g in m.groups()[1:] if g is not None)
        arr = np.asarray(ckpt.get_tensor(name), dtype=np.float32)
        if arr.size != 1:
            raise ValueError(f"checkpoint {path}: KV-cache scale {name} has shape {tuple(arr.shape)}, expected one "
                             "number (per-tensor scales only)")
        value = float(arr.reshape(()))
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"checkpoint {path}: KV-cache scale {name} is {value}, expected a positive finite number")
        if layer >= num_layers:
            raise ValueError(f"checkpoint {path}: KV-cache scale {name} names layer {layer}, the model has "
                             f"{num_layers} layers")
        for part in ("k", "v") if kind == "kv" else (kind,):
            found.setdefault(layer, {})[part] = value
    if not found:
        return None
    lacking = [f"{i}.{p}_scale" for i in range(num_layers) for p in ("k", "v") if p not in found.get(i, {})]
    if lacking:
        raise ValueError(f"checkpoint {path}: KV-cache scales for some layers only; none for layer(s) "
                         f"{', '.join(lacking[:8])}{' ...' if len(lacking) > 8 else ''}")
    return tuple((found[i]["k"], found[i]["v"]) for i in range(num_layers))


def describe(scales: KVScales) -> str:
    """A short summary for the log: the range of each side's scales."""
    ks, vs = [s[0] for s in scales], [s[1] for s in scales]
    return f"k_scale {min(ks):.4g}-{max(ks):.4g}, v_scale {min(vs):.4g}-{max(vs):.4g} over {len(scales)} layers"
