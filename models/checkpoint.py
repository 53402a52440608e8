"""Checkpoint readers: weights, config and tokenizer, independent of the model classes.

A ``Checkpoint`` answers four questions with Hugging Face vocabulary whatever the file format:
which tensors exist (HF parameter names such as ``model.layers.0.self_attn.q_proj.weight``),
their shapes (without reading data), their values (numpy, HF layout: ``[out, in]`` for Linear),
and the model's ``config.json`` dict. Weight loaders map those names to model parameters; they
never need to know whether the bytes came from safetensors or a quantized GGUF file.

``open_checkpoint`` picks the reader:
- a ``.gguf`` file (or a folder holding exactly one and no ``config.json``) -> ``GGUFCheckpoint``;
- a folder with ``config.json`` plus ``model.safetensors`` or ``model.safetensors.index.json``
  -> ``SafetensorsCheckpoint`` (tensors read lazily, one at a time);
- a hub id ``org/name`` -> downloaded with ``huggingface_hub.snapshot_download``, then as above.
"""

from __future__ import annotations

import abc
import difflib
import json
import logging
import os
import re
import struct
from pathlib import Path
from typing import TYPE_CHECKING

import ml_dtypes
import numpy as np

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# Files fetched from the hub: configs, weights, and every tokenizer format transformers reads.
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]
_HUB_TIMEOUT_S = 10.0
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")

# safetensors dtype names -> numpy dtypes (bf16 / fp8 come from ml_dtypes).
_ST_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
# dtypes that safetensors' numpy framework cannot return: read the raw bytes ourselves.
_RAW_READ = {"BF16", "F8_E4M3", "F8_E5M2"}


class Checkpoint(abc.ABC):
    """Read-only view of one model checkpoint, in Hugging Face names and layouts."""

    path: str  # where it was read from (file or folder)
    hf_config: dict  # a Hugging Face config.json dict ("architectures", "hidden_size", ...)

    @abc.abstractmethod
    def tensor_names(self) -> list[str]:
        """HF parameter names of every stored tensor (a tied lm_head is not stored)."""

    @abc.abstractmethod
    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Shape of one tensor as ``get_tensor`` returns it, without reading its data."""

    @abc.abstractmethod
    def tensor_dtype(self, name: str) -> np.dtype:
        """dtype of one tensor as ``get_tensor`` returns it, without reading its data."""

    @abc.abstractmethod
    def get_tensor(self, name: str) -> np.ndarray:
        """One tensor in HF layout ([out, in] for Linear), a fresh writable array."""

    @abc.abstractmethod
    def load_tokenizer(self) -> "PreTrainedTokenizerBase":
        """The model's tokenizer (or the one named by ``tokenizer=`` at open)."""

    @abc.abstractmethod
    def generation_config(self) -> dict:
        """generation_config.json (or its GGUF equivalent); {} when the checkpoint has none."""

    def __contains__(self, name: object) -> bool:
        return name in self.tensor_names()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r}, {len(self.tensor_names())} tensors)"

    def _unknown_tensor(self, name: str) -> ValueError:
        close = difflib.get_close_matches(name, self.tensor_names(), n=3)
        hint = f"; close names: {close}" if close else ""
        return ValueError(f"tensor {name!r} is not in checkpoint {self.path}{hint}")


# tokenizer_config.json classes that AutoTokenizer resolves to transformers' generic tokenizers-library
# class (Llama 3's and most recent checkpoints' fast tokenizers)
_GENERIC_TOKENIZER_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})


def _generic_tokenizer_folder(source: str) -> bool:
    """A local folder whose tokenizer is the generic class, with its tokenizer.json."""
    folder = Path(source)
    try:
        with open(folder / "tokenizer_config.json", encoding="utf-8") as f:
            name = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return False
    return name in _GENERIC_TOKENIZER_CLASSES and (folder / "tokenizer.json").is_file()


def load_hf_tokenizer(source: str, **kwargs: str) -> "PreTrainedTokenizerBase":
    """AutoTokenizer.from_pretrained with failures turned into one clear ValueError.

    A local folder whose tokenizer_config names the generic fast class is loaded with that class
    directly, which is what AutoTokenizer would build: importing AutoTokenizer also imports
    transformers' model configuration code and, where it is installed, PyTorch, on the thread that
    loads the tokenizer beside the weights, where it holds back the weight load."""
    if not kwargs and _generic_tokenizer_folder(source):
        from transformers import PreTrainedTokenizerFast as loader
    else:
        from transformers import AutoTokenizer as loader

    try:
        return loader.from_pretrained(source, **kwargs)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot load a tokenizer from {source!r}: {e}") from e


class _SafetensorsFile:
    """One .safetensors file: header parsed and checked at open, tensors read on demand.

    The header is parsed here (not only by the library) so that a truncated or corrupt file
    fails at open with the file's name, and so bf16/fp8 tensors can be read from their byte
    offsets (safetensors' numpy framework has no bf16).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        # name -> (dtype name, shape, byte offset from the start of the file, number of bytes)
        self.entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        self._handle = None  # safe_open handle, opened on the first numpy read
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise ValueError("file shorter than the 8-byte header length")
                (header_len,) = struct.unpack("<Q", head)
                if header_len > size - 8:
                    raise ValueError(f"header length {header_len} exceeds the file size {size}")
                header = json.loads(f.read(header_len))
        except OSError as e:
            raise ValueError(f"cannot read safetensors file {path}: {e}") from e
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"corrupt safetensors file {path}: {e}") from e
        data_start = 8 + header_len
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype, shape = info["dtype"], tuple(int(d) for d in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"corrupt safetensors file {path}: bad header entry {name!r}") from e
            if dtype not in _ST_DTYPES:
                raise ValueError(f"safetensors file {path}: tensor {name!r} has unsupported dtype {dtype}")
            if end - begin != int(np.prod(shape)) * _ST_DTYPES[dtype].itemsize:
                raise ValueError(f"corrupt safetensors file {path}: tensor {name!r} byte range "
                                 f"[{begin}, {end}) does not match shape {shape} of {dtype}")
            if data_start + end > size:
                raise ValueError(f"truncated safetensors file {path}: tensor {name!r} ends at byte "
                                 f"{data_start + end} but the file has {size} bytes")
            self.entries[name] = (dtype, shape, data_start + begin, end - begin)

    def read(self, name: str) -> np.ndarray:
        dtype, shape, offset, nbytes = self.entries[name]
        if dtype in _RAW_READ:
            with open(self.path, "rb") as f:
                raw = np.fromfile(f, dtype=np.uint8, count=nbytes, offset=offset)
            return raw.view(_ST_DTYPES[dtype]).reshape(shape)
        from safetensors import SafetensorError, safe_open

        try:
            if self._handle is None:
                self._handle = safe_open(str(self.path), framework="numpy")
            return self._handle.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"cannot read tensor {name!r} from {self.path}: {e}") from e


class SafetensorsCheckpoint(Checkpoint):
    """A Hugging Face folder: config.json + model.safetensors or a sharded index."""

    def __init__(self, path: str | os.PathLike, *, tokenizer: str | None = None) -> None:
        folder = Path(path)
        self.path = str(folder)
        self._tokenizer_source = tokenizer
        self.hf_config = _read_json(folder / "config.json", what="model config")
        self._files: dict[str, _SafetensorsFile] = {}  # file name -> reader
        self._where: dict[str, _SafetensorsFile] = {}  # tensor name -> its file
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = _read_json(index, what="safetensors index").get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"safetensors index {index} has no 'weight_map'")
            missing = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
            if missing:
                raise ValueError(f"safetensors index {index} names shard(s) missing from "
                                 f"{folder}: {missing}")
            for name, fname in weight_map.items():
                shard = self._open_file(folder / fname)
                if name not in shard.entries:
                    raise ValueError(f"safetensors index {index} places tensor {name!r} in "
                                     f"{fname}, which does not hold it")
                self._where[name] = shard
        else:
            files = [folder / "model.safetensors"] if (folder / "model.safetensors").is_file() else \
                sorted(p for p in folder.glob("*.safetensors") if not p.name.startswith("consolidated"))
            if not files:
                raise ValueError(f"no model.safetensors or model.safetensors.index.json in {folder}")
            for p in files:
                shard = self._open_file(p)
                for name in shard.entries:
                    if name in self._where:
                        raise ValueError(f"tensor {name!r} appears in both {self._where[name].path} "
                                         f"and {p}")
                    self._where[name] = shard

    def _open_file(self, p: Path) -> _SafetensorsFile:
        if p.name not in self._files:
            self._files[p.name] = _SafetensorsFile(p)
        return self._files[p.name]

    def tensor_names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def _entry(self, name: str) -> tuple[str, tuple[int, ...], int, int]:
        if name not in self._where:
            raise self._unknown_tensor(name)
        return self._where[name].entries[name]

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[1]

    def tensor_dtype(self, name: str) -> np.dtype:
        return _ST_DTYPES[self._entry(name)[0]]

    def get_tensor(self, name: str) -> np.ndarray:
        self._entry(name)
        return self._where[name].read(name)

    def load_tokenizer(self) -> "PreTrainedTokenizerBase":
        return load_hf_tokenizer(self._tokenizer_source or self.path)

    def generation_config(self) -> dict:
        p = Path(self.path) / "generation_config.json"
        return _read_json(p, what="generation config") if p.is_file() else {}


def _read_json(p: Path, *, what: str) -> dict:
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError as e:
        raise ValueError(f"{what} {p} does not exist") from e
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {what} {p}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{what} {p} is not a JSON object")
    return data


def _resolve_hub_id(model: str, revision: str | None) -> str:
    """Download (or find in the local cache) a hub snapshot; ValueError when unreachable."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(model, revision=revision, allow_patterns=HUB_ALLOW_PATTERNS,
                                 etag_timeout=_HUB_TIMEOUT_S)
    except Exception as e:  # network, auth, offline mode, missing repo: all mean "not reachable"
        raise ValueError(
            f"model {model!r} is neither a local path nor reachable on the Hugging Face hub "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e


def open_checkpoint(model: str | os.PathLike, *, revision: str | None = None,
                    tokenizer: str | None = None) -> Checkpoint:
    """Open a .gguf file, a Hugging Face folder, or a hub id ("org/name").

    ``revision`` applies to hub ids only; ``tokenizer`` overrides where the tokenizer is loaded
    from (a folder or hub id). Anything that cannot be opened raises ValueError naming it.
    """
    from jaxengine.models.gguf_reader import GGUFCheckpoint

    p = Path(model).expanduser()
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ValueError(f"{p} is a file but not a .gguf file; pass the folder holding "
                             "config.json and the safetensors weights instead")
        return GGUFCheckpoint(p, tokenizer=tokenizer)
    if p.is_dir():
        if revision is not None:
            logger.warning("revision=%r ignored for local folder %s", revision, p)
        ggufs = sorted(p.glob("*.gguf"))
        if not (p / "config.json").is_file() and len(ggufs) == 1:
            return GGUFCheckpoint(ggufs[0], tokenizer=tokenizer)
        if not (p / "config.json").is_file():
            found = sorted(x.name for x in p.iterdir())[:10]
            raise ValueError(f"{p} holds no config.json (found: {found}); expected a Hugging Face "
                             "model folder or a single .gguf file")
        return SafetensorsCheckpoint(p, tokenizer=tokenizer)
    name = str(model)
    if name.lower().endswith(".gguf") or name.startswith((".", "/", "~")) or not _HUB_ID.match(name):
        raise ValueError(f"model {name!r} does not exist as a local path and is not a hub id")
    return SafetensorsCheckpoint(_resolve_hub_id(name, revision), tokenizer=tokenizer)
