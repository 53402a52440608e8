"""`jaxengine generate | chat | serve | bench` on the command line."""

from __future__ import annotations

import argparse
import sys


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--n", type=int, default=1)


def _sampling_params(args):
    from jaxengine.sampling_params import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed, stop=args.stop, n=args.n)


def _make_llm(args):
    from jaxengine.arg_utils import engine_kwargs
    from jaxengine.llm import LLM
    return LLM(model=args.model, **engine_kwargs(args))


def cmd_generate(args) -> int:
    from jaxengine import distributed
    distributed.start_local_workers(args)
    distributed.initialize(distributed.multihost_config(args))  # every rank runs the same prompts
    llm = _make_llm(args)
    outs = llm.generate(args.prompt, _sampling_params(args), use_tqdm=False)
    if not distributed.is_leader():
        return 0
    for out in outs:
        for c in out.outputs:
            print(c.text)
    return 0


def cmd_chat(args) -> int:
    llm = _make_llm(args)
    params = _sampling_params(args)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    messages = args.message or []
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
        reply = llm.chat(history, params, use_tqdm=False)[0].outputs[0].text
        print(reply, flush=True)
        history.append({"role": "assistant", "content": reply})
    return 0


def build_parser() -> argparse.ArgumentParser:
    from jaxengine.arg_utils import add_engine_args
    from jaxengine.distributed import add_multihost_args

    parser = argparse.ArgumentParser(prog="jaxengine", description="LLM inference and serving on JAX/XLA")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompt", nargs="+")
    gen.add_argument("--model", default=None, help="HF folder, GGUF file or hub id (default: SmolLM2-135M-Instruct)")
    _add_sampling_args(gen)
    add_engine_args(gen)
    add_multihost_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="chat with the model (interactive, or --message for one-shot turns)")
    chat.add_argument("--model", default=None)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--message", action="append", default=None, help="a user turn (repeatable)")
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
