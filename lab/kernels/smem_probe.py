"""Shared memory the Triton attention kernels ask for, per tiling, head size and dtype (GPU).

Prints one line per case: the tiling, then 'ok' or the bytes the compiler requested.
    python -m lab.kernels.smem_probe
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.pallas_kernels import ragged_paged_attention_gpu as rpa
from tests.kernels.batch_factory import make_batch


def main() -> None:
    rpa.fit_shared_memory = lambda tiling, *a: tiling  # measure the tilings as given
    rng = np.random.default_rng(0)
    for dtype in (jnp.bfloat16, jnp.float32):
        for h, n, k in ((256, 16, 8), (128, 32, 8)):
            for kind in ("decode", "prefill"):
                b = make_batch(rng, q_lens=[1, 1] if kind == "decode" else [40, 30], ctx_lens=[50, 20], num_heads=n,
                               num_kv_heads=k, head_dim=h, block_size=16, dtype=dtype)
                only = {"decode_only": True} if kind == "decode" else {"prefill_only": True}
                for rows, bkv, st in ((128, 128, 3), (128, 128, 2), (128, 128, 1), (128, 64, 2), (64, 64, 2),
                                      (64, 128, 2), (128, 32, 2), (32, 32, 2), (64, 64, 1)):
                    if kind == "decode":
                        t = rpa.Tiling(decode_block_kv=bkv, decode_num_stages=st)
                        if rows != 128:
                            continue
                    else:
                        t = rpa.Tiling(prefill_rows=rows, prefill_block_kv=bkv, prefill_num_stages=st)
                    try:
                        jax.block_until_ready(rpa.ragged_paged_attention_gpu(*b.args(), sm_scale=0.1, tiling=t, **only))
                        res = "ok"
                    except Exception as e:  # noqa: BLE001
                        m = re.search(r"requested (\d+)", str(e))
                        res = f"requested {m.group(1)}" if m else str(e)[:120]
                    print(f"{jnp.dtype(dtype).name} h={h} g={n // k} {kind}: rows={rows} bkv={bkv} stages={st}: {res}",
                          flush=True)


if __name__ == "__main__":
    main()
