"""Start-up from a real 16 GB safetensors folder on one GPU: writes a random Llama-3-8B checkpoint
(bf16, Hugging Face names and layouts, 4 shards and an index, the synthetic tokenizer) to local
disk, then `jaxengine bench startup` on it: one cold start (empty cache directory) and two warm
ones (program bundle kept, the files in the page cache), each in a fresh process.

    python -m lab.gpu_checks.startup_safetensors_h100 --out $OUT --dir /tmp/llama3-8b-random
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import tempfile
import time

import numpy as np


def tensors(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Llama's checkpoint tensor names and shapes (HF layout: [out, in])."""
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    h = d // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * h
    out = [("model.embed_tokens.weight", (v, d))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (d,)), (p + "post_attention_layernorm.weight", (d,)),
                (p + "self_attn.q_proj.weight", (d, d)), (p + "self_attn.k_proj.weight", (kv, d)),
                (p + "self_attn.v_proj.weight", (kv, d)), (p + "self_attn.o_proj.weight", (d, d)),
                (p + "mlp.gate_proj.weight", (f, d)), (p + "mlp.up_proj.weight", (f, d)),
                (p + "mlp.down_proj.weight", (d, f))]
    out += [("model.norm.weight", (d,)), ("lm_head.weight", (v, d))]
    return out


def write_checkpoint(path: str, cfg: dict, shards: int = 4) -> int:
    """bf16 random weights (N(0, 0.02), norms 1), written in the safetensors format directly."""
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(0)
    pool = (rng.standard_normal(1 << 24, dtype=np.float32) * 0.02).view(np.uint32) >> 16  # bf16 bits
    pool = pool.astype(np.uint16)
    one = np.full(1, 0x3F80, np.uint16)  # bf16 1.0
    items = tensors(cfg)
    total = sum(int(np.prod(s)) * 2 for _, s in items)
    per_shard, groups, cur, size = total / shards, [], [], 0
    for name, shape in items:
        cur.append((name, shape))
        size += int(np.prod(shape)) * 2
        if size >= per_shard and len(groups) < shards - 1:
            groups.append(cur)
            cur, size = [], 0
    groups.append(cur)
    weight_map = {}
    for k, group in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        header, off = {}, 0
        for name, shape in group:
            n = int(np.prod(shape)) * 2
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
            weight_map[name] = fname
        hb = json.dumps(header).encode()
        hb += b" " * (-len(hb) % 8)
        with open(os.path.join(path, fname), "wb") as fh:
            fh.write(struct.pack("<Q", len(hb)))
            fh.write(hb)
            for name, shape in group:
                n = int(np.prod(shape))
                if len(shape) == 1:
                    fh.write(np.repeat(one, n).tobytes())
                    continue
                left = n
                while left:
                    m = min(left, pool.size)
                    fh.write(pool[:m].tobytes())
                    left -= m
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump({**cfg, "model_type": "llama"}, fh)
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--dir", default="/tmp/llama3-8b-random")
    ap.add_argument("--warm-runs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=240.0)
    ap.add_argument("--reuse", action="store_true", help="keep a checkpoint already in --dir (from an earlier run)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    from jaxengine.benchmarks.common import environment
    from jaxengine.benchmarks.gpu_suite import synthetic_tokenizer
    from jaxengine.benchmarks.startup import format_table, measure
    from jaxengine.models.presets import PRESETS

    cfg = dict(PRESETS["llama-3-8b"])
    t0 = time.perf_counter()
    if args.reuse and os.path.exists(os.path.join(args.dir, "model.safetensors.index.json")):
        size = sum(int(np.prod(shape)) * 2 for _, shape in tensors(cfg))
        write_s = None
        print(f"reusing the {size / 1e9:.2f} GB checkpoint in {args.dir}", flush=True)
    else:
        size = write_checkpoint(args.dir, cfg)
        tok = synthetic_tokenizer(tempfile.mkdtemp(prefix="tok-"), cfg["vocab_size"])
        for f in os.listdir(tok):
            shutil.copy(os.path.join(tok, f), args.dir)
        write_s = time.perf_counter() - t0
        print(f"wrote {size / 1e9:.2f} GB in {write_s:.1f} s to {args.dir}", flush=True)
    cache = tempfile.mkdtemp(prefix="jaxengine-startup-st-")
    try:
        res = measure(args.dir, {}, "Hello", 8, 1, args.warm_runs, cache, args.timeout)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    text = format_table(res)
    print(f"\n## {size / 1e9:.1f} GB safetensors folder; same tokens in every run: {res['same_tokens']}\n{text}",
          flush=True)
    out = {"environment": environment(), "checkpoint_bytes": size, "write_s": write_s, "results": res, "table": text}
    with open(os.path.join(args.out, "startup_safetensors_h100.json"), "w") as fh:
        json.dump(out, fh, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
