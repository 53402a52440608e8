"""Engine figures of one code tree, for before/after comparisons of a change on the GPU.

Run once per code tree, each in a fresh process (the tree measured is whichever `jaxengine` the
interpreter imports: put an older tree first on PYTHONPATH to measure it):

- the ceilings (copy bandwidth, bf16 matmul) in the same process;
- Llama-3-8B shape, dummy bf16 weights, engine defaults: start-up, batch-1 decode (128 in /
  256 out, greedy; median step after one warm-up batch, 3 batches) and offline throughput
  (random 256 in / 256 out x 1000 prompts, temperature 1, ignore_eos, detokenized with a
  synthetic tokenizer), as `jaxengine bench latency` / `throughput` define them;
- the real SmolLM2-135M-Instruct (the GGUF at --smollm2) in float32: greedy token ids of fixed
  prompts, to compare tree against tree.

    python lab/gpu_checks/engine_before_after.py --label after --out $OUT [--smollm2 FILE.gguf]
    python lab/gpu_checks/engine_before_after.py --compare before.json after.json --md out.md

`--engine-arg KEY=JSON` adds an `LLM(...)` argument (e.g. kv_cache_dtype="fp8"), `--kv-scales K,V`
gives every layer those fp8 KV-cache scales as if a checkpoint held them.
`--patch MODULE.NAME=VALUE` sets a constant of the engine (e.g. model_runner.DECODE_ONLY_PROGRAMS=false)
before the engine starts, to compare one tree with a code-path switch both ways; `--fresh-cache`
starts the Llama engine on an empty compilation cache (a cold start each run). Greedy token ids of
four fixed prompts (32 tokens each, dummy weights) are kept to compare runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

SMOL_PROMPTS = ["The three primary colors are", "def fibonacci(n):", "Paris is the capital of",
                "Write a haiku about the sea.", "1, 2, 3, 4,", "The quick brown fox"]


ENGINE_ARGS: dict = {}  # --engine-arg KEY=JSON: more LLM(...) arguments of the Llama engine


def measure(label: str, out_dir: str, smollm2: str | None, llama: bool = True,
            decode_batches: tuple[int, ...] = (1,), throughput: bool = True, fresh_cache: bool = False) -> dict:
    import jax

    import jaxengine
    from jaxengine import LLM, SamplingParams
    from jaxengine.benchmarks import ceilings

    res: dict = {"label": label, "argv": sys.argv[1:], "code": os.path.dirname(jaxengine.__file__), "jax": jax.__version__,
                 "device": jax.devices()[0].device_kind}
    try:
        res["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                            "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    path = os.path.join(out_dir, f"{label}.json")

    def save() -> None:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)

    if llama:
        res["ceilings"] = ceilings.measure()
        print(f"[{label}] ceilings {res['ceilings']}", flush=True)
        measure_llama(label, res, save, decode_batches, throughput, fresh_cache)
    if smollm2:
        llm = LLM(smollm2, dtype="float32")
        outs = llm.generate(SMOL_PROMPTS, SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False)
        res["smollm2_f32_greedy"] = {"attention": llm.llm_engine.runner.attention_impl,
                                     "token_ids": [o.outputs[0].token_ids for o in outs],
                                     "text": [o.outputs[0].text for o in outs]}
        print(f"[{label}] SmolLM2 f32: {res['smollm2_f32_greedy']['text'][0]!r}", flush=True)
        save()
    return res


def measure_llama(label: str, res: dict, save, decode_batches: tuple[int, ...] = (1,),
                  throughput: bool = True, fresh_cache: bool = False) -> None:
    """Llama-3-8B shape, dummy bf16, engine defaults: start-up, batch-1 decode (and decode at the
    other `decode_batches`), 256/256 x 1000."""
    from jaxengine import LLM
    from jaxengine.benchmarks.common import SampleRequest, percentiles, random_requests, weight_bytes
    from jaxengine.benchmarks.gpu_suite import synthetic_tokenizer
    from jaxengine.benchmarks.latency import run_batch
    from jaxengine.benchmarks.sweep import release
    from jaxengine.benchmarks.throughput import run_throughput

    tmp = tempfile.mkdtemp()
    vocab = 128256
    t0 = time.perf_counter()
    cache = {"compilation_cache_dir": tempfile.mkdtemp()} if fresh_cache else {}
    llm = LLM("llama-3-8b", load_format="dummy", dtype="bfloat16", tokenizer=synthetic_tokenizer(tmp, vocab), **cache,
              **ENGINE_ARGS)
    eng = llm.llm_engine
    res["llama"] = r = {"startup_s": time.perf_counter() - t0, "attention": eng.runner.attention_impl,
                        "max_model_len": eng.config.max_model_len, "max_num_seqs": eng.config.max_num_seqs,
                        "max_num_batched_tokens": eng.config.max_num_batched_tokens,
                        "num_kv_blocks": eng.config.num_kv_blocks, "weight_bytes": weight_bytes(llm)}
    print(f"[{label}] start-up {r['startup_s']:.1f} s", flush=True)
    save()

    def prompts(i: int, n: int = 1) -> list[list[int]]:
        return [q.prompt_token_ids for q in random_requests(n, 128, 256, 0.0, vocab, seed=500 + i)]

    from jaxengine import SamplingParams

    outs = llm.generate([{"prompt_token_ids": prompts(200 + i)[0]} for i in range(4)],
                        SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    r["greedy_token_ids"] = [o.outputs[0].token_ids for o in outs]
    run_batch(llm, prompts(100), 256)
    runs = [run_batch(llm, prompts(i), 256) for i in range(3)]
    steps = percentiles([g for x in runs for g in x["decode_steps"]])
    r["decode_b1"] = {"input_len": 128, "output_len": 256, "batches": 3,
                      "ms_per_token_median": 1e3 * steps["median"], "ms_per_token_p99": 1e3 * steps["p99"]}
    print(f"[{label}] batch-1 decode {1e3 * steps['median']:.2f} ms/token", flush=True)
    for b in (b for b in decode_batches if b != 1):
        runs = [run_batch(llm, prompts(i, b), 128) for i in range(2)]
        steps = percentiles([g for x in runs[1:] for g in x["decode_steps"]])
        r[f"decode_b{b}"] = {"input_len": 128, "output_len": 128, "batches": 1, "ms_per_step_median": 1e3 * steps["median"]}
        print(f"[{label}] batch-{b} decode {1e3 * steps['median']:.2f} ms/step", flush=True)
    save()
    if not throughput:
        release(llm)
        return
    warm = [SampleRequest(q.prompt_token_ids, 16) for q in random_requests(64, 256, 256, 0.0, vocab, seed=20_000)]
    run_throughput(llm, warm)
    tr = run_throughput(llm, random_requests(1000, 256, 256, 0.0, vocab, seed=100))
    t = tr["engine_timing"]
    tr["ms_per_step"] = 1e3 * t["step_s"] / max(t["steps"], 1)
    r["throughput_256x256"] = tr
    print(f"[{label}] throughput {tr['output_tokens_per_s']:.0f} output tok/s, {t['steps']} steps of "
          f"{tr['ms_per_step']:.2f} ms", flush=True)
    save()
    release(llm)
    del llm, eng
    gc.collect()


def compare(files: list[str], md_path: str | None) -> None:
    runs = [json.load(open(f)) for f in files]
    batches = sorted({int(k[len("decode_b"):]) for r in runs for k in r.get("llama", {})
                      if k.startswith("decode_b") and k != "decode_b1"})
    lines = ["| tree | copy GB/s | matmul TFLOP/s | start-up s | batch-1 decode ms/token | "
             + "".join(f"batch-{b} decode ms/step | " for b in batches) + "256/256 x 1000 output tok/s | ms/step |",
             "|---|---|---|---|---|" + "---|" * len(batches) + "---|---|"]
    for r in runs:
        if "llama" not in r:
            continue
        c, ll = r["ceilings"], r["llama"]
        tp = ll.get("throughput_256x256", {})
        more = "".join(f"{ll.get(f'decode_b{b}', {}).get('ms_per_step_median', float('nan')):.2f} | " for b in batches)
        lines.append(f"| {r['label']} | {c['copy_bandwidth_GBps']:.0f} | {c['bf16_matmul_TFLOPs']:.1f} | "
                     f"{ll['startup_s']:.1f} | {ll.get('decode_b1', {}).get('ms_per_token_median', float('nan')):.2f} | "
                     f"{more}{tp.get('output_tokens_per_s', float('nan')):,.0f} | {tp.get('ms_per_step', float('nan')):.2f} |")
    greedy = [r.get("smollm2_f32_greedy", {}).get("token_ids") for r in runs]
    if all(g is not None for g in greedy):
        same = all(g == greedy[0] for g in greedy)
        lines += ["", f"SmolLM2-135M-Instruct float32 greedy, {len(greedy[0])} prompts x 48 tokens: "
                      f"{'identical token ids in every tree' if same else 'token ids DIFFER between trees'}."]
    text = "\n".join(lines)
    print(text)
    if md_path:
        with open(md_path, "w") as f:
            f.write(text + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="tree")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--smollm2", default=None, help="the SmolLM2-135M-Instruct GGUF file")
    ap.add_argument("--skip-llama", action="store_true", help="only the SmolLM2 tokens")
    ap.add_argument("--compare", nargs="+", default=None, help="JSON files of earlier runs: print a table")
    ap.add_argument("--md", default=None)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--decode-batches", default="1", help="comma-separated batch sizes of the decode figure")
    ap.add_argument("--patch", action="append", default=[], help="MODULE.NAME=VALUE: a jaxengine constant")
    ap.add_argument("--fresh-cache", action="store_true", help="the Llama engine on an empty compilation cache")
    ap.add_argument("--engine-arg", action="append", default=[], help="KEY=JSON: an LLM(...) argument")
    ap.add_argument("--kv-scales", default=None, help="K,V: every layer's fp8 KV-cache scales, as a checkpoint "
                    "would give them (the dummy engine has none)")
    args = ap.parse_args()
    for item in args.engine_arg:
        key, value = item.split("=", 1)
        ENGINE_ARGS[key] = json.loads(value)
    if args.kv_scales:
        from jaxengine import loading

        k_scale, v_scale = (float(x) for x in args.kv_scales.split(","))
        loading._kv_scales = lambda config, mc, ckpt: ((k_scale, v_scale),) * mc.num_layers
    for patch in args.patch:  # e.g. model_runner.DECODE_ONLY_PROGRAMS=false
        import importlib

        target, value = patch.split("=", 1)
        module, name = target.rsplit(".", 1)
        mod = importlib.import_module(f"jaxengine.{module}")
        old = getattr(mod, name)
        setattr(mod, name, value.lower() in ("1", "true") if isinstance(old, bool) else type(old)(value))
    if args.compare:
        compare(args.compare, args.md)
        return 0
    os.makedirs(args.out, exist_ok=True)
    measure(args.label, args.out, args.smollm2, llama=not args.skip_llama,
            decode_batches=tuple(int(b) for b in args.decode_batches.split(",")),
            throughput=not args.skip_throughput, fresh_cache=args.fresh_cache)
    return 0


if __name__ == "__main__":
    sys.exit(main())
