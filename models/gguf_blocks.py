"""GGUF's quantized blocks taken apart into integer values, group scales and zeros, so a linear
weight can stay quantized on the device (models/quantization.PackedWeight) instead of being
dequantized to float at load.

Every block type below dequantizes as `(value - zero) * scale` with an integer zero point, or
`value * scale - minimum` with a float minimum per group; `unpack` returns the values, the scales
and the zeros of one tensor, and `value * scale - zero` (or `(value - zero) * scale`) computed in
float32 equals gguf-py's `dequantize` bit for bit (tests/models/test_gguf_blocks.py).

| type | bits kept | group | zero |
|---|---|---|---|
| Q8_0 | 8 | 32 | 128 (the int8 values shifted to unsigned) |
| Q4_0 | 4 | 32 | 8 |
| Q4_1 | 4 | 32 | float: minus the block's m |
| Q5_0 | 8 (5 used) | 32 | 16 |
| Q5_1 | 8 (5 used) | 32 | float: minus m |
| Q4_K | 4 | 32 (8 per super-block of 256) | float: dmin * m |
| Q5_K | 8 (5 used) | 32 | float: dmin * m |
| Q6_K | 8 (6 used) | 16 (16 per super-block) | 32 |
| Q3_K | 4 (3 used) | 16 (16 per super-block) | 4 |
| Q2_K | 4 (2 used) | 16 (16 per super-block) | float: dmin * m |

The 5- and 6-bit types are kept in 8-bit words (the packing is along int32 words of 32 / bits
values): half of bf16's bytes rather than their own 5.5-6.6 bits; the 2- and 3-bit K-quants in
4-bit words, with a scale and a zero (or minimum) per 16 values in the activations' dtype: about
6 bits a weight rather than their own 2.6-3.4, and 16 dequantized. A K-quant super-block's scale
is d * sc (f16 times a 6- or 8-bit integer: exact in float32), its minimum dmin * m.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import numpy as np

QK_K = 256  # values per K-quant super-block


@dataclasses.dataclass(frozen=True)
class GgufBlocks:
    """One tensor's blocks taken apart, in the file's row order ([rows, cols], cols the inputs)."""

    values: np.ndarray  # [rows, cols] uint8, unsigned
    scales: np.ndarray  # [rows, cols / group] float32
    zeros: np.ndarray  # [rows, cols / group]: uint8 zero points, or float32 minimums (float_min)
    bits: int  # 4 or 8: the width the values are packed at on the device
    group_size: int
    float_min: bool

    def dequantize(self) -> np.ndarray:
        """float32 [rows, cols]: what gguf-py's dequantize gives for the same blocks."""
        rows, cols = self.values.shape
        v = self.values.astype(np.float32).reshape(rows, -1, self.group_size)
        s, z = self.scales[..., None], self.zeros.astype(np.float32)[..., None]
        return (v * s - z if self.float_min else (v - z) * s).reshape(rows, cols)


def _f16(b: np.ndarray) -> np.ndarray:
    """[n, 2] uint8 -> [n] float32 (little-endian float16)."""
    return np.ascontiguousarray(b).view(np.float16)[:, 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32] values: low nibbles are values 0-15, high nibbles 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[n, 4] bytes (a little-endian uint32) -> [n, 32] bits, bit i for value i."""
    word = np.ascontiguousarray(qh).view(np.uint32)  # [n, 1]
    return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _q8_0(b):
    d, q = _f16(b[:, :2]), b[:, 2:].view(np.int8)
    return (q.astype(np.int16) + 128).astype(np.uint8), d[:, None], np.full((len(b), 1), 128, np.uint8)


def _q4_0(b):
    return _nibbles(b[:, 2:]), _f16(b[:, :2])[:, None], np.full((len(b), 1), 8, np.uint8)


def _q4_1(b):
    return _nibbles(b[:, 4:]), _f16(b[:, :2])[:, None], -_f16(b[:, 2:4])[:, None]


def _q5_0(b):
    q = _nibbles(b[:, 6:]) | (_high_bits(b[:, 2:6]) << 4)
    return q, _f16(b[:, :2])[:, None], np.full((len(b), 1), 16, np.uint8)


def _q5_1(b):
    q = _nibbles(b[:, 8:]) | (_high_bits(b[:, 4:8]) << 4)
    return q, _f16(b[:, :2])[:, None], -_f16(b[:, 2:4])[:, None]


def _k_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit minimums per super-block. Bytes
    0-3 hold scales 0-3 (low 6 bits), 4-7 minimums 0-3; bytes 8-11 hold the low 4 bits of scales
    4-7 (low nibble) and minimums 4-7 (high nibble), whose top 2 bits are the top bits of bytes
    0-3 (scales) and 4-7 (minimums)."""
    a, m, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([a & 0x3F, (hi & 0x0F) | ((a >> 6) << 4)], axis=1)
    mn = np.concatenate([m & 0x3F, (hi >> 4) | ((m >> 6) << 4)], axis=1)
    return sc, mn


def _k_chunks(qs: np.ndarray) -> np.ndarray:
    """[n, 128] bytes -> [n, 256] four-bit values: each chunk of 32 bytes holds sub-block 2c in
    its low nibbles and sub-block 2c + 1 in its high nibbles."""
    c = qs.reshape(len(qs), 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (c & 0x0F).reshape(len(qs), QK_K)


def _q4_k(b):
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales_mins(b[:, 4:16])
    return _k_chunks(b[:, 16:]), d[:, None] * sc, dmin[:, None] * mn


def _q5_k(b):
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales_mins(b[:, 4:16])
    qh = b[:, 16:48].reshape(len(b), 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)  # bit j: sub-block j
    q = _k_chunks(b[:, 48:]) | ((qh & 1).reshape(len(b), QK_K) << 4)
    return q, d[:, None] * sc, dmin[:, None] * mn


def _q6_k(b):
    n = len(b)
    ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208].view(np.int8), _f16(b[:, 208:210])
    low = (ql.reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F  # [n, 2, 2, 64]
    high = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 0x03  # [n, 2, 4, 32]
    q = low.reshape(n, 2, 4, 32) | (high << 4)
    return q.reshape(n, QK_K), d[:, None] * sc.astype(np.float32), np.full((n, QK_K // 16), 32, np.uint8)


def _k_pairs(qs: np.ndarray) -> np.ndarray:
    """Q2_K / Q3_K: [n, 64] bytes -> [n, 256] two-bit values. Each half of a super-block is 32
    bytes; its 128 values are the bytes' bit pairs 0-1, 2-3, 4-5 and 6-7 in turn, 32 at a time."""
    q = qs.reshape(len(qs), 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    return (q & 0x03).reshape(len(qs), QK_K)


def _q2_k(b):
    sc, d, dmin = b[:, :16], _f16(b[:, 80:82]), _f16(b[:, 82:84])
    return _k_pairs(b[:, 16:80]), d[:, None] * (sc & 0x0F).astype(np.float32), \
        dmin[:, None] * (sc >> 4).astype(np.float32)


def _q3_k(b):
    """Values: the two low bits from `qs`, the third from `hmask` (bit j of byte l is value
    32 j + l), so v - 4 is ggml's signed value. Scales: 16 six-bit values, low nibbles in bytes
    0-7 (scales 0-7 then 8-15), top bit pairs in bytes 8-11 (scales 0-3 in pairs 0-1, 4-7 in
    pairs 2-3, ...), offset by 32."""
    n = len(b)
    hmask, qs, sc, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    high = (hmask.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    low = (sc[:, :8].reshape(n, 1, 8) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)) & 0x0F
    top = (sc[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)) & 0x03
    scales = (low.reshape(n, 16) | (top.reshape(n, 16) << 4)).astype(np.float32) - 32
    return _k_pairs(qs) | (high.reshape(n, QK_K) << 2), d[:, None] * scales, np.full((n, QK_K // 16), 4, np.uint8)


class _Type(NamedTuple):
    per_block: int  # values per block
    nbytes: int  # bytes per block
    group: int  # values per scale
    bits: int  # bits kept on the device
    float_min: bool
    unpack: Callable


_TYPES = {name: _Type(*spec) for name, spec in {
    "Q8_0": (32, 34, 32, 8, False, _q8_0),
    "Q4_0": (32, 18, 32, 4, False, _q4_0),
    "Q4_1": (32, 20, 32, 4, True, _q4_1),
    "Q5_0": (32, 22, 32, 8, False, _q5_0),
    "Q5_1": (32, 24, 32, 8, True, _q5_1),
    "Q4_K": (QK_K, 144, 32, 4, True, _q4_k),
    "Q5_K": (QK_K, 176, 32, 8, True, _q5_k),
    "Q6_K": (QK_K, 210, 16, 8, False, _q6_k),
    "Q3_K": (QK_K, 110, 16, 4, False, _q3_k),
    "Q2_K": (QK_K, 84, 16, 4, True, _q2_k),
}.items()}
KEPT_TYPES = tuple(_TYPES)


def form(type_name: str) -> tuple[int, int, bool] | None:
    """(bits kept, group size, float minimums) of a type kept quantized, None for any other type:
    weights of one form can be concatenated into a fused projection."""
    t = _TYPES.get(type_name)
    return None if t is None else (t.bits, t.group, t.float_min)


def unpack(type_name: str, data: np.ndarray, rows: int, cols: int) -> GgufBlocks:
    """A GGUF tensor's raw bytes (`ReaderTensor.data`) of one of KEPT_TYPES, `rows` x `cols`
    (cols the inputs, contiguous in the file) -> its values, scales and zeros; ValueError for
    another type or a size that does not fit."""
    if type_name not in _TYPES:
        raise ValueError(f"GGUF type {type_name} cannot be kept quantized; kept: {', '.join(KEPT_TYPES)}")
    t = _TYPES[type_name]
    raw = np.asarray(data, np.uint8).reshape(-1)
    if cols % t.per_block or raw.size != rows * cols // t.per_block * t.nbytes:
        raise ValueError(f"GGUF {type_name} tensor of {rows} x {cols}: {raw.size} bytes do not hold "
                         f"{rows * cols // t.per_block} blocks of {t.nbytes}")
    values, scales, zeros = t.unpack(raw.reshape(-1, t.nbytes))
    zeros = np.asarray(zeros, np.float32 if t.float_min else np.uint8)
    return GgufBlocks(values.reshape(rows, cols).astype(np.uint8), np.asarray(scales, np.float32).reshape(rows, -1),
                      zeros.reshape(rows, -1), t.bits, t.group, t.float_min)
