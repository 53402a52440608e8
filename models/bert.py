"""BERT-style encoders (Devlin et al., 2019) for embedding and reranking: BERT, RoBERTa, XLM-R
(the bge, gte and e5 base models; bge-reranker as XLM-R with a one-label classification head).

    h = LayerNorm(word[ids] + position[positions] + token_type[type_ids])
    each layer (post-LayerNorm):  h = LN(h + attn(h));  h = LN(h + out(act(up(h))))
    hidden = h (every token);  logits = head(h[:, 0]) for the *ForSequenceClassification heads

Attention runs both ways over a right-padded dense batch [B, T] (padding keys masked out) and
keeps no cache: an encoder reads each sequence once, so the paged KV cache of the decoders
(models/attention.py) plays no part. The engine's pooling runner calls `EncoderModel` on bucketed
batches and pools `hidden` (CLS, mean) or reads `logits` (rerankers).

Legend: B batch, T query tokens, S key tokens, D model (E: a square projection's output side),
N heads, H head dim, F ffn, L labels, V vocab, P positions, Y token types.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.models import weights as w
from jaxengine.models.layer_call import call_layer
from jaxengine.models.layers import ACTIVATIONS, LayerNorm

if TYPE_CHECKING:
    from jaxengine.models.checkpoint import Checkpoint

# architecture -> classification head ("none": hidden states only)
_HEADS = {
    "BertModel": "none", "RobertaModel": "none", "XLMRobertaModel": "none",
    "BertForSequenceClassification": "bert",
    "RobertaForSequenceClassification": "roberta", "XLMRobertaForSequenceClassification": "roberta",
}
ENCODER_ARCHITECTURES: frozenset[str] = frozenset(_HEADS)
# A config without `architectures` is named by its model_type.
_MODEL_TYPES = {"bert": "BertModel", "roberta": "RobertaModel", "xlm-roberta": "XLMRobertaModel"}


def is_encoder_config(d: Mapping) -> bool:
    """Whether a Hugging Face config dict names an encoder this module implements."""
    if not isinstance(d, Mapping):
        return False
    archs = d.get("architectures") or []
    if isinstance(archs, list) and archs:
        return archs[0] in ENCODER_ARCHITECTURES
    return d.get("model_type") in _MODEL_TYPES


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    architecture: str  # one of ENCODER_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    hidden_act: str  # a key of models/layers.py ACTIVATIONS ("gelu" is the exact erf GELU)
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    pad_token_id: int
    position_offset: int  # first real token's position id: 0 (BERT), pad_token_id + 1 (RoBERTa, XLM-R)
    num_labels: int  # 0 without a classification head
    head: str  # "none" | "bert" (pooler dense+tanh on [CLS], classifier) | "roberta" (dense+tanh, out_proj on <s>)
    id2label: tuple[str, ...]  # label names in index order; () without a head

    def __post_init__(self):
        assert self.head in ("none", "bert", "roberta"), self.head
        assert (self.num_labels == 0) == (self.head == "none") and len(self.id2label) == self.num_labels
        assert self.hidden_size % self.num_heads == 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_model_len(self) -> int:
        """Longest sequence whose position ids stay inside the position table. Not checked at
        call time (the model is traced once per bucket): a longer one would read clamped rows."""
        return self.max_position_embeddings - self.position_offset

    @classmethod
    def from_hf_dict(cls, d: Mapping) -> "EncoderConfig":
        """From a Hugging Face config.json dict. A missing or bad field, or a setting that changes
        the math and is not implemented, is a ValueError naming the architecture and the field."""
        archs = d.get("architectures") or []
        arch = str(archs[0]) if isinstance(archs, list) and archs else _MODEL_TYPES.get(str(d.get("model_type")), "")
        if arch not in ENCODER_ARCHITECTURES:
            raise ValueError(f"{arch or d.get('model_type')!r} is not an encoder architecture this engine "
                             f"implements (supported: {', '.join(sorted(ENCODER_ARCHITECTURES))})")
        roberta = not arch.startswith("Bert")
        if d.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{arch}: position_embedding_type={d['position_embedding_type']!r} is not "
                             "supported (only 'absolute')")
        for flag in ("is_decoder", "add_cross_attention"):
            if d.get(flag):
                raise ValueError(f"{arch}: {flag}=True is not supported (bidirectional encoders only)")
        act = d.get("hidden_act", "gelu")
        if not isinstance(act, str) or act not in ACTIVATIONS:
            raise ValueError(f"{arch}: hidden_act {act!r} is not supported "
                             f"(supported: {', '.join(sorted(ACTIVATIONS))})")
        dims = {k: _int(d, k, arch) for k in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")}
        if dims["hidden_size"] % dims["num_attention_heads"]:
            raise ValueError(f"{arch}: hidden_size={dims['hidden_size']} is not a multiple of "
                             f"num_attention_heads={dims['num_attention_heads']}")
        pad = _int(d, "pad_token_id", arch, default=1 if roberta else 0, minimum=0)
        offset = pad + 1 if roberta else 0
        max_pos = _int(d, "max_position_embeddings", arch, default=512)
        if max_pos <= offset:
            raise ValueError(f"{arch}: max_position_embeddings={max_pos} leaves no position after the "
                             f"padding index {pad}")
        eps = d.get("layer_norm_eps", 1e-12)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise ValueError(f"{arch}: layer_norm_eps must be a positive number, got {eps!r}")
        head = _HEADS[arch]
        labels = _labels(d, arch) if head != "none" else ()
        return cls(
            architecture=arch, vocab_size=dims["vocab_size"], hidden_size=dims["hidden_size"],
            num_layers=dims["num_hidden_layers"], num_heads=dims["num_attention_heads"],
            intermediate_size=dims["intermediate_size"], hidden_act=act, max_position_embeddings=max_pos,
            type_vocab_size=_int(d, "type_vocab_size", arch, default=2), layer_norm_eps=float(eps),
            pad_token_id=pad, position_offset=offset, num_labels=len(labels), head=head, id2label=labels)


def _int(d: Mapping, key: str, arch: str, default: int | None = None, minimum: int = 1) -> int:
    v = d.get(key, default)
    if v is None:
        if default is None:
            raise ValueError(f"{arch}: config.json lacks {key!r}")
        v = default
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{arch}: {key} must be an integer >= {minimum}, got {v!r}")
    return v


def _labels(d: Mapping, arch: str) -> tuple[str, ...]:
    """Label names in index order, from id2label (keys "0".."L-1") and/or num_labels (default 2,
    as transformers); names default to LABEL_i."""
    id2label = d.get("id2label") or {}
    if not isinstance(id2label, Mapping):
        raise ValueError(f"{arch}: id2label must be a mapping from label index to name")
    try:
        by_index = {int(k): str(v) for k, v in id2label.items()}
    except (TypeError, ValueError):
        raise ValueError(f"{arch}: id2label keys must be label indices, got {sorted(id2label)}") from None
    n = d.get("num_labels", len(by_index) or 2)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{arch}: num_labels must be an integer >= 1, got {n!r}")
    if by_index and sorted(by_index) != list(range(n)):
        raise ValueError(f"{arch}: id2label indices {sorted(by_index)} do not match num_labels={n}")
    return tuple(by_index.get(i, f"LABEL_{i}") for i in range(n))


# -- the model ---------------------------------------------------------------------------------
class EncoderOutput(NamedTuple):
    hidden: jax.Array  # [B, T, D] last layer's output (after its LayerNorm); padding rows are garbage
    logits: jax.Array | None  # [B, L] float32 classification logits; None without a head


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: jnp.dtype) -> nnx.Param:
    return nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), shape, dtype))


def _zeros(shape: tuple[int, ...], dtype: jnp.dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype))


class Embeddings(nnx.Module):
    def __init__(self, cfg: EncoderConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.word = _param(rngs, (cfg.vocab_size, cfg.hidden_size), dtype)  # VD
        self.position = _param(rngs, (cfg.max_position_embeddings, cfg.hidden_size), dtype)  # PD
        self.token_type = _param(rngs, (cfg.type_vocab_size, cfg.hidden_size), dtype)  # YD
        self.norm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)
        self.position_offset = cfg.position_offset

    def __call__(self, input_ids: jax.Array, mask: jax.Array, token_type_ids: jax.Array) -> jax.Array:
        """[B, T] each -> [B, T, D]."""
        if self.position_offset:
            # RoBERTa / XLM-R: real tokens count up from padding_idx + 1, padding sits at padding_idx
            # (transformers derives the mask from input_ids != pad; here it is the given mask).
            mask = mask.astype(jnp.int32)
            positions = jnp.cumsum(mask, axis=1) * mask + (self.position_offset - 1)
        else:
            positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)
        x = self.word[...][input_ids] + self.token_type[...][token_type_ids] + self.position[...][positions]
        return self.norm(x)


class SelfAttention(nnx.Module):
    """Bidirectional multi-head attention with biases; scores and softmax in float32."""

    def __init__(self, cfg: EncoderConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        d, n, h = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        self.q_proj, self.q_bias = _param(rngs, (d, n, h), dtype), _zeros((n, h), dtype)  # DNH, NH
        self.k_proj, self.k_bias = _param(rngs, (d, n, h), dtype), _zeros((n, h), dtype)
        self.v_proj, self.v_bias = _param(rngs, (d, n, h), dtype), _zeros((n, h), dtype)
        self.o_proj, self.o_bias = _param(rngs, (n, h, d), dtype), _zeros((d,), dtype)  # NHD, D
        self.scale = h ** -0.5

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        """x [B, T, D], mask [B, T] (1 real, 0 padding) -> [B, T, D]."""
        q = jnp.einsum("BTD,DNH->BTNH", x, self.q_proj[...]) + self.q_bias[...]
        k = jnp.einsum("BSD,DNH->BSNH", x, self.k_proj[...]) + self.k_bias[...]
        v = jnp.einsum("BSD,DNH->BSNH", x, self.v_proj[...]) + self.v_bias[...]
        scores = jnp.einsum("BTNH,BSNH->BNTS", q, k, preferred_element_type=jnp.float32) * self.scale
        # A large finite negative rather than -inf: an all-padding row (a batch's filler
        # sequence) then averages its values instead of producing NaN.
        keep = mask.astype(bool)[:, None, None, :]  # B11S
        scores = jnp.where(keep, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        out = jnp.einsum("BNTS,BSNH->BTNH", probs, v)
        return jnp.einsum("BTNH,NHD->BTD", out, self.o_proj[...]) + self.o_bias[...]


class FeedForward(nnx.Module):
    def __init__(self, cfg: EncoderConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.up_proj, self.up_bias = _param(rngs, (d, f), dtype), _zeros((f,), dtype)  # DF, F
        self.down_proj, self.down_bias = _param(rngs, (f, d), dtype), _zeros((d,), dtype)  # FD, D
        self.act = ACTIVATIONS[cfg.hidden_act]

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.act(jnp.einsum("BTD,DF->BTF", x, self.up_proj[...]) + self.up_bias[...])
        return jnp.einsum("BTF,FD->BTD", h, self.down_proj[...]) + self.down_bias[...]


class EncoderLayer(nnx.Module):
    """Post-LayerNorm: each sub-block's output is added to its input, then normalised."""

    def __init__(self, cfg: EncoderConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.attention = SelfAttention(cfg, dtype, rngs)
        self.attention_norm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)
        self.mlp = FeedForward(cfg, dtype, rngs)
        self.mlp_norm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = self.attention_norm(x + self.attention(x, mask))
        return self.mlp_norm(x + self.mlp(x))


class ClassificationHead(nnx.Module):
    """logits = out(tanh(dense(h[:, 0]))): BERT's pooler + classifier and RoBERTa's
    classification head compute the same thing from differently named tensors."""

    def __init__(self, cfg: EncoderConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        d, labels = cfg.hidden_size, cfg.num_labels
        self.dense, self.dense_bias = _param(rngs, (d, d), dtype), _zeros((d,), dtype)  # DD, D
        self.out, self.out_bias = _param(rngs, (d, labels), dtype), _zeros((labels,), dtype)  # DL, L

    def __call__(self, first: jax.Array) -> jax.Array:
        """first [B, D] (the [CLS] / <s> token's hidden state) -> logits [B, L] float32."""
        h = jnp.tanh(jnp.einsum("BD,DE->BE", first, self.dense[...]) + self.dense_bias[...])
        return (jnp.einsum("BE,EL->BL", h, self.out[...]) + self.out_bias[...]).astype(jnp.float32)


class EncoderModel(nnx.Module):
    def __init__(self, cfg: EncoderConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.config = cfg
        self.embeddings = Embeddings(cfg, dtype, rngs)
        self.layers = nnx.List([EncoderLayer(cfg, dtype, rngs) for _ in range(cfg.num_layers)])
        self.head = ClassificationHead(cfg, dtype, rngs) if cfg.head != "none" else None

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array,
                 token_type_ids: jax.Array | None = None) -> EncoderOutput:
        """input_ids, attention_mask (1 real, 0 padding; padding on the right), token_type_ids
        (default zeros): [B, T] int32 -> EncoderOutput(hidden [B, T, D], logits [B, L] or None).
        Sequences must fit `config.max_model_len`."""
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        x = self.embeddings(input_ids, attention_mask, token_type_ids)
        for layer in self.layers:
            x = call_layer(layer, x, attention_mask)
        logits = self.head(x[:, 0]) if self.head is not None else None
        return EncoderOutput(x, logits)


# -- checkpoint names ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Tensor:
    name: str  # Hugging Face name, "{}" for the layer index, without the "bert."/"roberta." prefix
    path: w.Path  # parameter path (below ("layers", i) when the name has a layer index)
    transform: w.Transform  # HF layout -> ours (models/weights.py; they read hidden_size, num_heads, head_dim)
    prefixed: bool = True  # lives in the encoder body, which may sit under "bert." / "roberta."

    @property
    def pattern(self) -> re.Pattern:
        body = re.escape(self.name).replace(r"\{\}", r"(\d+)")
        # LayerNorm's names in older TensorFlow-converted files: gamma / beta.
        body = body.replace(r"LayerNorm\.weight", r"LayerNorm\.(?:weight|gamma)")
        body = body.replace(r"LayerNorm\.bias", r"LayerNorm\.(?:bias|beta)")
        return re.compile((_PREFIX if self.prefixed else "") + body + "$")


# BertModel.save_pretrained names the encoder's tensors bare; the *ForSequenceClassification
# models (and some hub uploads of the bare model) put them under "bert." / "roberta.".
_PREFIX = r"(?:bert\.|roberta\.)?"


def _norm(name: str, path: w.Path) -> tuple[_Tensor, ...]:
    return (_Tensor(name + "LayerNorm.weight", path + ("weight",), w.same),
            _Tensor(name + "LayerNorm.bias", path + ("bias",), w.same))


_L = "encoder.layer.{}."
_QKV = (("query", "q"), ("key", "k"), ("value", "v"))
_BODY: tuple[_Tensor, ...] = (
    _Tensor("embeddings.word_embeddings.weight", ("embeddings", "word"), w.same),
    _Tensor("embeddings.position_embeddings.weight", ("embeddings", "position"), w.same),
    _Tensor("embeddings.token_type_embeddings.weight", ("embeddings", "token_type"), w.same),
    *_norm("embeddings.", ("embeddings", "norm")),
    *(_Tensor(f"{_L}attention.self.{hf}.weight", ("attention", f"{ours}_proj"), w.heads_in("num_heads"))
      for hf, ours in _QKV),
    *(_Tensor(f"{_L}attention.self.{hf}.bias", ("attention", f"{ours}_bias"), w.heads_bias("num_heads"))
      for hf, ours in _QKV),
    _Tensor(_L + "attention.output.dense.weight", ("attention", "o_proj"), w.o_proj),
    _Tensor(_L + "attention.output.dense.bias", ("attention", "o_bias"), w.same),
    *_norm(_L + "attention.output.", ("attention_norm",)),
    _Tensor(_L + "intermediate.dense.weight", ("mlp", "up_proj"), w.transpose),
    _Tensor(_L + "intermediate.dense.bias", ("mlp", "up_bias"), w.same),
    _Tensor(_L + "output.dense.weight", ("mlp", "down_proj"), w.transpose),
    _Tensor(_L + "output.dense.bias", ("mlp", "down_bias"), w.same),
    *_norm(_L + "output.", ("mlp_norm",)),
)
_HEAD_TENSORS: dict[str, tuple[_Tensor, ...]] = {
    "none": (),
    "bert": (_Tensor("pooler.dense.weight", ("head", "dense"), w.transpose),
             _Tensor("pooler.dense.bias", ("head", "dense_bias"), w.same),
             _Tensor("classifier.weight", ("head", "out"), w.transpose, prefixed=False),
             _Tensor("classifier.bias", ("head", "out_bias"), w.same, prefixed=False)),
    "roberta": (_Tensor("classifier.dense.weight", ("head", "dense"), w.transpose, prefixed=False),
                _Tensor("classifier.dense.bias", ("head", "dense_bias"), w.same, prefixed=False),
                _Tensor("classifier.out_proj.weight", ("head", "out"), w.transpose, prefixed=False),
                _Tensor("classifier.out_proj.bias", ("head", "out_bias"), w.same, prefixed=False)),
}
# Tensors the encoder does not read: the position-id / token-type buffers some files carry, the
# masked-LM and next-sentence heads of pretraining checkpoints, and the pooler of a model whose
# head does not use it (BertModel keeps one that embedding models ignore).
_IGNORED = (_PREFIX + r"embeddings\.(?:position_ids|token_type_ids)", r"cls\..*", r"lm_head\..*")
_IGNORED_POOLER = _PREFIX + r"pooler\.dense\.(?:weight|bias)"


def checkpoint_tensors(cfg: EncoderConfig) -> tuple[_Tensor, ...]:
    return _BODY + _HEAD_TENSORS[cfg.head]


def ignored_pattern(cfg: EncoderConfig) -> re.Pattern:
    patterns = _IGNORED + ((_IGNORED_POOLER,) if cfg.head != "bert" else ())
    return re.compile("(?:" + "|".join(patterns) + ")$")


# -- loading -----------------------------------------------------------------------------------
def load_encoder(folder: str, dtype: jnp.dtype) -> tuple[EncoderModel, EncoderConfig]:
    """A transformers folder (config.json + *.safetensors; a hub id is downloaded first) -> the
    model with its weights, and its config. Missing, unexpected and misshapen tensors are one
    ValueError naming each."""
    from jaxengine.models.checkpoint import SafetensorsCheckpoint, open_checkpoint

    ckpt = open_checkpoint(folder)
    if not isinstance(ckpt, SafetensorsCheckpoint):
        raise ValueError(f"{ckpt.path}: encoders load from a config.json + safetensors folder only")
    cfg = EncoderConfig.from_hf_dict(ckpt.hf_config)
    return load_encoder_params(ckpt, cfg, dtype), cfg


def load_encoder_params(checkpoint: Checkpoint, cfg: EncoderConfig, dtype: jnp.dtype) -> EncoderModel:
    """Every tensor of `checkpoint` through the table above into a new model; every parameter
    filled exactly once (no parameter keeps its random initial value)."""
    dtype = jnp.dtype(dtype)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: EncoderModel(cfg, dtype, w.ShapeOnlyRngs())))
    pure = nnx.to_pure_dict(state)
    expected = w.flatten_paths(pure)
    table, ignored = checkpoint_tensors(cfg), ignored_pattern(cfg)
    filled: dict[w.Path, str] = {}  # parameter -> the tensor that filled it (or was misshapen)
    unexpected, problems = [], []
    for name in checkpoint.tensor_names():
        if ignored.match(name):
            continue
        path, fn = _target(name, table)
        if path not in expected:
            unexpected.append(name)
            continue
        if path in filled:
            problems.append(f"{filled[path]} and {name} both fill {'.'.join(map(str, path))}")
            continue
        raw = np.asarray(checkpoint.get_tensor(name))
        try:
            arr = fn(raw, cfg)
        except ValueError:
            arr = None
        want = tuple(expected[path].shape)
        if arr is None or tuple(arr.shape) != want:
            problems.append(f"{name}: checkpoint shape {tuple(raw.shape)} does not fit parameter {want}")
        else:
            w.set_path(pure, path, jnp.asarray(np.asarray(arr).astype(dtype)))
        filled[path] = name
    missing = [_hf_name(p, table, checkpoint.tensor_names()) for p in expected if p not in filled]
    if missing or unexpected or problems:
        parts = ([f"missing tensors: {', '.join(missing)}"] if missing else []) + \
                ([f"unexpected tensors: {', '.join(unexpected)}"] if unexpected else []) + problems
        raise ValueError(f"checkpoint {getattr(checkpoint, 'path', '?')} does not match "
                         f"{cfg.architecture}: " + " | ".join(parts))
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def _target(name: str, table: tuple[_Tensor, ...]) -> tuple[w.Path | None, w.Transform | None]:
    """HF tensor name -> (parameter path, layout transform); (None, None) when the table lacks it."""
    for t in table:
        m = t.pattern.match(name)
        if m:
            return (("layers", int(m.group(1))) if m.groups() else ()) + t.path, t.transform
    return None, None


def _hf_name(path: w.Path, table: tuple[_Tensor, ...], present: list[str]) -> str:
    """The checkpoint name a parameter reads, under the prefix the checkpoint's other tensors use."""
    layer, sub = (path[1], path[2:]) if path[0] == "layers" else (None, path)
    t = next(t for t in table if t.path == sub and ("{}" in t.name) == (layer is not None))
    prefix = next((p for p in ("bert.", "roberta.") if any(n.startswith(p) for n in present)), "")
    return (prefix if t.prefixed else "") + t.name.format(layer)
