"""`jaxengine generate` and `jaxengine chat` on the command line (in-process, tiny model): streamed and
labelled output, flag defaults and help."""

from __future__ import annotations

import argparse
import sys

import pytest

from jaxengine import LLM, SamplingParams, cli
from jaxengine.cli import build_parser, main


def _engine_flags(path: str, cache: str) -> list[str]:
    return ["--model", path, "--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
            "--num-kv-blocks", "128", "--compilation-cache-dir", cache]


def test_generate_prints_what_llm_generate_returns(tiny_model_factory, xla_cache_dir, capsys):
    path = tiny_model_factory("llama")
    assert main(["generate", "Hello, my name is", "--max-tokens", "8", "--temperature", "0",
                 *_engine_flags(path, xla_cache_dir)]) == 0
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


# -- streaming, labelled outputs, flags and their help -------------------------------------------------
@pytest.fixture(scope="module")
def shared_llm(tiny_model_factory, xla_cache_dir):
    """One engine for the tests below, handed to the commands in place of the one they would build."""
    return LLM(tiny_model_factory("llama"), max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
               num_kv_blocks=128, compilation_cache_dir=xla_cache_dir)


class _Recorder:
    """A stdout that keeps every write, to tell streamed text from text printed at the end."""

    def __init__(self):
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return len(s)

    def flush(self) -> None:
        pass

    @property
    def text(self) -> str:
        return "".join(self.writes)


@pytest.fixture
def run_cli(shared_llm, monkeypatch):
    """argv -> (exit status, the writes to stdout), with the shared engine."""
    monkeypatch.setattr(cli, "_make_llm", lambda args: shared_llm)

    def run(argv: list[str]) -> tuple[int, _Recorder]:
        out = _Recorder()
        monkeypatch.setattr(sys, "stdout", out)
        try:
            rc = main(argv)
        finally:
            monkeypatch.setattr(sys, "stdout", sys.__stdout__)
        return rc, out
    return run


def _text(llm: LLM, prompt, **kw) -> str:
    return llm.generate(prompt, SamplingParams(**kw), use_tqdm=False)[0].outputs[0].text


def test_generate_streams_text_as_it_comes(run_cli, shared_llm):
    want = _text(shared_llm, "Hello, my name is", max_tokens=8, temperature=0)
    rc, out = run_cli(["generate", "Hello, my name is", "--max-tokens", "8", "--temperature", "0"])
    assert rc == 0 and out.text == want + "\n"
    pieces = [w for w in out.writes if w and w != "\n"]
    assert len(pieces) > 1  # printed piece by piece, not once at the end
    # --no-stream (also spelled --no_stream): the same text, written once complete
    rc, out = run_cli(["generate", "Hello, my name is", "--max_tokens", "8", "--temperature", "0", "--no_stream"])
    assert rc == 0 and out.text == want + "\n"
    assert len([w for w in out.writes if w and w != "\n"]) == 1


def test_streamed_text_never_shows_a_stop_string(run_cli, shared_llm):
    full = _text(shared_llm, "The capital of France is", max_tokens=12, temperature=0)
    starts = [i for i in range(2, len(full) - 1) if not full[i].isspace() and full[i] != "-"]
    assert starts, full
    stop = full[starts[0]:starts[0] + 2]
    want = _text(shared_llm, "The capital of France is", max_tokens=12, temperature=0, stop=[stop])
    rc, out = run_cli(["generate", "The capital of France is", "--max-tokens", "12", "--temperature", "0",
                       "--stop", stop])
    assert rc == 0 and out.text == want + "\n" and stop not in want


def test_several_prompts_and_n_print_labelled_blocks_in_order(run_cli, shared_llm):
    prompts = ["Hello, my name is", "The sky is"]
    outs = shared_llm.generate(prompts, SamplingParams(n=2, max_tokens=4, seed=7), use_tqdm=False)
    want = "\n\n".join(f"--- prompt {i + 1} of 2, output {j + 1} of 2 ---\nprompt: {prompts[i]!r}\n"
                       f"{outs[i].outputs[j].text}" for i in range(2) for j in range(2))
    rc, out = run_cli(["generate", *prompts, "--n", "2", "--max-tokens", "4", "--sampling-seed", "7"])
    assert rc == 0 and out.text == want + "\n"
    labels = [out.text.index(f"--- prompt {i} of 2, output {j} of 2 ---") for i in (1, 2) for j in (1, 2)]
    assert labels == sorted(labels)
    # several prompts, n = 1: one block per prompt
    rc, out = run_cli(["generate", *prompts, "--max-tokens", "4", "--temperature", "0"])
    texts = [_text(shared_llm, p, max_tokens=4, temperature=0) for p in prompts]
    assert rc == 0 and out.text == (f"--- prompt 1 of 2 ---\nprompt: {prompts[0]!r}\n{texts[0]}\n\n"
                                    f"--- prompt 2 of 2 ---\nprompt: {prompts[1]!r}\n{texts[1]}\n")


def test_chat_streams_each_reply(run_cli, shared_llm):
    rc, out = run_cli(["chat", "--message", "hi", "--message", "and again", "--max-tokens", "6",
                       "--temperature", "0"])
    params = SamplingParams(max_tokens=6, temperature=0)
    first = shared_llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False)[0].outputs[0].text
    second = shared_llm.chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": first},
                              {"role": "user", "content": "and again"}], params, use_tqdm=False)[0].outputs[0].text
    assert rc == 0 and out.text == f"{first}\n{second}\n"
    assert len([w for w in out.writes if w and w != "\n"]) > 2


def test_chat_takes_one_reply_per_turn(run_cli, capsys):
    rc, _ = run_cli(["chat", "--message", "hi", "--n", "2"])
    assert rc == 2 and "--n must be 1" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_sampling_defaults_are_sampling_params(command):
    argv = [command, "x"] if command == "generate" else [command]
    args = build_parser().parse_args(argv)
    d = SamplingParams()
    assert (args.temperature, args.top_p, args.top_k, args.min_p, args.sampling_seed, args.stop, args.n) == (
        d.temperature, d.top_p, d.top_k, d.min_p, d.seed, None, d.n)
    # the one deliberate difference, max_tokens, is said in --help (test below)
    assert cli._sampling_params(args) == SamplingParams(max_tokens=cli.CLI_MAX_TOKENS)
    assert args.stream is True


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_help_shows_defaults_and_choices(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for needle in ("--temperature TEMPERATURE in [0, 2]; 0: greedy (argmax) (default: 1.0)",
                   f"(default: {cli.CLI_MAX_TOKENS}; SamplingParams' default is 16)",
                   "--top-p TOP_P", "(default: 0)", "--stream, --no-stream", "(default: True)",
                   "--dtype {auto,float32,float16,bfloat16,half,float}", "--load-format {auto,safetensors,gguf,dummy}",
                   "(default: 256)"):
        assert needle in text, needle


def _all_parsers(parser: argparse.ArgumentParser, name: str = "jaxengine"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _all_parsers(sub, f"{name} {sub_name}")


def test_every_flag_has_help_with_its_default():
    from jaxengine.arg_utils import HelpFormatter

    parsers = list(_all_parsers(build_parser()))
    assert {"jaxengine generate", "jaxengine chat", "jaxengine serve", "jaxengine bench throughput"} <= {
        n for n, _ in parsers}
    for name, parser in parsers:
        assert parser.formatter_class is HelpFormatter, name
        formatter = HelpFormatter(name)
        for action in parser._actions:
            assert (action.help or "").strip(), f"{name} {action.option_strings or action.dest}: no help"
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                assert "default" in formatter._get_help_string(action), f"{name} {action.option_strings}"
        help_text = parser.format_help()
        assert "default(" not in help_text, name  # serve's wrapped defaults show as plain values
    serve = dict(parsers)["jaxengine serve"].format_help()
    assert "(default: 8000)" in " ".join(serve.split())


def test_an_interrupted_stream_frees_its_request(shared_llm):
    engine = shared_llm.llm_engine
    params = SamplingParams(max_tokens=8, temperature=0)

    def interrupt(_: str) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cli.stream_one(engine, "Hello, my name is", params, interrupt)
    pieces: list[str] = []
    out = cli.stream_one(engine, "Hello, my name is", params, pieces.append)
    assert "".join(pieces) == out.outputs[0].text == _text(shared_llm, "Hello, my name is", max_tokens=8,
                                                            temperature=0)
    assert not engine.has_unfinished_requests()


def test_interactive_chat_streams_until_exit(run_cli, shared_llm, monkeypatch):
    lines = iter(["hi", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt: next(lines))
    rc, out = run_cli(["chat", "--max-tokens", "6", "--temperature", "0"])
    want = shared_llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=6, temperature=0),
                           use_tqdm=False)[0].outputs[0].text
    assert rc == 0 and out.text == want + "\n"
