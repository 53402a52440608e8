"""GGUF checkpoints (llama.cpp files) seen as Hugging Face checkpoints.

Three translations happen here so that nothing downstream knows about GGUF:
- names: llama.cpp tensor names -> HF parameter names (``blk.3.attn_q.weight`` ->
  ``model.layers.3.self_attn.q_proj.weight``);
- values: quantized blocks are dequantized to float32 with ``gguf.quants.dequantize``, and for
  llama-architecture files the rotary permutation that llama.cpp's converter applies to the q and
  k projections is undone (HF applies rotary embeddings to halves, llama.cpp to adjacent pairs);
  Gemma 3's norm scales, which llama.cpp stores as 1 + weight, are shifted back;
- config: the ``config.json`` dict is rebuilt from the GGUF metadata.

The numpy arrays the ``gguf`` reader returns are already row-major in HF order (``[out, in]``):
GGUF records dims innermost-first, and the reader reverses them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import re
import shutil
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from jaxengine.models import gguf_blocks
from jaxengine.models.checkpoint import Checkpoint, load_hf_tokenizer

if TYPE_CHECKING:
    import gguf
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# general.architecture -> (HF architecture, model_type, q/k stored in llama.cpp's rotary layout)
_ARCHITECTURES: dict[str, tuple[str, str, bool]] = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text", False),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe", False),
}
# Mixture-of-experts files read: qwen3moe, and Mixtral (llama.cpp files it as llama with an expert
# count). Other MoE architectures are refused by name.
_UNSUPPORTED_MOE = frozenset({"qwen2moe", "mixtral", "deepseek2", "olmoe"})
# llama.cpp stores each layer's experts stacked: ffn_{gate,up,down}_exps [E, ...] and the router
# ffn_gate_inp [E, D]. HF names per architecture: (router, expert prefix, gate, up, down).
_MOE_NAMES = {"llama": ("block_sparse_moe.gate", "block_sparse_moe.experts", "w1", "w3", "w2"),
              "qwen3moe": ("mlp.gate", "mlp.experts", "gate_proj", "up_proj", "down_proj")}
_EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma 3 names its four norms per layer as llama.cpp's Gemma converters do: the pre-MLP norm is
# ffn_norm (Llama's post_attention_layernorm), and the post-attention / post-MLP norms are their own.
_GEMMA3_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                       "post_attention_norm": "post_attention_layernorm",
                       "post_ffw_norm": "post_feedforward_layernorm"}
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_TENSOR = re.compile(r"^(\w+)\.(weight|bias)$")
# Meta's Llama 3.1/3.2/3.3 rope scaling, which llama.cpp stores only as a rope_freqs tensor.
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

_tokenizer_cache: dict[tuple[str, int, int], "PreTrainedTokenizerBase"] = {}
_tokenizer_lock = threading.Lock()


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    """HF parameter name of a llama.cpp tensor, or None when it has no HF counterpart."""
    names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    if m := _LAYER_TENSOR.match(name):
        layer, kind, suffix = m.groups()
        if kind in names:
            return f"model.layers.{layer}.{names[kind]}.{suffix}"
    elif (m := _GLOBAL_TENSOR.match(name)) and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute``: [n_head*H, ...] from (head, H/2, pair) back to HF's
    (head, pair, H/2) row order. Works for weights ([out, in]) and biases ([out])."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot undo the rotary permutation: {rows} rows, {n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFCheckpoint(Checkpoint):
    """A .gguf file: tensors dequantized to float32 on demand, HF names and config."""

    def __init__(self, path: str | os.PathLike, *, tokenizer: str | None = None) -> None:
        import gguf

        self.path = str(Path(path))
        self._tokenizer_source = tokenizer
        try:
            from jaxengine.models.gguf_header import GGUFHeader

            self._reader = GGUFHeader(self.path)  # the same fields and tensors, read in a fraction of the time
        except Exception:  # noqa: BLE001 - anything it does not read: the gguf package's reader decides
            try:
                self._reader = gguf.GGUFReader(self.path, "r")
            except Exception as e:  # the reader raises assorted errors on a bad file
                raise ValueError(f"cannot read GGUF file {self.path}: {type(e).__name__}: {e}") from e
        self._meta = self._reader.fields
        arch = self._meta_value("general.architecture")
        self._moe = bool(self._meta_value(f"{arch}.expert_count", 0)) or arch == "qwen3moe"
        if arch in _UNSUPPORTED_MOE or (self._moe and arch not in _MOE_NAMES):
            raise ValueError(f"GGUF file {self.path}: mixture-of-experts GGUF files ({arch}) are not supported "
                             "(supported: Mixtral, qwen3moe); load the model's Hugging Face safetensors folder")
        if arch not in _ARCHITECTURES:
            raise ValueError(f"GGUF file {self.path}: unsupported architecture {arch!r} "
                             f"(supported: {sorted(_ARCHITECTURES)})")
        self._arch = arch
        self._tensors: dict[str, "gguf.ReaderTensor"] = {}  # HF name (or GGUF name) -> tensor
        self._experts: dict[str, tuple["gguf.ReaderTensor", int]] = {}  # HF expert name -> (stacked, index)
        self._stacked: tuple[str, np.ndarray] | None = None  # the last stacked tensor dequantized
        extra: list[str] = []
        for t in self._reader.tensors:
            if self._moe and self._add_moe_tensor(t):
                continue
            hf = gguf_to_hf_name(t.name, arch)
            if hf is None and t.name != "rope_freqs.weight":
                extra.append(t.name)
            self._tensors[hf or t.name] = t
        if extra:
            # Kept under their GGUF names so the weight loader reports them as unexpected.
            logger.warning("GGUF file %s: tensors with no HF counterpart: %s", self.path, extra)
        self.hf_config = self._build_hf_config()
        self._log_dequantized_types()

    def _add_moe_tensor(self, t: "gguf.ReaderTensor") -> bool:
        """Names a mixture-of-experts tensor: the router under its HF name, each expert's slice of
        a stacked ffn_*_exps tensor under that expert's HF name. False for any other tensor."""
        router, experts, gate, up, down = _MOE_NAMES[self._arch]
        if m := _EXPERT_TENSOR.match(t.name):
            layer, kind = m.groups()
            part = {"gate": gate, "up": up, "down": down}[kind]
            num = int(t.shape.tolist()[-1])  # GGUF dims innermost-first: E is the last
            for e in range(num):
                self._experts[f"model.layers.{layer}.{experts}.{e}.{part}.weight"] = (t, e)
            return True
        if m := re.match(r"^blk\.(\d+)\.ffn_gate_inp\.weight$", t.name):
            self._tensors[f"model.layers.{m.group(1)}.{router}.weight"] = t
            return True
        return False

    def _log_dequantized_types(self) -> None:
        """One line naming the quantized GGUF types, which load as float weights unless
        quantization='gguf' keeps the linear weights of the types models/gguf_blocks.py takes."""
        counts: dict[str, int] = {}
        for t in self._reader.tensors:
            if t.tensor_type.name not in ("F32", "F16", "BF16"):
                counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        if counts:
            kinds = ", ".join(f"{k} ({n} tensors)" for k, n in sorted(counts.items()))
            logger.info("GGUF file %s: %s dequantized to float at load, except the linear weights of types %s "
                        "with quantization='gguf' (kept quantized)", self.path, kinds,
                        "/".join(gguf_blocks.KEPT_TYPES))

    # ---- metadata -------------------------------------------------------------------------

    def _meta_value(self, key: str, default: object = None) -> object:
        field = self._meta.get(key)
        return default if field is None else field.contents()

    def _arch_value(self, key: str, default: object = None) -> object:
        return self._meta_value(f"{self._arch}.{key}", default)

    def _required(self, key: str) -> int:
        value = self._arch_value(key)
        if value is None:
            raise ValueError(f"GGUF file {self.path} lacks the metadata key {self._arch}.{key}")
        return int(value)

    def _build_hf_config(self) -> dict:
        hf_arch, model_type, _ = _ARCHITECTURES[self._arch]
        name = str(self._meta_value("general.name", "") or "")
        if self._arch == "llama" and "mistral" in name.lower():
            hf_arch, model_type = "MistralForCausalLM", "mistral"  # llama.cpp files Mistral as llama
        heads = self._required("attention.head_count")
        kv_heads = self._arch_value("attention.head_count_kv", heads)
        if isinstance(kv_heads, list):  # per-layer counts; only uniform ones are supported
            if len(set(kv_heads)) != 1:
                raise ValueError(f"GGUF file {self.path}: per-layer KV head counts {kv_heads}")
            kv_heads = kv_heads[0]
        hidden = self._required("embedding_length")
        tokens = self._meta.get("tokenizer.ggml.tokens")
        if "model.embed_tokens.weight" in self._tensors:
            vocab = self.tensor_shape("model.embed_tokens.weight")[0]
        elif tokens is not None:
            vocab = len(tokens.contents())
        else:
            vocab = self._required("vocab_size")
        cfg: dict = {
            "architectures": [hf_arch],
            "model_type": model_type,
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": int(self._arch_value("feed_forward_length", 0) or 0)
            or self._required("expert_feed_forward_length"),
            "num_hidden_layers": self._required("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": int(kv_heads),
            "head_dim": int(self._arch_value("attention.key_length", hidden // heads)),
            "rms_norm_eps": float(self._arch_value("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self._arch_value("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._arch_value("context_length", 4096)),
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
            "attention_bias": "model.layers.0.self_attn.q_proj.bias" in self._tensors,
            "torch_dtype": "float32",  # what get_tensor returns after dequantization
        }
        for key, meta_key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
            tok_id = self._meta_value(f"tokenizer.ggml.{meta_key}_token_id")
            if tok_id is not None:
                cfg[f"{key}_token_id"] = int(tok_id)
        if rope_scaling := self._rope_scaling():
            cfg["rope_scaling"] = rope_scaling
        if self._arch == "gemma3":
            cfg.update(self._gemma3_config(cfg))
        if self._moe:
            cfg.update(self._moe_config(cfg))
        return cfg

    def _moe_config(self, cfg: dict) -> dict:
        """Mixtral (filed as llama) or Qwen3-MoE fields. llama.cpp's qwen3moe has every layer
        sparse and renormalises the top-k weights, as Qwen3-30B-A3B's and -235B-A22B's configs do."""
        experts, used = self._required("expert_count"), self._required("expert_used_count")
        if self._arch == "llama":
            return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": experts,
                    "num_experts_per_tok": used, "sliding_window": None}
        return {"num_experts": experts, "num_experts_per_tok": used,
                "moe_intermediate_size": self._required("expert_feed_forward_length"),
                "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}

    def _gemma3_config(self, cfg: dict) -> dict:
        """What llama.cpp's loader fixes for Gemma 3 rather than reads (llama-model.cpp): every 6th
        layer global, or all of them when no window is stored; local layers with rope base 10000,
        unscaled (rope.freq_base and any rope scaling are the global layers'); scores scaled by
        head_dim^-0.5, except the 27B (62 layers): (hidden / heads)^-0.5, its query_pre_attn_scalar."""
        window = int(self._arch_value("attention.sliding_window", 0) or 0)
        layers = cfg["num_hidden_layers"]
        extra: dict = {"sliding_window": window or None, "sliding_window_pattern": 6,
                       "rope_local_base_freq": 10000.0, "hidden_activation": "gelu_pytorch_tanh",
                       "query_pre_attn_scalar": (cfg["hidden_size"] // cfg["num_attention_heads"]
                                                 if layers == 62 else cfg["head_dim"])}
        if not window:
            extra["layer_types"] = ["full_attention"] * layers
        if cap := self._arch_value("final_logit_softcapping"):  # 0: none
            extra["final_logit_softcapping"] = float(cap)
        return extra

    def _rope_scaling(self) -> dict | None:
        kind = self._arch_value("rope.scaling.type")
        if kind not in (None, "none"):
            scaling: dict = {"rope_type": kind, "factor": float(self._arch_value("rope.scaling.factor", 1.0))}
            if (orig := self._arch_value("rope.scaling.original_context_length")) is not None:
                scaling["original_max_position_embeddings"] = int(orig)
            return scaling
        if "rope_freqs.weight" not in self._tensors:
            return None
        # Llama 3.x: llama.cpp precomputed the per-frequency divisors. Assume Meta's parameters,
        # then check they reproduce the stored divisors exactly; refuse to guess otherwise.
        freqs = self._dequantized("rope_freqs.weight").astype(np.float64)  # [H/2]
        scaling = {"rope_type": "llama3", "factor": float(freqs.max()), **_LLAMA3_ROPE}
        rot_dim = 2 * freqs.shape[0]
        expected = _llama3_rope_divisors(float(self._arch_value("rope.freq_base", 10000.0)),
                                         rot_dim, scaling)
        if not np.allclose(freqs, expected, rtol=1e-4):
            raise ValueError(f"GGUF file {self.path}: rope_freqs does not match llama3 rope "
                             f"scaling with {scaling}; unsupported rope scaling")
        return scaling

    # ---- tensors ---------------------------------------------------------------------------

    def tensor_names(self) -> list[str]:
        return [n for n in self._tensors if n != "rope_freqs.weight"] + list(self._experts)

    def __contains__(self, name: object) -> bool:
        return (name in self._tensors and name != "rope_freqs.weight") or name in self._experts

    def _tensor(self, name: str) -> "gguf.ReaderTensor":
        if name in self._experts:
            return self._experts[name][0]
        if name == "rope_freqs.weight" or name not in self._tensors:
            raise self._unknown_tensor(name)
        return self._tensors[name]

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        # GGUF records dims innermost-first; numpy (and HF) order is the reverse.
        shape = tuple(int(d) for d in reversed(self._tensor(name).shape.tolist()))
        return shape[1:] if name in self._experts else shape

    def tensor_dtype(self, name: str) -> np.dtype:
        self._tensor(name)
        return np.dtype(np.float32)

    def gguf_type(self, name: str) -> str:
        """Storage type in the file ("F32", "Q4_1", ...), for logs and memory estimates."""
        return self._tensor(name).tensor_type.name

    def _dequantized(self, name: str, tensor: "gguf.ReaderTensor | None" = None) -> np.ndarray:
        from gguf.quants import dequantize

        from jaxengine.models.gguf_header import FAST_DEQUANTIZE

        t = tensor if tensor is not None else self._tensors[name]
        try:
            fast = FAST_DEQUANTIZE.get(t.tensor_type.name)
            w = fast(t.data) if fast is not None else dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ValueError(f"GGUF file {self.path}: tensor {t.name} has type "
                             f"{t.tensor_type.name}, which cannot be dequantized: {e}") from e
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        w = np.asarray(w, dtype=np.float32).reshape(shape)
        # F32 dequantizes to a view of the read-only file mapping; callers get their own copy.
        return w if w.flags.writeable else w.copy()

    def get_tensor(self, name: str) -> np.ndarray:
        if name in self._experts:
            return self._expert(name)
        self._tensor(name)
        w = self._unpermuted(name, self._dequantized(name))  # HF layout, float32
        if self._arch == "gemma3" and name.endswith("norm.weight"):
            w = w - np.float32(1.0)  # llama.cpp stores Gemma's (1 + weight) norm scales
        return np.ascontiguousarray(w)

    def _expert(self, name: str) -> np.ndarray:
        """One expert's [out, in] slice of a stacked tensor. The loader reads a layer's experts in
        turn, so the stacked tensor is dequantized once and kept until another one is read."""
        t, e = self._experts[name]
        if self._stacked is None or self._stacked[0] != t.name:
            self._stacked = (t.name, self._dequantized(t.name, t))
        return np.ascontiguousarray(self._stacked[1][e])

    def _unpermuted(self, name: str, w: np.ndarray) -> np.ndarray:
        """Rows of a llama-architecture q/k projection back in HF's rotary order (any array whose
        rows are the projection's outputs: weights, Q8_0 values or their block scales)."""
        if _ARCHITECTURES[self._arch][2] and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
            key = "num_attention_heads" if ".q_proj." in name else "num_key_value_heads"
            w = unpermute_rotary(w, self.hf_config[key])
        return w

    def blocks(self, name: str) -> "gguf_blocks.GgufBlocks":
        """A linear weight's quantized blocks without dequantizing (models/gguf_blocks.py: values,
        group scales and zeros, [out, in] in HF layout and row order); ValueError for expert
        weights and for types that are not kept quantized."""
        t = self._tensor(name)
        if name in self._experts:
            raise ValueError(f"GGUF tensor {t.name}: expert weights are dequantized, not kept quantized")
        out, inp = (int(d) for d in reversed(t.shape.tolist()))
        b = gguf_blocks.unpack(t.tensor_type.name, t.data, out, inp)
        return dataclasses.replace(b, values=self._unpermuted(name, b.values), scales=self._unpermuted(name, b.scales),
                                   zeros=self._unpermuted(name, b.zeros))

    # ---- tokenizer and generation defaults -------------------------------------------------

    def load_tokenizer(self) -> "PreTrainedTokenizerBase":
        """transformers' tokenizer built from the GGUF vocabulary, with the file's chat template.

        Building it takes seconds (the merges are converted in Python), so it is cached per file
        for the life of the process; callers share one instance.
        """
        if self._tokenizer_source:
            return load_hf_tokenizer(self._tokenizer_source)
        st = os.stat(self.path)
        key = (os.path.realpath(self.path), st.st_mtime_ns, st.st_size)
        with _tokenizer_lock:
            tok = _tokenizer_cache.get(key)
            if tok is None:
                tok = _load_disk_cached_tokenizer(key)
            if tok is None:
                tok = self._build_tokenizer()
                _save_disk_cached_tokenizer(key, tok)
            _tokenizer_cache[key] = tok
        return tok

    def _build_tokenizer(self) -> "PreTrainedTokenizerBase":
        if self._meta_value("tokenizer.ggml.model") == "gpt2":
            from jaxengine.models.gguf_tokenizer import build_bpe_tokenizer
            return build_bpe_tokenizer(self._meta_value)
        try:  # SentencePiece-style vocabularies: transformers' converter (needs PyTorch)
            import torch  # noqa: F401
        except ImportError:
            raise ValueError(f"building the tokenizer of {self.path} (tokenizer model "
                             f"{self._meta_value('tokenizer.ggml.model')!r}) needs PyTorch installed; "
                             "or pass tokenizer= a Hugging Face tokenizer folder or hub id") from None
        p = Path(self.path)
        tok = load_hf_tokenizer(str(p.parent), gguf_file=p.name)
        template = self._meta_value("tokenizer.chat_template")
        if template:
            tok.chat_template = template
        return tok

    def generation_config(self) -> dict:
        gen: dict = {}
        if (bos := self._meta_value("tokenizer.ggml.bos_token_id")) is not None:
            gen["bos_token_id"] = int(bos)
        # llama.cpp stops on any end-of-generation token: eos, end-of-turn, end-of-message.
        eog = [int(v) for k in ("eos", "eot", "eom")
               if (v := self._meta_value(f"tokenizer.ggml.{k}_token_id")) is not None]
        eog = list(dict.fromkeys(eog))
        if eog:
            gen["eos_token_id"] = eog[0] if len(eog) == 1 else eog
        if (pad := self._meta_value("tokenizer.ggml.padding_token_id")) is not None:
            gen["pad_token_id"] = int(pad)
        return gen


def _tokenizer_cache_dir(key: tuple) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    digest = hashlib.sha256(repr(key).encode()).hexdigest()[:24]
    return Path(base) / "jaxengine" / "tokenizers" / digest


def _load_disk_cached_tokenizer(key: tuple) -> "PreTrainedTokenizerBase | None":
    """A tokenizer saved by an earlier process for the same file (path, mtime, size): loads in a
    fraction of a second instead of rebuilding the merges from the GGUF vocabulary."""
    folder = _tokenizer_cache_dir(key)
    if not (folder / "tokenizer_config.json").is_file():
        return None
    try:
        import json

        cls = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
        if cls in ("PreTrainedTokenizerFast", "TokenizersBackend") and (folder / "tokenizer.json").is_file():
            # the class the saved tokenizer already is; AutoTokenizer would resolve it through
            # transformers' model registry, which imports PyTorch (seconds of a CPU start)
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(folder))
        return load_hf_tokenizer(str(folder))
    except (ValueError, OSError) as e:  # a JSONDecodeError is a ValueError
        logger.warning("ignoring unreadable cached tokenizer %s: %s", folder, e)
        return None


def _save_disk_cached_tokenizer(key: tuple, tok: "PreTrainedTokenizerBase") -> None:
    folder = _tokenizer_cache_dir(key)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    try:
        tok.save_pretrained(str(tmp))
        os.replace(tmp, folder) if not folder.exists() else shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:  # a read-only home is fine: the cache is an optimisation
        logger.debug("could not cache the tokenizer in %s: %s", folder, e)
        shutil.rmtree(tmp, ignore_errors=True)


def _llama3_rope_divisors(theta: float, rot_dim: int, scaling: dict) -> np.ndarray:
    """Per-frequency divisors of Llama 3.1 rope scaling (as llama.cpp's converter writes them)."""
    factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    inv_freq = 1.0 / theta ** (np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim)  # [H/2]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - lo) / (hi - lo)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old_len / hi, 1.0, np.where(wavelen > old_len / lo, factor, mid))
