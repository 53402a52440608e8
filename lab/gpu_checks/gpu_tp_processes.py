"""Tensor parallelism with one process per GPU, against one process driving every GPU.

At TP=2 in one process the batch-1 decode step is host-bound: the launch of the forward program
over two devices costs the host about 2.5x its single-device launch (lab/results/
dispatch_h200x2.md). This runs the same engine as a two-process job on one host (the multi-host
flags: `jax.distributed`, one GPU per process through CUDA_VISIBLE_DEVICES, every process taking
the same deterministic steps), so that each process launches a single-device program, and times:
batch-1 decode ms/token, the engine's host / device-wait split per step, and offline throughput
(256 prompts x (256 in, 128 out)). Llama-3-8B shape, dummy weights, bf16; the settings of
gpu_tp_check.py. Rank 0 measures the ceilings on its GPU and writes JSON to $OUT.

    python lab/gpu_checks/gpu_tp_processes.py [--smoke]   # --smoke: two CPU processes, a tiny model
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def worker(rank: int, coordinator: str, smoke: bool) -> None:
    from jaxengine import distributed
    distributed.initialize(distributed.MultiHostConfig(2, rank, coordinator))
    import jax

    from jaxengine.benchmarks.ceilings import measure
    from lab.gpu_checks.gpu_tp_check import engine_figures, engine_settings
    from jaxengine import LLM
    model, kw, n_batch = engine_settings(smoke)
    if smoke:
        kw["compilation_cache_dir"] = None  # two processes on one small machine: no shared cache
    res = {"jax": jax.__version__, "processes": jax.process_count(), "devices": jax.device_count(),
           "device_kind": jax.local_devices()[0].device_kind}
    if rank == 0:
        res["ceilings_rank0"] = measure(32 << 20, 256) if smoke else measure()
    t0 = time.perf_counter()
    llm = LLM(model, tensor_parallel_size=2, skip_tokenizer_init=True, load_format="dummy", dtype="bfloat16", **kw)
    res["startup_s"] = time.perf_counter() - t0
    res.update(engine_figures(llm, n_batch))
    if rank == 0:
        print("RESULT " + json.dumps(res), flush=True)


def main() -> None:
    smoke = "--smoke" in sys.argv
    if "--worker" in sys.argv:
        i = sys.argv.index("--worker")
        worker(int(sys.argv[i + 1]), sys.argv[i + 2], smoke)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        coord = f"127.0.0.1:{s.getsockname()[1]}"
    procs = []
    for rank in (0, 1):
        env = dict(os.environ)
        if smoke:
            env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
        else:
            env["CUDA_VISIBLE_DEVICES"] = str(rank)
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", str(rank), coord] + (["--smoke"] if smoke else []),
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (out, err) in zip(procs, outs):
        if p.returncode:
            print(out[-3000:], err[-5000:])
            raise SystemExit(f"a worker failed ({p.returncode})")
    res = json.loads([ln for ln in outs[0][0].splitlines() if ln.startswith("RESULT ")][-1][7:])
    with open(os.path.join(os.environ.get("OUT", "."), "tp_processes.json"), "w") as f:
        json.dump(res, f, indent=2)
    c = res["ceilings_rank0"]
    print(f"\nTP=2 as two processes x one {res['device_kind']} (jax {res['jax']}); ceilings on rank 0's GPU: "
          f"copy {c['copy_bandwidth_GBps']:.0f} GB/s, bf16 matmul {c['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    print("| figure | value |\n|---|---|")
    for key in ("decode_b1_ms", "decode_b1_tok_s", "b1_dispatch_host_ms", "b1_step_ms", "b1_device_wait_ms",
                "throughput_256x256_128_out_tok_s", "throughput_host_ms_per_step", "startup_s"):
        print(f"| {key} | {res[key]:.2f} |")


if __name__ == "__main__":
    main()
