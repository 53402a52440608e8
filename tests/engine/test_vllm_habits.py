"""What scripts and commands copied from vLLM do here: its argument spellings and aliases are
accepted with their meaning, what is not served fails with a message saying so, and chat
template variables, scheduling timestamps and preemption warnings behave as in vLLM."""

from __future__ import annotations

import argparse
import logging
import os
import re

import pytest

from jaxengine import LLM, SamplingParams
from jaxengine.arg_utils import normalize_flags
from jaxengine.config import EngineConfig

ENGINE_KW = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=128, block_size=16)


@pytest.fixture(scope="module")
def llm(tiny_model_factory, xla_cache_dir) -> LLM:
    return LLM(tiny_model_factory("llama"), compilation_cache_dir=xla_cache_dir, **ENGINE_KW)


def test_engine_arguments_accepted_with_their_meaning() -> None:
    assert EngineConfig(dtype="half").dtype == "float16" and EngineConfig(dtype="float").dtype == "float32"
    cfg = EngineConfig(task="generate", runner="generate", enforce_eager=True, enable_chunked_prefill=True,
                       trust_remote_code=True)
    assert cfg.enforce_eager and cfg.trust_remote_code and not cfg.is_pooling
    assert EngineConfig(runner="pooling").is_pooling and EngineConfig(task="embed").is_pooling
    assert EngineConfig(task="reward").is_pooling  # a classifier's score head: LLM.classify / encode


@pytest.mark.parametrize("kw, match", [
    (dict(runner="generate", task="embed"), "disagree"),
    (dict(task="transcription"), "task must be one of auto, generate"),
    (dict(enable_chunked_prefill=False), "chunked prefill is always on"),
])
def test_what_is_not_served_says_so(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


def test_flags_in_either_spelling() -> None:
    """vLLM's own examples write `--max_num_batched_tokens`; both spellings parse alike."""
    from jaxengine.cli import build_parser

    argv = ["generate", "hi", "--max_num_batched_tokens", "128", "--max-num-seqs=4", "--enforce_eager",
            "--dtype=half", "--no-enable-chunked-prefill", "--trust_remote_code", "--stop", "a_b"]
    assert normalize_flags(argv)[2:5] == ["--max-num-batched-tokens", "128", "--max-num-seqs=4"]
    args = build_parser().parse_args(normalize_flags(argv))
    assert (args.max_num_batched_tokens, args.max_num_seqs, args.enforce_eager, args.dtype, args.trust_remote_code,
            args.enable_chunked_prefill, args.stop) == (128, 4, True, "half", True, False, ["a_b"])
    assert normalize_flags(["--x_y", "--", "--keep_this"]) == ["--x-y", "--", "--keep_this"]


def test_server_flags_in_either_spelling() -> None:
    from jaxengine.server.cli import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(normalize_flags(["--served_model_name", "m", "--max_num_seqs", "2", "--api_key=k"]))
    assert (args.served_model_name, args.max_num_seqs, args.api_key) == (["m"], 2, "k")


def test_multimodal_input_is_refused_by_name(llm: LLM) -> None:
    with pytest.raises(ValueError, match="multi_modal_data: model LlamaForCausalLM takes text only"):
        llm.generate({"prompt": "What is in this image?", "multi_modal_data": {"image": object()}})
    with pytest.raises(ValueError, match="'image_url': this model takes text only"):
        llm.chat([{"role": "user", "content": [{"type": "text", "text": "Describe"},
                                               {"type": "image_url", "image_url": {"url": "x"}}]}])
    assert not llm.llm_engine.has_unfinished_requests()


def test_chat_template_kwargs_reach_the_template(llm: LLM) -> None:
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if shout %}!!!{% endif %}"
    params = SamplingParams(max_tokens=2, temperature=0)
    plain = llm.chat([{"role": "user", "content": "hi"}], params, chat_template=template, use_tqdm=False)[0]
    loud = llm.chat([{"role": "user", "content": "hi"}], params, chat_template=template, use_tqdm=False,
                    chat_template_kwargs={"shout": True})[0]
    assert plain.prompt == "hi" and loud.prompt == "hi!!!"
    with pytest.raises(ValueError, match="chat_template_kwargs may not set add_generation_prompt"):
        llm.chat([{"role": "user", "content": "hi"}], params, chat_template_kwargs={"add_generation_prompt": False})


def test_first_scheduled_time_is_recorded(llm: LLM) -> None:
    out = llm.generate("Hello", SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_preemption_is_a_warning_with_the_count(tiny_model_factory, xla_cache_dir) -> None:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("jaxengine.engine_core")
    logger.addHandler(handler)
    try:
        tight = LLM(tiny_model_factory("llama"), compilation_cache_dir=xla_cache_dir,
                    **{**ENGINE_KW, "num_kv_blocks": 17})
        tight.generate(["Hello, my name is"] * 6, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    finally:
        logger.removeHandler(handler)
    assert tight.llm_engine.stats()["num_preemptions"] > 0
    warned = [r for r in records if r.levelno == logging.WARNING and "preempted for lack of KV cache" in r.getMessage()]
    assert len(warned) == 1  # once per interval, however many preemptions
    assert re.match(r"\d+ request\(s\) preempted .* \(\d+ in all\)", warned[0].getMessage())


def test_vllm_prompt_types_and_the_prompt_token_ids_keyword(llm: LLM) -> None:
    from jaxengine import TextPrompt, TokensPrompt

    params = SamplingParams(max_tokens=4, temperature=0)
    ids = llm.get_tokenizer().encode("Hello, my name is")
    by_text = llm.generate(TextPrompt(prompt="Hello, my name is"), params, use_tqdm=False)[0]
    by_ids = llm.generate(TokensPrompt(prompt_token_ids=ids), params, use_tqdm=False)[0]
    by_keyword = llm.generate(sampling_params=params, prompt_token_ids=[ids, ids], use_tqdm=False)
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids == by_keyword[1].outputs[0].token_ids
    assert len(by_keyword) == 2 and by_keyword[0].prompt_token_ids == ids
    with pytest.raises(ValueError, match="not both"):
        llm.generate("hi", params, prompt_token_ids=ids)


def test_no_pytorch_advice_at_import() -> None:
    """transformers tells a PyTorch-less process that models are unavailable; jaxengine needs none."""
    import subprocess
    import sys

    code = "import sys; sys.modules['torch'] = None\nimport jaxengine, jaxengine.models.checkpoint\nimport transformers"
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "PyTorch was not found" not in r.stderr
