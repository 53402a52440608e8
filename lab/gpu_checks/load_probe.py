"""Where a safetensors load's time goes on one GPU: the random Llama-3-8B folder of
startup_safetensors_h100 (written unless --reuse finds it), then, one stage at a time over every
tensor the model takes: the reads alone (`get_tensor`, page cache warm), the layout transforms on
the host, the host-to-device copies of the tensors as stored, and the whole `load_params`.

    python -m lab.gpu_checks.load_probe --out $OUT --dir /tmp/ck [--reuse]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--dir", default="/tmp/llama3-8b-random")
    ap.add_argument("--reuse", action="store_true")
    ap.add_argument("--transform", action="store_true", help="also time the host transforms with a contiguous copy (slow)")
    ap.add_argument("--preset", default="llama-3-8b", help="a preset shape (smollm2-135m for a quick check)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    from lab.gpu_checks.startup_safetensors_h100 import write_checkpoint

    from jaxengine.models.presets import PRESETS

    cfg = dict(PRESETS[args.preset])
    if not (args.reuse and os.path.exists(os.path.join(args.dir, "model.safetensors.index.json"))):
        write_checkpoint(args.dir, cfg)
    if not os.path.exists(os.path.join(args.dir, "tokenizer.json")):  # the suite's synthetic tokenizer
        import shutil
        import tempfile

        from jaxengine.benchmarks.gpu_suite import synthetic_tokenizer

        tok = synthetic_tokenizer(tempfile.mkdtemp(prefix="tok-"), cfg["vocab_size"])
        for f in os.listdir(tok):
            shutil.copy(os.path.join(tok, f), args.dir)
    import jax
    import jax.numpy as jnp

    from jaxengine.models.checkpoint import open_checkpoint
    from jaxengine.models.config import ModelConfig
    from jaxengine.models.loader import load_params, param_paths
    from jaxengine.models.registry import get_family

    mc = ModelConfig.from_hf_dict(cfg)
    ckpt = open_checkpoint(args.dir)
    family = get_family(mc.architecture)
    names = [n for n in ckpt.tensor_names() if param_paths(n, family)]
    res: dict[str, object] = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "tensors": len(names)}

    def stage(label: str, fn) -> None:
        t0 = time.perf_counter()
        nbytes = fn()
        dt = time.perf_counter() - t0
        res[label] = {"s": dt, "GB": nbytes / 1e9, "GBps": nbytes / max(dt, 1e-9) / 1e9}
        print(f"{label:32s} {dt:7.2f} s  {nbytes / 1e9:6.2f} GB  {nbytes / max(dt, 1e-9) / 1e9:6.2f} GB/s", flush=True)

    def read_all() -> int:
        return sum(ckpt.get_tensor(n).nbytes for n in names)

    def transform_all() -> int:
        total = 0
        for n in names:
            raw = ckpt.get_tensor(n)
            for _, fn, _ in param_paths(n, family):
                total += np.ascontiguousarray(np.asarray(fn(raw, mc)).astype(jnp.bfloat16, copy=False)).nbytes
        return total

    def put_all() -> int:
        total = 0
        for n in names:
            raw = ckpt.get_tensor(n)
            jax.device_put(raw).block_until_ready()
            total += raw.nbytes
        return total

    def put_one_big() -> int:
        a = np.ones((1 << 30,), np.uint16)
        jax.device_put(a).block_until_ready()
        t0 = time.perf_counter()
        jax.device_put(a).block_until_ready()
        res["put_2GB_second_s"] = time.perf_counter() - t0
        return 2 * a.nbytes

    def load() -> int:
        _, state = load_params(ckpt, mc, jnp.bfloat16)
        jax.block_until_ready(state)
        return sum(x.nbytes for x in jax.tree.leaves(state))

    def put_read_ahead() -> int:  # one thread reads the next tensors while this one copies
        from concurrent.futures import ThreadPoolExecutor

        total = 0
        with ThreadPoolExecutor(1) as pool:
            futures = [pool.submit(ckpt.get_tensor, n) for n in names[:4]]
            for i in range(len(names)):
                if i + 4 < len(names):
                    futures.append(pool.submit(ckpt.get_tensor, names[i + 4]))
                raw = futures[i].result()
                futures[i] = None
                jax.device_put(raw).block_until_ready()
                total += raw.nbytes
        return total

    def load_beside_tokenizer() -> int:  # as the engine's weight phase runs
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as pool:
            def timed_tokenizer():
                t0 = time.perf_counter()
                ckpt.load_tokenizer()
                res["tokenizer_on_thread_s"] = time.perf_counter() - t0

            tok = pool.submit(timed_tokenizer)
            n = load()
            t0 = time.perf_counter()
            tok.result()
            res["tokenizer_wait_after_load_s"] = time.perf_counter() - t0
        return n

    stage("read (get_tensor)", read_all)
    stage("read again", read_all)
    if args.transform:
        stage("read + host transform", transform_all)
    stage("read + device_put as stored", put_all)
    stage("device_put 2 GB uint16 (x2)", put_one_big)
    stage("load_params + tokenizer thread", load_beside_tokenizer)  # first: the tokenizer is not loaded yet
    stage("load_params", load)
    stage("read-ahead thread + device_put", put_read_ahead)
    print(f"tokenizer: {res['tokenizer_on_thread_s']:.2f} s on its thread beside load_params, "
          f"{res['tokenizer_wait_after_load_s']:.2f} s waited for after it", flush=True)
    with open(os.path.join(args.out, "load_probe.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
