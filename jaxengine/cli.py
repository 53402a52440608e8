"""`jaxengine generate | chat | serve | bench` on the command line.

`generate` with one prompt and n == 1, and every `chat` reply, stream: each piece of text is
printed as soon as the engine has it (`stream_one` drives the engine's add_request / step loop).
Several prompts, or n > 1, would interleave, so those runs print each finished output in a
labelled block (`format_outputs`): `--- prompt 2 of 3, output 1 of 2 ---`, the prompt, the text,
and a blank line between blocks. `--no-stream` prints a single output only once it is complete.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from jaxengine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jaxengine.engine import LLMEngine
    from jaxengine.outputs import RequestOutput

# The command line's one deliberate difference from `SamplingParams()`: 16 tokens (vLLM's default)
# is too short to read as an answer in a terminal.
CLI_MAX_TOKENS = 128


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    d = SamplingParams()  # the defaults below are SamplingParams', so they cannot drift apart
    g = p.add_argument_group("sampling (defaults are SamplingParams', except --max-tokens)")
    g.add_argument("--max-tokens", type=int, default=CLI_MAX_TOKENS,
                   help=f"most tokens per output (default: %(default)s; SamplingParams' default is {d.max_tokens})")
    g.add_argument("--temperature", type=float, default=d.temperature, help="in [0, 2]; 0: greedy (argmax)")
    g.add_argument("--top-p", type=float, default=d.top_p,
                   help="in (0, 1]: sample from the most likely tokens that hold this much probability; 1: off")
    g.add_argument("--top-k", type=int, default=d.top_k, help="sample from the k most likely tokens; 0 or -1: off")
    g.add_argument("--min-p", type=float, default=d.min_p,
                   help="in [0, 1]: drop tokens less likely than min-p times the most likely one; 0: off")
    g.add_argument("--sampling-seed", type=int, default=d.seed,
                   help="per-request sampling seed (default: drawn from the engine's --seed)")
    g.add_argument("--stop", action="append", default=None, help="stop string, repeatable (default: none)")
    g.add_argument("--n", type=int, default=d.n, help="outputs per prompt; with n > 1 each is printed under a label")
    g.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="print text as it is generated (one prompt with n = 1, and chat replies); "
                        "--no-stream prints it once complete")


def _sampling_params(args) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed, stop=args.stop, n=args.n)


def _make_llm(args):
    from jaxengine.arg_utils import engine_kwargs
    from jaxengine.llm import LLM
    return LLM(model=args.model, **engine_kwargs(args))


def _emit(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def stream_one(engine: LLMEngine, prompt: str | dict, params: SamplingParams,
               write: Callable[[str], None]) -> RequestOutput:
    """Runs one request (n == 1) to its end, handing `write` each new piece of text as it comes;
    the pieces join to the final text. Returns the final output.

    While the request runs, its last `len(longest stop) - 1` characters are held back: they may be
    the start of a stop string the engine will cut (the server's streams hold back the same)."""
    if params.n != 1:
        raise ValueError(f"streaming prints one output; got n={params.n}")
    rid = engine.new_request_id()
    engine.add_request(rid, prompt, params)
    hold = params.output_text_buffer_length
    sent, final = 0, None
    emit_unfinished = engine.emit_unfinished
    engine.emit_unfinished = True  # an output every step, not only the final one
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id != rid:
                    continue
                text = out.outputs[0].text
                end = len(text) if out.finished else len(text) - hold
                if end > sent:
                    write(text[sent:end])
                    sent = end
                if out.finished:
                    final = out
    finally:
        engine.emit_unfinished = emit_unfinished
        if final is None:  # interrupted (Ctrl+C): free the request's KV blocks
            engine.abort_request(rid)
    if final is None:
        raise RuntimeError(f"request {rid} ended without a final output")
    return final


def format_outputs(prompts: Sequence[str], outs: Sequence[RequestOutput]) -> str:
    """Every output in a labelled block, in prompt order then output order; blank lines between."""
    blocks = []
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True), 1):
        n = len(out.outputs)
        for c in out.outputs:
            label = f"prompt {i} of {len(outs)}" + (f", output {c.index + 1} of {n}" if n > 1 else "")
            blocks.append(f"--- {label} ---\nprompt: {prompt!r}\n{c.text}")
    return "\n\n".join(blocks)


def _failures(engine: LLMEngine, outs: Sequence[RequestOutput]) -> int:
    """Reports requests that failed inside the engine on stderr; returns the exit status."""
    errors = [engine.request_errors.pop(o.request_id) for o in outs if o.request_id in engine.request_errors]
    for e in errors:
        print(f"error: generation failed: {e}", file=sys.stderr)
    return 1 if errors else 0


def cmd_generate(args) -> int:
    from jaxengine import distributed
    distributed.start_local_workers(args)
    distributed.initialize(distributed.multihost_config(args))  # every rank runs the same prompts
    params = _sampling_params(args)
    llm = _make_llm(args)
    leader = distributed.is_leader()
    if args.stream and len(args.prompt) == 1 and params.n == 1:
        out = stream_one(llm.llm_engine, args.prompt[0], params, _emit if leader else lambda _: None)
        if leader:
            _emit("\n")
        return _failures(llm.llm_engine, [out])
    outs = llm.generate(args.prompt, params, use_tqdm=False)
    if not leader:
        return 0
    if len(outs) == 1 and params.n == 1:
        print(outs[0].outputs[0].text, flush=True)
    else:
        print(format_outputs(args.prompt, outs), flush=True)
    return _failures(llm.llm_engine, outs)


def cmd_chat(args) -> int:
    from jaxengine.llm import render_chat

    params = _sampling_params(args)
    if params.n != 1:
        raise ValueError(f"chat keeps one reply per turn: --n must be 1, got {params.n}")
    llm = _make_llm(args)
    engine = llm.llm_engine
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    messages = list(args.message or [])
    interactive = not messages
    while True:
        if interactive:
            try:
                text = input("> ")
            except EOFError:
                break
            if text.strip() in ("/exit", "/quit"):
                break
        else:
            if not messages:
                break
            text = messages.pop(0)
        history.append({"role": "user", "content": text})
        prompt_text, ids = render_chat(engine.tokenizer, history, None, add_generation_prompt=True)
        prompt = {"prompt": prompt_text, "prompt_token_ids": ids}
        if args.stream:
            try:
                out = stream_one(engine, prompt, params, _emit)
            except KeyboardInterrupt:
                if not interactive:
                    raise
                _emit("\n")  # Ctrl+C cut the reply short: drop the turn, ask for the next
                history.pop()
                continue
            _emit("\n")
        else:
            out = llm.generate(prompt, params, use_tqdm=False)[0]
            print(out.outputs[0].text, flush=True)
        if _failures(engine, [out]):
            return 1
        history.append({"role": "assistant", "content": out.outputs[0].text})
    return 0


def build_parser() -> argparse.ArgumentParser:
    from jaxengine.arg_utils import HelpFormatter, add_engine_args, use_help_formatter
    from jaxengine.distributed import add_multihost_args

    parser = argparse.ArgumentParser(prog="jaxengine", description="LLM inference and serving on JAX/XLA",
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True,
                                help="the command; `jaxengine COMMAND --help` lists its flags")

    gen = sub.add_parser("generate", help="generate text for one or more prompts",
                         description="Generate text. One prompt with --n 1 streams its text as it is produced; "
                                     "several prompts or --n > 1 print each output under a label "
                                     "('--- prompt 1 of 2, output 2 of 2 ---'), blank lines between.")
    gen.add_argument("prompt", nargs="+", help="prompt text; several prompts run as one batch")
    gen.add_argument("--model", default=None, help="HF folder, GGUF file or hub id (default: SmolLM2-135M-Instruct)")
    _add_sampling_args(gen)
    add_engine_args(gen)
    add_multihost_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="chat with the model (interactive, or --message for one-shot turns)",
                          description="Chat with the model's chat template; replies stream as they are produced. "
                                      "Interactive unless --message is given; /exit or /quit ends.")
    chat.add_argument("--model", default=None, help="HF folder, GGUF file or hub id (default: SmolLM2-135M-Instruct)")
    chat.add_argument("--system", default=None, help="system prompt (default: none)")
    chat.add_argument("--message", action="append", default=None,
                      help="a user turn, repeatable; the replies are printed and the command ends (default: "
                           "interactive)")
    _add_sampling_args(chat)
    add_engine_args(chat)
    chat.set_defaults(func=cmd_chat)

    try:
        from jaxengine.server.cli import add_serve_parser
        add_serve_parser(sub)
    except ImportError:
        pass
    from jaxengine.benchmarks.cli import add_bench_parser
    add_bench_parser(sub)
    use_help_formatter(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    from jaxengine.arg_utils import normalize_flags

    argv = normalize_flags(sys.argv[1:] if argv is None else list(argv))
    args = parser.parse_args(argv)
    args.argv, args.prog_module = argv, "jaxengine.cli"  # for worker processes that repeat the command
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
