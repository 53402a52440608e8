"""AsyncEngine in-process, 256 consumers x 128 tokens; GC collections and their time per generation."""
import asyncio, gc, os, sys, time, collections
from jaxengine.benchmarks.common import random_requests
from jaxengine import SamplingParams, LLM
from jaxengine.async_engine import AsyncEngine
llm = LLM('/tmp/sg/tiny', load_format='dummy', dtype='float32', max_model_len=256, max_num_seqs=256,
          max_num_batched_tokens=2048, compilation_cache_dir='/tmp/sg/xla', warmup=True)
eng = llm.llm_engine
gc.collect(); gc.freeze()
stats = collections.defaultdict(lambda: [0, 0.0]); t_start = {}
def cb(phase, info):
    if phase == "start": t_start['t'] = time.perf_counter()
    else:
        s = stats[info["generation"]]; s[0] += 1; s[1] += time.perf_counter() - t_start['t']
gc.callbacks.insert(0, cb)
N = 256
async def run(seed, thr):
    gc.set_threshold(*thr)
    ae = AsyncEngine(eng); ae.start()
    reqs = random_requests(N, 16, 128, 0.0, 512, seed=seed)
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    async def one(i, r):
        async for out in ae.generate({"prompt_token_ids": r.prompt_token_ids}, params, f"r{seed}-{i}"):
            _ = out.outputs[0].text
    stats.clear(); t0 = time.perf_counter()
    await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
    el = time.perf_counter() - t0
    await ae.shutdown()
    print(f"threshold {thr}: {N*128/el:.0f} tok/s {el:.2f} s; gc " + ", ".join(f"gen{g}: {n} x, {t*1e3:.0f} ms" for g, (n, t) in sorted(stats.items())) + f"; tracked {len(gc.get_objects())}", flush=True)
for s, thr in enumerate([(700, 10, 10), (50000, 20, 100), (700, 10, 10), (50000, 20, 100)]):
    asyncio.run(run(50 + s, thr))
