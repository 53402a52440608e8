"""Checks and times the ragged paged-attention kernel on one GPU, in one run.

Order: device facts -> ceilings measured in this run (device copy bandwidth, bf16 matmul rate)
-> correctness (random mixed batches against the jnp reference and a float64 dense reference)
-> a small tiling sweep -> decode grid (Llama-3-8B heads: 32 q / 8 kv, head dim 128, bf16,
block 16) against the JAX-bundled Pallas `paged_attention` and the XLA reference -> prefill and
mixed shapes against the XLA reference. Full results go to <out>/kernels_bench.json; a short
table is printed last.

Timing: kernel time from CUPTI (`jax.experimental.mosaic.gpu.profiler.measure`), i.e. the sum of
every kernel one call launches, median over iterations. Each timed function chains R calls
(the q of call i+1 is the output of call i) over disjoint block sets where memory allows, so
small shapes are not served from L2; per-call time = chain time / R. The wall time of the same
chain (launch gaps and 1/R of one dispatch included) is recorded beside it.

Usage (device machine, repo root): python lab/kernels/bench_paged_attention.py --out $OUT
`--smoke` runs tiny shapes through the interpreter on the CPU to check the script itself.
The product kernel is called through the lab wrapper
(lab/kernels/ragged_paged_attention_mgpu_decode.py), which adds the `decode=` choice of the
Mosaic decode kernel (--mosaic-decode); with decode="triton" it is the product call itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
import types

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bootstrap_imports() -> None:
    """Maps the repo folders to jaxengine.* when the package is not installed (device machine)."""
    try:
        import jaxengine.pallas_kernels  # noqa: F401
        return
    except ImportError:
        pass
    for name, folder in (("jaxengine", "jaxengine"), ("jaxengine.pallas_kernels", "pallas_kernels")):
        mod = types.ModuleType(name)
        mod.__path__ = [os.path.join(ROOT, folder)]
        sys.modules[name] = mod
    sys.modules["jaxengine"].pallas_kernels = sys.modules["jaxengine.pallas_kernels"]


_bootstrap_imports()
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxengine.pallas_kernels.ragged_paged_attention import (  # noqa: E402
    ragged_paged_attention_reference,
)
from jaxengine.pallas_kernels.ragged_paged_attention_gpu import MosaicTiling  # noqa: E402
from lab.kernels.mosaic_phases import phases  # noqa: E402
from lab.kernels.ragged_paged_attention_mgpu_decode import (  # noqa: E402
    Tiling,
    ragged_paged_attention_gpu,
)
from tests.kernels.batch_factory import dense_reference, make_batch  # noqa: E402

N_HEADS, N_KV, HEAD_DIM, BLOCK = 32, 8, 128, 16
SM_SCALE = HEAD_DIM ** -0.5
L2_ROTATION_BYTES = 256 << 20  # aim for this much distinct KV per timed chain


def _cta_mode(name: str) -> dict:
    """MosaicTiling fields for a --mosaic-ctas name: sm (persistent, one CTA per streaming
    multiprocessor: the default) or all (one CTA per work item)."""
    if name not in ("sm", "all"):
        raise ValueError(f"--mosaic-ctas takes sm or all, got {name!r}")
    return {"persistent": name == "sm",
            "sm_count": getattr(jax.devices()[0], "core_count", None) or 132}


def log(*a) -> None:
    print(*a, flush=True)


class Timer:
    """CUPTI kernel time when available, wall time of the same function always."""

    def __init__(self, iters: int, use_cupti: bool):
        self.iters = iters
        self.cupti_error: str | None = None
        self.profiler = None
        if use_cupti:
            try:
                from jax.experimental.mosaic.gpu import profiler
                self.profiler = profiler
            except Exception as e:  # noqa: BLE001
                self.cupti_error = repr(e)

    def __call__(self, f, args, iters: int | None = None) -> dict:
        iters = iters or self.iters
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        first_s = time.perf_counter() - t0
        walls = []
        for _ in range(iters):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            walls.append((time.perf_counter() - t0) * 1e3)
        kernel_ms = None
        if self.profiler is not None:
            try:
                _, ts = self.profiler.measure(f, iterations=iters)(*args)
                if ts is not None:
                    kernel_ms = statistics.median(ts) if isinstance(ts, list) else float(ts)
            except Exception as e:  # noqa: BLE001
                self.cupti_error = repr(e)
                self.profiler = None
        return {"kernel_ms": kernel_ms, "wall_ms": statistics.median(walls),
                "first_call_s": first_s}


def kernel_breakdown(timer: Timer, f, args, reps: int) -> dict | None:
    """Per-kernel CUPTI time of one call (chain / reps), summed by kernel name, in us."""
    if timer.profiler is None:
        return None
    try:
        _, ts = timer.profiler.measure(f, aggregate=False)(*args)
    except Exception as e:  # noqa: BLE001
        return {"error": repr(e)}
    out: dict = {}
    for name, ms in ts or []:
        out[name[:80]] = out.get(name[:80], 0.0) + ms * 1e3 / reps
    return out


def _ms(t: dict) -> float:
    return t["kernel_ms"] if t["kernel_ms"] is not None else t["wall_ms"]


def device_facts() -> dict:
    facts = {"jax": jax.__version__, "backend": jax.default_backend(),
             "device_kind": jax.devices()[0].device_kind}
    try:
        import jaxlib
        facts["jaxlib"] = jaxlib.__version__
    except Exception:  # noqa: BLE001
        pass
    try:
        q = ("name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,"
             "power.draw,temperature.gpu")
        r = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        facts["nvidia_smi"] = r.stdout.strip() or r.stderr.strip()
        facts["nvidia_smi_fields"] = q
    except Exception as e:  # noqa: BLE001
        facts["nvidia_smi"] = repr(e)
    return facts


def ceilings(timer: Timer, smoke: bool) -> dict:
    key = jax.random.PRNGKey(0)
    n = (1 << 14) if smoke else (1 << 29)  # 2 GiB of f32
    x = jax.random.normal(key, (n,), jnp.float32)
    t = timer(jax.jit(lambda x: x * 1.0001), (x,), 10)
    copy_bps = 2 * n * 4 / (_ms(t) * 1e-3)
    # Read-only: the same bytes summed in rows of 8192 (a 1/8192 output), the rate a kernel
    # that only reads (as attention over a KV cache) can reach through XLA's reduction.
    t_read = timer(jax.jit(lambda x: x.reshape(-1, 8192).sum(axis=1)), (x,), 10)
    read_bps = n * 4 / (_ms(t_read) * 1e-3)
    del x
    d = 256 if smoke else 8192
    a = jax.random.normal(key, (d, d), jnp.bfloat16)
    b = jax.random.normal(jax.random.PRNGKey(1), (d, d), jnp.bfloat16)
    t2 = timer(jax.jit(lambda a, b: a @ b), (a, b), 10)
    flops = 2 * d ** 3 / (_ms(t2) * 1e-3)
    return {"copy_bytes_per_s": copy_bps, "copy_timing": t, "copy_bytes": 2 * n * 4,
            "read_bytes_per_s": read_bps, "read_timing": t_read, "read_bytes": n * 4,
            "matmul_flops_per_s": flops, "matmul_timing": t2, "matmul_dim": d}


def probe_start(iters: int, **params) -> tuple[Timer, dict]:
    """A probe run's CUPTI timer (`iters` timed iterations) and its result dict: the device
    facts and the ceilings measured first (logged), `iters`, then `params`."""
    timer = Timer(iters, use_cupti=True)
    res = {"facts": device_facts(), "ceilings": ceilings(timer, False), "iters": iters, **params}
    log("ceilings", res["ceilings"]["copy_bytes_per_s"] / 1e12, "TB/s copy,",
        res["ceilings"]["read_bytes_per_s"] / 1e12, "TB/s read,",
        res["ceilings"]["matmul_flops_per_s"] / 1e12, "TFLOP/s")
    return timer, res


def rel_err(a, b) -> float:
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


@functools.lru_cache(maxsize=None)
def _jit_reference(sm_scale, soft_cap, sliding_window):
    return jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=sm_scale,
                                     soft_cap=soft_cap, sliding_window=sliding_window))


def correctness(interpret: bool, smoke: bool, prefill: str = "triton",
                decode: str = "triton", prefill_only: bool = False,
                tiling: Tiling | None = None) -> list[dict]:
    """Every case against the XLA reference and a float64 dense one, padding rows zero. With
    prefill_only (no decode kernel: decode rows are not computed) the decode rows are left
    out of the comparison."""
    rng = np.random.default_rng(1234)
    cases = [
        dict(name="mixed bf16 G4 H128 P16", q_lens=[1, 1, 1, 1, 1, 37, 300, 17],
             ctx_lens=[0, 15, 16, 17, 3000, 0, 500, 1234], n=32, k=8, h=128, p=16,
             dtype=jnp.bfloat16, pad_slots=3, pad_tokens=11),
        dict(name="mixed f32 G8 H64 P32 window+cap", q_lens=[1, 1, 64, 5],
             ctx_lens=[700, 31, 100, 0], n=16, k=2, h=64, p=32, dtype=jnp.float32,
             soft_cap=30.0, sliding_window=128, pad_slots=1, pad_tokens=3),
        dict(name="G3 bf16 H64 P64", q_lens=[1, 1, 129], ctx_lens=[64, 1000, 65], n=9, k=3,
             h=64, p=64, dtype=jnp.bfloat16),
        dict(name="decode x64 ragged bf16", q_lens=[1] * 64,
             ctx_lens=list(rng.integers(0, 3000, 64)), n=32, k=8, h=128, p=16,
             dtype=jnp.bfloat16, pad_slots=64),
        dict(name="prefill 1000@3000 + 20 decodes", q_lens=[1] * 20 + [1000],
             ctx_lens=list(rng.integers(1, 2000, 20)) + [3000], n=32, k=8, h=128, p=16,
             dtype=jnp.bfloat16, pad_tokens=4),
        # Shapes the Mosaic prefill kernel takes (token rows a multiple of 8).
        dict(name="7 ragged chunks G4 H128 P16", q_lens=[1, 1, 37, 300, 17, 64, 2],
             ctx_lens=[15, 3000, 0, 500, 1234, 63, 1], n=32, k=8, h=128, p=16,
             dtype=jnp.bfloat16, pad_slots=2, pad_tokens=2),
        dict(name="chunks G8 H64 P32", q_lens=[1, 129, 8, 250], ctx_lens=[40, 0, 31, 777],
             n=16, k=2, h=64, p=32, dtype=jnp.bfloat16, pad_tokens=4),
        dict(name="chunks G1 H128 P64", q_lens=[3, 200, 1, 100], ctx_lens=[0, 64, 10, 129],
             n=4, k=4, h=128, p=64, dtype=jnp.bfloat16),
        # 144 token rows: 40 (tile, KV head) items, so the Mosaic kernel cuts each tile's
        # keys in 3 (KV splits, a cluster of 3 CTAs) and merges.
        dict(name="long-context chunks G4 H128 P16, 144 rows", q_lens=[1, 96, 40],
             ctx_lens=[4000, 3000, 0], n=32, k=8, h=128, p=16, dtype=jnp.bfloat16,
             pad_tokens=7),
        # 256 token rows: 64 items, 2 KV splits.
        dict(name="chunks G4 H128 P16, 256 rows", q_lens=[1, 200, 48],
             ctx_lens=[100, 1500, 0], n=32, k=8, h=128, p=16, dtype=jnp.bfloat16,
             pad_slots=1, pad_tokens=7),
        # 300 slots (more than FUSED_TABLE_MAX_SLOTS): the Mosaic tile table gets a launch of
        # its own, 8 tiles per table program.
        dict(name="300 slots: 150 decodes + 120 chunks G4 H128 P16", q_lens=[1] * 150 + [3] * 120,
             ctx_lens=list(rng.integers(0, 600, 270)), n=32, k=8, h=128, p=16,
             dtype=jnp.bfloat16, pad_slots=30, pad_tokens=2),
        # Block tables of a multiple of 32 ids: the Mosaic decode kernel fetches each row's
        # whole table (2 copies of 256 ids at M 512; 1 at M 64) beside its metadata.
        dict(name="4 decodes, M 512 tables G4 H128 P16", q_lens=[1, 1, 1, 1],
             ctx_lens=[8100, 0, 130, 2000], n=32, k=8, h=128, p=16, dtype=jnp.bfloat16,
             pad_tokens=3, max_blocks=512),
        dict(name="2 decodes + chunk, M 64 tables G4 H128 P16", q_lens=[1, 1, 24],
             ctx_lens=[1000, 5, 10], n=32, k=8, h=128, p=16, dtype=jnp.bfloat16,
             pad_tokens=6, max_blocks=64),
        # Keys that grow along the sequence, so that the running max rises at every step and
        # every step rescales what came before: by ~100 (base 2) per 128 keys (8 rows: the
        # Mosaic decode kernel's one split) and by a few units (4 rows: 2 splits).
        dict(name="8 decodes, fast-growing keys G4 H128 P16", q_lens=[1] * 8,
             ctx_lens=[300, 2000, 4000, 129, 1, 17, 1000, 2500], n=32, k=8, h=128, p=16,
             dtype=jnp.bfloat16, pad_tokens=2, key_growth=0.25),
        dict(name="4 decodes, slow-growing keys G4 H128 P16", q_lens=[1] * 4,
             ctx_lens=[1000, 3000, 64, 2500], n=32, k=8, h=128, p=16, dtype=jnp.bfloat16,
             pad_slots=1, key_growth=0.02),
    ]
    if smoke:
        cases = [dict(c, q_lens=[min(x, 9) for x in c["q_lens"]][:6],
                      ctx_lens=[min(int(x), 40) for x in c["ctx_lens"]][:6]) for c in cases[:3]]
    results = []
    for c in cases:
        row = {"name": c["name"], "prefill": prefill, "decode": decode,
               "prefill_only": prefill_only,
               "decode_transposed": bool(tiling and tiling.mosaic_decode.transposed)}
        if prefill_only and max(c["q_lens"]) == 1:
            continue  # no prefill row to compare
        try:
            b = make_batch(rng, q_lens=c["q_lens"], ctx_lens=[int(x) for x in c["ctx_lens"]],
                           num_heads=c["n"], num_kv_heads=c["k"], head_dim=c["h"],
                           block_size=c["p"], dtype=c["dtype"], pad_slots=c.get("pad_slots", 0),
                           pad_tokens=c.get("pad_tokens", 0), max_blocks=c.get("max_blocks"),
                           key_growth=c.get("key_growth", 0.0))
            kw = dict(sm_scale=c["h"] ** -0.5, soft_cap=c.get("soft_cap"),
                      sliding_window=c.get("sliding_window"))
            out = ragged_paged_attention_gpu(*b.args(), **kw, interpret=interpret,
                                             prefill=prefill, decode=decode,
                                             prefill_only=prefill_only, tiling=tiling)
            ref = _jit_reference(**kw)(*b.args())
            dense = dense_reference(b, **kw)
            live_end = int(np.asarray(b.query_start_loc)[int(b.num_seqs[0])])
            o = np.asarray(out.astype(jnp.float32))
            if prefill_only:  # decode rows are not computed: compare the others
                keep = np.ones(o.shape[0], bool)
                keep[:live_end] = np.repeat(np.asarray(c["q_lens"]) > 1, c["q_lens"])
                o, dense = np.where(keep[:, None, None], o, 0), np.where(
                    keep[:, None, None], dense, 0)
                out = jnp.where(jnp.asarray(keep)[:, None, None], out, 0)
                ref = jnp.where(jnp.asarray(keep)[:, None, None], ref, 0)
            tol = 1e-4 if c["dtype"] == jnp.float32 else 2e-2
            row.update(rel_err_vs_reference=rel_err(out, ref),
                       rel_err_vs_dense_f64=float(np.linalg.norm(o - dense)
                                                  / np.linalg.norm(dense)),
                       nan_rows=int(np.isnan(o).any(axis=(1, 2)).sum()),
                       padding_rows_zero=bool((o[live_end:] == 0).all()), tol=tol)
            row["ok"] = (row["rel_err_vs_dense_f64"] < tol and row["nan_rows"] == 0
                         and row["padding_rows_zero"])
        except Exception as e:  # noqa: BLE001
            row.update(ok=False, error=repr(e), trace=traceback.format_exc()[-2000:])
        log("correctness", json.dumps(row)[:400])
        results.append(row)
    return results


@dataclasses.dataclass
class Pool:
    """One layer's K/V pool shared by every timed shape; block 0 is the null block."""

    k: jax.Array  # [NB, K, P, H]
    v: jax.Array
    k_t: jax.Array | None = None  # [K, NB, P, H] for the bundled kernel
    v_t: jax.Array | None = None

    @property
    def num_blocks(self) -> int:
        return self.k.shape[0]


def make_pool(num_blocks: int, with_transposed: bool) -> Pool:
    shape = (num_blocks, N_KV, BLOCK, HEAD_DIM)
    k = jax.random.normal(jax.random.PRNGKey(2), shape, jnp.bfloat16)
    v = jax.random.normal(jax.random.PRNGKey(3), shape, jnp.bfloat16)
    pool = Pool(k, v)
    if with_transposed:
        pool.k_t = jnp.transpose(k, (1, 0, 2, 3))
        pool.v_t = jnp.transpose(v, (1, 0, 2, 3))
    return pool


def kv_bytes(kv_lens) -> int:
    return int(sum(kv_lens)) * N_KV * HEAD_DIM * 2 * 2


def attn_flops(q_lens, ctx_lens) -> int:
    """QK^T and PV, causal within the chunk: 4 * N * H * sum of attended keys."""
    keys = sum(q * c + q * (q + 1) // 2 for q, c in zip(q_lens, ctx_lens))
    return 4 * N_HEADS * HEAD_DIM * keys


def build_step(rng, pool: Pool, q_lens, ctx_lens, *, slots: int | None = None,
               tokens: int | None = None, n_sets: int = 1):
    """Inputs of one step: q, kv_lens, n_sets disjoint block tables, qsl, num_seqs."""
    live = len(q_lens)
    slots = slots or live
    tokens = tokens or sum(q_lens)
    kv = [q + c for q, c in zip(q_lens, ctx_lens)]
    need = [-(-x // BLOCK) for x in kv]
    m = max(need)
    per_set = sum(need)
    ids = rng.permutation(np.arange(1, pool.num_blocks, dtype=np.int32))
    if n_sets * per_set > len(ids):
        n_sets = max(1, len(ids) // per_set)
    tables = []
    for j in range(n_sets):
        t = np.zeros((slots, m), np.int32)
        chunk = ids[j * per_set:(j + 1) * per_set]
        o = 0
        for i, nb in enumerate(need):
            t[i, :nb] = chunk[o:o + nb]
            o += nb
        tables.append(jnp.asarray(t))
    qsl = np.zeros(slots + 1, np.int32)
    qsl[1:live + 1] = np.cumsum(q_lens)
    qsl[live + 1:] = qsl[live]
    kv_lens = np.zeros(slots, np.int32)
    kv_lens[:live] = kv
    q = jax.random.normal(jax.random.PRNGKey(int(rng.integers(1 << 30))),
                          (tokens, N_HEADS, HEAD_DIM), jnp.bfloat16)
    return dict(q=q, kv_lens=jnp.asarray(kv_lens), tables=tuple(tables), qsl=jnp.asarray(qsl),
                num_seqs=jnp.asarray([live], jnp.int32), n_sets=n_sets)


def chain_args(step: dict, pool: Pool) -> tuple:
    """The arguments of a chain of calls (`chain_ours`, `chain_reference`) over a step's
    tables: q, the K/V pool, the lengths, the tables, query_start_loc and num_seqs."""
    return (step["q"], pool.k, pool.v, step["kv_lens"], step["tables"], step["qsl"],
            step["num_seqs"])


@functools.cache
def _l2_evictor():
    buf = jnp.ones((L2_ROTATION_BYTES // 4,), jnp.float32)  # 256 MiB, 5x the H100's L2
    return buf, jax.jit(lambda x: x * 1.0001)


def _evict_l2() -> jax.Array:
    """Streams 256 MiB through the GPU (read and written), leaving no earlier data in L2."""
    buf, touch = _l2_evictor()
    return touch(buf)


def chain_ours(reps: int, tiling: Tiling, interpret: bool, prefill: str = "triton",
               decode: str = "triton", decode_only: bool = False, prefill_only: bool = False):
    @jax.jit
    def f(q, kc, vc, kvl, tables, qsl, ns):
        for i in range(reps):
            q = ragged_paged_attention_gpu(q, kc, vc, kvl, tables[i % len(tables)], qsl, ns,
                                           sm_scale=SM_SCALE, tiling=tiling, interpret=interpret,
                                           prefill=prefill, decode=decode,
                                           decode_only=decode_only, prefill_only=prefill_only)
        return q
    return f


def chain_reference(reps: int):
    @jax.jit
    def f(q, kc, vc, kvl, tables, qsl, ns):
        for i in range(reps):
            q = ragged_paged_attention_reference(q, kc, vc, kvl, tables[i % len(tables)], qsl, ns,
                                                 sm_scale=SM_SCALE)
        return q
    return f


def chain_bundled(reps: int, interpret: bool):
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    @jax.jit
    def f(q, kt, vt, lengths, tables):
        for i in range(reps):
            # The bundled kernel takes pre-scaled queries; the scale (an extra elementwise op)
            # is left out of the timed chain, it does not change the work.
            q = paged_attention(q, kt, vt, tables[i % len(tables)], lengths,
                                interpret=interpret)
        return q
    return f


class Runner:
    def __init__(self, args, timer: Timer, ceil: dict, t_start: float):
        self.args = args
        self.timer = timer
        self.ceil = ceil
        self.t_start = t_start
        self.interpret = args.smoke

    def over_budget(self) -> bool:
        return time.time() - self.t_start > self.args.budget_s

    def ours(self, step, pool, reps, tiling, prefill: str = "triton",
             decode: str = "triton", decode_only: bool = False,
             prefill_only: bool = False) -> dict:
        f = chain_ours(reps, tiling, self.interpret, prefill, decode, decode_only, prefill_only)
        t = self.timer(f, chain_args(step, pool))
        return {k: (v / reps if k in ("kernel_ms", "wall_ms") and v is not None else v)
                for k, v in t.items()}

    def profile(self, name: str, step, pool, tiling: Tiling, **kw) -> dict:
        """One call with Mosaic GPU's in-kernel profiler on (--mosaic-profile DIR): its traces go
        to DIR/name, and the phases of each (mosaic_phases.phases) come back, keyed by file."""
        out = os.path.join(self.args.mosaic_profile, name)
        os.makedirs(out, exist_ok=True)
        tiling = dataclasses.replace(
            tiling, mosaic=dataclasses.replace(tiling.mosaic, profile_dir=out),
            mosaic_decode=dataclasses.replace(tiling.mosaic_decode, profile_dir=out))
        args = chain_args(step, pool)
        f = chain_ours(1, tiling, self.interpret, **kw).lower(*args).compile()
        if self.args.mosaic_profile_cold:
            # The timed chains rotate their K/V through HBM; a lone call right after them
            # would read what is left in L2. Evict it first, so the phases are an HBM-bound
            # call's.
            jax.block_until_ready(_evict_l2())
        jax.block_until_ready(f(*args))
        jax.effects_barrier()  # the traces are written by a host callback
        res = {}
        for path in sorted(glob.glob(os.path.join(out, "*trace.json"))):
            with open(path) as fh:
                trace = json.load(fh)
            # Prefill kernel: 2 compute warpgroups + 1 memory; decode kernel: 1 + 1.
            tids = {e["tid"] for e in trace["traceEvents"]}
            wgs, roles = ((3, ["compute", "compute", "memory"]) if any(
                e["name"] == "first_k_wait" for e in trace["traceEvents"])
                else (2, ["compute", "memory"]))
            res[os.path.basename(path)] = dict(phases(trace, wgs, roles), traces=len(tids))
        return res

    def reference(self, step, pool, reps) -> dict:
        f = chain_reference(reps)
        t = self.timer(f, chain_args(step, pool), iters=3)
        return {k: (v / reps if k in ("kernel_ms", "wall_ms") and v is not None else v)
                for k, v in t.items()}

    def bundled(self, step, pool, reps) -> dict:
        f = chain_bundled(reps, self.interpret)
        t = self.timer(f, (step["q"], pool.k_t, pool.v_t, step["kv_lens"], step["tables"]))
        return {k: (v / reps if k in ("kernel_ms", "wall_ms") and v is not None else v)
                for k, v in t.items()}

    def check(self, step, pool, tiling, with_bundled: bool, prefill: str = "triton",
              decode: str = "triton", decode_only: bool = False,
              prefill_only: bool = False) -> dict:
        args = (step["q"], pool.k, pool.v, step["kv_lens"], step["tables"][0], step["qsl"],
                step["num_seqs"])
        out = ragged_paged_attention_gpu(*args, sm_scale=SM_SCALE, tiling=tiling,
                                         interpret=self.interpret, prefill=prefill,
                                         decode=decode, decode_only=decode_only,
                                         prefill_only=prefill_only)
        ref = _jit_reference(SM_SCALE, None, None)(*args)
        res = {"rel_err_vs_reference": rel_err(out, ref),
               "nan": bool(jnp.isnan(out.astype(jnp.float32)).any())}
        if with_bundled:
            from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
            bo = paged_attention(step["q"] * SM_SCALE, pool.k_t, pool.v_t, step["tables"][0],
                                 step["kv_lens"], interpret=self.interpret)
            res["bundled_rel_err_vs_reference"] = rel_err(bo, ref)
        return res


def decode_variant(tiling: Tiling, name: str) -> tuple[Tiling, dict]:
    """A decode path to time, by name: triton | triton-only | mosaic:BKVxSTAGES[xSPLITS][:t|:r]
    | mosaic-only:... ("-only": decode_only=True, no prefill kernel launched; ":t" / ":r":
    DecodeTiling.transposed True / False, the heads as wgmma columns / rows; neither: the
    default choice), e.g. mosaic-only:64x4, mosaic:128x2x8 or mosaic-only:128x2:t. Returns
    the tiling and the call's keywords."""
    kind, _, shape = name.partition(":")
    shape, _, flag = shape.partition(":")
    kw = {"decode": kind.split("-")[0], "decode_only": kind.endswith("-only")}
    if shape:
        parts = [int(x) for x in shape.split("x")]
        dt = dataclasses.replace(tiling.mosaic_decode, block_kv=parts[0], stages=parts[1],
                                 splits=parts[2] if len(parts) > 2 else None,
                                 transposed={"t": True, "r": False}.get(flag))
        tiling = dataclasses.replace(tiling, mosaic_decode=dt)
    return tiling, kw


def n_sets_for(bytes_per_call: int, reps: int) -> int:
    return max(1, min(reps, math.ceil(L2_ROTATION_BYTES / max(bytes_per_call, 1))))


def sweep(runner: Runner, pool: Pool, rng, smoke: bool) -> dict:
    base = Tiling()
    dec_variants = {
        "bkv64_w4_s3_t264_m32": base,
        "bkv32_w4_s3_t264_m32": dataclasses.replace(base, decode_block_kv=32),
        "bkv64_w4_s3_t528_m64": dataclasses.replace(base, target_programs=528, max_splits=64),
    }
    pre_variants = {"r128_bkv128_w8_s3": base}  # one variant: not re-timed
    dec_shapes = [(8, 128), (2, 256)] if smoke else [(1, 512), (8, 2048), (32, 2048), (256, 2048)]
    pre_shapes = [(32, 16)] if smoke else [(2048, 2048), (512, 4096), (1024, 0)]
    out = {"decode": [], "prefill": []}
    for b, ctx in dec_shapes:
        step = build_step(rng, pool, [1] * b, [ctx - 1] * b,
                          n_sets=n_sets_for(kv_bytes([ctx] * b), runner.args.reps))
        for name, til in dec_variants.items():
            if runner.over_budget():
                break
            try:
                t = runner.ours(step, pool, runner.args.reps, til)
                out["decode"].append({"batch": b, "ctx": ctx, "variant": name, **t})
            except Exception as e:  # noqa: BLE001
                out["decode"].append({"batch": b, "ctx": ctx, "variant": name, "error": repr(e)})
            log("sweep decode", json.dumps(out["decode"][-1])[:300])
    for c, ctx in pre_shapes if len(pre_variants) > 1 else []:
        step = build_step(rng, pool, [c], [ctx])
        for name, til in pre_variants.items():
            if runner.over_budget():
                break
            try:
                t = runner.ours(step, pool, 2, til)
                out["prefill"].append({"chunk": c, "ctx": ctx, "variant": name, **t})
            except Exception as e:  # noqa: BLE001
                out["prefill"].append({"chunk": c, "ctx": ctx, "variant": name, "error": repr(e)})
            log("sweep prefill", json.dumps(out["prefill"][-1])[:300])

    def best(rows, variants):
        score = {}
        for name in variants:
            ts = [r for r in rows if r["variant"] == name and "error" not in r]
            if len(ts) != len({(r.get("batch"), r.get("ctx"), r.get("chunk")) for r in rows}):
                continue
            base_t = {(r.get("batch"), r.get("chunk"), r["ctx"]): _ms(r) for r in rows
                      if r["variant"] == next(iter(variants)) and "error" not in r}
            try:
                score[name] = sum(_ms(r) / base_t[(r.get("batch"), r.get("chunk"), r["ctx"])]
                                  for r in ts)
            except KeyError:
                continue
        return min(score, key=score.get) if score else next(iter(variants))

    bd = best(out["decode"], dec_variants)
    bp = best(out["prefill"], pre_variants)
    d, p = dec_variants[bd], pre_variants[bp]
    chosen = dataclasses.replace(d, prefill_rows=p.prefill_rows,
                                 prefill_block_kv=p.prefill_block_kv,
                                 prefill_num_warps=p.prefill_num_warps,
                                 prefill_num_stages=p.prefill_num_stages)
    out["chosen"] = {"decode": bd, "prefill": bp, "tiling": dataclasses.asdict(chosen)}
    return out, chosen


def decode_grid(runner: Runner, pool: Pool, rng, tiling: Tiling, smoke: bool) -> list[dict]:
    batches = [1, 2] if smoke else [1, 8, 32, 64, 128, 256]
    ctxs = [256] if smoke else [512, 1024, 2048, 4096, 8192]
    reps = runner.args.reps
    rows = []
    shapes = itertools.product(batches, ctxs)
    if runner.args.decode_filter:  # exactly these rows, grid or not (e.g. 2x1024)
        shapes = [tuple(int(x) for x in name.split("x"))
                  for name in runner.args.decode_filter.split(",")]
    for b, ctx in shapes:
        row = {"batch": b, "ctx": ctx, "kv_bytes": kv_bytes([ctx] * b)}
        if runner.over_budget():
            row["skipped"] = "budget"
            rows.append(row)
            continue
        try:
            step = build_step(rng, pool, [1] * b, [ctx - 1] * b,
                              n_sets=n_sets_for(row["kv_bytes"], reps))
            row["n_sets"] = step["n_sets"]
            row["rotation_bytes"] = row["kv_bytes"] * min(step["n_sets"], reps)
            row["check"] = runner.check(step, pool, tiling, with_bundled=True)
            row["ours"] = runner.ours(step, pool, reps, tiling)
            row["bundled"] = runner.bundled(step, pool, reps)
            if runner.args.mosaic_decode:
                variants = {}
                for name in runner.args.decode_variants:
                    vt, kw = decode_variant(tiling, name)
                    v = runner.ours(step, pool, reps, vt, **kw)
                    v["check"] = runner.check(step, pool, vt, False, **kw)
                    if (b, ctx) in ((1, 512), (1, 8192), (8, 2048)):
                        v["breakdown_us"] = kernel_breakdown(
                            runner.timer, chain_ours(reps, vt, False, **kw),
                            chain_args(step, pool), reps)
                    variants[name] = v
                mosaic = [k for k in variants if k.startswith("mosaic")]
                best = min(mosaic or variants, key=lambda k: _ms(variants[k]))
                row["mosaic_decode_variants"] = variants
                row["ours_mosaic_decode"] = dict(variants[best], variant=best)
                if runner.args.mosaic_profile:  # every Mosaic variant; "phases": the best's
                    for name in mosaic:
                        vt, kw = decode_variant(tiling, name)
                        variants[name]["phases"] = runner.profile(
                            f"decode_{b}x{ctx}_{name.replace(':', '_')}", step, pool, vt,
                            **kw)
                    if best.startswith("mosaic"):
                        row["phases"] = variants[best]["phases"]
                row["check_mosaic_decode"] = variants[best]["check"]
                row["mosaic_decode_speedup_vs_bundled"] = (
                    _ms(row["bundled"]) / _ms(row["ours_mosaic_decode"]))
                row["mosaic_decode_bw_frac_of_copy"] = row["kv_bytes"] / (
                    _ms(row["ours_mosaic_decode"]) * 1e-3) / runner.ceil["copy_bytes_per_s"]
            if not runner.args.skip_reference_timing:
                row["reference"] = runner.reference(step, pool, 2)
            if (b, ctx) in ((1, 512), (8, 512), (32, 2048), (1, 8192)):
                targs = chain_args(step, pool)
                bargs = (step["q"], pool.k_t, pool.v_t, step["kv_lens"], step["tables"])
                row["breakdown_us"] = {
                    "ours": kernel_breakdown(runner.timer, chain_ours(reps, tiling, False),
                                             targs, reps),
                    "bundled": kernel_breakdown(runner.timer, chain_bundled(reps, False),
                                                bargs, reps)}
            t = _ms(row["ours"])
            row["ours_bw_frac_of_copy"] = row["kv_bytes"] / (t * 1e-3) / \
                runner.ceil["copy_bytes_per_s"]
            row["speedup_vs_bundled"] = _ms(row["bundled"]) / t
            if "reference" in row:
                row["speedup_vs_reference"] = _ms(row["reference"]) / t
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)
            row["trace"] = traceback.format_exc()[-1500:]
        log("decode", json.dumps(row)[:500])
        rows.append(row)
    return rows


def prefill_grid(runner: Runner, pool: Pool, rng, tiling: Tiling, smoke: bool) -> list[dict]:
    if smoke:
        shapes = [("prefill", [16], [0]), ("mixed", [1, 1, 8], [20, 30, 10])]
    else:
        shapes = [("prefill", [c], [ctx]) for c in (256, 512, 1024, 2048) for ctx in (0, 2048, 8192)]
        shapes += [
            ("mixed 32x dec@2048 + 512@1536", [1] * 32 + [512], [2047] * 32 + [1536]),
            ("mixed 128x dec@1024 + 2x1024@0", [1] * 128 + [1024, 1024], [1023] * 128 + [0, 0]),
            ("mixed 8x dec@4096 + 2048@4096", [1] * 8 + [2048], [4095] * 8 + [4096]),
        ]
    rows = []
    for kind, q_lens, ctx_lens in shapes:
        name = f"{kind} {max(q_lens)}@{max(ctx_lens)}"
        if runner.args.prefill_filter and not any(
                f in name for f in runner.args.prefill_filter.split(",")):
            continue
        row = {"kind": kind, "q_lens_summary": f"{len(q_lens)} seqs, {sum(q_lens)} tokens",
               "chunk": max(q_lens), "ctx": max(ctx_lens),
               "flops": attn_flops(q_lens, ctx_lens),
               "kv_bytes": kv_bytes([q + c for q, c in zip(q_lens, ctx_lens)])}
        if runner.over_budget():
            row["skipped"] = "budget"
            rows.append(row)
            continue
        try:
            step = build_step(rng, pool, q_lens, ctx_lens)
            row["check"] = runner.check(step, pool, tiling, with_bundled=False)
            row["ours"] = runner.ours(step, pool, 2, tiling)
            if not runner.args.skip_reference_timing:
                row["reference"] = runner.reference(step, pool, 1)
            if runner.args.mosaic:
                row["check_mosaic"] = runner.check(step, pool, tiling, with_bundled=False,
                                                   prefill="mosaic")
                variants, tilings = {}, {}
                for bkv, ctas, sp, ov, tab in itertools.product(
                        runner.args.mosaic_block_kv, runner.args.mosaic_ctas,
                        runner.args.mosaic_splits, runner.args.mosaic_overlap,
                        runner.args.mosaic_table):
                    mt = MosaicTiling(block_kv=bkv, **_cta_mode(ctas), overlap=ov,
                                      kv_splits=None if sp == "auto" else int(sp),
                                      tile_table=tab)
                    key = ((bkv, ctas, sp) + (("ov",) if ov else ())
                           + (("xla",) if tab == "xla" else ()))
                    tilings[key] = dataclasses.replace(tiling, mosaic=mt)
                    variants[key] = runner.ours(step, pool, 2, tilings[key],
                                                prefill="mosaic")
                    if len(runner.args.mosaic_splits) > 1 or ov:
                        variants[key]["check"] = runner.check(
                            step, pool, tilings[key], with_bundled=False,
                            prefill="mosaic")
                    if runner.args.prefill_only and kind == "prefill":
                        # The same call with no decode kernel (a prefill-only step).
                        k2 = (*key, "only")
                        tilings[k2] = tilings[key]
                        variants[k2] = runner.ours(step, pool, 2, tilings[key],
                                                   prefill="mosaic", prefill_only=True)
                        variants[k2]["check"] = runner.check(
                            step, pool, tilings[key], with_bundled=False,
                            prefill="mosaic", prefill_only=True)
                row["mosaic_variants"] = {"/".join(map(str, k)): v for k, v in variants.items()}
                best = min(variants, key=lambda b: _ms(variants[b]))
                only = best[-1] == "only"  # the fastest was a prefill_only call
                row["ours_mosaic"] = dict(variants[best], block_kv=best[0], ctas=best[1],
                                          kv_splits=best[2], prefill_only=only,
                                          overlap="ov" in best,
                                          tile_table="xla" if "xla" in best else "triton")
                tm = _ms(row["ours_mosaic"])
                row["mosaic_flops_frac_of_matmul"] = row["flops"] / (tm * 1e-3) / \
                    runner.ceil["matmul_flops_per_s"]
                row["mosaic_vs_triton"] = _ms(row["ours"]) / tm
                tb = tilings[best]
                args = chain_args(step, pool)
                row["breakdown_us"] = {
                    "triton": kernel_breakdown(runner.timer, chain_ours(2, tiling, False), args, 2),
                    "mosaic": kernel_breakdown(
                        runner.timer, chain_ours(2, tb, False, "mosaic", prefill_only=only),
                        args, 2)}
                if runner.args.mosaic_profile:
                    row["phases"] = runner.profile(
                        f"prefill_{max(q_lens)}at{max(ctx_lens)}_{len(q_lens)}seqs", step, pool,
                        tb, prefill="mosaic", prefill_only=only)
            t = _ms(row["ours"])
            row["ours_flops_frac_of_matmul"] = row["flops"] / (t * 1e-3) / \
                runner.ceil["matmul_flops_per_s"]
            row["ours_bw_frac_of_copy"] = row["kv_bytes"] / (t * 1e-3) / \
                runner.ceil["copy_bytes_per_s"]
            if "reference" in row:
                row["speedup_vs_reference"] = _ms(row["reference"]) / t
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)
            row["trace"] = traceback.format_exc()[-1500:]
        log("prefill", json.dumps(row)[:500])
        if row.get("mosaic_variants"):
            log("prefill", row["kind"], row["chunk"], row["ctx"], "mosaic variants us:",
                _variant_times(row["mosaic_variants"]))
        rows.append(row)
    return rows


def padding_rows(runner: Runner, pool: Pool, rng, tiling: Tiling, smoke: bool) -> list[dict]:
    """Same 8 live decodes in 8 slots vs padded into 256 slots / 256 tokens."""
    live, ctx, slots = (2, 64, 16) if smoke else (8, 2048, 256)
    rows = []
    for s, t in ((live, live), (slots, slots)):
        if runner.over_budget():
            break
        step = build_step(rng, pool, [1] * live, [ctx - 1] * live, slots=s, tokens=t,
                          n_sets=n_sets_for(kv_bytes([ctx] * live), runner.args.reps))
        row = {"live": live, "ctx": ctx, "slots": s, "tokens": t,
               "check": runner.check(step, pool, tiling, with_bundled=False),
               "ours": runner.ours(step, pool, runner.args.reps, tiling)}
        if runner.args.mosaic:
            row["ours_mosaic"] = runner.ours(step, pool, runner.args.reps, tiling, prefill="mosaic")
        if runner.args.mosaic_decode:
            row["check_mosaic_decode"] = runner.check(step, pool, tiling, False, decode="mosaic")
            row["ours_mosaic_decode"] = runner.ours(step, pool, runner.args.reps, tiling,
                                                    decode="mosaic")
            row["ours_mosaic_decode_only"] = runner.ours(step, pool, runner.args.reps, tiling,
                                                         decode="mosaic", decode_only=True)
            row["check_mosaic_decode_only"] = runner.check(step, pool, tiling, False,
                                                           decode="mosaic", decode_only=True)
        log("padding", json.dumps(row)[:300])
        rows.append(row)
    return rows


def _passes(res: dict, key: str, label: str) -> str:
    """One correctness pass as a line: each case's name and ok / FAIL."""
    return f"{label}: " + ", ".join(f"{r['name']}:{'ok' if r.get('ok') else 'FAIL'}"
                                    for r in res.get(key, []))


def _variant_times(variants: dict) -> str:
    """A prefill row's Mosaic variants as 'name us (err e)' items."""
    return ", ".join(f"{k} {_ms(v) * 1e3:.1f}" + (
        f" (err {v['check']['rel_err_vs_reference']:.1e})" if "check" in v else "")
        for k, v in variants.items())


def table(res: dict) -> str:
    c = res["ceilings"]
    lines = [f"device: {res['facts'].get('nvidia_smi', '?')}",
             f"jax {res['facts'].get('jax')} jaxlib {res['facts'].get('jaxlib')}; "
             f"copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s; "
             f"read {c['read_bytes_per_s'] / 1e12:.2f} TB/s; "
             f"bf16 matmul {c['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s; "
             f"timing: {'CUPTI kernel time' if res.get('cupti_ok') else 'wall'}",
             _passes(res, "correctness", "correctness"),
             _passes(res, "correctness_mosaic",
                     "correctness (prefill=auto, Mosaic where it applies)"),
             _passes(res, "correctness_mosaic_prefill_only",
                     "correctness (prefill=auto, prefill_only)"),
             _passes(res, "correctness_mosaic_overlap", "correctness (prefill=auto, overlap)"),
             _passes(res, "correctness_mosaic_overlap_prefill_only",
                     "correctness (prefill=auto, overlap, prefill_only)"),
             f"tiling: {res['sweep'].get('chosen', {}).get('decode')} / "
             f"{res['sweep'].get('chosen', {}).get('prefill')}",
             _passes(res, "correctness_mosaic_decode",
                     "correctness (decode=auto, Mosaic where it applies)"),
             _passes(res, "correctness_mosaic_decode_transposed",
                     "correctness (decode=auto, transposed decode)"),
             _passes(res, "correctness_mosaic_both", "correctness (decode=auto, prefill=auto)"),
             "decode  batch x ctx | ours us | %copyBW | bundled us | x bundled | ref us | x ref"
             " | mosaic decode us | %copyBW | x bundled | err"]
    for r in res.get("decode", []):
        if "ours" not in r:
            lines.append(f"  {r['batch']:>4} x {r['ctx']:<5} | {r.get('skipped') or r.get('error', '')[:60]}")
            continue
        ref = (f"{_ms(r['reference']) * 1e3:8.1f} | {r['speedup_vs_reference']:6.1f}"
               if "reference" in r else "       - |      -")
        mos = (f" | {_ms(r['ours_mosaic_decode']) * 1e3:8.1f} | "
               f"{100 * r['mosaic_decode_bw_frac_of_copy']:5.1f}% | "
               f"{r['mosaic_decode_speedup_vs_bundled']:6.2f} | "
               f"{r['check_mosaic_decode']['rel_err_vs_reference']:.1e} "
               f"{r['ours_mosaic_decode'].get('variant', '')}"
               if "ours_mosaic_decode" in r else "")
        lines.append(f"  {r['batch']:>4} x {r['ctx']:<5} | {_ms(r['ours']) * 1e3:8.1f} | "
                     f"{100 * r['ours_bw_frac_of_copy']:5.1f}% | {_ms(r['bundled']) * 1e3:9.1f} | "
                     f"{r['speedup_vs_bundled']:6.2f} | " + ref + mos)
        if r.get("mosaic_decode_variants"):
            lines.append("      variants us (x bundled): " + ", ".join(
                f"{k} {_ms(v) * 1e3:.1f} ({_ms(r['bundled']) / _ms(v):.2f})"
                for k, v in r["mosaic_decode_variants"].items()))
    lines.append("prefill/mixed            | ours us | %matmul | %copyBW | ref us | x ref"
                 " | mosaic us (bkv/ctas/splits) | %matmul | x triton | mosaic err")
    for r in res.get("prefill", []):
        name = f"{r['kind'][:14]} {r['chunk']}@{r['ctx']}"
        if "ours_flops_frac_of_matmul" not in r:
            lines.append(f"  {name:<22} | {r.get('skipped') or r.get('error', '')[:60]}")
            continue
        ref = (f"{_ms(r['reference']) * 1e3:8.1f} | {r['speedup_vs_reference']:6.1f}"
               if "reference" in r else "       - |      -")
        lines.append(f"  {name:<22} | {_ms(r['ours']) * 1e3:8.1f} | "
                     f"{100 * r['ours_flops_frac_of_matmul']:6.1f}% | "
                     f"{100 * r['ours_bw_frac_of_copy']:6.1f}% | " + ref
                     + (f" | {_ms(r['ours_mosaic']) * 1e3:8.1f} ({r['ours_mosaic']['block_kv']}/"
                        f"{r['ours_mosaic']['ctas']}/{r['ours_mosaic'].get('kv_splits')}"
                        f"{'/ov' if r['ours_mosaic'].get('overlap') else ''})"
                        f" | {100 * r['mosaic_flops_frac_of_matmul']:6.1f}% | "
                        f"{r['mosaic_vs_triton']:5.2f} | "
                        f"{r['check_mosaic']['rel_err_vs_reference']:.1e}"
                        if "ours_mosaic" in r else ""))
        if len(r.get("mosaic_variants", {})) > 1:
            lines.append("      mosaic variants us: " + _variant_times(r["mosaic_variants"]))
    for r in res.get("padding", []):
        lines.append(f"padding: {r['live']} live @ {r['ctx']} in {r['slots']} slots/"
                     f"{r['tokens']} tokens: {_ms(r['ours']) * 1e3:.1f} us"
                     + (f" (prefill=mosaic: {_ms(r['ours_mosaic']) * 1e3:.1f} us)"
                        if "ours_mosaic" in r else "")
                     + (f" (decode=mosaic: {_ms(r['ours_mosaic_decode']) * 1e3:.1f} us, err "
                        f"{r['check_mosaic_decode']['rel_err_vs_reference']:.1e}; decode_only: "
                        f"{_ms(r['ours_mosaic_decode_only']) * 1e3:.1f} us, err "
                        f"{r['check_mosaic_decode_only']['rel_err_vs_reference']:.1e})"
                        if "ours_mosaic_decode" in r else ""))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_out"))
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="stop starting new rows after this many seconds")
    ap.add_argument("--reps", type=int, default=8, help="chained calls per timed function")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpreter, CPU")
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--mosaic", action="store_true",
                    help="also check and time the Mosaic GPU prefill kernel (Hopper)")
    ap.add_argument("--mosaic-decode", action="store_true",
                    help="also check and time the Mosaic GPU decode kernel (Hopper)")
    ap.add_argument("--decode-variants", type=lambda x: x.split(","),
                    default=["mosaic:128x2", "triton-only", "mosaic-only:128x2"],
                    help="with --mosaic-decode, decode paths to time beside the default "
                         "Triton call (see decode_variant); the best Mosaic one is tabled")
    ap.add_argument("--only-mosaic-decode-correctness", action="store_true",
                    help="correctness section: only the decode=auto (and, with --mosaic, "
                         "decode=auto + prefill=auto) passes")
    ap.add_argument("--decode-transposed", action="store_true",
                    help="with --mosaic-decode: one more correctness pass (decode=auto) with "
                         "DecodeTiling.transposed (the heads as wgmma columns)")
    ap.add_argument("--decode-filter", default="",
                    help="only these decode rows, '<batch>x<ctx>' comma-separated (rows "
                         "outside the grid too, e.g. 2x1024)")
    ap.add_argument("--mosaic-ctas", type=lambda x: x.split(","), default=["sm"],
                    help="Mosaic prefill grids to try: sm (one persistent CTA per SM, the "
                         "default), all (one CTA per work item)")
    ap.add_argument("--mosaic-splits", type=lambda x: x.split(","), default=["auto"],
                    help="Mosaic KV splits per tile to time: auto (MosaicTiling default) or "
                         "numbers, e.g. 1,auto")
    ap.add_argument("--mosaic-block-kv", type=lambda x: [int(v) for v in x.split(",")],
                    default=[128], help="block_kv values of the Mosaic kernel to time")
    ap.add_argument("--mosaic-overlap", type=lambda x: [v == "1" for v in x.split(",")],
                    default=[False], help="MosaicTiling.overlap values to time: 0 (Q.K^T, "
                    "softmax, P.V in turn), 1 (Q.K^T of step i with P.V of step i-1 over the "
                    "softmax), e.g. 0,1; with 1 among them, the correctness cases also run "
                    "with overlap")
    ap.add_argument("--mosaic-table", type=lambda x: x.split(","), default=["triton"],
                    help="MosaicTiling.tile_table values to time: triton (the table from "
                    "Triton programs: in the decode kernel, or a launch of its own in a "
                    "prefill_only call), xla (XLA ops before the call), e.g. triton,xla")
    ap.add_argument("--prefill-filter", default="",
                    help="only prefill-grid shapes whose '<kind> <chunk>@<ctx>' contains one "
                         "of these comma-separated texts")
    ap.add_argument("--prefill-only", action="store_true",
                    help="with --mosaic: also time and check each Mosaic variant as a "
                         "prefill_only call (no decode kernel) on prefill shapes, and run the "
                         "correctness cases with prefill=auto, prefill_only=True")
    ap.add_argument("--mosaic-profile", default="",
                    help="a folder: one more call per Mosaic row with Mosaic GPU's in-kernel "
                         "profiler on; its traces go there and each row gets the phases "
                         "(lab/kernels/mosaic_phases.py) of its call")
    ap.add_argument("--mosaic-profile-cold", action="store_true",
                    help="with --mosaic-profile: evict L2 (256 MiB streamed) before each "
                         "profiled call, so its phases are those of a call reading K/V from HBM "
                         "as the timed chains do (without it the lone call reads what L2 kept)")
    ap.add_argument("--skip-reference-timing", action="store_true",
                    help="prefill grid: check against the XLA reference but do not time it")
    ap.add_argument("--only", default="correctness,decode,prefill,padding",
                    help="comma-separated sections to run")
    args = ap.parse_args()
    only = set(args.only.split(","))
    if args.smoke:
        args.reps = 2
        args.iters = 1
    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    res: dict = {"params": {"num_heads": N_HEADS, "num_kv_heads": N_KV, "head_dim": HEAD_DIM,
                            "block_size": BLOCK, "dtype": "bfloat16", "sm_scale": SM_SCALE,
                            "reps": args.reps, "iters": args.iters,
                            "l2_rotation_bytes": L2_ROTATION_BYTES, "smoke": args.smoke}}
    res["facts"] = device_facts()
    log("facts", res["facts"])
    timer = Timer(args.iters, use_cupti=not args.smoke)

    def dump():
        res["elapsed_s"] = time.time() - t_start
        res["cupti_error"] = timer.cupti_error
        with open(os.path.join(args.out, "kernels_bench.json"), "w") as fh:
            json.dump(res, fh, indent=1, default=str)

    res["ceilings"] = ceilings(timer, args.smoke)
    res["cupti_ok"] = res["ceilings"]["copy_timing"]["kernel_ms"] is not None
    log("ceilings", res["ceilings"])
    if "correctness" in only:
        if not args.only_mosaic_decode_correctness:
            res["correctness"] = correctness(args.smoke, args.smoke)
        if args.mosaic and not args.only_mosaic_decode_correctness:
            res["correctness_mosaic"] = correctness(False, args.smoke, prefill="auto")
        if args.mosaic and args.prefill_only:
            res["correctness_mosaic_prefill_only"] = correctness(
                False, args.smoke, prefill="auto", prefill_only=True)
        if args.mosaic and True in args.mosaic_overlap:
            overlapped = Tiling(mosaic=MosaicTiling(overlap=True))
            res["correctness_mosaic_overlap"] = correctness(
                False, args.smoke, prefill="auto", tiling=overlapped)
            res["correctness_mosaic_overlap_prefill_only"] = correctness(
                False, args.smoke, prefill="auto", prefill_only=True, tiling=overlapped)
        if args.mosaic_decode:
            res["correctness_mosaic_decode"] = correctness(False, args.smoke, decode="auto")
            if args.decode_transposed:
                res["correctness_mosaic_decode_transposed"] = correctness(
                    False, args.smoke, decode="auto",
                    tiling=decode_variant(Tiling(), "mosaic:128x2:t")[0])
            if args.mosaic:
                res["correctness_mosaic_both"] = correctness(False, args.smoke, prefill="auto",
                                                             decode="auto")
        dump()
    rng = np.random.default_rng(0)
    pool = make_pool(300 if args.smoke else 131072 + 4096, with_transposed=True)
    runner = Runner(args, timer, res["ceilings"], t_start)
    tiling = Tiling()
    res["sweep"] = {}
    if not args.skip_sweep:
        res["sweep"], tiling = sweep(runner, pool, rng, args.smoke)
        dump()
    res["tiling"] = dataclasses.asdict(tiling)
    if "decode" in only:
        res["decode"] = decode_grid(runner, pool, rng, tiling, args.smoke)
        dump()
    if "prefill" in only:
        res["prefill"] = prefill_grid(runner, pool, rng, tiling, args.smoke)
        dump()
    if "padding" in only:
        res["padding"] = padding_rows(runner, pool, rng, tiling, args.smoke)
        dump()
    txt = table(res)
    with open(os.path.join(args.out, "kernels_table.txt"), "w") as fh:
        fh.write(txt + "\n")
    log("\n" + txt)


if __name__ == "__main__":
    main()
