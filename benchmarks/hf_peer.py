"""transformers (PyTorch) as a peer on the same device: batch-1 decode and batched `generate` throughput.

Run by `benchmarks/gpu_suite.py peer` in a process of its own (JAX never runs in it, so the two
frameworks never share the GPU's memory). The model is a random-init `LlamaForCausalLM` built
directly on the device in the target dtype (no float32 CPU copy). Results go to `--out` after
every section, so a run stopped by its time limit still leaves what it measured.

    python benchmarks/hf_peer.py --config-json cfg.json --device cuda --dtype bfloat16 --out peer.json \
        --workload 256:256:1000:256 --workload 1024:128:1000:128 --budget-s 480

A workload is IN:OUT:MAX_PROMPTS:BATCH: prompts of IN random tokens, exactly OUT new tokens each
(greedy, min_new_tokens = max_new_tokens), in batches of BATCH, as many batches as its time share
allows (the count run is recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback


def _now() -> float:
    return time.perf_counter()


class Peer:
    def __init__(self, args: argparse.Namespace):
        import torch

        self.args = args
        self.torch = torch
        self.device = torch.device(args.device)
        self.dtype = getattr(torch, args.dtype)
        self.t_start = _now()
        self.result: dict = {"benchmark": "hf_peer", "args": vars(args), "sections": {}, "errors": []}

    # -- bookkeeping --------------------------------------------------------------------------
    def left(self) -> float:
        return self.args.budget_s - (_now() - self.t_start)

    def save(self) -> None:
        self.result["elapsed_s"] = _now() - self.t_start
        tmp = self.args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.result, f, indent=2, default=str)
        os.replace(tmp, self.args.out)

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    # -- model --------------------------------------------------------------------------------
    def build(self) -> None:
        import transformers

        torch = self.torch
        with open(self.args.config_json) as f:
            cfg_dict = json.load(f)
        cfg_dict = {k: v for k, v in cfg_dict.items() if k not in ("architectures", "torch_dtype", "dtype")}
        config = transformers.LlamaConfig(**cfg_dict)
        config._attn_implementation = self.args.attn_implementation
        torch.manual_seed(self.args.seed)
        t0 = _now()
        # Parameters are created on the device in the target dtype (the default dtype is switched
        # while the modules are built): no float32 host copy of the weights is ever made.
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with self.device:
                model = transformers.LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(prev)
        model.eval()
        model.generation_config.pad_token_id = 0
        self.sync()
        build_s = _now() - t0
        n_params = sum(p.numel() for p in model.parameters())
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        with torch.no_grad():
            zeros = [n for n, p in model.named_parameters() if p.dim() >= 2 and float(p.abs().max()) == 0.0]
        self.model, self.config = model, config
        self.result["model"] = {"parameters": n_params, "weight_bytes": nbytes, "build_s": build_s,
                                "dtype": str(next(model.parameters()).dtype),
                                "device": str(next(model.parameters()).device),
                                "attn_implementation": self.args.attn_implementation,
                                "all_zero_matrices": zeros[:5],
                                "init": "random (transformers' own init, std 0.02), built on the device"}
        env = {"python": platform.python_version(), "torch": torch.__version__,
               "transformers": transformers.__version__}
        if self.device.type == "cuda":
            env["device_name"] = torch.cuda.get_device_name(self.device)
        self.result["environment"] = env
        self.save()

    def prompts(self, batch: int, length: int, seed: int):
        torch = self.torch
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(10, self.config.vocab_size, (batch, length), generator=g)
        return ids.to(self.device), torch.ones_like(ids).to(self.device)

    def generate(self, ids, mask, new_tokens: int, **extra):
        with self.torch.inference_mode():
            return self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                       min_new_tokens=new_tokens, do_sample=False, **extra)

    # -- sections -----------------------------------------------------------------------------
    def decode_b1(self, name: str, extra: dict, note: str) -> None:
        """Batch-1 decode ms/token: (time of N+1 new tokens - time of 1 new token) / N, best of repeats."""
        a = self.args
        ids, mask = self.prompts(1, a.decode_input_len, seed=1)
        sec: dict = {"mode": name, "note": note, "input_len": a.decode_input_len, "new_tokens": a.decode_tokens}
        self.result["sections"][f"decode_b1_{name}"] = sec
        try:
            t0 = _now()
            for _ in range(a.decode_warmup):  # compiles (if any) and warms the kernels
                self.generate(ids, mask, a.decode_tokens + 1, **extra)
            self.sync()
            sec["warmup_s"] = _now() - t0
            one, full = [], []
            for _ in range(a.decode_repeats):
                t0 = _now()
                out1 = self.generate(ids, mask, 1, **extra)
                self.sync()
                one.append(_now() - t0)
                t0 = _now()
                out = self.generate(ids, mask, a.decode_tokens + 1, **extra)
                self.sync()
                full.append(_now() - t0)
            assert out.shape[1] == a.decode_input_len + a.decode_tokens + 1, out.shape
            assert out1.shape[1] == a.decode_input_len + 1
            per_tok = [(f - o) / a.decode_tokens for f, o in zip(full, one)]
            best = min(per_tok)
            sec.update({"ms_per_token": best * 1e3, "ms_per_token_all": [p * 1e3 for p in per_tok],
                        "tok_per_s": 1.0 / best, "first_token_s": min(one), "ok": True})
        except Exception as e:  # noqa: BLE001 - a failed mode is recorded, the others still run
            sec.update({"ok": False, "error": f"{type(e).__name__}: {e}"})
            self.result["errors"].append(traceback.format_exc()[-2000:])
        self.save()

    def throughput(self, spec: str, budget_s: float) -> None:
        """Batches of `generate` until the prompts or the time share run out."""
        torch = self.torch
        il, ol, max_prompts, batch = (int(x) for x in spec.split(":"))
        sec: dict = {"input_len": il, "output_len": ol, "max_prompts": max_prompts, "batch_size": batch,
                     "time_share_s": budget_s, "padding": "left (prompts have equal lengths: no pad tokens)",
                     "decoding": "greedy, min_new_tokens = max_new_tokens", "cache": "transformers default (dynamic)"}
        self.result["sections"][f"throughput_{il}x{ol}"] = sec
        self.save()
        t_sec = _now()
        try:
            while True:
                try:  # warm-up batch: kernels, allocator; a too-large batch shows here, not in the timing
                    ids, mask = self.prompts(batch, il, seed=99)
                    self.generate(ids, mask, min(ol, 4))
                    self.sync()
                    break
                except torch.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    if batch == 1:
                        raise
                    batch //= 2
                    sec["batch_size"] = batch
                    sec["oom_halved"] = sec.get("oom_halved", 0) + 1
            done_prompts, elapsed, n_in, n_out, batches = 0, 0.0, 0, 0, []
            while done_prompts < max_prompts:
                b = min(batch, max_prompts - done_prompts)
                est = batches[-1] * b / batch if batches else 0.0
                if batches and (_now() - t_sec) + est > budget_s:
                    break
                ids, mask = self.prompts(b, il, seed=1000 + done_prompts)
                t0 = _now()
                out = self.generate(ids, mask, ol)
                self.sync()
                dt = _now() - t0
                assert out.shape == (b, il + ol), out.shape
                batches.append(dt)
                elapsed += dt
                done_prompts += b
                n_in += b * il
                n_out += b * ol
                sec.update({"num_prompts": done_prompts, "elapsed_s": elapsed, "batch_s": batches,
                            "total_input_tokens": n_in, "total_output_tokens": n_out,
                            "requests_per_s": done_prompts / elapsed, "total_tokens_per_s": (n_in + n_out) / elapsed,
                            "output_tokens_per_s": n_out / elapsed, "ok": True})
                self.save()
            if self.device.type == "cuda":
                sec["max_memory_allocated_GiB"] = torch.cuda.max_memory_allocated() / 2**30
        except Exception as e:  # noqa: BLE001
            sec.update({"ok": False, "error": f"{type(e).__name__}: {e}"})
            self.result["errors"].append(traceback.format_exc()[-2000:])
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.save()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-json", required=True, help="a Hugging Face config.json (dict) for LlamaForCausalLM")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--attn-implementation", default="sdpa")
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=480.0, help="wall-clock seconds for everything")
    ap.add_argument("--decode-input-len", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--decode-warmup", type=int, default=1)
    ap.add_argument("--decode-repeats", type=int, default=3)
    ap.add_argument("--workload", action="append", default=None, metavar="IN:OUT:MAX_PROMPTS:BATCH")
    ap.add_argument("--workload-share-s", type=float, nargs="+", default=None,
                    help="seconds per workload (default: equal shares of 60%% of the budget)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                    help="last: batch-1 decode with a static cache and torch.compile (time permitting)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    peer = Peer(args)
    peer.build()
    peer.decode_b1("eager", {}, "dynamic cache, no compile")
    workloads = args.workload or []
    shares = args.workload_share_s or [0.6 * peer.left() / max(len(workloads), 1)] * len(workloads)
    for spec, share in zip(workloads, shares):
        peer.throughput(spec, min(share, max(peer.left() - 10, 0)))
    if args.compile:
        if peer.left() < 60:
            peer.result["sections"]["decode_b1_static_compile"] = {"ok": False, "error": "skipped: no time left"}
        else:
            # transformers compiles the decoding forward itself when the cache is static
            # (generation_config.compile_config, CUDA graphs through mode "reduce-overhead").
            peer.decode_b1("static_compile", {"cache_implementation": "static"},
                           "static cache; transformers' automatic torch.compile of the decode step")
            sec = peer.result["sections"]["decode_b1_static_compile"]
            sec["compiled"] = getattr(peer.model, "_compiled_call", None) is not None
            cc = getattr(peer.model, "_last_compile_config", None)
            sec["compile_config"] = cc.to_dict() if cc is not None and hasattr(cc, "to_dict") else None
            if not sec["compiled"]:
                sec["note"] += " (transformers did not compile here: it compiles on cuda only)"
            peer.save()
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk in ("ms_per_token", "output_tokens_per_s",
                                                                   "num_prompts", "ok", "error", "batch_size")}
                      for k, v in peer.result["sections"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
