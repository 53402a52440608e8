"""Same workload through AsyncEngine in-process (no HTTP): 256 consumers that only read their streams."""
import asyncio, os, sys, time, json
sys.path.insert(0, '/tmp/sg')
from thr import snap
from jaxengine.benchmarks.common import random_requests
from jaxengine import SamplingParams
from jaxengine.engine import LLMEngine
from jaxengine.config import EngineConfig
from jaxengine.async_engine import AsyncEngine
sw = float(os.environ.get('SG_SWITCH', '0') or 0)
if sw: sys.setswitchinterval(sw)
from jaxengine import LLM
llm = LLM('/tmp/sg/tiny', load_format='dummy', dtype='float32', max_model_len=256, max_num_seqs=256,
          max_num_batched_tokens=2048, compilation_cache_dir='/tmp/sg/xla', warmup=True)
eng = llm.llm_engine
eng.emit_unfinished = True
N = 256
async def run(seed):
    ae = AsyncEngine(eng); ae.start()
    reqs = random_requests(N, 16, 128, 0.0, 512, seed=seed)
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    chunks = 0
    async def one(i, r):
        nonlocal chunks
        async for out in ae.generate({"prompt_token_ids": r.prompt_token_ids}, params, f"r{seed}-{i}"):
            chunks += 1
            _ = out.outputs[0].text
    eng.timing.update(steps=0, device_wait_s=0.0, step_s=0.0)
    a = snap(os.getpid()); t0 = time.perf_counter()
    await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
    el = time.perf_counter() - t0; b = snap(os.getpid())
    await ae.shutdown()
    d = {k: round(b[k] - a.get(k, 0), 2) for k in b if b[k] - a.get(k, 0) > 0.005}
    t = eng.timing
    print(f"async-only switch {sys.getswitchinterval()}: {N*128/el:.0f} out tok/s, {el:.2f} s, steps {t['steps']} step {t['step_s']/t['steps']*1e3:.1f} ms (wait {t['device_wait_s']/t['steps']*1e3:.1f}), chunks {chunks}, threads {d}, load {os.getloadavg()[0]:.2f}", flush=True)
for s in range(int(os.environ.get('REPS', '3'))):
    asyncio.run(run(50 + s))
