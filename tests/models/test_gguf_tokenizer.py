"""The torch-free GGUF tokenizer equals transformers' GGUF tokenizer on the real SmolLM2 file."""

from __future__ import annotations

import os

import pytest
import transformers

from jaxengine.default_model import DEFAULT_MODEL_FILE, default_model_path
from jaxengine.models.gguf_reader import GGUFCheckpoint

TEXTS = [
    "Hello world", "In 2024, 12345 people paid $3.50 each.", "café naïve 😀 日本語",
    "<|im_start|>user\nhi<|im_end|>\n", "  leading spaces\n\n\ttabs", "x=1+22*333", "<|endoftext|>tail",
    "don't I'll we've", "",
]


@pytest.fixture(scope="module")
def pair():
    path = default_model_path()
    ours = GGUFCheckpoint(path)._build_tokenizer()
    ref = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=DEFAULT_MODEL_FILE)
    return ours, ref


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_equal(pair, text):
    ours, ref = pair
    ids = ours.encode(text)
    assert ids == ref.encode(text)
    assert ours.decode(ids) == ref.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


def test_special_tokens_and_template(pair):
    ours, ref = pair
    assert (ours.eos_token_id, ours.bos_token_id) == (2, 1)
    assert ours.eos_token == ref.eos_token
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
