"""Does the layer-call form change the compiled program? Compiles one forward bucket of a preset
(dummy weights) with the decoder layers inlined (models/layer_call.py, the engine's form) and as
called functions (the same jitted function without `inline`, patched in here), times trace, lowering and compile of each, and compares the optimized HLO
with metadata and instruction numbering removed.

    python -m lab.probes.layer_call_hlo [--model llama-3-8b] [--tokens 16]
"""

from __future__ import annotations

import argparse
import collections
import re
import tempfile
import time


def _normalized(text: str) -> list[str]:
    text = text[text.index("HloModule"):]
    keep = [ln for ln in text.splitlines() if not re.match(r"^\s*\d+ ", ln) and "file_location_id" not in ln
            and "file_name_id" not in ln and not ln.startswith(("FileNames", "FunctionNames", "FileLocations",
                                                                  "StackFrames"))]
    out = re.sub(r", metadata=\{[^}]*\}", "", "\n".join(keep))
    return sorted(re.sub(r"\.\d+", "", out).splitlines())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp

    from jaxengine import LLM
    from jaxengine.benchmarks.gpu_suite import synthetic_tokenizer
    from jaxengine.model_runner import Layout, _abstract, _flat, _forward, abstract_inputs
    from jaxengine.models import layer_call
    from jaxengine.models.presets import PRESETS

    vocab = PRESETS[args.model]["vocab_size"]
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", warmup=False, num_kv_blocks=256, max_num_seqs=16,
              max_model_len=1024, max_num_batched_tokens=256, compilation_cache_dir=None,
              tokenizer=synthetic_tokenizer(tempfile.mkdtemp(), vocab))
    r = llm.llm_engine.runner
    t = args.tokens
    texts = {}
    inlined = layer_call._apply
    called = jax.jit(layer_call._merged_call, static_argnums=(0, 2))
    for inline in (True, False):
        layer_call._apply = inlined if inline else called
        layout = Layout.of(abstract_inputs(t, r.rows_for(t), r.config.max_blocks_per_seq))
        fn = jax.jit(_flat(_forward, r.graphdef, r.param_treedef, layout=layout, attention=r.attention, lora_rank=0),
                     donate_argnums=(1,), out_shardings=r._fwd_out)
        prev = jax.ShapeDtypeStruct((r.config.max_num_seqs,), jnp.int32, sharding=r._rep)
        a = [r._params_abs, _abstract(r.kv_caches), layout.abstract(r._rep), prev]
        t0 = time.perf_counter()
        traced = fn.trace(*a)
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
        compiled = lowered.compile()
        t3 = time.perf_counter()
        texts[inline] = compiled.as_text()
        entry = texts[inline][texts[inline].index("ENTRY"):]
        kinds = collections.Counter(re.findall(r"kind=(\w+)", entry))
        print(f"{jax.devices()[0].device_kind} {args.model} T={t} inline={inline}: trace {t1 - t0:.2f} s, "
              f"lower {t2 - t1:.2f} s, compile {t3 - t2:.2f} s, fusions {dict(kinds)}", flush=True)
    a, b = _normalized(texts[True]), _normalized(texts[False])
    diff = collections.Counter(a) - collections.Counter(b), collections.Counter(b) - collections.Counter(a)
    print(f"optimized HLO equal (metadata, numbering removed): {a == b}; lines only inlined "
          f"{sum(diff[0].values())}, only called {sum(diff[1].values())}")
    for line in list(diff[0])[:3] + list(diff[1])[:3]:
        print("  ", line[:200])


if __name__ == "__main__":
    main()
