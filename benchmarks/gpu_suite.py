"""The H100 result set of the results table, one part per process.

    python benchmarks/gpu_suite.py PART [--smoke] [--out DIR] [--budget-s S]

PART is one of:
- engine:  Llama-3-8B shape (dummy weights, bf16): batch-1 decode ms/token against the HBM roofline,
           offline throughput (random 256/256 and 1024/128, 1000 prompts each, vLLM's definitions),
           host vs device-wait time per step; then the SmolLM2-135M shape at batch 256 with the
           share of wall time the GPU sits idle.
- serve:   `jaxengine serve` (8B shape) in a subprocess, and the serving benchmark client at request
           rates 1, 4, 16 and inf (random 1024 in / 128 out): TTFT, TPOT, ITL, E2EL, throughput.
- peer:    transformers (PyTorch) on the same GPU: batch-1 decode and batched `generate` throughput
           on the same workloads (benchmarks/hf_peer.py in a subprocess).
- startup: process start to first token of `jaxengine generate`, cold (empty compilation cache)
           and warm (the same cache filled), in subprocesses.
- sweep:   `jaxengine bench sweep` of the 8B shape over a few bucket schedules, with its choice.

Every part measures the ceilings (copy bandwidth, bf16 matmul; benchmarks/ceilings.py) in the same
run, in a subprocess of its own that exits before the part starts (so it never holds GPU memory),
writes `suite_<part>.json` (device, versions, every parameter, results, ceilings) and
`suite_<part>.md` to --out (default ./gpu_suite_out), and prints a short table last. `--smoke` runs the same code
paths on the CPU with a tiny model and tiny workloads (a couple of minutes in all).

Dummy-preset models have no tokenizer. Where text is needed (`jaxengine generate`, server-side
detokenization as vLLM does it), the suite writes a synthetic word-level tokenizer with the model's
vocabulary size ("w123" is token 123) and passes it with --tokenizer; prompts are token ids.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PARTS = ("engine", "serve", "peer", "startup", "sweep")
VLLM_PUBLISHED = {"throughput_256x256_output_tok_s": 11364.0, "serve_median_tpot_ms_light_load": 7.6,
                  "source": "vLLM PR #11078 (H100, Llama-3-8B, 256 in / 256 out, 1000 prompts); "
                            "TPOT: vLLM's published serving figures for this model class on an H100"}
T_PROCESS = time.perf_counter()


# -- settings ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class ModelSpec:
    """An engine configuration of the suite; `model` is a preset name or (smoke) a folder."""

    label: str
    model: str
    vocab_size: int
    dtype: str = "bfloat16"
    max_model_len: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048

    def engine_kwargs(self) -> dict[str, object]:
        return {"model": self.model, "load_format": "dummy", "dtype": self.dtype, "max_model_len": self.max_model_len,
                "max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens}

    def flags(self) -> list[str]:
        return ["--load-format", "dummy", "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
                "--max-num-seqs", str(self.max_num_seqs), "--max-num-batched-tokens", str(self.max_num_batched_tokens)]


def settings(smoke: bool, tmp: str) -> dict[str, object]:
    """Everything a part may use, full (H100) or smoke (CPU, tiny)."""
    if not smoke:
        llama = ModelSpec("Llama-3-8B shape (dummy, bf16)", "llama-3-8b", 128256)
        return {
            "smoke": False, "llama": llama,
            "smol": ModelSpec("SmolLM2-135M shape (dummy, bf16)", "smollm2-135m", 49152),
            "ceilings": {"copy_bytes": 2 << 30, "matmul_n": 8192},
            # engine
            "decode": {"batch_size": 1, "input_len": 128, "output_len": 256, "iters": 3, "warmup_iters": 1},
            "throughput": [  # name, input, output, prompts, detokenize
                ("256x256", 256, 256, 1000, True), ("256x256_no_detok", 256, 256, 1000, False),
                ("1024x128", 1024, 128, 1000, True)],
            "throughput_warmup": 64,
            "smol_throughput": ("256x256", 256, 256, 1024),
            "idle_probe": {"prompts": 256, "input_len": 256, "output_len": 256, "sample_every": 8, "reps": 5,
                           "max_samples_per_bucket": 12},
            # serve: (rate, prompts); counts chosen so the part fits its budget (see GPU_SUITE.md)
            "serve": {"input_len": 1024, "output_len": 128, "plan": [(1.0, 100), (4.0, 300), (16.0, 800),
                                                                      (float("inf"), 1000)],
                      "warmup": 16, "server_start_timeout_s": 300, "tail_s": 15.0},
            # peer: IN:OUT:MAX_PROMPTS:BATCH
            "peer": {"device": "cuda", "dtype": "bfloat16", "decode_input_len": 128, "decode_tokens": 128,
                     "workloads": ["256:256:1000:256", "1024:128:1000:128"], "shares_s": [150, 150],
                     "compile": True},
            # startup: configurations run cold then warm (twice)
            "startup": {"configs": [("as the engine part (2048 tokens/step)", llama.flags()),
                                    ("engine defaults (max_model_len 8192, 8192 tokens/step)",
                                     ["--load-format", "dummy", "--dtype", "bfloat16"])],
                        "warm_runs": 2, "timeout_s": 240},
            "sweep": {"schedules": ["512:256:16", "1024:256:16", "2048:256:16"], "num_prompts": 200,
                      "input_len": 512, "output_len": 128, "range_ratio": 0.5, "bucket_iters": 10,
                      "bucket_warmup": 2, "timeout_s": 540},
        }
    folder = os.path.join(tmp, "tiny-llama")
    make_tiny_model(folder, vocab_size=512)
    tiny = ModelSpec("tiny Llama (2 layers, hidden 64; dummy, float32) [smoke]", folder, 512, dtype="float32",
                     max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)
    return {
        "smoke": True, "llama": tiny,
        "smol": dataclasses.replace(tiny, label="tiny Llama standing in for the SmolLM2 shape [smoke]"),
        "ceilings": {"copy_bytes": 32 << 20, "matmul_n": 256},
        "decode": {"batch_size": 1, "input_len": 16, "output_len": 8, "iters": 2, "warmup_iters": 1},
        "throughput": [("32x16", 32, 16, 12, True), ("32x16_no_detok", 32, 16, 12, False), ("64x8", 64, 8, 12, True)],
        "throughput_warmup": 4,
        "smol_throughput": ("32x16", 32, 16, 16),
        "idle_probe": {"prompts": 8, "input_len": 32, "output_len": 16, "sample_every": 2, "reps": 2,
                       "max_samples_per_bucket": 3},
        "serve": {"input_len": 32, "output_len": 8, "plan": [(4.0, 4), (16.0, 8), (64.0, 8), (float("inf"), 8)],
                  "warmup": 2, "server_start_timeout_s": 180, "tail_s": 5.0},
        "peer": {"device": "cpu", "dtype": "float32", "decode_input_len": 16, "decode_tokens": 8,
                 "workloads": ["32:16:8:4", "64:8:8:4"], "shares_s": [15, 15], "compile": True},
        "startup": {"configs": [("tiny [smoke]", tiny.flags())], "warm_runs": 1, "timeout_s": 150},
        "sweep": {"schedules": ["32:8:16", "64:8:16"], "num_prompts": 6, "input_len": 24, "output_len": 4,
                  "range_ratio": 0.5, "bucket_iters": 3, "bucket_warmup": 1, "timeout_s": 200},
    }


# -- helpers ----------------------------------------------------------------------------------------
def make_tiny_model(folder: str, vocab_size: int = 512) -> str:
    """A tiny Llama config + a placeholder safetensors file + a synthetic tokenizer (for
    `load_format="dummy"` smoke runs: the weights are never read)."""
    import numpy as np
    from safetensors.numpy import save_file

    os.makedirs(folder, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
           "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512,
           "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file({"placeholder": np.zeros(1, np.float32)}, os.path.join(folder, "model.safetensors"))
    synthetic_tokenizer(folder, vocab_size)
    return folder


def synthetic_tokenizer(folder: str, vocab_size: int) -> str:
    """A word-level tokenizer with `vocab_size` entries: 0 <unk>, 1 <s>, 2 </s>, i "w<i>" above.
    Decoding costs what a fast tokenizer's decode costs; it stands in for a real one."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    os.makedirs(folder, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")
    fast.save_pretrained(folder)
    return folder


def preset_config(name: str) -> dict:
    from jaxengine.models.presets import PRESETS
    return dict(PRESETS[name])


def nvidia_smi() -> dict[str, str] | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    lines = out.stdout.strip().splitlines()
    f = [x.strip() for x in lines[0].split(",")]
    return {"name": f[0], "driver": f[1] if len(f) > 1 else "", "memory_total": f[2] if len(f) > 2 else "",
            "count": str(len(lines))}


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "platform": platform.platform(), "host": platform.node(),
           "cpu_count": str(os.cpu_count())}
    for pkg in ("jaxengine", "jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "numpy",
                "transformers", "tokenizers", "torch", "fastapi", "uvicorn", "httpx", "aiohttp"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    try:
        out["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                           timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return out


_CEILINGS_CODE = r"""
import json, sys, time
import jax
from jaxengine.benchmarks.ceilings import copy_bandwidth, matmul_rate
nbytes, n = int(sys.argv[1]), int(sys.argv[2])
t0 = time.perf_counter()
bw = copy_bandwidth(nbytes)
mm = matmul_rate(n)
d = jax.devices()[0]
print("CEILINGS " + json.dumps({"copy_bandwidth_GBps": bw / 1e9, "bf16_matmul_TFLOPs": mm / 1e12,
      "copy_buffer_bytes": nbytes, "matmul_n": n, "backend": jax.default_backend(), "device_kind": d.device_kind,
      "num_devices": len(jax.devices()), "jax": jax.__version__, "seconds": time.perf_counter() - t0}))
"""


def measure_ceilings(cfg: dict) -> dict:
    """benchmarks/ceilings.py in a subprocess (it exits before the part's own work starts)."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    p = subprocess.run([sys.executable, "-c", _CEILINGS_CODE, str(cfg["copy_bytes"]), str(cfg["matmul_n"])],
                       capture_output=True, text=True, env=env, timeout=300)
    for line in p.stdout.splitlines():
        if line.startswith("CEILINGS "):
            out = json.loads(line[len("CEILINGS "):])
            out["method"] = ("benchmarks/ceilings.py: copy = a * 1.0001 over the buffer, bytes read + written, "
                             "20 back-to-back calls, best of 5; matmul = bf16 n^3, same timing")
            if out["backend"] == "cpu":
                out["note"] = "CPU: host memory bandwidth and a CPU matmul; not a GPU ceiling"
            return out
    raise RuntimeError(f"ceilings subprocess failed (rc {p.returncode}): {p.stderr[-2000:]}")


class Budget:
    def __init__(self, seconds: float):
        self.seconds = seconds

    def elapsed(self) -> float:
        return time.perf_counter() - T_PROCESS

    def left(self) -> float:
        return self.seconds - self.elapsed()


def show(cmd: list[str]) -> str:
    """A subprocess's command line as a shell would take it, with `python` for the interpreter."""
    return shlex.join(["python" if c == sys.executable else c for c in cmd])


def fmt(x: object, spec: str = ".2f") -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


def _stem(out_dir: str, part: str, smoke: bool) -> str:
    return os.path.join(out_dir, f"suite_{part}{'_smoke' if smoke else ''}")


def save_partial(out_dir: str, payload: dict) -> None:
    """The payload so far, so that a part stopped by the call's time limit still leaves its numbers."""
    from jaxengine.benchmarks.common import write_json

    payload["partial"] = True
    payload["wall_s"] = time.perf_counter() - T_PROCESS
    write_json(_stem(out_dir, payload["part"], payload["smoke"]) + ".json", payload)


def write_part(out_dir: str, part: str, smoke: bool, payload: dict, md: list[str]) -> tuple[str, str]:
    from jaxengine.benchmarks.common import write_json

    stem = _stem(out_dir, part, smoke)
    payload["partial"] = False
    payload["wall_s"] = time.perf_counter() - T_PROCESS
    write_json(stem + ".json", payload)
    with open(stem + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    return stem + ".json", stem + ".md"


def header(part: str, args: argparse.Namespace, st: dict, ceilings: dict) -> dict:
    return {"suite": "benchmarks/gpu_suite.py", "part": part, "smoke": st["smoke"],
            "command": " ".join([os.path.relpath(sys.argv[0], ROOT) if os.path.isabs(sys.argv[0]) else sys.argv[0],
                                 *sys.argv[1:]]),
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "budget_s": args.budget_s,
            "device": {"nvidia_smi": nvidia_smi(), "jax_backend": ceilings.get("backend"),
                       "jax_device_kind": ceilings.get("device_kind"), "num_devices": ceilings.get("num_devices")},
            "versions": versions(), "ceilings": ceilings,
            "parameters": {k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v) for k, v in st.items()
                           if k in (part, "llama", "smol", "ceilings", "smoke") or part == "engine" and k in
                           ("decode", "throughput", "throughput_warmup", "smol_throughput", "idle_probe")}}


def ceilings_md(c: dict) -> list[str]:
    return [f"| copy bandwidth (read + write) | {c['copy_bandwidth_GBps']:.0f} GB/s | | |",
            f"| bf16 matmul {c['matmul_n']}^3 | {c['bf16_matmul_TFLOPs']:.4g} TFLOP/s | | |"]


def device_line(payload: dict) -> str:
    smi = payload["device"]["nvidia_smi"]
    name = smi["name"] if smi else payload["device"]["jax_device_kind"]
    v = payload["versions"]
    return (f"Device: {name} ({payload['device']['jax_backend']}), jax {v.get('jax')}, jaxlib {v.get('jaxlib')}, "
            f"commit {v.get('git_commit', '?')[:10]}{' [SMOKE: CPU, tiny model]' if payload['smoke'] else ''}.")


# -- engine ---------------------------------------------------------------------------------------------
class StepCapture:
    """Records, on a runner, each token bucket's use and copies of the inputs of every
    `sample_every`-th forward of that bucket (with the sampler metadata that followed it), so the
    device time of those steps can be replayed alone, without the host work around them."""

    def __init__(self, runner, sample_every: int):
        import jax
        import numpy as np

        self.runner, self.every = runner, sample_every
        self.counts: dict[int, int] = {}
        self.samples: dict[int, list[dict]] = {}
        self._pending: dict | None = None
        orig_fwd, orig_samp = runner._get_forward, runner._get_sampler
        copy = lambda tree: jax.tree.map(lambda a: np.array(a) if isinstance(a, np.ndarray) else a, tree)  # noqa: E731

        def get_forward(t):
            fn = orig_fwd(t)

            def call(params, kv, inputs, prev):
                k = self.counts[t] = self.counts.get(t, 0) + 1
                self._pending = None
                if (k - 1) % self.every == 0:
                    self._pending = {"t": t, "inputs": copy(inputs), "prev": prev}
                    self.samples.setdefault(t, []).append(self._pending)
                return fn(params, kv, inputs, prev)
            return call

        def get_sampler(*variant):
            fn = orig_samp(*variant)

            def call(logits, *rest):
                if self._pending is not None and "md" not in self._pending:
                    self._pending.update(md=copy(rest), variant=variant)
                return fn(logits, *rest)
            return call

        runner._get_forward, runner._get_sampler = get_forward, get_sampler

    def remove(self) -> None:
        del self.runner._get_forward, self.runner._get_sampler  # back to the class methods

    def replay(self, reps: int, max_samples: int) -> dict[int, dict]:
        """Per bucket: mean device seconds of forward + sampler over the recorded samples, each
        replayed `reps` times back to back with its inputs already on the device."""
        import jax
        import numpy as np

        runner = self.runner
        out = {}
        for t, samples in sorted(self.samples.items()):
            samples = [s for s in samples if "md" in s]
            if len(samples) > max_samples:  # evenly spread over the run (contexts grow along it)
                idx = np.linspace(0, len(samples) - 1, max_samples).round().astype(int)
                samples = [samples[i] for i in idx]
            times = []
            for s in samples:
                fwd, samp = runner._get_forward(t), runner._get_sampler(*s["variant"])
                inputs, md = jax.device_put(s["inputs"]), jax.device_put(s["md"])

                def once():
                    runner.kv_caches, logits, _ = fwd(runner.param_leaves, runner.kv_caches, inputs, s["prev"])
                    return samp(logits, *md)

                jax.block_until_ready(once())
                t0 = time.perf_counter()
                res = None
                for _ in range(reps):
                    res = once()
                jax.block_until_ready(res)
                times.append((time.perf_counter() - t0) / reps)
            if times:
                out[t] = {"count": self.counts.get(t, 0), "samples": len(times), "device_s_mean": float(np.mean(times)),
                          "device_s_min": float(np.min(times)), "device_s_max": float(np.max(times))}
        return out


def timing_summary(t: dict) -> dict:
    steps = max(int(t.get("steps", 0)), 1)
    host = t["step_s"] - t["device_wait_s"]
    return {**t, "step_ms": 1e3 * t["step_s"] / steps, "device_wait_ms": 1e3 * t["device_wait_s"] / steps,
            "host_ms": 1e3 * host / steps, "device_wait_share_of_step": t["device_wait_s"] / t["step_s"] if t["step_s"] else None}


def measure_smol(st: dict, tmp: str) -> dict:
    """The SmolLM2 shape at batch 256: output tok/s, then an instrumented run whose recorded steps
    are replayed alone to estimate how much of the wall time the GPU idles (see `explanation`)."""
    from jaxengine import LLM
    from jaxengine.benchmarks.common import SampleRequest, random_requests, weight_bytes
    from jaxengine.benchmarks.sweep import release
    from jaxengine.benchmarks.throughput import run_throughput

    sspec: ModelSpec = st["smol"]
    tokdir = sspec.model if st["smoke"] else synthetic_tokenizer(os.path.join(tmp, "tok_smol"), sspec.vocab_size)
    t0 = time.perf_counter()
    llm = LLM(**sspec.engine_kwargs(), tokenizer=tokdir)
    eng = llm.llm_engine
    rs = {"model": sspec.label, "startup_s": time.perf_counter() - t0, "compile_s": eng.runner.compile_seconds,
          "num_kv_blocks": eng.config.num_kv_blocks, "max_num_seqs": eng.config.max_num_seqs,
          "attention_impl": eng.runner.attention_impl, "weight_bytes": weight_bytes(llm)}
    sname, til, tol, n = st["smol_throughput"]
    warm = [SampleRequest(r.prompt_token_ids, 16)
            for r in random_requests(st["throughput_warmup"], til, tol, 0.0, sspec.vocab_size, seed=20_001)]
    run_throughput(llm, warm)
    reqs = random_requests(n, til, tol, 0.0, sspec.vocab_size, seed=7)
    tr = run_throughput(llm, reqs)
    tr["engine_timing"] = timing_summary(tr["engine_timing"])
    tr.update({"input_len": til, "output_len": tol, "detokenize": True})
    rs["throughput"] = tr
    # Second pass, instrumented: which buckets ran how often, and copies of sampled steps' inputs.
    probe = st["idle_probe"]
    cap = StepCapture(eng.runner, probe["sample_every"])
    preqs = random_requests(probe["prompts"], probe["input_len"], probe["output_len"], 0.0, sspec.vocab_size, seed=8)
    try:
        ptr = run_throughput(llm, preqs)
    finally:
        cap.remove()
    per_bucket = cap.replay(probe["reps"], probe["max_samples_per_bucket"])  # overwrites KV blocks: last use
    busy = sum(v["count"] * v["device_s_mean"] for v in per_bucket.values())
    pt = timing_summary(ptr["engine_timing"])
    idle = max(0.0, 1.0 - busy / ptr["elapsed_s"])
    rs["gpu_idle"] = {
        "probe_run": {"num_requests": ptr["num_requests"], "elapsed_s": ptr["elapsed_s"],
                      "output_tokens_per_s": ptr["output_tokens_per_s"], "engine_timing": pt,
                      "input_len": probe["input_len"], "output_len": probe["output_len"]},
        "per_bucket": {str(k): v for k, v in per_bucket.items()},
        "device_busy_s_estimate": busy,
        "idle_fraction_estimate": idle,
        "device_wait_share_of_step": pt["device_wait_share_of_step"],
        "explanation": (
            "The engine runs one step ahead (step N+1 is dispatched before step N's tokens are read), so "
            "engine.timing's device_wait_s (the host blocked on the device) is not the device's busy time. "
            "Device busy time is estimated instead: a second, instrumented run of the same kind of workload "
            "counts the steps of every token bucket and keeps copies of the inputs of every "
            f"{probe['sample_every']}th step per bucket; after it, up to {probe['max_samples_per_bucket']} "
            f"recorded steps per bucket (spread over the run) are replayed {probe['reps']} times back to back "
            "(forward + sampler, inputs already on the device, no host work in between), giving the mean "
            "device seconds per step of each bucket. busy = sum(steps x device seconds) over buckets; "
            "idle fraction = 1 - busy / wall time of that run. device_wait_share_of_step = device_wait_s / "
            "step_s: the share of the host's step time spent waiting (near 0: the host is the bottleneck). "
            "Caveats: host-to-device input copies are left out of busy time (small); a replayed step reads "
            "the KV cache as the engine left it, which has the same sizes and so the same cost.")}
    print(f"[engine] SmolLM2 shape: {tr['output_tokens_per_s']:.0f} output tok/s, "
          f"{tr['engine_timing']['step_ms']:.2f} ms/step ({tr['engine_timing']['device_wait_ms']:.2f} waiting); "
          f"GPU idle ~{100 * idle:.0f}% of the probe run", flush=True)
    release(llm)
    del llm, eng
    gc.collect()
    return rs


def part_engine(args, st, out_dir) -> tuple[dict, list[str]]:
    import numpy as np

    from jaxengine import LLM
    from jaxengine.benchmarks.common import (SampleRequest, decode_weight_bytes, percentiles, random_requests,
                                             weight_bytes)
    from jaxengine.benchmarks.latency import run_batch
    from jaxengine.benchmarks.sweep import release
    from jaxengine.benchmarks.throughput import run_throughput
    from jaxengine.model_runner import kv_bytes_per_block

    ceil = measure_ceilings(st["ceilings"])
    payload = header("engine", args, st, ceil)
    bw = ceil["copy_bandwidth_GBps"] * 1e9
    tmp = tempfile.mkdtemp(prefix="suite_engine_")
    res: dict = {}
    payload["results"] = res

    # ---- 8B shape --------------------------------------------------------------------------------
    spec: ModelSpec = st["llama"]
    tokdir = spec.model if st["smoke"] else synthetic_tokenizer(os.path.join(tmp, "tok_llama"), spec.vocab_size)
    t0 = time.perf_counter()
    llm = LLM(**spec.engine_kwargs(), tokenizer=tokdir)
    eng = llm.llm_engine
    wbytes = weight_bytes(llm)
    read_bytes = decode_weight_bytes(llm)  # the input embedding table is gathered, not read
    kv_tok = kv_bytes_per_block(eng.model_config, eng.config.block_size,
                                eng.runner.attention.kv_dtype(eng.runner.dtype),
                                eng.runner.attention.kv_head_dim(eng.model_config.head_dim)) / eng.config.block_size
    res["llama"] = r8 = {"model": spec.label, "startup_s": time.perf_counter() - t0, "compile_s": eng.runner.compile_seconds,
                         "num_kv_blocks": eng.config.num_kv_blocks, "block_size": eng.config.block_size,
                         "attention_impl": eng.runner.attention_impl, "token_buckets": list(eng.runner.token_buckets),
                         "weight_bytes": wbytes, "decode_weight_bytes": read_bytes, "kv_bytes_per_token": kv_tok,
                         "tokenizer": "synthetic word-level (see the module docstring)",
                         # as the engine left them (jaxengine.device_memory chooses the allocator on GPUs)
                         "xla_allocator": os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default"),
                         "xla_flags": os.environ.get("XLA_FLAGS", "")}
    print(f"[engine] {spec.label}: start-up {r8['startup_s']:.1f} s, attention {r8['attention_impl']}", flush=True)

    d = st["decode"]
    bs, il, ol = d["batch_size"], d["input_len"], d["output_len"]

    def prompts(i: int) -> list[list[int]]:
        return [r.prompt_token_ids for r in random_requests(bs, il, ol, 0.0, spec.vocab_size, seed=500 + i)]

    for i in range(d["warmup_iters"]):
        run_batch(llm, prompts(100 + i), ol)
    eng.timing.update(steps=0, device_wait_s=0.0, step_s=0.0)
    runs = [run_batch(llm, prompts(i), ol) for i in range(d["iters"])]
    dec_timing = timing_summary(dict(eng.timing))
    steps = [g for r in runs for g in r["decode_steps"]]
    step = percentiles(steps)
    step_bytes = read_bytes + bs * (il + ol / 2) * kv_tok
    roof_s = step_bytes / bw
    r8["decode_b1"] = {"batch_size": bs, "input_len": il, "output_len": ol, "iters": d["iters"],
                       "decode_step_ms": {k: v * 1e3 for k, v in step.items()}, "steps_measured": len(steps),
                       "ms_per_token": step["median"] * 1e3, "tok_per_s": 1.0 / step["median"],
                       "ttft_ms_median": 1e3 * float(np.median([r["ttft_s"] for r in runs])),
                       "roofline_step_bytes": step_bytes, "roofline_ms": roof_s * 1e3,
                       "fraction_of_roofline": roof_s / step["median"],
                       "roofline_definition": "(weight bytes + KV bytes of the mean context) / measured copy bandwidth",
                       "engine_timing": dec_timing}
    print(f"[engine] batch-1 decode {step['median'] * 1e3:.2f} ms/token, roofline {roof_s * 1e3:.2f} ms "
          f"({100 * roof_s / step['median']:.0f}%)", flush=True)
    save_partial(out_dir, payload)

    r8["throughput"] = {}
    for k, (name, til, tol, n, detok) in enumerate(st["throughput"]):
        warm = [SampleRequest(r.prompt_token_ids, min(r.output_len, 16))
                for r in random_requests(st["throughput_warmup"], til, tol, 0.0, spec.vocab_size, seed=20_000)]
        run_throughput(llm, warm, detokenize=detok)
        reqs = random_requests(n, til, tol, 0.0, spec.vocab_size, seed=100 + k)
        tr = run_throughput(llm, reqs, detokenize=detok)
        tr["engine_timing"] = timing_summary(tr["engine_timing"])
        tr.update({"input_len": til, "output_len": tol, "detokenize": detok, "warmup_requests": len(warm)})
        if til == 256 and tol == 256:
            tr["vs_vllm_published_output_tok_s"] = tr["output_tokens_per_s"] / VLLM_PUBLISHED["throughput_256x256_output_tok_s"]
        r8["throughput"][name] = tr
        print(f"[engine] throughput {name}: {tr['output_tokens_per_s']:.0f} output tok/s, "
              f"{tr['engine_timing']['step_ms']:.2f} ms/step ({tr['engine_timing']['device_wait_ms']:.2f} waiting)",
              flush=True)
        save_partial(out_dir, payload)
    payload["wall_s_llama"] = time.perf_counter() - T_PROCESS
    release(llm)
    del llm, eng
    gc.collect()

    # ---- SmolLM2 shape at batch 256: how much of the time the GPU idles ----------------------------
    sspec: ModelSpec = st["smol"]
    res["smol"] = rs = measure_smol(st, tmp)
    tr, idle, sname = rs["throughput"], rs["gpu_idle"]["idle_fraction_estimate"], st["smol_throughput"][0]
    per_bucket = rs["gpu_idle"]["per_bucket"]
    save_partial(out_dir, payload)
    shutil.rmtree(tmp, ignore_errors=True)

    # ---- table ---------------------------------------------------------------------------------------
    db = r8["decode_b1"]
    md = [f"# Engine: {spec.label}; {sspec.label}", "", device_line(payload), "",
          f"Engine: attention `{r8['attention_impl']}`, max_model_len {spec.max_model_len}, max_num_seqs "
          f"{spec.max_num_seqs}, max_num_batched_tokens {spec.max_num_batched_tokens}, block size "
          f"{r8['block_size']}, {r8['num_kv_blocks']} KV blocks; allocator {r8['xla_allocator']}, XLA_FLAGS "
          f"`{r8['xla_flags'] or '(none)'}`. Ceilings measured in the same run.", "",
          "| figure | measured | ceiling / peer (same run) | ratio |", "|---|---|---|---|", *ceilings_md(ceil),
          f"| start-up (dummy weights) | {r8['startup_s']:.1f} s (compile {r8['compile_s']:.1f} s) | | |",
          f"| batch-1 decode ({il} in, {ol} out) | {db['ms_per_token']:.2f} ms/token ({db['tok_per_s']:.1f} tok/s) | "
          f"HBM roofline {db['roofline_ms']:.2f} ms | {100 * db['fraction_of_roofline']:.0f}% (target 90%) |"]
    for name, tr8 in r8["throughput"].items():
        ratio = tr8.get("vs_vllm_published_output_tok_s")
        md.append(f"| throughput {name}, {tr8['num_requests']} prompts{'' if tr8['detokenize'] else ' (no detokenization)'} | "
                  f"{tr8['requests_per_s']:.2f} req/s, {tr8['total_tokens_per_s']:.0f} total tok/s, "
                  f"{tr8['output_tokens_per_s']:.0f} output tok/s | "
                  f"{'vLLM published 11,364 output tok/s' if ratio is not None else ''} | {fmt(ratio)} |")
    md.append(f"| {sspec.label} throughput {sname}, {tr['num_requests']} prompts, batch {sspec.max_num_seqs} | "
              f"{tr['output_tokens_per_s']:.0f} output tok/s | GPU idle ~{100 * idle:.0f}% of wall time (estimate) | |")
    md += ["", "Where step time goes (engine.timing; host = step - device wait):", "",
           "| run | steps | step ms | device-wait ms | host ms |", "|---|---|---|---|---|"]
    rows = [("batch-1 decode", db["engine_timing"])] + [(f"throughput {k}", v["engine_timing"])
                                                        for k, v in r8["throughput"].items()]
    rows.append((f"SmolLM2 shape {sname}", tr["engine_timing"]))
    for label, t in rows:
        md.append(f"| {label} | {t['steps']} | {t['step_ms']:.2f} | {t['device_wait_ms']:.2f} | {t['host_ms']:.2f} |")
    md += ["", "SmolLM2 shape, device time per token bucket (replayed alone) vs steps run:", "",
           "| bucket | steps | device ms/step (mean) |", "|---|---|---|"]
    md += [f"| {k} | {v['count']} | {1e3 * v['device_s_mean']:.3f} |" for k, v in per_bucket.items()]
    return payload, md


# -- serve ----------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> float:
    import httpx

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the server was not ready within {timeout_s} s")


def _stop(proc: subprocess.Popen, grace_s: float = 30.0) -> int | None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def plan_counts(plan: list[tuple[float, int]], time_left: float, tail_s: float, inf_s: float) -> list[tuple[float, int]]:
    """Prompt counts per rate that fit `time_left`: a finite rate's run lasts about n / rate + tail;
    the inf run's estimate `inf_s` is reserved first. Counts shrink (never below 10) to fit."""
    finite = [(r, n) for r, n in plan if r != float("inf")]
    sending = sum(n / r for r, n in finite)
    avail = time_left - inf_s - tail_s * len(finite)
    scale = min(1.0, max(avail, 0.0) / sending) if sending > 0 else 1.0
    return [(r, n if r == float("inf") else max(min(n, 10), int(n * scale))) for r, n in plan]


def part_serve(args, st, out_dir) -> tuple[dict, list[str]]:
    import numpy as np

    from jaxengine.benchmarks.common import SampleRequest, random_requests
    from jaxengine.benchmarks.serve import run_serve
    from jaxengine.benchmarks.serving_metrics import compute_metrics

    budget = Budget(args.budget_s)
    ceil = measure_ceilings(st["ceilings"])
    payload = header("serve", args, st, ceil)
    spec: ModelSpec = st["llama"]
    sv = st["serve"]
    tmp = tempfile.mkdtemp(prefix="suite_serve_")
    tokdir = spec.model if st["smoke"] else synthetic_tokenizer(os.path.join(tmp, "tok"), spec.vocab_size)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    name = "llama-3-8b" if not st["smoke"] else "tiny"
    cmd = [sys.executable, "-m", "jaxengine.server", spec.model, *spec.flags(), "--tokenizer", tokdir,
           "--port", str(port), "--served-model-name", name, "--uvicorn-log-level", "warning"]
    log_path = os.path.join(out_dir, f"suite_serve{'_smoke' if st['smoke'] else ''}_server.log")
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    res: dict = {"server_command": show(cmd), "server_log": os.path.basename(log_path),
                 "prompts": "token ids (random, exact lengths), sent to /v1/completions with stream=true, "
                            "ignore_eos, temperature 0; the server detokenizes with the synthetic tokenizer",
                 "runs": []}
    payload["results"] = res
    try:
        res["server_ready_s"] = _wait_ready(url, proc, sv["server_start_timeout_s"])
        print(f"[serve] server ready in {res['server_ready_s']:.1f} s", flush=True)
        warm = [SampleRequest(r.prompt_token_ids, 8) for r in
                random_requests(sv["warmup"], sv["input_len"], 8, 0.0, spec.vocab_size, seed=999)]
        wres, _ = asyncio.run(run_serve(url, "completions", name, warm, float("inf"), 1.0, None))
        res["warmup"] = {"requests": len(warm), "failed": sum(not r.success for r in wres)}
        inf_est = 90.0 if not st["smoke"] else 20.0
        plan = plan_counts(sv["plan"], budget.left() - 45.0, sv["tail_s"], inf_est)
        res["plan"] = [{"rate": r, "prompts": n, "asked": n0} for (r, n), (_, n0) in zip(plan, sv["plan"])]
        for i, (rate, n) in enumerate(plan):
            if rate != float("inf") and budget.left() < n / rate + sv["tail_s"] + inf_est:
                n = max(10, int((budget.left() - inf_est - sv["tail_s"]) * rate))
            reqs = random_requests(n, sv["input_len"], sv["output_len"], 0.0, spec.vocab_size, seed=1 + i)
            t_run = time.perf_counter()
            results, duration = asyncio.run(run_serve(url, "completions", name, reqs, rate, 1.0, None, seed=1 + i))
            m = compute_metrics(results, duration)
            errors = [r.error for r in results if not r.success][:5]
            res["runs"].append({"request_rate": rate if rate != float("inf") else "inf", "num_prompts": n,
                                "metrics": m, "errors": errors, "wall_s": time.perf_counter() - t_run,
                                "itl_chunks_per_request_median": float(np.median([len(r.itl) for r in results]))})
            print(f"[serve] rate {rate}: {n} prompts, {m['completed']} ok, median TTFT {m['ttft_ms']['median']:.1f} ms, "
                  f"median TPOT {m['tpot_ms']['median']:.2f} ms, {m['output_throughput']:.0f} out tok/s "
                  f"({time.perf_counter() - t_run:.0f} s)", flush=True)
            save_partial(out_dir, payload)
    finally:
        res["server_exit_code"] = _stop(proc)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
    md = [f"# Serving: {spec.label}, random {sv['input_len']} in / {sv['output_len']} out", "", device_line(payload), "",
          f"Server: `{res['server_command']}` (ready in {fmt(res.get('server_ready_s'), '.1f')} s). Client: "
          "benchmarks/serve.py (vLLM's serving-benchmark definitions), Poisson arrivals. Prompt counts per rate are "
          "cut so the part fits one device call (vLLM's runs use 1000 at every rate).", "",
          "| rate (req/s) | prompts | ok | duration s | req/s | out tok/s | TTFT ms mean / median / p99 | "
          "TPOT ms mean / median / p99 | ITL ms mean / median / p99 | E2EL ms mean / median / p99 |",
          "|---|---|---|---|---|---|---|---|---|---|"]

    def trio(s: dict) -> str:
        return f"{fmt(s['mean'], '.1f')} / {fmt(s['median'], '.1f')} / {fmt(s['p99'], '.1f')}"

    for r in res["runs"]:
        m = r["metrics"]
        md.append(f"| {r['request_rate']} | {r['num_prompts']} | {m['completed']} | {m['duration_s']:.1f} | "
                  f"{m['request_throughput']:.2f} | {m['output_throughput']:.0f} | {trio(m['ttft_ms'])} | "
                  f"{trio(m['tpot_ms'])} | {trio(m['itl_ms'])} | {trio(m['e2el_ms'])} |")
    md += ["", *ceilings_md_plain(ceil), "Target at light load: median TPOT under vLLM's published 7.6 ms."]
    return payload, md


def ceilings_md_plain(c: dict) -> list[str]:
    return [f"Ceilings, same run: copy bandwidth {c['copy_bandwidth_GBps']:.0f} GB/s, "
            f"bf16 matmul {c['bf16_matmul_TFLOPs']:.4g} TFLOP/s."]


# -- peer -----------------------------------------------------------------------------------------------
def part_peer(args, st, out_dir) -> tuple[dict, list[str]]:
    budget = Budget(args.budget_s)
    ceil = measure_ceilings(st["ceilings"])
    payload = header("peer", args, st, ceil)
    spec: ModelSpec = st["llama"]
    pc = st["peer"]
    tmp = tempfile.mkdtemp(prefix="suite_peer_")
    if st["smoke"]:
        with open(os.path.join(spec.model, "config.json")) as f:
            cfg = json.load(f)
    else:
        cfg = preset_config(spec.model)
    cfg_path = os.path.join(tmp, "config.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    out_json = os.path.join(tmp, "peer.json")
    inner = max(60.0, budget.left() - 20.0)
    cmd = [sys.executable, os.path.join(HERE, "hf_peer.py"), "--config-json", cfg_path, "--device", pc["device"],
           "--dtype", pc["dtype"], "--out", out_json, "--budget-s", str(inner),
           "--decode-input-len", str(pc["decode_input_len"]), "--decode-tokens", str(pc["decode_tokens"]),
           "--workload-share-s", *[str(s) for s in pc["shares_s"]],
           "--compile" if pc["compile"] else "--no-compile"]
    for w in pc["workloads"]:
        cmd += ["--workload", w]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=inner + 10)
        rc, tail = p.returncode, (p.stdout + p.stderr)[-3000:]
    except subprocess.TimeoutExpired as e:
        rc, tail = "timeout", ((e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace"))[-3000:]
    peer = {}
    if os.path.exists(out_json):
        with open(out_json) as f:
            peer = json.load(f)
    payload["results"] = {"peer": peer, "subprocess": {"command": show(cmd),
                                                       "returncode": rc, "wall_s": time.perf_counter() - t0,
                                                       "output_tail": tail}}
    shutil.rmtree(tmp, ignore_errors=True)
    secs = peer.get("sections", {})
    env = peer.get("environment", {})
    md = [f"# Peer: transformers {env.get('transformers', '?')} / torch {env.get('torch', '?')}, {spec.label}", "",
          device_line(payload), "",
          f"Random-init LlamaForCausalLM built on the device ({peer.get('model', {}).get('dtype', '?')}, "
          f"attention {peer.get('model', {}).get('attn_implementation', '?')}); greedy, min_new_tokens = max_new_tokens.",
          "", "| figure | transformers | note |", "|---|---|---|"]
    for k, s in secs.items():
        if k.startswith("decode_b1"):
            val = (f"{s['ms_per_token']:.2f} ms/token ({s['tok_per_s']:.1f} tok/s)" if s.get("ok") else
                   f"failed: {s['error']}" if "error" in s else "did not finish within the part's time")
            extra = f"; compiled: {s.get('compiled')}" if "compiled" in s else ""
            md.append(f"| batch-1 decode, {s.get('mode', k)} | {val} | {s.get('note', '')}{extra} |")
        elif k.startswith("throughput"):
            if s.get("num_prompts"):
                val = (f"{s['requests_per_s']:.2f} req/s, {s['total_tokens_per_s']:.0f} total tok/s, "
                       f"{s['output_tokens_per_s']:.0f} output tok/s")
            else:
                val = f"failed: {s['error']}" if "error" in s else "did not finish within the part's time"
            md.append(f"| throughput {s['input_len']}x{s['output_len']}, {s.get('num_prompts', 0)} of "
                      f"{s['max_prompts']} prompts, batch {s['batch_size']} | {val} | "
                      f"{'prompts cut to the time share' if s.get('num_prompts', 0) < s['max_prompts'] else 'time share'} "
                      f"{s['time_share_s']:.0f} s{'; ' + s['error'] if s.get('error') else ''} |")
    md += ["", *ceilings_md_plain(ceil), f"hf_peer.py exit: {rc}."]
    return payload, md


# -- startup --------------------------------------------------------------------------------------------
_COMPILED = re.compile(r"compiled (\d+) programs(?: and loaded \d+ from the program bundle)? in ([0-9.]+) s")
_READY = re.compile(r"ready in ([0-9.]+) s")


def time_generate(cmd: list[str], timeout_s: float) -> dict:
    """Wall seconds from process start to its last line on stdout (the generated text, printed once
    the one token of --max-tokens 1 exists) and to its exit; the engine's own log figures."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = None
    try:
        import threading

        err: list[str] = []
        th = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
        th.start()
        out_lines = []
        for line in proc.stdout:  # generate prints its text last; anything printed earlier is not it
            first = time.perf_counter() - t0
            out_lines.append(line)
        proc.wait(timeout=timeout_s)
        th.join(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    total = time.perf_counter() - t0
    log = "".join(err)
    m, r = _COMPILED.search(log), _READY.search(log)
    return {"first_token_s": first, "exit_s": total, "returncode": proc.returncode,
            "programs": int(m.group(1)) if m else None, "compile_s": float(m.group(2)) if m else None,
            "engine_ready_s": float(r.group(1)) if r else None, "stdout": "".join(out_lines)[-200:],
            "stderr_tail": log[-1500:] if proc.returncode else log[-300:]}


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def part_startup(args, st, out_dir) -> tuple[dict, list[str]]:
    budget = Budget(args.budget_s)
    ceil = measure_ceilings(st["ceilings"])
    payload = header("startup", args, st, ceil)
    spec: ModelSpec = st["llama"]
    sc = st["startup"]
    tmp = tempfile.mkdtemp(prefix="suite_startup_")
    tokdir = spec.model if st["smoke"] else synthetic_tokenizer(os.path.join(tmp, "tok"), spec.vocab_size)
    prompt = " ".join(f"w{10 + i}" for i in range(32))
    t0 = time.perf_counter()
    imp = subprocess.run([sys.executable, "-c", "import jaxengine.cli, jaxengine.engine, jax; jax.devices()"],
                         capture_output=True, timeout=120)
    res: dict = {"import_and_device_init_s": time.perf_counter() - t0 if imp.returncode == 0 else None,
                 "method": ("subprocess `python -m jaxengine.cli generate PROMPT --model M --load-format dummy "
                            "--tokenizer SYNTHETIC --max-tokens 1 --compilation-cache-dir DIR ...`; time from Popen "
                            "to the first line on its stdout (the generated text, printed once the first token "
                            "exists) and to exit. Cold: DIR freshly made and empty. Warm: the same DIR again. "
                            "The JAX cache keeps programs that took >= 0.5 s to compile (the engine's setting)."),
                 "configs": []}
    payload["results"] = res
    for label, flags in sc["configs"]:
        cache = tempfile.mkdtemp(prefix="xla_cache_", dir=tmp)
        cmd = [sys.executable, "-m", "jaxengine.cli", "generate", prompt, "--model", spec.model, *flags,
               "--tokenizer", tokdir, "--max-tokens", "1", "--compilation-cache-dir", cache]
        entry = {"label": label, "command": show(cmd), "runs": []}
        res["configs"].append(entry)
        for kind in ["cold"] + ["warm"] * sc["warm_runs"]:
            if budget.left() < sc["timeout_s"] * (0.6 if kind == "warm" else 1.0):
                entry["runs"].append({"kind": kind, "skipped": "not enough time left in the part's budget"})
                continue
            if kind == "warm" and _du(cache) == 0:  # the cold run was skipped: this one fills the cache
                kind = "cold"
            r = time_generate(cmd, sc["timeout_s"])
            r.update(kind=kind, cache_bytes_after=_du(cache), cache_files_after=sum(len(fs) for _, _, fs in os.walk(cache)))
            entry["runs"].append(r)
            save_partial(out_dir, payload)
            print(f"[startup] {label} {kind}: first token {fmt(r['first_token_s'], '.1f')} s, exit {r['exit_s']:.1f} s, "
                  f"compile {fmt(r['compile_s'], '.1f')} s (rc {r['returncode']})", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    md = [f"# Start-up to first token: `jaxengine generate`, {spec.label}", "", device_line(payload), "",
          f"Process start to first token (subprocess, `--max-tokens 1`); imports + device init alone: "
          f"{fmt(res['import_and_device_init_s'], '.1f')} s. Target: warm under 20 s.", "",
          "| configuration | run | first token s | process exit s | engine ready s (log) | programs | compile s (log) | "
          "cache MB after |", "|---|---|---|---|---|---|---|---|"]
    for e in res["configs"]:
        for r in e["runs"]:
            if "skipped" in r:
                md.append(f"| {e['label']} | {r['kind']} | skipped | | | | | |")
                continue
            md.append(f"| {e['label']} | {r['kind']} | {fmt(r['first_token_s'], '.1f')} | {r['exit_s']:.1f} | "
                      f"{fmt(r['engine_ready_s'], '.1f')} | {fmt(r['programs'])} | {fmt(r['compile_s'], '.1f')} | {r['cache_bytes_after'] / 1e6:.1f} |")
    md += ["", *ceilings_md_plain(ceil)]
    return payload, md


# -- sweep ----------------------------------------------------------------------------------------------
def part_sweep(args, st, out_dir) -> tuple[dict, list[str]]:
    ceil = measure_ceilings(st["ceilings"])
    payload = header("sweep", args, st, ceil)
    spec: ModelSpec = st["llama"]
    sw = st["sweep"]
    stem = os.path.join(out_dir, f"sweep_{'smoke' if st['smoke'] else os.path.basename(spec.model)}")
    cmd = [sys.executable, "-m", "jaxengine.cli", "bench", "sweep", "--model", spec.model, "--load-format", "dummy",
           "--dtype", spec.dtype, "--max-model-len", str(spec.max_model_len), "--num-prompts", str(sw["num_prompts"]),
           "--input-len", str(sw["input_len"]), "--output-len", str(sw["output_len"]), "--range-ratio",
           str(sw["range_ratio"]), "--bucket-iters", str(sw["bucket_iters"]), "--bucket-warmup", str(sw["bucket_warmup"]),
           "--output-prefix", stem, "--compilation-cache-dir", ""]
    for s in sw["schedules"]:
        cmd += ["--schedule", s]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(60.0, min(sw["timeout_s"], args.budget_s - 30)))
        rc, stdout, stderr = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc = "timeout"
        stdout = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        stderr = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
    data = {}
    if os.path.exists(stem + ".json"):
        with open(stem + ".json") as f:
            data = json.load(f)
    rec = [ln for ln in stdout.splitlines() if ln.startswith(("recommended", "  e.g."))]
    payload["results"] = {"command": show(cmd),
                          "returncode": rc, "wall_s": time.perf_counter() - t0, "sweep_json": os.path.basename(stem) + ".json",
                          "recommended": data.get("recommended"), "printed_recommendation": rec,
                          "schedules": [{"label": s["label"], "token_buckets": s["token_buckets"],
                                         "num_kv_blocks": s["num_kv_blocks"], "load_s": s["load_s"],
                                         "compile_s": s["compile_s"], "replay": s["replay"],
                                         "buckets": s["buckets"]} for s in data.get("schedules", [])],
                          "workload": data.get("workload"), "stdout_tail": stdout[-3000:], "stderr_tail": stderr[-3000:]}
    md = [f"# Bucket sweep: {spec.label}", "", device_line(payload), "",
          f"`jaxengine bench sweep` (cold compiles: --compilation-cache-dir ''), workload: {sw['num_prompts']} random "
          f"prompts, {sw['input_len']} in / {sw['output_len']} out, range ratio {sw['range_ratio']}.", "",
          "| schedule T:S:B | buckets | compile s | replay s | padding waste | output tok/s |", "|---|---|---|---|---|---|"]
    for s in payload["results"]["schedules"]:
        rep = s["replay"]
        md.append(f"| {s['label']} | {len(s['token_buckets'])} | {s['compile_s']:.1f} | {rep['total_s']:.2f} | "
                  f"{100 * rep['padding_waste']:.1f}% | {rep['output_tokens_per_s']:.0f} |")
    md += ["", *(rec or [f"no recommendation printed (exit {rc})"]), "",
           "Per bucket (compile s / median step ms):", ""]
    for s in payload["results"]["schedules"]:
        cells = [f"{b['bucket']}: {b['compile_s']:.1f} / {b['step_ms']['median']:.2f}" for b in s["buckets"] if "skipped" not in b]
        md.append(f"- {s['label']}: " + ", ".join(cells))
    md += ["", *ceilings_md_plain(ceil)]
    return payload, md


# -- main -----------------------------------------------------------------------------------------------
PART_FNS = {"engine": part_engine, "serve": part_serve, "peer": part_peer, "startup": part_startup, "sweep": part_sweep}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=[*PARTS, "all"], help="'all' runs every part in turn (for --smoke)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, tiny workloads: checks the code paths")
    ap.add_argument("--out", default=None, help="output folder (default: ./gpu_suite_out)")
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="wall seconds the part may take (serve / peer / startup / sweep fit their counts to it)")
    args = ap.parse_args(argv)
    try:  # the serving client holds one connection per request in flight (1000 at rate inf)
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = 65536 if hard == resource.RLIM_INFINITY else hard
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, ValueError, OSError):
        pass
    out_dir = args.out or os.path.join(os.getcwd(), "gpu_suite_out")
    os.makedirs(out_dir, exist_ok=True)
    if args.smoke:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    tmp = tempfile.mkdtemp(prefix="gpu_suite_")
    parts = list(PARTS) if args.part == "all" else [args.part]
    if args.part == "all" and not args.smoke:
        print("warning: 'all' without --smoke takes far longer than one device call", file=sys.stderr)
    tables, status = [], 0
    try:
        st = settings(args.smoke, tmp)
        for part in parts:
            t0 = time.perf_counter()
            try:
                payload, md = PART_FNS[part](args, st, out_dir)
            except Exception:  # noqa: BLE001 - report, keep the other parts (with 'all') going
                import traceback
                traceback.print_exc()
                status = 1
                tables.append(f"## {part}: FAILED (see the traceback above)")
                continue
            paths = write_part(out_dir, part, args.smoke, payload, md)
            tables.append("\n".join(md) + f"\n\n({part}: {time.perf_counter() - t0:.0f} s; wrote {', '.join(paths)})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("\n\n" + "\n\n".join(tables), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
