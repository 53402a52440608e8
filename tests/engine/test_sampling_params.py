"""SamplingParams: vLLM's defaults, normalisation and validation."""

import dataclasses
import logging

import numpy as np
import pytest

from jaxengine.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.best_of, p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (1, None, 0.0, 0.0, 1.0)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1.0, 1.0, 0, 0.0, None)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.max_tokens, p.min_tokens) == ([], [], False, 16, 0)
    assert (p.logprobs, p.prompt_logprobs) == (None, None)
    assert p.skip_special_tokens and p.spaces_between_special_tokens and p.detokenize
    assert not p.include_stop_str_in_output
    assert p.sampling_type == SamplingType.RANDOM and not p.is_greedy and not p.uses_penalties


def test_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=[5, 3, 5], top_k=-1, seed=-1, logprobs=True)
    assert p.stop == ["###"] and p.stop_token_ids == [5, 3] and p.top_k == 0 and p.seed is None
    assert p.logprobs == 1
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(logprobs=False).logprobs is None
    q = SamplingParams(n=np.int64(2), max_tokens=np.int32(7), temperature=1)
    assert type(q.n) is int and type(q.max_tokens) is int and type(q.temperature) is float
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_greedy_resets_truncation():
    p = SamplingParams(temperature=0.0, top_p=0.3, top_k=4, min_p=0.2)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert p.is_greedy and p.sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=5e-6).is_greedy
    assert SamplingParams(temperature=0.5, seed=3).sampling_type == SamplingType.RANDOM_SEED


def test_tiny_positive_temperature_is_raised(caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("jaxengine"), "propagate", True)  # the package logs to its own handler
    with caplog.at_level("WARNING"):
        p = SamplingParams(temperature=1e-3)
    assert p.temperature == 1e-2 and not p.is_greedy
    assert "temperature" in caplog.text


@pytest.mark.parametrize("kwargs, message", [
    (dict(n=0), "n must be"),
    (dict(n=1.5), "n must be an integer"),
    (dict(n=True), "n must be an integer"),
    (dict(n=2, temperature=0), "greedy"),
    (dict(n=2, best_of=3), "best_of"),
    (dict(n=2, best_of=1), "best_of"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be a finite"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=2.5), "temperature"),
    (dict(temperature=float("nan")), "temperature must be a finite"),
    (dict(temperature="1"), "temperature must be a number"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.1), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2.0), "top_k must be an integer"),
    (dict(min_p=1.5), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens must be less"),
    (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"),
    (dict(logprobs=-1), "logprobs"),
    (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(stop=[""]), "empty string"),
    (dict(stop=["a", 3]), "stop must be"),
    (dict(stop_token_ids=[1, "2"]), "stop_token_ids"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids=7), "stop_token_ids"),
    (dict(stop="x", detokenize=False), "detokenize"),
    (dict(ignore_eos="yes"), "ignore_eos must be a boolean"),
    (dict(seed=1.5), "seed"),
])
def test_invalid_values_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_valid_edges():
    SamplingParams(n=4, best_of=4, presence_penalty=-2, frequency_penalty=2, temperature=2.0, top_p=1e-3,
                   top_k=1, min_p=1.0, logprobs=0, prompt_logprobs=MAX_LOGPROBS, min_tokens=16, max_tokens=16)


def test_frozen_replace_and_clone():
    p = SamplingParams(stop=["x"], temperature=0.7)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.1  # type: ignore[misc]
    q = dataclasses.replace(p, max_tokens=5)
    assert q.max_tokens == 5 and q.stop == ["x"] and q.temperature == 0.7
    with pytest.raises(ValueError, match="top_p"):
        dataclasses.replace(p, top_p=0)  # replace re-validates
    c = p.clone()
    assert c == p and c.stop is not p.stop


def test_derived_views():
    assert SamplingParams(stop=["ab", "abcd"]).output_text_buffer_length == 3
    assert SamplingParams(stop=["ab"], include_stop_str_in_output=True).output_text_buffer_length == 0
    assert SamplingParams().output_text_buffer_length == 0
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    assert SamplingParams(presence_penalty=0.1).uses_penalties
    assert SamplingParams(frequency_penalty=0.1).uses_penalties
