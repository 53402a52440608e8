"""Would a pre-converted checkpoint load faster than the safetensors folder? A random Llama-3-8B
safetensors folder (lab/gpu_checks/startup_safetensors_h100.py's writer) is loaded by the
engine's loader (`load_params`) and its device arrays saved with orbax-checkpoint (the model's own
layout, so a restore needs no transform); then, each in a fresh process and twice (page cache
warm), the engine's load from safetensors and an orbax restore straight onto the device are timed.

    python -m lab.gpu_checks.orbax_load_probe --out $OUT --dir /tmp/llama3-8b-random
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _flat(state) -> dict:
    import jax

    return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(state)[0]}


def prepare(folder: str, orbax_dir: str, preset: str) -> dict:
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    from jaxengine.models.checkpoint import open_checkpoint
    from jaxengine.models.config import ModelConfig
    from jaxengine.models.loader import load_params
    from jaxengine.models.presets import PRESETS
    from lab.gpu_checks.startup_safetensors_h100 import write_checkpoint

    cfg = dict(PRESETS[preset])
    t0 = time.perf_counter()
    if not os.path.exists(os.path.join(folder, "model.safetensors.index.json")):
        write_checkpoint(folder, cfg)
    write_s = time.perf_counter() - t0
    _, state = load_params(open_checkpoint(folder), ModelConfig.from_hf_dict(cfg), jnp.bfloat16)
    flat = _flat(state)
    jax.block_until_ready(flat)
    t0 = time.perf_counter()
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(orbax_dir, flat)
    ckptr.wait_until_finished()
    save_s = time.perf_counter() - t0
    return {"safetensors_write_s": write_s, "orbax_save_s": save_s, "bytes": sum(v.nbytes for v in flat.values()),
            "arrays": len(flat)}


def time_one(kind: str, folder: str, orbax_dir: str, preset: str) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxengine.models.checkpoint import open_checkpoint
    from jaxengine.models.config import ModelConfig
    from jaxengine.models.loader import abstract_model, load_params
    from jaxengine.models.presets import PRESETS

    mc = ModelConfig.from_hf_dict(dict(PRESETS[preset]))
    jax.devices()
    t0 = time.perf_counter()
    if kind == "safetensors":
        _, state = load_params(open_checkpoint(folder), mc, jnp.bfloat16)
        jax.block_until_ready(state)
        nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    else:
        import orbax.checkpoint as ocp
        from jax.sharding import SingleDeviceSharding

        sh = SingleDeviceSharding(jax.devices()[0])
        _, abstract = abstract_model(mc, jnp.bfloat16)
        target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh) for k, v in _flat(abstract).items()}
        restored = ocp.StandardCheckpointer().restore(orbax_dir, target)
        jax.block_until_ready(restored)
        nbytes = sum(x.nbytes for x in restored.values())
    dt = time.perf_counter() - t0
    return {"kind": kind, "seconds": dt, "bytes": nbytes, "GBps": nbytes / dt / 1e9}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--dir", default="/tmp/llama3-8b-random")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--preset", default="llama-3-8b", help="a preset shape (smollm2-135m for a quick check)")
    args = ap.parse_args()
    orbax_dir = args.dir.rstrip("/") + "-orbax"
    if args.one:
        print(json.dumps(time_one(args.one, args.dir, orbax_dir, args.preset)))
        return 0
    res = {"preset": args.preset, "prepare": prepare(args.dir, orbax_dir, args.preset), "runs": []}
    print(f"prepared: {res['prepare']}", flush=True)
    for _ in range(args.runs):
        for kind in ("safetensors", "orbax"):
            p = subprocess.run([sys.executable, "-m", "lab.gpu_checks.orbax_load_probe", "--dir", args.dir,
                                "--one", kind, "--preset", args.preset], capture_output=True, text=True, timeout=300)
            line = [x for x in p.stdout.splitlines() if x.startswith("{")]
            r = json.loads(line[-1]) if line else {"kind": kind, "error": p.stderr[-2000:]}
            res["runs"].append(r)
            print(r if "error" in r else f"{kind}: {r['seconds']:.2f} s, {r['GBps']:.2f} GB/s", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "orbax_load_probe.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
