"""`jaxengine bench throughput`: offline throughput of `LLM.generate`, as vLLM's `benchmark_throughput`.

All requests are submitted at once; eos is ignored so each request generates exactly its output
length. Start-up (weights, compilation of every bucket) is outside the timed region and reported
on its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time

from jaxengine.benchmarks.common import (SampleRequest, args_dict, default_out, environment, load_sharegpt,
                                         make_llm, random_requests, write_json)

logger = logging.getLogger(__name__)


def add_dataset_args(p: argparse.ArgumentParser, *, num_prompts: int = 100) -> None:
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset", default=None, help="ShareGPT-format JSON or JSONL file (default: random tokens)")
    g.add_argument("--num-prompts", type=int, default=num_prompts, help="requests in the benchmark")
    g.add_argument("--input-len", type=int, default=256, help="random dataset: prompt tokens")
    g.add_argument("--output-len", type=int, default=None,
                   help="output tokens per request (default: 128 with random tokens; with ShareGPT, each reply's "
                        "length)")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="random dataset: lengths uniform in len*(1-r) .. len*(1+r)")
    g.add_argument("--dataset-seed", type=int, default=0,
                   help="seed of the random prompts, or of the shuffle of a ShareGPT file")


def build_requests(args: argparse.Namespace, vocab_size: int, tokenizer, max_model_len: int) -> list[SampleRequest]:
    """The benchmark's requests from the dataset flags, checked against the context length."""
    if args.dataset:
        reqs = load_sharegpt(args.dataset, args.num_prompts, tokenizer, args.output_len, max_model_len,
                             args.dataset_seed)
    else:
        reqs = random_requests(args.num_prompts, args.input_len, args.output_len or 128, args.range_ratio,
                               vocab_size, args.dataset_seed)
    too_long = [r for r in reqs if r.prompt_len + r.output_len > max_model_len]
    if too_long:
        raise ValueError(f"{len(too_long)} requests need more than max_model_len={max_model_len} tokens "
                         f"(e.g. {too_long[0].prompt_len} + {too_long[0].output_len}); lower the lengths "
                         f"or raise --max-model-len")
    return reqs


def run_throughput(llm, requests: list[SampleRequest], detokenize: bool = True) -> dict[str, object]:
    """Generates every request at once; returns counts, seconds and rates. `detokenize=False` skips
    the output text (as vLLM's SamplingParams(detokenize=False)); it changes nothing without a tokenizer."""
    from jaxengine import SamplingParams

    eng = llm.llm_engine
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(max_tokens=r.output_len, temperature=1.0, top_p=1.0, ignore_eos=True,
                             detokenize=detokenize) for r in requests]
    eng.timing.update(steps=0, device_wait_s=0.0, step_s=0.0)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"num_requests": len(outs), "elapsed_s": elapsed, "total_input_tokens": n_in,
            "total_output_tokens": n_out, "requests_per_s": len(outs) / elapsed,
            "total_tokens_per_s": (n_in + n_out) / elapsed, "output_tokens_per_s": n_out / elapsed,
            "engine_timing": dict(eng.timing)}


def cmd_throughput(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    llm = make_llm(args)
    startup = time.perf_counter() - t0
    eng = llm.llm_engine
    reqs = build_requests(args, eng.model_config.vocab_size, eng.tokenizer, eng.config.max_model_len)
    if args.num_warmup:  # same lengths, other tokens: the timed run gets no prefix-cache hits from it
        vocab = eng.model_config.vocab_size
        warm = [SampleRequest(random_requests(1, r.prompt_len, r.output_len, 0.0, vocab, seed=10_000 + i)[0]
                              .prompt_token_ids, r.output_len) for i, r in enumerate(reqs[:args.num_warmup])]
        run_throughput(llm, warm)
    res = run_throughput(llm, reqs)
    payload = {"benchmark": "throughput", "environment": environment(), "args": args_dict(args),
               "engine_config": dataclasses.asdict(eng.config), "startup_s": startup, "compile_s": eng.runner.compile_seconds,
               "results": res}
    path = write_json(default_out(args, "throughput"), payload)
    print(f"Throughput: {res['requests_per_s']:.2f} requests/s, {res['total_tokens_per_s']:.2f} total tokens/s, "
          f"{res['output_tokens_per_s']:.2f} output tokens/s")
    print(f"Total num prompt tokens: {res['total_input_tokens']}")
    print(f"Total num output tokens: {res['total_output_tokens']}")
    print(f"results: {path}")
    return 0


def add_parser(sub) -> None:
    from jaxengine.arg_utils import add_engine_args

    p = sub.add_parser("throughput", help="offline throughput (requests/s, tokens/s) of LLM.generate")
    p.add_argument("--model", default=None, help="HF folder, GGUF file, hub id, or a preset with --load-format dummy "
                                                "(default: the embedded SmolLM2-135M-Instruct)")
    add_dataset_args(p)
    p.add_argument("--num-warmup", type=int, default=0, help="requests run once, untimed, before the measurement")
    p.add_argument("--output-json", default=None,
                   help="where to write the results (default: ./bench_throughput_<model>_<time>.json)")
    add_engine_args(p)
    p.set_defaults(func=cmd_throughput)
