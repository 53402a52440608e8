"""`jaxengine generate` and `jaxengine chat` on the command line (in-process, tiny model)."""

from __future__ import annotations

import pytest

from jaxengine import LLM, SamplingParams
from jaxengine.cli import main


def _engine_flags(path: str, cache: str) -> list[str]:
    return ["--model", path, "--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
            "--num-kv-blocks", "128", "--compilation-cache-dir", cache]


def test_generate_prints_what_llm_generate_returns(tiny_model_factory, xla_cache_dir, capsys):
    path = tiny_model_factory("llama")
    assert main(["generate", "Hello, my name is", "--max-tokens", "8", *_engine_flags(path, xla_cache_dir)]) == 0
    printed = capsys.readouterr().out.strip()
    llm = LLM(path, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=128,
              compilation_cache_dir=xla_cache_dir)
    want = llm.generate("Hello, my name is", SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert printed == want[0].outputs[0].text.strip()


def test_chat_one_shot(tiny_model_factory, xla_cache_dir, capsys):
    path = tiny_model_factory("llama")
    rc = main(["chat", "--message", "hi", "--message", "and again", "--max-tokens", "4",
               *_engine_flags(path, xla_cache_dir)])
    assert rc == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines()]
    assert len(lines) >= 2


def test_bad_flag_value_is_a_clear_error(capsys):
    assert main(["generate", "x", "--block-size", "12"]) == 2
    assert "block_size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate"])  # argparse: the prompt is required
