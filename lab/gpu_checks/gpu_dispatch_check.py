"""Does a step's dispatch return before the device has finished, on one device and over a mesh?

The engine overlaps the host's work for step N+1 (scheduling, input building, the launch) with the
device's work for step N. That needs every jitted call to return as soon as its work is enqueued.
This check times, on 1 and on 2 devices:

1. two programs in a dependent chain, as the engine's step has them: a long one (`big`: matrix
   products, optionally with a collective), then a short one consuming its output (`small`, like
   the sampler), repeated; the host time of each call and the wait at the end;
2. the host price of one call by what it passes: N small parameter arrays, M donated cache
   arrays, K numpy inputs (each one host-to-device copy), on 1 and 2 devices;
3. the engine itself (the Llama-3-8B shape with `--layers` layers, dummy weights, batch-1
   decode): the host time of each forward and sampler call, the step time and the device wait;
   and the forward call split into placing its numpy inputs and the call on placed inputs; then
   greedy tokens of three prompts, compared with the first variant's (a flag must not change them).

Each XLA_FLAGS variant (VARIANTS) runs in its own process, which measures the ceilings on device
0 first. Tables are printed last; JSON goes to $OUT.

    python lab/gpu_checks/gpu_dispatch_check.py [--parts chain,args,engine] [--variants default,...]
                                                [--layers 8,32] [--tp 1,2] [--smoke]
    (--smoke: on the CPU with 2 simulated devices, default variant only)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

VARIANTS = {"default": "", "no_command_buffers": "--xla_gpu_enable_command_buffer=",
            "command_buffers_with_collectives": "--xla_gpu_enable_command_buffer=+COLLECTIVES",
            "command_buffers_with_collectives_exclusive_lock":
                "--xla_gpu_enable_command_buffer=+COLLECTIVES --xla_gpu_require_exclusive_lock=true",
            "nccl_all_reduce": "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false",
            "nccl_all_reduce_in_command_buffers":
                "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false --xla_gpu_enable_command_buffer=+COLLECTIVES"}


def chain(ns: int, collective: bool, smoke: bool, iters: int = 8) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.asarray(jax.devices()[:ns]), ("model",))
    rep = NamedSharding(mesh, P())
    n, reps = (256, 4) if smoke else (4096, 40)
    w = jax.device_put(jnp.full((n, n), 1e-3, jnp.bfloat16), NamedSharding(mesh, P(None, "model") if collective else P()))
    x = jax.device_put(jnp.ones((1024, n), jnp.bfloat16), rep)

    def big(x, w):
        for _ in range(reps):
            x = jnp.tanh(x @ w)  # with w split by columns: an all-gather per product
        return x
    big_c = jax.jit(big, out_shardings=rep, donate_argnums=(0,))
    small_c = jax.jit(lambda y, t: (y[:, :8].astype(jnp.float32).sum(1) + t.sum()), out_shardings=rep)
    x = big_c(x, w)
    jax.block_until_ready(small_c(x, np.zeros(8, np.int32)))
    t_big, t_small = [], []
    t_all = time.perf_counter()
    out = None
    for _ in range(iters):
        t0 = time.perf_counter()
        x = big_c(x, w)
        t1 = time.perf_counter()
        out = small_c(x, np.zeros(8, np.int32))
        t_big.append(t1 - t0)
        t_small.append(time.perf_counter() - t1)
    t_enq = time.perf_counter()
    jax.block_until_ready(out)
    t_end = time.perf_counter()
    return {"devices": ns, "collective": collective, "big_call_ms": float(np.median(t_big) * 1e3),
            "small_call_ms": float(np.median(t_small) * 1e3), "final_wait_ms": (t_end - t_enq) * 1e3,
            "per_iter_ms": (t_end - t_all) / iters * 1e3}


def args_cost(ns: int, n_params: int, n_cache: int, n_numpy: int, iters: int = 50) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.asarray(jax.devices()[:ns]), ("model",))
    rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("model"))
    params = tuple(jax.device_put(jnp.ones((256, 256), jnp.bfloat16), split) for _ in range(n_params))
    cache = [jax.device_put(jnp.ones((64, 256), jnp.bfloat16), split) for _ in range(n_cache)]
    host = tuple(np.zeros(64, np.int32) for _ in range(n_numpy))
    a = jax.ShapeDtypeStruct

    def f(params, cache, host):
        s = sum((h.sum() for h in host), jnp.int32(0))
        return [c + s.astype(c.dtype) for c in cache], params[0][0, :8] if params else s
    fc = jax.jit(f, donate_argnums=(1,)).lower(
        tuple(a(p.shape, p.dtype, sharding=split) for p in params),
        [a(c.shape, c.dtype, sharding=split) for c in cache],
        tuple(a(h.shape, h.dtype, sharding=rep) for h in host)).compile()
    cache, out = fc(params, cache, host)
    jax.block_until_ready(out)
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        cache, out = fc(params, cache, host)
        ts.append(time.perf_counter() - t0)
    jax.block_until_ready(out)
    return {"devices": ns, "params": n_params, "donated_cache": n_cache, "numpy_inputs": n_numpy,
            "call_us": float(np.median(ts) * 1e6)}


def engine(tp: int, smoke: bool, layers: int) -> dict:
    import jax
    import numpy as np
    from lab.gpu_checks.gpu_tp_check import dispatch_host_ms
    from jaxengine import LLM, SamplingParams
    from jaxengine.models.presets import PRESETS
    over = dict(num_hidden_layers=layers)
    if smoke:
        over.update(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4)
    PRESETS["dispatch-probe"] = dict(PRESETS["llama-3-8b"], **over)
    llm = LLM("dispatch-probe", tensor_parallel_size=tp, skip_tokenizer_init=True, load_format="dummy",
              dtype="bfloat16", max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=256, num_kv_blocks=512)
    eng = llm.llm_engine
    runner, calls = eng.runner, {"forward": [], "sampler": []}

    def timed(name, getter):
        def get(*a, **k):
            fn = getter(*a, **k)

            def call(*x):
                t0 = time.perf_counter()
                out = fn(*x)
                calls[name].append(time.perf_counter() - t0)
                return out
            return call
        return get
    runner._get_forward = timed("forward", runner._get_forward)
    placed = {"place": [], "call": []}

    def timed_placed(getter):
        def get(*a, **k):
            fn = getter(*a, **k)

            def call(params, kv, inputs, prev):
                t0 = time.perf_counter()
                inputs = jax.device_put(inputs, runner._rep)
                t1 = time.perf_counter()
                out = fn(params, kv, inputs, prev)
                placed["place"].append(t1 - t0)
                placed["call"].append(time.perf_counter() - t1)
                return out
            return call
        return get
    runner._get_sampler = timed("sampler", runner._get_sampler)
    dispatch_host_ms(eng, 20)
    for v in calls.values():
        v.clear()
    disp, step, wait = dispatch_host_ms(eng, 60)
    runner._get_forward = timed_placed(runner.__class__._get_forward.__get__(runner))
    dispatch_host_ms(eng, 60)
    runner._get_forward, runner._get_sampler = (getattr(runner.__class__, n).__get__(runner)
                                                for n in ("_get_forward", "_get_sampler"))
    greedy = llm.generate([{"prompt_token_ids": list(range(7 + i, 47 + 5 * i))} for i in range(3)],
                          SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    return {"greedy_tokens": [o.outputs[0].token_ids for o in greedy],"forward_place_inputs_ms": float(np.median(placed["place"][4:]) * 1e3),
            "forward_call_placed_ms": float(np.median(placed["call"][4:]) * 1e3),
            "param_leaves": len(runner.param_leaves), "kv_arrays": 2 * len(runner.kv_caches),
            "tp": tp, "layers": layers, "dispatch_host_ms": disp, "step_ms": step, "device_wait_ms": wait,
            "forward_call_ms": float(np.median(calls["forward"][4:]) * 1e3),
            "sampler_call_ms": float(np.median(calls["sampler"][4:]) * 1e3)}


def child(variant: str, smoke: bool, parts: set[str], layer_counts: tuple[int, ...], tps: tuple[int, ...]) -> dict:
    import jax
    from jaxengine.benchmarks.ceilings import measure
    res = {"variant": variant, "xla_flags": os.environ.get("XLA_FLAGS", ""), "jax": jax.__version__,
           "devices": [d.device_kind for d in jax.devices()],
           "ceilings_gpu0": measure(32 << 20, 256) if smoke else measure(), "chain": [], "args": [], "engine": []}
    for ns in (1, 2) if "chain" in parts else ():
        for coll in (False, True):
            if ns == 1 and coll:
                continue
            res["chain"].append(chain(ns, coll, smoke))
            print(variant, res["chain"][-1], flush=True)
    for ns in (1, 2) if "args" in parts else ():
        for n_params, n_cache, n_numpy in ((0, 0, 0), (300, 0, 0), (0, 64, 0), (0, 0, 16), (300, 64, 16)):
            res["args"].append(args_cost(ns, n_params, n_cache, n_numpy))
            print(variant, res["args"][-1], flush=True)
    for tp in tps if "engine" in parts else ():
        for layers in (2,) if smoke else layer_counts:
            res["engine"].append(engine(tp, smoke, layers))
            print(variant, res["engine"][-1], flush=True)
    return res


def main() -> None:
    smoke = "--smoke" in sys.argv
    parts = set(sys.argv[sys.argv.index("--parts") + 1].split(",")) if "--parts" in sys.argv else {"chain", "args", "engine"}
    layers = tuple(int(x) for x in sys.argv[sys.argv.index("--layers") + 1].split(",")) if "--layers" in sys.argv else (8, 32)
    tps = tuple(int(x) for x in sys.argv[sys.argv.index("--tp") + 1].split(",")) if "--tp" in sys.argv else (1, 2)
    variants = sys.argv[sys.argv.index("--variants") + 1].split(",") if "--variants" in sys.argv else list(VARIANTS)
    if "--child" in sys.argv:
        res = child(sys.argv[sys.argv.index("--child") + 1], smoke, parts, layers, tps)
        print("RESULT " + json.dumps(res), flush=True)
        return
    out_dir = os.environ.get("OUT", ".")
    results = []
    for name in variants:
        flags = VARIANTS[name]
        env = dict(os.environ)
        env["XLA_FLAGS"] = " ".join(f for f in (env.get("XLA_FLAGS", ""), flags) if f)
        if smoke:
            env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=2"
            env["JAX_PLATFORMS"] = "cpu"
        p = subprocess.run([sys.executable, __file__, "--child", name, "--parts", ",".join(parts), "--layers", ",".join(map(str, layers)),
                            "--tp", ",".join(map(str, tps))] + (["--smoke"] if smoke else []), env=env,
                           capture_output=True, text=True)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if p.returncode or not lines:
            print(p.stdout[-3000:], p.stderr[-3000:])
            raise SystemExit(f"variant {name} failed")
        results.append(json.loads(lines[-1][7:]))
        if smoke:
            break  # the flags are GPU flags
    with open(os.path.join(out_dir, f"dispatch_check_{'_'.join(sorted(parts))}.json"), "w") as f:
        json.dump(results, f, indent=2)
    for r in results:
        c = r["ceilings_gpu0"]
        print(f"{r['variant']}: {r['devices'][0]} x {len(r['devices'])}, jax {r['jax']}, ceilings on device 0: "
              f"copy {c['copy_bandwidth_GBps']:.0f} GB/s, bf16 matmul {c['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    first = {(e["tp"], e["layers"]): e["greedy_tokens"] for e in results[0]["engine"]}
    _table(["variant", "program chain", "devices", "big call ms", "small call ms", "final wait ms", "ms per iteration"],
           [[r["variant"], "with all-gather" if c["collective"] else "no collective", c["devices"],
             f"{c['big_call_ms']:.2f}", f"{c['small_call_ms']:.2f}", f"{c['final_wait_ms']:.2f}",
             f"{c['per_iter_ms']:.2f}"] for r in results for c in r["chain"]])
    _table(["variant", "devices", "parameter arrays", "donated cache arrays", "numpy inputs", "call us"],
           [[r["variant"], c["devices"], c["params"], c["donated_cache"], c["numpy_inputs"], f"{c['call_us']:.0f}"]
            for r in results for c in r["args"]])
    _table(["variant", "TP", "layers", "forward call ms", "of which placing inputs / call on placed", "sampler call ms",
            "dispatch ms", "step ms", "device wait ms", "greedy tokens == first variant's"],
           [[r["variant"], e["tp"], e["layers"], f"{e['forward_call_ms']:.2f}",
             f"{e['forward_place_inputs_ms']:.2f} / {e['forward_call_placed_ms']:.2f}", f"{e['sampler_call_ms']:.2f}",
             f"{e['dispatch_host_ms']:.2f}", f"{e['step_ms']:.2f}", f"{e['device_wait_ms']:.2f}",
             first.get((e["tp"], e["layers"])) == e["greedy_tokens"]] for r in results for e in r["engine"]])


def _table(header: list[str], rows: list[list]) -> None:
    if rows:
        print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(str(x) for x in row) + " |")


if __name__ == "__main__":
    main()
