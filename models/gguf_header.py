"""A GGUF file's metadata and tensor index, read in one pass over its header.

The `gguf` package's reader builds a numpy view per array element, which takes seconds on a
vocabulary of 49k tokens and as many merges (most of the start-up of the embedded SmolLM2).
This reader returns the same things the checkpoint uses (`fields[key].contents()` and
`tensors`: name, type, GGUF dims, data) with numeric arrays read whole and strings decoded in a
plain loop; tensor data stays a view of the memory-mapped file. Anything it cannot read (an
unknown value type, a big-endian file) raises, and the caller falls back to `gguf.GGUFReader`.
"""

from __future__ import annotations

import dataclasses
import struct

import numpy as np

_MAGIC = 0x46554747  # "GGUF" read as a little-endian uint32
# GGUF value types: 0..7 and 10..12 are scalars, 8 a string, 9 an array.
_SCALARS = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
            7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclasses.dataclass(frozen=True)
class Field:
    value: object  # a Python scalar, str, or list of them

    def contents(self) -> object:
        return self.value


@dataclasses.dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: np.ndarray  # GGUF dims, innermost first (as gguf.ReaderTensor.shape)
    data: np.ndarray  # the stored values (float types) or bytes (quantized), a view of the file


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8")
        self.pos += n
        return s

    def value(self, vtype: int) -> object:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            sub, n = self.scalar("<I"), self.scalar("<Q")
            if sub == _STRING:
                return [self.string() for _ in range(n)]
            if sub not in _SCALARS:
                raise ValueError(f"GGUF array of value type {sub} is not read here")
            dt = np.dtype(_SCALARS[sub]).newbyteorder("<")
            arr = np.frombuffer(self.buf, dt, count=n, offset=self.pos)
            self.pos += n * dt.itemsize
            return arr.tolist()
        if vtype not in _SCALARS:
            raise ValueError(f"GGUF value type {vtype} is not read here")
        dt = np.dtype(_SCALARS[vtype]).newbyteorder("<")
        v = np.frombuffer(self.buf, dt, count=1, offset=self.pos)[0].item()
        self.pos += dt.itemsize
        return v


class GGUFHeader:
    """`fields` (key -> Field) and `tensors` (in file order) of a little-endian GGUF v2/v3 file."""

    def __init__(self, path: str) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self._map = np.memmap(path, dtype=np.uint8, mode="r")
        cur = _Cursor(memoryview(self._map))
        if cur.scalar("<I") != _MAGIC:
            raise ValueError("not a GGUF file")
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not read here")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        self.fields: dict[str, Field] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.fields[key] = Field(cur.value(cur.scalar("<I")))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
            infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
        align = int(self.fields["general.alignment"].value) if "general.alignment" in self.fields else 32
        start = -(-cur.pos // align) * align
        floats = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}
        self.tensors: list[Tensor] = []
        for name, dims, raw_type, offset in infos:
            qtype = GGMLQuantizationType(raw_type)
            n = int(np.prod(dims))
            block, type_size = GGML_QUANT_SIZES[qtype]
            nbytes = n * type_size // block
            view = self._map[start + offset:start + offset + nbytes]
            if len(view) != nbytes:
                raise ValueError(f"tensor {name} runs past the end of the file")
            if qtype in floats:
                data = view.view(floats[qtype]).reshape(tuple(reversed(dims)))
            else:  # quantized: rows of bytes, as gguf's reader gives them
                data = view.reshape(tuple(reversed(dims[1:])) + (dims[0] * type_size // block,))
            self.tensors.append(Tensor(name, qtype, np.array(dims, np.uint64), data))


def dequantize_q4_1(data: np.ndarray) -> np.ndarray:
    """Q4_1 blocks (32 weights: float16 scale d, float16 minimum m, 16 bytes of 4-bit q; low
    nibbles are weights 0-15, high nibbles 16-31) -> float32 [blocks * 32], w = q * d + m. The
    same values as gguf.quants.dequantize, in whole-array numpy operations (the embedded
    SmolLM2's tensors are Q4_1)."""
    b = np.asarray(data).reshape(-1, 20)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)  # [blocks, 1]
    m = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    q = b[:, 4:]
    out = np.empty((b.shape[0], 32), np.float32)
    np.multiply(q & 0x0F, d, out=out[:, :16], casting="unsafe")
    np.multiply(q >> 4, d, out=out[:, 16:], casting="unsafe")
    out += m
    return out.reshape(-1)


def dequantize_q8_0(data: np.ndarray) -> np.ndarray:
    """Q8_0 blocks (32 weights: float16 scale d, 32 int8 q) -> float32 [blocks * 32], w = q * d,
    as gguf.quants.dequantize, in whole-array numpy operations."""
    b = np.asarray(data).reshape(-1, 34)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)  # [blocks, 1]
    out = b[:, 2:].view(np.int8).astype(np.float32)
    out *= d
    return out.reshape(-1)


# GGML types with a whole-array dequantizer here (the embedded SmolLM2's); others use gguf's.
FAST_DEQUANTIZE = {"Q4_1": dequantize_q4_1, "Q8_0": dequantize_q8_0}
