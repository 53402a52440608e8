"""Pooling engines: embeddings, class scores and pair scores.

`LLM(model, runner="pooling")` (or vLLM's `task="embed" | "classify" | "score"`, or any encoder
checkpoint) builds one of two engines instead of the generating engine (`make_pooling_engine`):

- `PoolingEngine` for encoder checkpoints (BERT, RoBERTa, XLM-R; embedders and cross-encoders);
- `DecoderPoolingEngine` for decoder models of the supported families (Qwen3-Embedding,
  e5-mistral, SmolLM2, ...): last-token pooling through the generating engine's own steps.

For encoders, prompts are tokenized (pairs with the tokenizer's pair template and token types), sorted by
length and run in batches padded to power-of-two buckets (rows and tokens), one compiled program
per bucket, compiled on first use. Each program returns the pooled vector per row on the device
(CLS, MEAN over real tokens, or LAST real token: `PoolerConfig`) and the classification logits of
models with a head; finishing (Matryoshka truncation, L2 normalisation, softmax or sigmoid,
cosine similarity) runs on the host over those few numbers.

The pooling method comes from the checkpoint's sentence-transformers files (`modules.json` and
its Pooling module's `config.json`, plus a Normalize module) where present, else vLLM's default
for encoders: CLS, normalised.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.config import EngineConfig
from jaxengine.outputs import (ClassificationOutput, EmbeddingOutput, PoolingOutput, PoolingRequestOutput,
                               ScoringOutput)
from jaxengine.pooling_params import PoolingParams
from jaxengine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

POOLING_TYPES = ("CLS", "MEAN", "LAST")
_MIN_TOKENS_BUCKET = 16
PromptInput = str | dict | Sequence[int]  # a text, token ids, or a {"prompt" | "prompt_token_ids"} dict


@dataclasses.dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str  # one of POOLING_TYPES
    normalize: bool  # embeddings L2-normalised by default


def pooler_config(folder: Path | None, default: PoolerConfig = PoolerConfig("CLS", True)) -> PoolerConfig:
    """The sentence-transformers pooling of a checkpoint folder; `default` where the folder has
    none (vLLM's: CLS for encoders, the last token for decoders, both normalised)."""
    if folder is None or not (folder / "modules.json").is_file():
        return default
    modules = json.loads((folder / "modules.json").read_text())
    pooling, normalize = default.pooling_type, False
    for m in modules:
        kind = str(m.get("type", ""))
        if kind.endswith("models.Pooling"):
            cfg_path = folder / str(m.get("path", "")) / "config.json"
            if cfg_path.is_file():
                cfg = json.loads(cfg_path.read_text())
                modes = {"CLS": cfg.get("pooling_mode_cls_token"), "MEAN": cfg.get("pooling_mode_mean_tokens"),
                         "LAST": cfg.get("pooling_mode_lasttoken")}
                chosen = [k for k, v in modes.items() if v]
                others = [k for k in ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                                      "pooling_mode_weightedmean_tokens") if cfg.get(k)]
                if others or len(chosen) > 1:
                    raise ValueError(f"{cfg_path}: pooling {others + chosen} is not supported; "
                                     f"one of {', '.join(POOLING_TYPES)} is")
                if chosen:
                    pooling = chosen[0]
        elif kind.endswith("models.Normalize"):
            normalize = True
    return PoolerConfig(pooling, normalize)


def wants_pooling(config: EngineConfig) -> bool:
    """Whether `config` asks for the pooling engine: runner="pooling", a pooling task, or (runner
    and task left "auto") a local checkpoint folder of an encoder or a decoder classifier."""
    if config.is_pooling:
        return True
    if "generate" in (config.runner, config.task):  # asked for by name: the model decides nothing
        return False
    from jaxengine.models.bert import is_encoder_config
    from jaxengine.models.registry import CLASSIFIER_ARCHITECTURES

    hf = local_hf_config(config)
    return hf is not None and (is_encoder_config(hf) or (hf.get("architectures") or [""])[0] in CLASSIFIER_ARCHITECTURES)


def local_hf_config(config: EngineConfig) -> dict | None:
    """config.json of the model when it is a local folder (None otherwise, or when unreadable)."""
    path = Path(config.model).expanduser() / "config.json" if config.model else None
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        return None


def _pool(hidden: jax.Array, mask: jax.Array, pooling_type: str) -> jax.Array:
    """hidden [B, T, D], mask [B, T] (1 real, right-padded) -> [B, D] float32."""
    h = hidden.astype(jnp.float32)
    if pooling_type == "CLS":
        return h[:, 0]
    m = mask.astype(jnp.float32)
    if pooling_type == "MEAN":
        return jnp.einsum("btd,bt->bd", h, m) / jnp.maximum(m.sum(-1, keepdims=True), 1.0)
    last = jnp.maximum(mask.sum(-1) - 1, 0)
    return jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]


def _run(graphdef, state, input_ids, mask, type_ids, *, pooling_type: str):
    model = nnx.merge(graphdef, state)
    out = model(input_ids, mask, type_ids)
    logits = out.logits if out.logits is not None else jnp.zeros((input_ids.shape[0], 0), jnp.float32)
    return _pool(out.hidden, mask, pooling_type), logits


def _bucket(n: int, lo: int, hi: int) -> int:
    return min(max(lo, 1 << max(0, (n - 1).bit_length())), hi)


@dataclasses.dataclass
class _Encoded:
    """One prompt (or pair) as the model reads it."""

    ids: list[int]
    type_ids: list[int]


class PoolingEngineBase:
    """What every pooling engine shares: the tasks its model serves, input checks, and finishing
    pooled vectors and logits on the host. Subclasses set `model_config` (architecture,
    num_labels, vocab_size, hidden_size), `tokenizer`, `max_model_len` (most prompt tokens) and
    `pooler`, and implement `encode_prompt` and `run`."""

    model_config: object
    tokenizer: object
    max_model_len: int
    pooler: PoolerConfig
    _next_id: int = 0

    # -- what the model is for ----------------------------------------------------------------
    @property
    def is_cross_encoder(self) -> bool:
        """A one-label classifier: scores a pair of texts read together (rerankers)."""
        return self.model_config.num_labels == 1

    def supported_tasks(self) -> tuple[str, ...]:
        if self.model_config.num_labels:
            return ("classify", "score", "encode") if self.is_cross_encoder else ("classify", "encode")
        return ("embed", "score", "encode")

    def check_task(self, task: str) -> None:
        if task not in self.supported_tasks():
            arch = self.model_config.architecture
            raise ValueError(f"{arch} does not support {task!r}; it supports {', '.join(self.supported_tasks())}")

    def encode_pair(self, text_1: str, text_2: str, params: PoolingParams) -> _Encoded:
        raise ValueError(f"{self.model_config.architecture} does not read text pairs")

    def _tokenizer(self):
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompts as token ids")
        return self.tokenizer

    def _checked(self, enc: _Encoded, params: PoolingParams) -> _Encoded:
        k = params.truncate_prompt_tokens
        if k is not None:
            k = self.max_model_len if k == -1 else k
            if k > self.max_model_len:
                raise ValueError(f"truncate_prompt_tokens={k} exceeds max_model_len={self.max_model_len}")
            enc = _Encoded(enc.ids[-k:], enc.type_ids[-k:])
        if not enc.ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in enc.ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of vocabulary [0, {vocab}): {bad[:5]}")
        if len(enc.ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(enc.ids)} tokens, the model accepts at most "
                             f"max_model_len = {self.max_model_len} (truncate_prompt_tokens cuts it)")
        return enc

    # -- finishing ----------------------------------------------------------------------------
    def embedding(self, pooled: np.ndarray, params: PoolingParams) -> np.ndarray:
        """Matryoshka truncation, then L2 normalisation (the model's default unless asked)."""
        if params.dimensions is not None:
            if params.dimensions > pooled.shape[-1]:
                raise ValueError(f"dimensions={params.dimensions} exceeds the model's "
                                 f"{pooled.shape[-1]}-dimensional embeddings")
            pooled = pooled[..., : params.dimensions]
        normalize = self.pooler.normalize if params.normalize is None else params.normalize
        if normalize:
            pooled = pooled / np.maximum(np.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
        return pooled

    @staticmethod
    def probabilities(logits: np.ndarray, params: PoolingParams) -> np.ndarray:
        """Softmax over the labels (one label: sigmoid); the raw logits with activation=False."""
        if params.activation is False:
            return logits
        if logits.shape[-1] == 1:
            return 1.0 / (1.0 + np.exp(-logits))
        z = np.exp(logits - logits.max(-1, keepdims=True))
        return z / z.sum(-1, keepdims=True)

    # -- tasks: what LLM.embed / encode / classify / score and the server's endpoints run ---------
    def embed(self, prompts: Sequence[PromptInput], params: PoolingParams) -> list[PoolingRequestOutput]:
        """One embedding per prompt (`.outputs.embedding`), normalised unless params say otherwise."""
        encoded = [self.encode_prompt(p, params) for p in prompts]
        pooled, _ = self.run(encoded)
        vectors = self.embedding(pooled, params)
        return [PoolingRequestOutput(rid, EmbeddingOutput(v.tolist()), e.ids)
                for rid, v, e in zip(self.new_request_ids(len(encoded)), vectors, encoded)]

    def encode(self, prompts: Sequence[PromptInput], params: PoolingParams) -> list[PoolingRequestOutput]:
        """The raw pooled vector per prompt (`.outputs.data`, float32 numpy): the logits of a model
        with a classification head; else the pooled hidden state, normalised only if asked."""
        encoded = [self.encode_prompt(p, params) for p in prompts]
        pooled, logits = self.run(encoded)
        data = logits if self.model_config.num_labels else self.embedding(
            pooled, dataclasses.replace(params, normalize=bool(params.normalize)))
        return [PoolingRequestOutput(rid, PoolingOutput(d), e.ids)
                for rid, d, e in zip(self.new_request_ids(len(encoded)), data, encoded)]

    def classify(self, prompts: Sequence[PromptInput], params: PoolingParams) -> list[PoolingRequestOutput]:
        """Class probabilities per prompt (`.outputs.probs`): softmax, or sigmoid for one label."""
        encoded = [self.encode_prompt(p, params) for p in prompts]
        _, logits = self.run(encoded)
        probs = self.probabilities(logits, params)
        return [PoolingRequestOutput(rid, ClassificationOutput(p.tolist()), e.ids)
                for rid, p, e in zip(self.new_request_ids(len(encoded)), probs, encoded)]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str],
              params: PoolingParams) -> list[PoolingRequestOutput]:
        """Scores of text pairs, paired as vLLM pairs them: one text against each of many, or N
        against N. A cross-encoder reads each pair together (sigmoid of its logit); an embedding
        model gives the cosine similarity of the two embeddings."""
        left = [data_1] if isinstance(data_1, str) else list(data_1)
        right = [data_2] if isinstance(data_2, str) else list(data_2)
        if not left or not right:
            raise ValueError("score needs at least one text on each side")
        if len(left) == 1:
            left = left * len(right)
        if len(left) != len(right):
            raise ValueError(f"score pairs one text with many, or N with N; got {len(left)} and {len(right)}")
        if self.is_cross_encoder:
            encoded = [self.encode_pair(a, b, params) for a, b in zip(left, right)]
            _, logits = self.run(encoded)
            scores = self.probabilities(logits, params)[:, 0].tolist()
        else:
            texts = list(dict.fromkeys(left + right))
            pooled, _ = self.run([self.encode_prompt(t, params) for t in texts])
            vec = dict(zip(texts, self.embedding(pooled, params)))
            scores = [cosine(vec[a], vec[b]) for a, b in zip(left, right)]
            encoded = [self.encode_prompt(a, params) for a in left]
        return [PoolingRequestOutput(rid, ScoringOutput(float(s)), e.ids)
                for rid, s, e in zip(self.new_request_ids(len(scores)), scores, encoded)]

    def new_request_ids(self, n: int) -> list[str]:
        ids = [str(self._next_id + i) for i in range(n)]
        self._next_id += n
        return ids



class PoolingEngine(PoolingEngineBase):
    """Runs an encoder checkpoint for pooling: `embed`, `classify`, `score`, `encode`."""

    def __init__(self, config: EngineConfig):
        from jaxengine.loading import enable_compilation_cache
        from jaxengine.models.bert import EncoderConfig, is_encoder_config, load_encoder_params
        from jaxengine.models.checkpoint import SafetensorsCheckpoint, open_checkpoint

        t0 = time.perf_counter()
        if config.model is None:
            raise ValueError("pooling needs a model: the embedded default is a generative model")
        enable_compilation_cache(config.compilation_cache_dir)
        ckpt = open_checkpoint(config.model, revision=config.revision, tokenizer=config.tokenizer)
        arch = (ckpt.hf_config.get("architectures") or ["?"])[0]
        if not is_encoder_config(ckpt.hf_config):
            raise ValueError(f"{arch} is not an encoder model (BertModel, XLMRobertaModel, RobertaModel or "
                             "their *ForSequenceClassification); decoders pool through DecoderPoolingEngine")
        if not isinstance(ckpt, SafetensorsCheckpoint):
            raise ValueError(f"{ckpt.path}: encoders load from a config.json + safetensors folder")
        self.config = config
        self.model_config = cfg = EncoderConfig.from_hf_dict(ckpt.hf_config)
        self.dtype = jnp.float32 if config.dtype in ("auto", "float32") else jnp.dtype(config.dtype)
        model = load_encoder_params(ckpt, cfg, self.dtype)
        self.tokenizer = None if config.skip_tokenizer_init else ckpt.load_tokenizer()
        self.max_model_len = min(config.max_model_len or cfg.max_model_len, cfg.max_model_len)
        self.max_batch = _bucket(min(config.max_num_seqs, 64), 1, 64)
        self.pooler = pooler_config(Path(ckpt.path))
        self.graphdef, self.state = nnx.split(model)
        self._programs: dict[tuple[int, int], object] = {}
        logger.info("pooling model %s (%s, %s): %s pooling%s, %s; max_model_len %d; ready in %.1f s",
                    config.model, arch, jnp.dtype(self.dtype).name, self.pooler.pooling_type,
                    ", normalised" if self.pooler.normalize else "",
                    f"{cfg.num_labels} labels" if cfg.num_labels else "no classification head",
                    self.max_model_len, time.perf_counter() - t0)

    # -- inputs -------------------------------------------------------------------------------
    def encode_prompt(self, prompt, params: PoolingParams) -> _Encoded:
        """A text, a token id list or a {"prompt" | "prompt_token_ids"} dict -> model input."""
        if isinstance(prompt, dict):
            if prompt.get("multi_modal_data"):
                raise ValueError(f"multi_modal_data: model {self.model_config.architecture} takes text only")
            prompt = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt.get("prompt")
        if isinstance(prompt, str):
            ids = list(self._tokenizer()(prompt)["input_ids"])
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in prompt):
            ids = [int(t) for t in prompt]
        else:
            raise ValueError(f"unsupported prompt type {type(prompt).__name__}")
        return self._checked(_Encoded(ids, [0] * len(ids)), params)

    def encode_pair(self, text_1: str, text_2: str, params: PoolingParams) -> _Encoded:
        enc = self._tokenizer()(text_1, text_2)
        ids = list(enc["input_ids"])
        types = list(enc.get("token_type_ids") or [0] * len(ids))
        if self.model_config.type_vocab_size < 2:  # RoBERTa / XLM-R: one segment embedding
            types = [0] * len(ids)
        return self._checked(_Encoded(ids, types), params)

    # -- the device ---------------------------------------------------------------------------
    def _program(self, b: int, t: int):
        key = (b, t)
        if key not in self._programs:
            t0 = time.perf_counter()
            fn = jax.jit(functools.partial(_run, self.graphdef, pooling_type=self.pooler.pooling_type))
            spec = jax.ShapeDtypeStruct((b, t), jnp.int32)
            self._programs[key] = fn.lower(self.state, spec, spec, spec).compile()
            logger.info("compiled the pooling program for %d rows x %d tokens in %.1f s", b, t,
                        time.perf_counter() - t0)
        return self._programs[key]

    def run(self, encoded: Sequence[_Encoded]) -> tuple[np.ndarray, np.ndarray]:
        """(pooled [N, D] float32, logits [N, L] float32) for every input, in input order;
        batched by length into bucketed programs."""
        n = len(encoded)
        d, labels = self.model_config.hidden_size, self.model_config.num_labels
        pooled = np.zeros((n, d), np.float32)
        logits = np.zeros((n, labels), np.float32)
        order = sorted(range(n), key=lambda i: len(encoded[i].ids))
        for start in range(0, n, self.max_batch):
            rows = order[start:start + self.max_batch]
            b = _bucket(len(rows), 1, self.max_batch)
            t = _bucket(max(len(encoded[i].ids) for i in rows), _MIN_TOKENS_BUCKET, self.max_model_len)
            ids = np.zeros((b, t), np.int32)
            types = np.zeros((b, t), np.int32)
            mask = np.zeros((b, t), np.int32)
            for r, i in enumerate(rows):
                e = encoded[i]
                ids[r, : len(e.ids)] = e.ids
                types[r, : len(e.ids)] = e.type_ids
                mask[r, : len(e.ids)] = 1
            p, lg = jax.device_get(self._program(b, t)(self.state, ids, mask, types))
            pooled[rows] = p[: len(rows)]
            logits[rows] = lg[: len(rows)]
        return pooled, logits


@dataclasses.dataclass(frozen=True)
class _DecoderInfo:
    """What pooling reads of a decoder model's config."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_labels: int = 0
    id2label: tuple[str, ...] = ()


class DecoderPoolingEngine(PoolingEngineBase):
    """Embeddings from a decoder model (Qwen3-Embedding, e5-mistral, any supported family): the
    final hidden state of each prompt's last token, through the generating engine's own steps
    (batched, chunked, prefix-cached; each request samples one token that is dropped and frees
    its KV blocks when its prompt is done). Decoder classifiers and reward models
    (`*ForSequenceClassification` of the Llama family) apply their `score` head to that state."""

    def __init__(self, config: EngineConfig):
        from jaxengine.engine import LLMEngine

        if not config.is_pooling:
            config = dataclasses.replace(config, runner="pooling")
        folder = Path(config.model).expanduser() if config.model else None
        self.pooler = pooler_config(folder if folder is not None and folder.is_dir() else None,
                                    PoolerConfig("LAST", True))
        if self.pooler.pooling_type != "LAST" and config.enable_prefix_caching:
            # MEAN and CLS read every prompt row: a prefix served from the cache is never recomputed
            logger.info("%s pooling reads every prompt token: prefix caching is off", self.pooler.pooling_type)
            config = dataclasses.replace(config, enable_prefix_caching=False)
        self.engine = LLMEngine(config)
        mc = self.engine.model_config
        self.score_head = self._score_head(config, mc.architecture)  # [L, D] float32, or None
        labels = 0 if self.score_head is None else self.score_head.shape[0]
        self.model_config = _DecoderInfo(mc.architecture, mc.vocab_size, mc.hidden_size, labels,
                                         self._label_names(config, labels))
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.config.max_model_len - 1  # a prompt leaves room for one token
        self._params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    @staticmethod
    def _score_head(config: EngineConfig, architecture: str) -> np.ndarray | None:
        from jaxengine.models.checkpoint import open_checkpoint
        from jaxengine.models.registry import CLASSIFIER_ARCHITECTURES

        if architecture not in CLASSIFIER_ARCHITECTURES:
            return None
        ckpt = open_checkpoint(config.model, revision=config.revision)
        if "score.weight" not in ckpt:
            raise ValueError(f"{ckpt.path}: {architecture} needs its classification head, tensor 'score.weight'")
        return np.asarray(ckpt.get_tensor("score.weight"), np.float32)

    @staticmethod
    def _label_names(config: EngineConfig, n: int) -> tuple[str, ...]:
        """config.json's id2label in index order ("LABEL_i" where absent)."""
        names = [f"LABEL_{i}" for i in range(n)]
        for key, name in ((local_hf_config(config) or {}).get("id2label") or {}).items():
            if str(key).isdigit() and int(key) < n:
                names[int(key)] = str(name)
        return tuple(names)

    def encode_prompt(self, prompt, params: PoolingParams) -> _Encoded:
        _, ids = self.engine.prompt_ids(prompt)
        return self._checked(_Encoded(ids, [0] * len(ids)), params)

    def run(self, encoded: Sequence[_Encoded]) -> tuple[np.ndarray, np.ndarray]:
        """(pooled hidden states [N, D] float32 (the last token's, the first's, or the mean over
        the prompt, as the pooler says), logits [N, L] of the score head (L = 0 without one)), in
        input order. Classifiers read the last token."""
        engine = self.engine
        ids = []
        try:
            for e in encoded:
                rid = f"pool-{engine.new_request_id()}"
                engine.add_request(rid, {"prompt_token_ids": e.ids}, self._params)
                ids.append(rid)
            engine.emit_unfinished = False
            while engine.has_unfinished_requests():
                engine.step()
        except BaseException:
            engine.abort_request(ids)
            for rid in ids:
                engine.core.pop_pooled(rid)
            raise
        done = [engine.core.pop_pooled(rid) for rid in ids]
        missing = [rid for rid, r in zip(ids, done) if r is None]
        if missing:
            raise RuntimeError(f"pooling requests {missing} ended without a pooled vector")
        field = {"LAST": "last", "CLS": "first", "MEAN": "mean"}[self.pooler.pooling_type]
        pooled = np.stack([getattr(d, field) for d in done]).astype(np.float32)
        if self.score_head is None:
            logits = np.zeros((len(done), 0), np.float32)
        else:
            logits = np.stack([d.last for d in done]).astype(np.float32) @ self.score_head.T
        return pooled, logits


def make_pooling_engine(config: EngineConfig) -> PoolingEngineBase:
    """The encoder engine for an encoder checkpoint, else the decoder pooling engine."""
    from jaxengine.models.bert import is_encoder_config

    hf = local_hf_config(config)
    if hf is not None:
        return PoolingEngine(config) if is_encoder_config(hf) else DecoderPoolingEngine(config)
    folder = Path(config.model).expanduser() if config.model else None
    if folder is not None and not folder.exists() and "/" in config.model:
        from jaxengine.models.checkpoint import open_checkpoint  # a hub id: its config decides
        if is_encoder_config(open_checkpoint(config.model, revision=config.revision).hf_config):
            return PoolingEngine(config)
    return DecoderPoolingEngine(config)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / max(math.sqrt(float(np.dot(a, a)) * float(np.dot(b, b))), 1e-12))
