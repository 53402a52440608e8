"""The encoder family (models/bert.py) against transformers on tiny random checkpoints written by
save_pretrained: hidden states of the real tokens and classification logits of a right-padded
batch, through jit as the pooling runner calls it; config and checkpoint errors by name."""

from __future__ import annotations

import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jaxengine.models.bert import (ENCODER_ARCHITECTURES, EncoderConfig, EncoderOutput, is_encoder_config,
                                   load_encoder)
from jaxengine.models.config import ModelConfig

ATOL = 1e-4
LENGTHS = (9, 5, 1)  # one batch, right-padded to the longest
TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
            max_position_embeddings=64)
CASES = {  # architecture -> (config class, model class, extra config)
    "BertModel": (transformers.BertConfig, transformers.BertModel, {}),
    "XLMRobertaModel": (transformers.XLMRobertaConfig, transformers.XLMRobertaModel,
                        dict(pad_token_id=1, type_vocab_size=1)),
    "BertForSequenceClassification": (transformers.BertConfig, transformers.BertForSequenceClassification,
                                      dict(num_labels=3, hidden_act="gelu_new")),
    "XLMRobertaForSequenceClassification": (transformers.XLMRobertaConfig,
                                            transformers.XLMRobertaForSequenceClassification,
                                            dict(pad_token_id=1, type_vocab_size=1, num_labels=1)),
    "RobertaForSequenceClassification": (transformers.RobertaConfig, transformers.RobertaForSequenceClassification,
                                         dict(pad_token_id=1, num_labels=2)),
}


def _make(arch: str, path: str):
    cfg_cls, model_cls, extra = CASES[arch]
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**TINY, **extra, attn_implementation="eager")).eval()
    with torch.no_grad():  # every tensor random, norms and biases too, so a mix-up shows
        for name, p in model.named_parameters():
            p.normal_(1.0 if "LayerNorm.weight" in name else 0.0, 0.3 if p.dim() >= 2 else 0.1)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(arch: str):
        if arch not in made:
            path = str(tmp_path_factory.mktemp(arch))
            made[arch] = (path, _make(arch, path))
        return made[arch]
    return get


def _batch(cfg: EncoderConfig, pairs: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ids, mask, token types [B, T]: real ids never the padding id; pairs: the second half of each
    sequence is segment 1 (as a tokenizer writes sentence pairs)."""
    rng = np.random.default_rng(0)
    b, t = len(LENGTHS), max(LENGTHS)
    ids = np.full((b, t), cfg.pad_token_id, np.int32)
    mask, types = np.zeros((b, t), np.int32), np.zeros((b, t), np.int32)
    for i, n in enumerate(LENGTHS):
        ids[i, :n] = rng.integers(cfg.pad_token_id + 1, cfg.vocab_size, n)
        mask[i, :n] = 1
        if pairs:
            types[i, n // 2 + 1:n] = 1
    return ids, mask, types


def _run(model, ids, mask, types) -> EncoderOutput:
    """Through jit, split once, as the pooling runner will call the model."""
    graphdef, state = nnx.split(model)
    return _forward(graphdef, state, jnp.asarray(ids), jnp.asarray(mask),
                    None if types is None else jnp.asarray(types))


@functools.partial(jax.jit, static_argnums=0)  # one compile per model structure and batch shape
def _forward(graphdef, state, ids, mask, types) -> EncoderOutput:
    return nnx.merge(graphdef, state)(ids, mask, types)


def _reference(ref, ids, mask, types):
    kwargs = dict(input_ids=torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long())
    if types is not None:
        kwargs["token_type_ids"] = torch.from_numpy(types).long()
    with torch.no_grad():
        hidden = ref.base_model(**kwargs).last_hidden_state.numpy()
        logits = ref(**kwargs).logits.numpy() if hasattr(ref, "classifier") else None
    return hidden, logits


@pytest.mark.parametrize("arch", list(CASES))
def test_matches_transformers(checkpoints, arch):
    path, ref = checkpoints(arch)
    model, cfg = load_encoder(path, jnp.float32)
    assert cfg.architecture == arch and (cfg.position_offset == 0) == arch.startswith("Bert")
    ids, mask, types = _batch(cfg, pairs=arch.startswith("Bert"))
    out = _run(model, ids, mask, types if arch.startswith("Bert") else None)
    want_hidden, want_logits = _reference(ref, ids, mask, types if arch.startswith("Bert") else None)
    assert out.hidden.shape == (len(LENGTHS), max(LENGTHS), TINY["hidden_size"])
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(out.hidden)[real], want_hidden[real], atol=ATOL, rtol=0)
    if want_logits is None:
        assert out.logits is None and cfg.num_labels == 0 and cfg.head == "none"
    else:
        assert out.logits.dtype == jnp.float32 and out.logits.shape == (len(LENGTHS), cfg.num_labels)
        assert cfg.id2label == tuple(ref.config.id2label[i] for i in range(cfg.num_labels))
        np.testing.assert_allclose(np.asarray(out.logits), want_logits, atol=ATOL, rtol=0)


def test_all_padding_row_and_bfloat16(checkpoints):
    """A filler row (mask all zeros) stays finite and leaves the others alone; bfloat16 loads and
    stays near float32."""
    path, _ = checkpoints("BertForSequenceClassification")
    model, cfg = load_encoder(path, jnp.float32)
    ids, mask, types = _batch(cfg, pairs=True)
    base = _run(model, ids, mask, types)
    mask2 = mask.copy()
    mask2[2] = 0
    out = _run(model, ids, mask2, types)
    assert np.isfinite(np.asarray(out.hidden)).all() and np.isfinite(np.asarray(out.logits)).all()
    np.testing.assert_allclose(np.asarray(out.logits)[:2], np.asarray(base.logits)[:2], atol=1e-6, rtol=0)
    half, _ = load_encoder(path, jnp.bfloat16)
    low = _run(half, ids, mask, types)
    assert low.hidden.dtype == jnp.bfloat16 and low.logits.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(low.logits), np.asarray(base.logits), atol=0.15, rtol=0)


def _rewrite(src: str, dst: str, edit) -> str:
    from safetensors.numpy import load_file, save_file
    shutil.copytree(src, dst)
    f = os.path.join(dst, "model.safetensors")
    tensors = load_file(f)
    tensors = edit(tensors) or tensors
    save_file(tensors, f, metadata={"format": "pt"})
    return dst


def test_prefixed_bare_model_loads(checkpoints, tmp_path):
    """A BertModel uploaded with "bert."-prefixed names loads as the bare one does."""
    path, _ = checkpoints("BertModel")
    prefixed = _rewrite(path, str(tmp_path / "p"), lambda t: {"bert." + k: v for k, v in t.items()})
    (a, cfg), (b, _) = load_encoder(path, jnp.float32), load_encoder(prefixed, jnp.float32)
    ids, mask, types = _batch(cfg, pairs=True)
    np.testing.assert_array_equal(np.asarray(_run(a, ids, mask, types).hidden),
                                  np.asarray(_run(b, ids, mask, types).hidden))


def test_missing_unexpected_and_misshapen_tensors_are_named(checkpoints, tmp_path):
    path, _ = checkpoints("BertForSequenceClassification")

    def edit(t):
        del t["bert.encoder.layer.1.attention.self.key.weight"]
        del t["classifier.bias"]
        t["bert.encoder.layer.0.extra.weight"] = np.zeros(3, np.float32)
        t["bert.encoder.layer.0.output.dense.bias"] = np.zeros(5, np.float32)
    bad = _rewrite(path, str(tmp_path / "bad"), edit)
    with pytest.raises(ValueError) as e:
        load_encoder(bad, jnp.float32)
    msg = str(e.value)
    missing = msg.split("missing tensors: ")[1].split(" | ")[0].split(", ")
    assert sorted(missing) == ["bert.encoder.layer.1.attention.self.key.weight", "classifier.bias"]
    assert "unexpected tensors: bert.encoder.layer.0.extra.weight" in msg
    assert "bert.encoder.layer.0.output.dense.bias: checkpoint shape (5,)" in msg

    path, _ = checkpoints("BertModel")  # bare names, pooler present but not needed
    bare = _rewrite(path, str(tmp_path / "bare"), lambda t: t.__delitem__("embeddings.LayerNorm.bias"))
    with pytest.raises(ValueError, match=r"missing tensors: embeddings\.LayerNorm\.bias$"):
        load_encoder(bare, jnp.float32)


def _hf(arch: str, **changes) -> dict:
    cfg_cls, _, extra = CASES[arch]
    d = cfg_cls(**TINY, **extra).to_dict()
    d["architectures"] = [arch]
    d.update(changes)
    return {k: v for k, v in d.items() if v is not _DROP}


_DROP = object()


@pytest.mark.parametrize("arch, changes, field", [
    ("BertModel", dict(position_embedding_type="relative_key"), "position_embedding_type"),
    ("XLMRobertaModel", dict(is_decoder=True), "is_decoder"),
    ("BertModel", dict(add_cross_attention=True), "add_cross_attention"),
    ("BertModel", dict(hidden_size=_DROP), "'hidden_size'"),
    ("BertModel", dict(num_hidden_layers="2"), "num_hidden_layers"),
    ("BertModel", dict(num_attention_heads=5), "num_attention_heads=5"),
    ("BertModel", dict(hidden_act="mish"), "hidden_act"),
    ("BertModel", dict(layer_norm_eps=-1.0), "layer_norm_eps"),
    ("XLMRobertaModel", dict(max_position_embeddings=2), "max_position_embeddings"),
    ("BertForSequenceClassification", dict(id2label={"0": "a", "2": "b"}, num_labels=2), "id2label"),
    ("BertForSequenceClassification", dict(num_labels=0, id2label=_DROP), "num_labels"),
])
def test_bad_configs_name_the_field(arch, changes, field):
    with pytest.raises(ValueError, match=f"{arch}: .*{field}|{field}.*"):
        EncoderConfig.from_hf_dict(_hf(arch, **changes))


def test_config_fields():
    c = EncoderConfig.from_hf_dict(_hf("XLMRobertaForSequenceClassification"))
    assert (c.head, c.num_labels, c.id2label, c.position_offset, c.max_model_len) == (
        "roberta", 1, ("LABEL_0",), 2, 62)
    c = EncoderConfig.from_hf_dict(_hf("BertForSequenceClassification", id2label={"0": "neg", "1": "pos"},
                                       num_labels=_DROP, label2id=_DROP))
    assert (c.head, c.id2label, c.position_offset) == ("bert", ("neg", "pos"), 0)
    bare = {k: v for k, v in _hf("XLMRobertaModel").items() if k != "architectures"}
    assert EncoderConfig.from_hf_dict(bare).architecture == "XLMRobertaModel"
    with pytest.raises(ValueError, match="'LlamaForCausalLM' is not an encoder"):
        EncoderConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"]})


def test_encoder_configs_are_recognised_and_refused_by_the_decoder_path():
    assert is_encoder_config({"architectures": ["XLMRobertaForSequenceClassification"]})
    assert is_encoder_config({"model_type": "bert"})
    assert not is_encoder_config({"architectures": ["LlamaForCausalLM"], "model_type": "bert"})
    assert not is_encoder_config({"model_type": "llama"})
    assert "BertModel" in ENCODER_ARCHITECTURES and len(ENCODER_ARCHITECTURES) == 6
    with pytest.raises(ValueError, match="BertModel is an encoder .*runner='pooling'"):
        ModelConfig.from_hf_dict(json.loads(json.dumps(_hf("BertModel"))))
