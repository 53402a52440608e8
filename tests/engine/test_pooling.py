"""The pooling engine (`LLM.embed / encode / classify / score`) against transformers on tiny random
encoder checkpoints written by save_pretrained, with a real (small) BERT tokenizer: embeddings
within cosine 0.999 of sentence-transformers' conventions (CLS or mean, normalised), class
probabilities and cross-encoder scores equal to transformers' softmax / sigmoid, score order equal;
a generative model asked to pool, or a pooling model asked to generate, is a clear error."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import transformers

from jaxengine import LLM
from jaxengine.pooling_params import PoolingParams

WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "in", "park", "sun", "is", "hot", "cold", "what",
         "where", "did", "go", "blue", "sky"]
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
            max_position_embeddings=64)
TEXTS = ["the cat sat on the mat", "a dog ran in the park", "the sun is hot", "sky"]


def _tokenizer(folder: str) -> transformers.PreTrainedTokenizerBase:
    vocab = os.path.join(folder, "vocab.txt")
    with open(vocab, "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS) + "\n")
    tok = transformers.BertTokenizerFast(vocab_file=vocab)
    tok.save_pretrained(folder)
    return tok


def _make(folder: str, model_cls, cfg_cls, pooling: str | None = None, **extra):
    tok = _tokenizer(folder)
    torch.manual_seed(0)
    model = model_cls(cfg_cls(vocab_size=len(tok), **TINY, **extra, attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "LayerNorm.weight" in name else 0.0, 0.3 if p.dim() >= 2 else 0.1)
    model.save_pretrained(folder)
    if pooling is not None:  # a sentence-transformers layout: Transformer, Pooling, Normalize
        os.makedirs(os.path.join(folder, "1_Pooling"))
        with open(os.path.join(folder, "1_Pooling", "config.json"), "w") as f:
            json.dump({"word_embedding_dimension": 32, "pooling_mode_cls_token": pooling == "CLS",
                       "pooling_mode_mean_tokens": pooling == "MEAN", "pooling_mode_lasttoken": pooling == "LAST"}, f)
        with open(os.path.join(folder, "modules.json"), "w") as f:
            json.dump([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                       {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                       {"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"}], f)
    return model, tok


@pytest.fixture(scope="module")
def made(tmp_path_factory, xla_cache_dir):
    out = {}

    def get(name: str):
        if name not in out:
            folder = str(tmp_path_factory.mktemp(name))
            if name == "bert-mean":
                ref = _make(folder, transformers.BertModel, transformers.BertConfig, pooling="MEAN")
            elif name == "bert-cls":
                ref = _make(folder, transformers.BertModel, transformers.BertConfig)
            elif name == "bert-classifier":
                ref = _make(folder, transformers.BertForSequenceClassification, transformers.BertConfig, num_labels=3)
            else:  # a reranker: XLM-R with one label
                ref = _make(folder, transformers.XLMRobertaForSequenceClassification, transformers.XLMRobertaConfig,
                            num_labels=1, pad_token_id=0, type_vocab_size=1)
            kw = {} if name == "bert-cls" else {"runner": "pooling"}  # an encoder folder is found without it
            out[name] = (LLM(folder, max_num_seqs=4, compilation_cache_dir=xla_cache_dir, **kw), *ref)
        return out[name]
    return get


def _hidden(model, tok, texts):
    enc = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(**enc).last_hidden_state.numpy(), enc["attention_mask"].numpy()


def _cos(a, b) -> np.ndarray:
    a, b = np.asarray(a), np.asarray(b)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_embed_mean_pooling_normalised_like_sentence_transformers(made):
    llm, model, tok = made("bert-mean")
    outs = llm.embed(TEXTS, use_tqdm=False)
    h, m = _hidden(model, tok, TEXTS)
    want = (h * m[..., None]).sum(1) / m.sum(1, keepdims=True)
    want /= np.linalg.norm(want, axis=-1, keepdims=True)
    got = np.asarray([o.outputs.embedding for o in outs])
    assert got.shape == want.shape and (_cos(got, want) > 0.999).all()
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, rtol=1e-5)
    assert outs[0].prompt_token_ids == tok(TEXTS[0])["input_ids"]
    # Matryoshka: the first k dimensions, normalised again; normalize=False keeps the raw mean
    short = llm.embed(TEXTS[:2], PoolingParams(dimensions=8), use_tqdm=False)
    part = want[:2, :8] / np.linalg.norm(want[:2, :8], axis=-1, keepdims=True)
    assert (_cos([o.outputs.embedding for o in short], part) > 0.999).all() and short[0].outputs.hidden_size == 8
    raw = llm.encode(TEXTS[:1], use_tqdm=False)[0].outputs.data
    np.testing.assert_allclose(raw, (h[0] * m[0, :, None]).sum(0) / m[0].sum(), rtol=1e-3, atol=1e-4)


def test_embed_cls_by_default_and_cosine_scores(made):
    llm, model, tok = made("bert-cls")  # no runner given: the encoder folder is recognised
    h, _ = _hidden(model, tok, TEXTS)
    got = np.asarray([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    assert (_cos(got, h[:, 0]) > 0.999).all()
    scores = [o.outputs.score for o in llm.score(TEXTS[0], TEXTS[1:], use_tqdm=False)]
    np.testing.assert_allclose(scores, _cos(np.broadcast_to(h[0, 0], h[1:, 0].shape), h[1:, 0]), rtol=1e-3)
    with pytest.raises(ValueError, match="does not support 'classify'"):
        llm.classify(TEXTS)
    with pytest.raises(ValueError, match="pooling model: use embed"):
        llm.generate("the cat")


def test_classify_equals_transformers_softmax(made):
    llm, model, tok = made("bert-classifier")
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        want = torch.softmax(model(**enc).logits, -1).numpy()
    got = np.asarray([o.outputs.probs for o in llm.classify(TEXTS, use_tqdm=False)])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert llm.classify(TEXTS[:1], use_tqdm=False)[0].outputs.num_classes == 3


def test_cross_encoder_scores_and_rerank_order_equal_transformers(made):
    llm, model, tok = made("reranker")
    query, docs = "where did the dog go", ["a dog ran in the park", "the sun is hot", "the cat sat on the mat"]
    enc = tok([query] * len(docs), docs, padding=True, return_tensors="pt")
    enc.pop("token_type_ids")  # XLM-R has one segment
    with torch.no_grad():
        want = torch.sigmoid(model(**enc).logits[:, 0]).numpy()
    got = np.asarray([o.outputs.score for o in llm.score(query, docs, use_tqdm=False)])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert list(np.argsort(-got)) == list(np.argsort(-want))
    pairs = llm.score([query, "what is hot"], ["a dog ran in the park", "the sun is hot"], use_tqdm=False)
    assert len(pairs) == 2 and got[0] == pytest.approx(pairs[0].outputs.score, rel=1e-6)


def test_bad_input_and_truncation(made):
    llm, _, tok = made("bert-mean")
    long = " ".join(["cat"] * 100)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.embed(long)
    out = llm.embed(long, truncate_prompt_tokens=10, use_tqdm=False)[0]
    assert len(out.prompt_token_ids) == 10
    with pytest.raises(ValueError, match="dimensions=64 exceeds"):
        llm.embed("the cat", PoolingParams(dimensions=64))
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.embed([[2, 10**6]])
    with pytest.raises(ValueError, match="score pairs one text with many"):
        llm.score(["a", "b"], ["a", "b", "c"])
    with pytest.raises(ValueError, match="normalize must be a boolean"):
        PoolingParams(normalize="yes")


def test_a_generating_model_asked_to_embed_says_so(tiny_model_factory, xla_cache_dir):
    llm = LLM(tiny_model_factory("llama"), max_model_len=64, max_num_seqs=2, num_kv_blocks=16,
              compilation_cache_dir=xla_cache_dir)
    with pytest.raises(ValueError, match="was loaded to generate: embed needs"):
        llm.embed("hello")


def test_decoder_last_token_embeddings_equal_transformers(tiny_model_factory, xla_cache_dir):
    """A decoder with runner="pooling": the final hidden state (after the last norm) of each
    prompt's last token, normalised, equals transformers' within cosine 0.999; prompts longer than
    a chunk are pooled after their last chunk; a sentence-transformers MEAN config is refused."""
    path = tiny_model_factory("llama")
    llm = LLM(path, runner="pooling", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
              num_kv_blocks=64, compilation_cache_dir=xla_cache_dir)
    tok = llm.get_tokenizer()
    texts = ["Hello, my name is", "The capital of France is Paris, and the capital of Italy is Rome; " * 3, "1 2 3"]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want = []
    for t in texts:
        with torch.no_grad():
            h = model(torch.tensor([tok.encode(t)]), output_hidden_states=True).hidden_states[-1][0, -1].numpy()
        want.append(h / np.linalg.norm(h))
    outs = llm.embed(texts, use_tqdm=False)
    assert len(outs[1].prompt_token_ids) > 32  # more than one chunk
    assert (_cos([o.outputs.embedding for o in outs], want) > 0.999).all()
    scores = llm.score(texts[0], texts[1:], use_tqdm=False)
    np.testing.assert_allclose([s.outputs.score for s in scores], _cos(np.broadcast_to(want[0], (2, len(want[0]))),
                                                                        want[1:]), rtol=1e-3)
    with pytest.raises(ValueError, match="is a pooling model"):
        llm.generate("hello")
    assert not llm.pooling_engine.engine.has_unfinished_requests() and not llm.pooling_engine.engine.core.pooled


@pytest.mark.parametrize("pooling", ["MEAN", "CLS"])
def test_decoder_mean_and_first_token_pooling(pooling, tiny_model_factory, tmp_path, xla_cache_dir):
    """A decoder folder whose sentence-transformers config says MEAN (or CLS): the mean over every
    prompt token (or the first token's state), across chunks, equals transformers'."""
    import shutil

    folder = str(tmp_path / "m")
    shutil.copytree(tiny_model_factory("llama"), folder)
    os.makedirs(os.path.join(folder, "1_Pooling"))
    with open(os.path.join(folder, "1_Pooling", "config.json"), "w") as f:
        json.dump({"pooling_mode_mean_tokens": pooling == "MEAN", "pooling_mode_cls_token": pooling == "CLS"}, f)
    with open(os.path.join(folder, "modules.json"), "w") as f:
        json.dump([{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}], f)
    llm = LLM(folder, runner="pooling", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
              num_kv_blocks=64, compilation_cache_dir=xla_cache_dir)
    tok = llm.get_tokenizer()
    texts = ["Hello, my name is", "The capital of France is Paris, and the capital of Italy is Rome; " * 3]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    want = []
    for t in texts:
        with torch.no_grad():
            h = model(torch.tensor([tok.encode(t)]), output_hidden_states=True).hidden_states[-1][0].numpy()
        want.append(h.mean(0) if pooling == "MEAN" else h[0])
    got = [o.outputs.embedding for o in llm.embed(texts, PoolingParams(normalize=False), use_tqdm=False)]
    assert len(tok.encode(texts[1])) > 32  # pooled across chunks
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("arch", ["LlamaForSequenceClassification", "Qwen2ForSequenceClassification"])
def test_decoder_classifier_equals_transformers(arch, tmp_path, smollm2_tokenizer_dir, xla_cache_dir):
    """A decoder classifier (a reward model when it has one label): softmax (sigmoid) of its score
    head on the last token equals transformers'; it is recognised as a pooling model from its
    folder, and refuses to generate."""
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    cfg_cls = transformers.LlamaConfig if arch.startswith("Llama") else transformers.Qwen2Config
    torch.manual_seed(0)
    model = getattr(transformers, arch)(cfg_cls(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, num_labels=3, pad_token_id=0)).eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1)
    model.save_pretrained(str(tmp_path))
    tok.save_pretrained(str(tmp_path))
    llm = LLM(str(tmp_path), max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=32,
              compilation_cache_dir=xla_cache_dir)
    texts = ["Hello, my name is", "The sky is blue and the grass is green."]
    want = []
    for t in texts:
        with torch.no_grad():
            want.append(torch.softmax(model(torch.tensor([tok.encode(t)])).logits[0], -1).numpy())
    got = [o.outputs.probs for o in llm.classify(texts, use_tqdm=False)]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="does not support 'embed'"):
        llm.embed(texts)
    with pytest.raises(ValueError, match="is a classifier, not a text generator"):
        LLM(str(tmp_path), runner="generate", compilation_cache_dir=xla_cache_dir)
