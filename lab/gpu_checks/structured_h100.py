"""Structured outputs on the GPU: the decode step of a batch whose every row is JSON-schema
constrained, against the same batch unconstrained, in one engine.

One engine (Llama-3-8B shape by default, dummy bf16 weights, engine defaults) with a real
tokenizer (`--tokenizer`: SmolLM2's, 49,152 tokens, padded to the model's vocabulary, so the
bitmask has the model's full width and the grammar walks real token strings):

- grammar compile time of every schema of tests/json_schema_corpus.py (32) and of the 8 run
  below, each uncached, plus the tokenizer's one-time build;
- 64 requests of 128 random prompt tokens, temperature 1, each constrained by one of 8 JSON
  schemas (a string field of 1000 to 1500 characters, so rows stay alive for the whole window), then
  the same 64 unconstrained (ignore_eos), alternating, `--repeats` times each: the median
  wall time of `engine.step()` over steps that decode exactly 64 rows; the host time spent
  filling bitmasks and advancing matchers per constrained step.

    python -m lab.gpu_checks.structured_h100 --tokenizer DIR --out $OUT

DIR: SmolLM2's tokenizer as a folder, made where the embedded model is installed with
`open_checkpoint(default_model_path()).load_tokenizer().save_pretrained(DIR)`
(jaxengine.models.checkpoint, jaxengine.default_model) and carried to the GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

BATCH = 64


def bench_schemas() -> list[dict]:
    return [{"type": "object", "properties": {f"field{k}": {"type": "string", "minLength": 1000, "maxLength": 1500}},
             "required": [f"field{k}"], "additionalProperties": False} for k in range(8)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--model", default="llama-3-8b", help="a preset (dummy weights)")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--no-sampler-cond", action="store_true",
                    help="experiment: the sampler's lax.conds take their false branch unconditionally (right for "
                         "these runs: no row truncates with top-k / top-p), to see what the conds cost")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    import jax

    from jaxengine import LLM, SamplingParams

    if args.no_sampler_cond:
        import types

        import jaxengine.sampler as sampler_module
        lax = types.SimpleNamespace(**{k: getattr(jax.lax, k) for k in dir(jax.lax) if not k.startswith("__")})
        lax.cond = lambda pred, true_fn, false_fn, *ops: false_fn(*ops)
        sampler_module.jax = types.SimpleNamespace(**{k: getattr(jax, k) for k in dir(jax) if not k.startswith("__")})
        sampler_module.jax.lax = lax
    from jaxengine.benchmarks import ceilings
    from jaxengine.grammar import GrammarBackend
    from jaxengine.models.presets import PRESETS
    from jaxengine.structured_outputs import StructuredOutputsParams
    from tests.json_schema_corpus import SCHEMAS

    res: dict = {"commit": args.commit, "jax": jax.__version__, "device": jax.devices()[0].device_kind,
                 "model": f"{args.model} (dummy bf16)", "batch": BATCH, "tokenizer": "SmolLM2 (49,152 tokens)",
                 "max_tokens": args.max_tokens, "no_sampler_cond": args.no_sampler_cond}
    path = os.path.join(args.out, "structured_outputs.json")

    def save() -> None:
        with open(path, "w") as fh:
            json.dump(res, fh, indent=1)

    res["ceilings"] = ceilings.measure() if jax.default_backend() == "gpu" else None
    vocab = PRESETS[args.model]["vocab_size"]
    t0 = time.perf_counter()
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", tokenizer=args.tokenizer)
    eng = llm.llm_engine
    res.update({"startup_s": time.perf_counter() - t0, "attention": eng.runner.attention_impl,
                "num_kv_blocks": eng.config.num_kv_blocks, "max_num_seqs": eng.config.max_num_seqs,
                "max_num_batched_tokens": eng.config.max_num_batched_tokens, "compile_s": eng.runner.compile_seconds,
                "mask_words": eng.runner.mask_words})
    print(f"start-up {res['startup_s']:.1f} s (compile {res['compile_s']:.1f} s)", flush=True)

    # Grammar compile times: a fresh backend each time the tokenizer is built, then each schema uncached.
    fresh = GrammarBackend(eng.tokenizer, vocab, eng.eos_token_ids)
    t0 = time.perf_counter()
    fresh.ll_tokenizer
    res["tokenizer_build_s"] = time.perf_counter() - t0
    compile_ms, first_mask_ms = {}, {}
    for what, schema in SCHEMAS + [(f"bench {k}", s) for k, s in enumerate(bench_schemas())]:
        so = StructuredOutputsParams(json=schema)
        t0 = time.perf_counter()
        fresh.compile(so)
        t1 = time.perf_counter()
        fresh.fill_bitmask([(fresh.new_matcher(so), 0)], 1)  # the first mask builds lexer states lazily
        compile_ms[what], first_mask_ms[what] = 1e3 * (t1 - t0), 1e3 * (time.perf_counter() - t1)

    def summary(d: dict) -> dict:
        v = sorted(d.values())
        return {"per_schema": d, "median": statistics.median(v), "p90": v[int(0.9 * (len(v) - 1))], "max": v[-1]}
    res["grammar_compile_ms"], res["first_mask_ms"] = summary(compile_ms), summary(first_mask_ms)
    print(f"tokenizer build {res['tokenizer_build_s']:.2f} s; grammar compile per schema median "
          f"{res['grammar_compile_ms']['median']:.2f} ms, max {res['grammar_compile_ms']['max']:.2f} ms; first mask "
          f"median {res['first_mask_ms']['median']:.2f} ms, max {res['first_mask_ms']['max']:.2f} ms", flush=True)
    save()

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 49152, 128).tolist() for _ in range(BATCH)]
    schemas = [StructuredOutputsParams(json=s) for s in bench_schemas()]
    host = {"fill_s": 0.0, "fills": 0, "advance_s": 0.0}
    grammar, core = eng.grammar, eng.core
    orig_fill, orig_adv = grammar.fill_bitmask, core._advance_grammars

    def fill(*a, **kw):
        t0 = time.perf_counter()
        try:
            return orig_fill(*a, **kw)
        finally:
            host["fill_s"] += time.perf_counter() - t0
            host["fills"] += 1

    def adv(*a, **kw):
        t0 = time.perf_counter()
        try:
            return orig_adv(*a, **kw)
        finally:
            host["advance_s"] += time.perf_counter() - t0
    grammar.fill_bitmask, core._advance_grammars = fill, adv

    # Host time per part of the step (where the step's wall time goes), both paths.
    parts = {"schedule": (eng.scheduler, "schedule"), "dispatch_forward": (eng.runner, "dispatch_forward"),
             "dispatch_sampler": (eng.runner, "dispatch_sampler"), "resolve": (core, "_resolve"),
             "outputs": (core, "_outputs")}
    spent = {k: 0.0 for k in parts}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += time.perf_counter() - t0
        return wrapper
    for name, (obj, attr) in parts.items():
        setattr(obj, attr, timed(name, getattr(obj, attr)))

    def run(constrained: bool, tag: str) -> dict:
        for i, p in enumerate(prompts):
            so = schemas[i % len(schemas)] if constrained else None
            eng.add_request(f"{tag}-{i}", {"prompt_token_ids": p},
                            SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, ignore_eos=not constrained,
                                           structured_outputs=so))
        for k in host:
            host[k] = 0 if k == "fills" else 0.0
        steps, breakdown = [], {k: [] for k in parts}
        while eng.has_unfinished_requests():
            before = dict(spent)
            t0 = time.perf_counter()
            eng.step()
            dt = time.perf_counter() - t0
            if core.last_step_tokens == BATCH and eng.scheduler.num_running == BATCH:
                steps.append(dt)
                for k in parts:
                    breakdown[k].append(spent[k] - before[k])
        return {"decode_steps": len(steps), "step_ms_median": 1e3 * statistics.median(steps),
                "step_ms_mean": 1e3 * statistics.fmean(steps),
                "fill_ms_per_step": 1e3 * host["fill_s"] / max(host["fills"], 1),
                "advance_ms_per_step": 1e3 * host["advance_s"] / max(host["fills"], 1),
                "host_ms_median": {k: 1e3 * statistics.median(v) for k, v in breakdown.items()}}

    run(False, "warm-free")
    run(True, "warm-json")
    runs = {"free": [], "json": []}
    for r in range(args.repeats):
        for kind in ("free", "json"):
            x = run(kind == "json", f"{kind}{r}")
            runs[kind].append(x)
            print(f"{kind}: {x['step_ms_median']:.2f} ms/step over {x['decode_steps']} steps "
                  f"(fill {x['fill_ms_per_step']:.2f} ms, advance {x['advance_ms_per_step']:.2f} ms; "
                  + ", ".join(f"{k} {v:.2f}" for k, v in x["host_ms_median"].items()) + ")", flush=True)
            res["runs"] = runs
            save()
    free = statistics.median(x["step_ms_median"] for x in runs["free"])
    cons = statistics.median(x["step_ms_median"] for x in runs["json"])
    res["summary"] = {"free_step_ms": free, "json_step_ms": cons, "ratio": cons / free}
    save()
    print(f"batch {BATCH} decode step: unconstrained {free:.2f} ms, every row JSON-constrained {cons:.2f} ms "
          f"({cons / free:.3f}x)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
