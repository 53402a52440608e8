"""The fp8 KV cache with a layer's scales through the compiled Triton kernels (not interpreted):
the GPU backend's cache and output against the jnp reference backend's with the same scales, on
keys and values far beyond e4m3's 448 (tests/engine/test_kv_scales.py runs the same in interpret
mode on the CPU).

    python lab/gpu_checks/kv_scales_check.py
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxengine.attention_backend import AttentionBackend
    from jaxengine.pallas_kernels import ragged_paged_attention_gpu as rpa_gpu
    from jaxengine.pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
    from tests.engine.test_attention_backend import _step

    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "cases": []}
    for seed, (ks, vs) in enumerate(((40.0, 120.0), (1.0, 1.0), (0.05, 0.02))):
        b, k, v, md = _step(np.random.default_rng(seed))
        k, v = k * (ks * 7.5), v * (vs * 7.5)
        caches = (b.k_cache.astype(jnp.float8_e4m3fn), b.v_cache.astype(jnp.float8_e4m3fn))
        md = dataclasses.replace(md, kv_scale=jnp.asarray([ks, vs], jnp.float32))  # as layer_metadata gives it
        gpu = AttentionBackend("pallas", "gpu", rpa_gpu.ragged_paged_attention_gpu,
                               cache_dtype=jnp.dtype(jnp.float8_e4m3fn))
        ref = dataclasses.replace(gpu, fn=ragged_paged_attention_reference)
        scale = 0.25 / (ks * 7.5)
        o, (kc, vc) = jax.jit(lambda *a: gpu.attend(*a, sm_scale=scale))(b.q, k, v, caches, md)
        o_ref, (kc_ref, vc_ref) = jax.jit(lambda *a: ref.attend(*a, sm_scale=scale))(b.q, k, v, caches, md)
        f32 = lambda x: np.asarray(x.astype(jnp.float32))  # noqa: E731
        row = {"k_scale": ks, "v_scale": vs, "cache_equal": bool((f32(kc) == f32(kc_ref)).all() and (f32(vc) == f32(vc_ref)).all()),
               "cache_max_abs": float(np.abs(f32(kc)).max()),
               "out_rel_err": float(np.abs(f32(o) - f32(o_ref)).max() / max(np.abs(f32(o_ref)).max(), 1e-30))}
        res["cases"].append(row)
        print(json.dumps(row), flush=True)
    ok = all(r["cache_equal"] and r["out_rel_err"] < 1e-2 for r in res["cases"])
    print("kv scales on the GPU kernels:", "OK" if ok else "MISMATCH")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "kv_scales_check.json"), "w") as f:
            json.dump(res, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
