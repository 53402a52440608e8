"""Registers and local-memory spills of the weight-only kernel's compiled code, per step layout:
compiles one call per layout with XLA's dump on and reads the PTX of the Triton kernel.

    XLA_FLAGS=--xla_dump_to=/tmp/wodump python -m lab.gpu_checks.weight_only_ptx /tmp/wodump
"""

from __future__ import annotations

import glob
import re
import sys

import jax
import jax.numpy as jnp

from jaxengine.pallas_kernels import weight_only_matmul_gpu as kernel

VARIANTS = {"bk128_w4": dict(), "bk128_w8_bn256": dict(num_warps=8, block_n=256), "bk64": dict(block_k_rows=64),
            "bk32": dict(block_k_rows=32), "slabs": dict(slabs=True), "post": dict(post_scale=True)}


def main(dump: str) -> int:
    k, n = 4096, 6144
    x = jnp.ones((16, k), jnp.bfloat16)
    p = jnp.zeros((k // 8, n), jnp.int32)
    s = jnp.ones((k // 128, n), jnp.bfloat16)
    z = jnp.full((k // 128, n), 8, jnp.uint8)
    for name, opts in VARIANTS.items():
        fn = jax.jit(lambda x, p, s, z, o=opts: kernel.weight_only_matmul(x, p, s, z, bits=4, group_size=128, **o))
        fn.lower(x, p, s, z).compile()
    for path in sorted(glob.glob(f"{dump}/**/*.ptx", recursive=True)):
        text = open(path, errors="replace").read()
        for m in re.finditer(r"\.entry\s+(\w*weight_only\w*)", text):
            body = text[m.start(): text.find("\n}", m.start())]
            regs = {t: max([int(v) for v in re.findall(rf"\.reg \.{t} %\w+<(\d+)>", body)] or [0])
                    for t in ("b32", "f32", "b16", "pred")}
            print(f"{path.rsplit('/', 1)[-1][:60]} {m.group(1)[:40]} lines {body.count(chr(10))} "
                  f"ld.local {body.count('ld.local')} st.local {body.count('st.local')} regs {regs} "
                  f"mma {body.count('mma.sync')} wgmma {body.count('wgmma')} cp.async {body.count('cp.async')} "
                  f"ld.shared {body.count('ld.shared')} st.shared {body.count('st.shared')} "
                  f"bar.sync {body.count('bar.sync')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
