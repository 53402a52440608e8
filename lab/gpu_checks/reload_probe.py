"""Does an executable compiled in this process launch slower than the same one read back from the
program bundle? (On the H100 the fp8 batch-1 step took 4.84 ms in the process that compiled its
programs and 4.38 ms in one that loaded them, forward launch p50 2.39 against 1.31 ms, with the
same 3.90 ms of device time.)

One process: the engine starts with a fresh compilation cache (so it compiles and fills the
bundle), then batch-1 decode (128 in / 256 out, greedy) is timed with the forward's launch; then
every program in the runner's tables is replaced by the bundle's copy (deserialized) and the same
is timed again; then once more with the compiled ones put back (order effects); then with each
program's calls taking turns between its two executables (compiled, read back), so that no call
updates the command buffer of a launch still in flight.

    python lab/gpu_checks/reload_probe.py --quantization fp8 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ab-only", action="store_true", help="each round: the compiled executables, then "
                    "alternating (every other round the other way round); no read-back rows")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()

    from jaxengine import LLM
    from jaxengine.benchmarks.common import percentiles, random_requests
    from jaxengine.benchmarks.gpu_suite import synthetic_tokenizer
    from jaxengine.benchmarks.latency import run_batch
    from jaxengine.models.presets import PRESETS
    from lab.gpu_checks.step_trace import time_compiled_calls

    vocab = PRESETS[args.model]["vocab_size"]
    t0 = time.perf_counter()
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", quantization=args.quantization,
              max_num_seqs=16, max_num_batched_tokens=512, compilation_cache_dir=tempfile.mkdtemp(),
              tokenizer=synthetic_tokenizer(tempfile.mkdtemp(), vocab))
    runner = llm.llm_engine.runner
    res: dict = {"model": args.model, "quantization": args.quantization, "startup_s": time.perf_counter() - t0}

    def prompts(i: int) -> list[list[int]]:
        return [q.prompt_token_ids for q in random_requests(1, 128, 256, 0.0, vocab, seed=500 + i)]

    def alternate_calls() -> None:  # consecutive calls of a program take turns between its two executables
        turn = {"fwd": 0, "samp": 0}

        def pick(kind, name, key):
            turn[name] ^= 1
            return (compiled if turn[name] else loaded)[kind][key]
        runner._get_forward = lambda t: pick("forward", "fwd", t)
        runner._get_forward_decode = lambda t: pick("forward_decode", "fwd", t)
        runner._get_sampler = lambda r, proc, masked=False, trunc=None: pick(  # the runner's table key
            "sampler", "samp", (r, True, True, None) if proc else (r, False, masked, bool(trunc)))

    def measure(tag: str, alternate: bool = False) -> None:
        run_batch(llm, prompts(100), 32)
        if alternate:
            alternate_calls()
        launches = time_compiled_calls(runner)
        try:
            runs = [run_batch(llm, prompts(i), 256) for i in range(3)]
        finally:
            del runner._get_forward, runner._get_sampler
            runner.__dict__.pop("_get_forward_decode", None)
        steps = percentiles([g for r in runs for g in r["decode_steps"]])
        fwd = np.array(launches.get("fwd t=16 decode-only", launches.get("fwd t=16", [0.0]))) * 1e3
        samp = np.array(launches.get("sampler r=16", [0.0])) * 1e3
        res.setdefault("rows", []).append({"what": tag, "ms_per_token": 1e3 * steps["median"],
                                           "fwd_launch_p50_ms": float(np.median(fwd)),
                                           "sampler_launch_p50_ms": float(np.median(samp))})
        print(f"{tag:<28} {1e3 * steps['median']:7.3f} ms/token, forward launch p50 {np.median(fwd):.3f} ms, "
              f"sampler {np.median(samp):.3f} ms", flush=True)

    tables = runner._program_tables()
    compiled = {kind: dict(t) for kind, t in tables.items()}
    loaded = {}
    for kind, t in tables.items():
        loaded[kind] = {}
        for key in t:
            fn = runner.bundle.load(f"{kind}:{key!r}")
            if fn is not None:
                loaded[kind][key] = fn
    res["reloaded_programs"] = sum(len(v) for v in loaded.values())
    print(f"{res['reloaded_programs']} programs read back from the bundle", flush=True)

    def use(which: dict) -> None:
        for kind, t in tables.items():
            t.update(which[kind])

    for r in range(args.rounds):
        use(compiled)
        if args.ab_only:
            for alt in ((False, True) if r % 2 == 0 else (True, False)):
                measure(f"{'alternating' if alt else 'one executable'}, round {r + 1}", alternate=alt)
            continue
        measure(f"compiled here, round {r + 1}")
        use(loaded)
        measure(f"read back, round {r + 1}")
        use(compiled)
        measure(f"alternating, round {r + 1}", alternate=True)
    # greedy tokens of one executable against alternating ones (4 prompts at once, then one alone)
    from jaxengine import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    use(compiled)
    same = []
    for batch in ([prompts(200 + i)[0] for i in range(4)], prompts(300)):
        ref = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)]
        alternate_calls()
        try:
            alt = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in batch], sp,
                                                               use_tqdm=False)]
        finally:
            del runner._get_forward, runner._get_sampler
            runner.__dict__.pop("_get_forward_decode", None)
        same.append(ref == alt)
    res["greedy_tokens_equal"] = same
    print(f"greedy tokens equal (4 prompts, 1 prompt): {same}", flush=True)
    with open(os.path.join(args.out, f"reload_probe_{args.quantization or 'bf16'}.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
