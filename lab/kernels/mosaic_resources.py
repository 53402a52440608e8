"""What ptxas made of the Mosaic GPU kernels: registers, spills, wgmma warnings, SASS counts.

Compiles one prefill-only call of `ragged_paged_attention_gpu` (the Mosaic prefill kernel) with
Mosaic GPU's dump switches on
(MOSAIC_GPU_DUMP_TO, _PTXAS, _SASS: read by the compiler when the kernel is compiled, so this
script sets them before it compiles), then summarises the dump folder:
- every ptxas line about registers, spills, stack frames and "Performance" warnings (ptxas
  names wgmma serialisation there);
- counts of a few SASS opcodes in any disassembly there (a file with "sass" in its name, e.g.
  `cuobjdump -sass` of the dumped PTX assembled by ptxas): HGMMA (tensor-core matmuls), WARPGROUP.DEPBAR / WARPGROUP.ARRIVE
  (wgmma waits and fences), LDL / STL (local memory: spilled registers), BAR / SYNCS (barriers).

GPU only (Hopper). Example (the compile's own output goes to a log in the same folder, since
Mosaic GPU may print its dumps instead of writing them; --summarise reads every file there):
  python lab/kernels/mosaic_resources.py --overlap 1 --out /tmp/ov1 \
      > /tmp/ov1.log 2>&1; mv /tmp/ov1.log /tmp/ov1/
  python lab/kernels/mosaic_resources.py --summarise /tmp/ov1
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

_OPCODES = ("HGMMA", "WARPGROUP.DEPBAR", "WARPGROUP.ARRIVE", "LDL", "STL", "BAR", "SYNCS",
            "MUFU.EX2")
_PTXAS_LINE = re.compile(r"registers|spill|stack frame|Performance|warning", re.I)


def summarise(dump_dir: str) -> dict:
    """ptxas lines and SASS opcode counts found in the files of `dump_dir`."""
    ptxas, counts, files = [], collections.Counter(), []
    for root, _, names in os.walk(dump_dir):
        for name in sorted(names):
            path = os.path.join(root, name)
            files.append(os.path.relpath(path, dump_dir))
            with open(path, errors="replace") as fh:
                text = fh.read()
            ptxas += [ln.strip() for ln in text.splitlines()
                      if "ptxas" in ln and _PTXAS_LINE.search(ln)]
            if "SASS" in name.upper():
                for ln in text.splitlines():
                    op = ln.split("*/", 1)[-1].strip().split(" ", 1)[0].rstrip(";")
                    for want in _OPCODES:
                        if op.startswith(want):
                            counts[want] += 1
    return {"files": files, "ptxas": ptxas, "sass_counts": dict(counts)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--overlap", type=int, default=0, help="MosaicTiling.overlap (prefill)")
    ap.add_argument("--tokens", type=int, default=256, help="token rows of the call")
    ap.add_argument("--out", help="folder for the dump")
    ap.add_argument("--summarise", metavar="DIR",
                    help="only print the summary of the files under DIR (no compile)")
    args = ap.parse_args()
    if args.summarise:
        print(json.dumps(summarise(args.summarise), indent=1))
        return
    dump = os.path.join(args.out, "dump")
    os.makedirs(dump, exist_ok=True)
    os.environ.update(MOSAIC_GPU_DUMP_TO=dump, MOSAIC_GPU_DUMP_PTXAS="1",
                      MOSAIC_GPU_DUMP_SASS="1")

    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
    from jaxengine.pallas_kernels.ragged_paged_attention_gpu import (
        MosaicTiling, Tiling, ragged_paged_attention_gpu)

    n, k, h, p, s, m, blocks = 32, 8, 128, 16, 8, 256, 1024
    t = args.tokens
    sd = jax.ShapeDtypeStruct
    shapes = (sd((t, n, h), jnp.bfloat16), sd((blocks, k, p, h), jnp.bfloat16),
              sd((blocks, k, p, h), jnp.bfloat16), sd((s,), jnp.int32), sd((s, m), jnp.int32),
              sd((s + 1,), jnp.int32), sd((1,), jnp.int32))
    tiling = Tiling(mosaic=MosaicTiling(overlap=bool(args.overlap)))
    ragged_paged_attention_gpu.trace(*shapes, sm_scale=h ** -0.5, tiling=tiling, prefill="mosaic",
                                     prefill_only=True).lower().compile()
    print("compiled", json.dumps(vars(args)))


if __name__ == "__main__":
    main()
