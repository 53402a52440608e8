"""Offline run of the same workload, with CPU time per thread around the timed generate."""
import os, sys, time, json
sys.path.insert(0, '/tmp/sg')
from thr import snap
from jaxengine.benchmarks.throughput import run_throughput
from jaxengine.benchmarks.common import random_requests, SampleRequest
from jaxengine import LLM
llm = LLM('/tmp/sg/tiny', load_format='dummy', dtype='float32', max_model_len=256, max_num_seqs=256,
          max_num_batched_tokens=2048, compilation_cache_dir='/tmp/sg/xla', warmup=True)
N=256
reqs = [SampleRequest(r.prompt_token_ids, 128) for r in random_requests(N, 16, 128, 0.0, 512, seed=0)]
warm = [SampleRequest(r.prompt_token_ids, 128) for r in random_requests(N, 16, 128, 0.0, 512, seed=7)]
run_throughput(llm, warm)
for k in range(int(os.environ.get('REPS', '3'))):
    a = snap(os.getpid()); t = os.times()
    res = run_throughput(llm, reqs if k == 0 else [SampleRequest(r.prompt_token_ids, 128) for r in random_requests(N, 16, 128, 0.0, 512, seed=100 + k)])
    b = snap(os.getpid())
    d = {kk: round(b[kk] - a.get(kk, 0), 2) for kk in b if b[kk] - a.get(kk, 0) > 0.005}
    print(f"offline: {res['output_tokens_per_s']:.0f} out tok/s, {res['elapsed_s']:.2f} s, timing {res['engine_timing']}, threads {d}, load {os.getloadavg()[0]:.2f}", flush=True)
