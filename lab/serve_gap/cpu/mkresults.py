import json, re, statistics as st, platform, os
runs = {}
for l in open('/tmp/sg/runs.jsonl'):
    r = json.loads(l); runs[r['tag']] = r
def srow(tag, config):
    r = runs[tag]; e = r.get('engine'); t = r.get('threads')
    row = {"run": tag, "config": config, "out_tok_s": round(r['out_tok_s'], 1), "duration_s": round(r['duration_s'], 3),
           "tpot_mean_ms": round(r['tpot_mean_ms'], 2), "ttft_mean_ms": round(r['ttft_mean_ms'], 1),
           "server_cpu_s": round(r['server_cpu_s'], 2), "client_cpu_s": round(r['client_cpu_s'], 2),
           "load1": round(r['load1'], 2)}
    if e:
        row.update(engine_steps=e['steps'], engine_step_ms=round(e['step_s'] / e['steps'] * 1e3, 2),
                   engine_device_wait_ms=round(e['device_wait_s'] / e['steps'] * 1e3, 2), sse_chunks=r['chunks'],
                   loop_thread_cpu_us_per_chunk=round(t.get('main', 0) / r['chunks'] * 1e6, 1),
                   engine_threads_cpu_us_per_token=round(t.get('python', 0) / 32768 * 1e6, 1),
                   xla_thread_cpu_s=round(t.get('tf_XLAEigen', 0), 2), switch_interval_s=r['switch'])
    return row
def off(tag):
    d = json.load(open(f'/tmp/sg/off_{tag}.json')); r = d['results']; t = r['engine_timing']
    load = re.search(r'load ([\d.]+)', open(f'/tmp/sg/off_{tag}.log').read())
    return {"run": tag, "config": "offline: jaxengine bench throughput (base tree; the engine is unchanged)",
            "out_tok_s": round(r['output_tokens_per_s'], 1), "duration_s": round(r['elapsed_s'], 3),
            "engine_steps": t['steps'], "engine_step_ms": round(t['step_s'] / t['steps'] * 1e3, 2),
            "engine_device_wait_ms": round(t['device_wait_s'] / t['steps'] * 1e3, 2)}
final = []
for i in (1, 2, 3):
    final.append(off(f'F_off{i}'))
    final.append(srow(f'F_base{i}', 'serve, base e4179c8'))
    final.append(srow(f'F_new{i}', 'serve, after 9f89e94'))
# offline loads printed by off1.sh
offl = {}
r1 = []
for i in (1, 2, 3):
    r1.append(srow(f'R1base{i}', 'serve, base e4179c8')); r1.append(srow(f'R1new{i}', 'serve, after 9f89e94'))
ao = []
for l in open('/tmp/sg/async_only.log'):
    m = re.match(r"async-only switch ([\d.]+): (\d+) out tok/s, ([\d.]+) s, steps (\d+) step ([\d.]+) ms \(wait ([\d.]+)\), chunks (\d+), threads (\{.*\}), load ([\d.]+)", l)
    sw, tps, el, steps, stepms, wait, chunks, thr, load = m.groups()
    thr = eval(thr)
    ao.append({"config": "AsyncEngine in-process, 256 consumers reading their streams, no HTTP (after 9f89e94)",
               "switch_interval_s": float(sw), "out_tok_s": int(tps), "duration_s": float(el), "engine_steps": int(steps),
               "engine_step_ms": float(stepms), "engine_device_wait_ms": float(wait), "outputs_delivered": int(chunks),
               "engine_threads_cpu_us_per_token": round(thr.get('python', 0) / 32768 * 1e6, 1), "load1": float(load)})
# attribution experiments (the earlier servers; no engine timing then)
exp_json = [srow(f'A{i}', 'serve, base e4179c8') for i in range(1, 9)] + \
           [srow(f'Bj{i}', 'serve, templated chunks only (de98c66 without the switch interval)') for i in range(1, 9)] + \
           [srow(f'Cs{i}', 'serve, templated chunks + switch interval 0.5 ms') for i in (1, 2, 3)]
# printed by an earlier version of the run script (before it wrote runs.jsonl): base with / without 0.5 ms
printed_switch_only = [
    {"run": "A1'", "config": "serve, base e4179c8", "out_tok_s": 6565, "tpot_mean_ms": 33.8, "load1": 4.20},
    {"run": "Bsw1", "config": "serve, base e4179c8 + switch interval 0.5 ms", "out_tok_s": 8417, "tpot_mean_ms": 23.3, "load1": 4.50},
    {"run": "A2'", "config": "serve, base e4179c8", "out_tok_s": 7921, "tpot_mean_ms": 26.2, "load1": 4.54},
    {"run": "Bsw2", "config": "serve, base e4179c8 + switch interval 0.5 ms", "out_tok_s": 9736, "tpot_mean_ms": 20.6, "load1": 4.58},
    {"run": "A3'", "config": "serve, base e4179c8", "out_tok_s": 6680, "tpot_mean_ms": 30.8, "load1": 4.81},
    {"run": "Bsw3", "config": "serve, base e4179c8 + switch interval 0.5 ms", "out_tok_s": 7244, "tpot_mean_ms": 28.5, "load1": 4.99}]
switch_values = [srow(t, f"serve, after 9f89e94, switch interval {runs[t]['switch']*1e3:.1f} ms") for t in
                 [k for k in runs if k.startswith('R2_')]]
httptools = [srow(t, 'serve, after 9f89e94' + (' + httptools 0.9.0 on the path (uvicorn picks it over h11)' if 'ht' in t else ' (h11)'))
             for t in [k for k in runs if k.startswith('R3')]]
client = [srow(t, 'client: ' + ('bench serve as committed (httpx aiter_lines)' if 'old' in t else
                                 'client splitting SSE lines from aiter_bytes (tried, not kept)'))
          for t in [k for k in runs if k.startswith('C_') and k != 'C_one']]
client_one = srow('C_one', 'client startup alone: --num-prompts 1')

def med(rows, cfg_prefix, key='out_tok_s'):
    return st.median(r[key] for r in rows if r['config'].startswith(cfg_prefix))
summary = {
    "final_round": {
        "offline_out_tok_s_median": med(final, 'offline'),
        "serve_base_out_tok_s_median": med(final, 'serve, base'),
        "serve_after_out_tok_s_median": med(final, 'serve, after'),
    },
    "round_R1": {"serve_base_out_tok_s_median": med(r1, 'serve, base'), "serve_after_out_tok_s_median": med(r1, 'serve, after')},
    "async_engine_no_http_out_tok_s_median": st.median(a['out_tok_s'] for a in ao),
}
f = summary['final_round']
f['ratio_base'] = round(f['serve_base_out_tok_s_median'] / f['offline_out_tok_s_median'], 3)
f['ratio_after'] = round(f['serve_after_out_tok_s_median'] / f['offline_out_tok_s_median'], 3)
summary['async_engine_ratio_to_final_offline'] = round(summary['async_engine_no_http_out_tok_s_median'] / f['offline_out_tok_s_median'], 3)
payload = {
    "benchmark": "serve at rate inf vs offline, same workload, CPU (issue #32)",
    "date_utc": "2026-11-26",
    "commits": {"base": "e4179c8", "after": "9f89e94 (de98c66 templated chunks + 9f89e94 switch interval)"},
    "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                "note": "2 cores shared with another session's pytest (1-2 cores busy); load average 4-7 during the runs"},
    "workload": {"model": "tiny Llama (benchmarks/gpu_suite.py make_tiny_model: 2 layers, hidden 64, vocabulary 512, synthetic word-level tokenizer), --load-format dummy, float32",
                 "engine": "--max-model-len 256 --max-num-seqs 256 --max-num-batched-tokens 2048, --warmup (every bucket compiled before the runs)",
                 "requests": "256 random prompts of 16 token ids, 128 output tokens each, ignore_eos",
                 "xla": "XLA_FLAGS=--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1 (the 'device' is one thread)",
                 "offline": "jaxengine bench throughput --num-prompts 256 --input-len 16 --output-len 128 --num-warmup 256 (temperature 1.0, as the bench does)",
                 "serve": "python -m jaxengine.server (same engine flags) on 127.0.0.1; jaxengine bench serve --num-prompts 256 --input-len 16 --output-len 128 --request-rate inf --vocab-size 512 (stream, temperature 0, include_usage); one warm-up run per server before its measured runs; servers stay up across runs, runs alternate",
                 "per_thread_cpu": "from /proc/<pid>/task/*/stat before and after each run: 'loop thread' = the uvicorn/asyncio main thread, 'engine threads' = every other Python thread (engine loop, output worker, AnyIO workers), XLA = tf_XLAEigen",
                 "engine_timing": "LLMEngine.timing read from inside the server process before and after each run (a measurement-only wrapper, lab/serve_gap_cpu/srv.py)"},
    "summary": summary,
    "final_round_alternating": final,
    "round_R1_alternating": r1,
    "async_engine_no_http": ao,
    "experiments": {
        "templated_chunks_only_vs_base": exp_json,
        "switch_interval_only_on_base_printed": printed_switch_only,
        "switch_interval_values": switch_values,
        "httptools_instead_of_h11": httptools,
        "client_line_splitting": client,
        "client_startup_only": client_one,
    },
}
json.dump(payload, open('/tmp/sg/out/serve_vs_offline_cpu.json', 'w'), indent=1)
print(json.dumps(summary, indent=1))

# ---- Markdown
def fmt(x, f='.0f'):
    return '' if x is None else format(x, f)
md = ["# `bench serve` at rate inf against offline, same workload (CPU, tiny Llama; issue #32)", "",
      "Machine: this workplace's CPU machine, 2 cores, shared with another session's test run (load average 4-7 "
      "during every run; the two cores were oversubscribed throughout). No GPU. Base e4179c8, after 9f89e94 "
      "(de98c66: templated stream chunks, background close on the loop; 9f89e94: GIL switch interval 0.5 ms in the server).", "",
      "Workload: tiny Llama (`benchmarks/gpu_suite.py` `make_tiny_model`: 2 layers, hidden 64, vocabulary 512, synthetic "
      "word-level tokenizer), `--load-format dummy --dtype float32 --max-model-len 256 --max-num-seqs 256 "
      "--max-num-batched-tokens 2048 --warmup`, XLA on one thread (`--xla_cpu_multi_thread_eigen=false "
      "intra_op_parallelism_threads=1`); 256 random 16-token prompts, 128 output tokens, ignore_eos. So the model is "
      "nearly free and each step's host work (one SSE chunk per request per step in the server) dominates.", "",
      "- offline: `jaxengine bench throughput --model <tiny> ... --num-prompts 256 --input-len 16 --output-len 128 --num-warmup 256` (a fresh process each run);",
      "- serve: `python -m jaxengine.server <tiny> ...` (through a wrapper that only adds a side door reading `LLMEngine.timing`: `lab/serve_gap/cpu/srv.py`), "
      "then `jaxengine bench serve --num-prompts 256 --input-len 16 --output-len 128 --request-rate inf --vocab-size 512` "
      "(streaming, temperature 0, include_usage); base and after servers up side by side, one warm-up run each, runs alternating.",
      "- per-thread CPU from `/proc/<pid>/task/*/stat` around each run: loop = the uvicorn/asyncio main thread, engine = "
      "the other Python threads (engine loop, output worker, AnyIO workers), XLA = the compute thread. Engine step = "
      "`LLMEngine.timing` (step_s / steps; device wait = the wait for the step's tokens).", "",
      "## Final round (offline, base, after; alternating)", "",
      "| run | out tok/s | of offline (median) | duration s | TPOT mean ms | engine step ms (device wait) | SSE chunks | loop CPU us / chunk | engine threads CPU us / token | server CPU s | client CPU s | load |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|"]
offm = summary['final_round']['offline_out_tok_s_median']
for r in final:
    if r['config'].startswith('offline'):
        md.append(f"| offline {r['run'][-1]} | {r['out_tok_s']:.0f} | | {r['duration_s']:.2f} | | {r['engine_step_ms']:.1f} ({r['engine_device_wait_ms']:.1f}) | | | | | | |")
    else:
        name = ('base ' if 'base' in r['config'] else 'after ') + r['run'][-1]
        md.append(f"| {name} | {r['out_tok_s']:.0f} | {r['out_tok_s'] / offm:.2f} | {r['duration_s']:.2f} | {r['tpot_mean_ms']:.1f} | "
                  f"{r['engine_step_ms']:.1f} ({r['engine_device_wait_ms']:.1f}) | {r['sse_chunks']} | {r['loop_thread_cpu_us_per_chunk']:.1f} | "
                  f"{r['engine_threads_cpu_us_per_token']:.1f} | {r['server_cpu_s']:.2f} | {r['client_cpu_s']:.2f} | {r['load1']:.1f} |")
f = summary['final_round']
md += ["", f"Medians: offline **{f['offline_out_tok_s_median']:.0f}** output tok/s; serve base **{f['serve_base_out_tok_s_median']:.0f}** "
       f"(**{f['ratio_base']:.2f}** of offline), after **{f['serve_after_out_tok_s_median']:.0f}** (**{f['ratio_after']:.2f}**). "
       f"An earlier alternating round (R1, same servers) gave base {summary['round_R1']['serve_base_out_tok_s_median']:.0f} and after "
       f"{summary['round_R1']['serve_after_out_tok_s_median']:.0f} (medians of 3). The issue's target (within 10% of offline) is not met on this machine.", "",
       "Client CPU includes about 1.25 s of start-up (imports) per run: `--num-prompts 1` alone cost 1.25 s.", "",
       "## Where the time goes", "",
       f"- **Without HTTP** (AsyncEngine in-process, 256 consumers that only read their streams, after 9f89e94, 6 runs): median "
       f"**{summary['async_engine_no_http_out_tok_s_median']:.0f}** tok/s, {summary['async_engine_ratio_to_final_offline']:.2f} of the final round's offline "
       "median; engine step 15-18 ms against offline's 13 ms; the engine threads spend 22-38 us CPU per token against offline's 22 "
       "(offline: 0.26 s main + 0.46 s output worker per run; the server additionally builds a RequestOutput per request per step and "
       "routes it). The switch interval made no difference there (3 runs each: 15059/14460/13828 at 5 ms, 13284/15417/13753 at 0.5 ms).",
       "- **The HTTP streaming path** is the larger part: the asyncio thread spends 40-58 us of CPU per SSE chunk (one chunk per "
       "request per step; 256 per step here). A py-spy profile of the server (after the templated chunks) put 38% of that thread in "
       "the ASGI send path (26% in uvloop's transport write itself, 8% in h11, the rest in Starlette's send wrappers), 20% in our "
       "generator (delta, chunk, the stream wake-up) and 21% in the event loop's own C code; building and dumping the pydantic "
       "chunk had been about 9 us of it (now 0.5 us).",
       "- **GIL hand-backs**: the engine thread releases the GIL at every device call and wait of a step and must get it back from "
       "the event loop; with CPython's 5 ms switch interval each hand-back can wait 5 ms while the loop streams. In the final round the engine step "
       "in the server was 33-37 ms with base (host part, step minus device wait, 16-21 ms) and 28-30 ms after (host part 8-10 ms; "
       "the device wait grew to 19-20 ms: the XLA thread now shares the cores with the loop's streaming), against offline's 13 ms "
       "(host part 1.7-2 ms).",
       "- **The client** (`bench serve`, httpx) runs on the same two cores: about 2.5-3.2 s CPU per run, 1.25 s of it start-up.", "",
       "## Attribution (alternating A/B rounds, same workload)", "",
       "| change | runs | out tok/s | note |", "|---|---|---|---|"]
def vals(rows, pre):
    return [round(r['out_tok_s']) for r in rows if r['config'].startswith(pre)]
a = vals(exp_json, 'serve, base'); bj = vals(exp_json, 'serve, templated chunks only'); cs = vals(exp_json, 'serve, templated chunks +')
bsw = [r['out_tok_s'] for r in printed_switch_only if 'switch' in r['config']]; ab = [r['out_tok_s'] for r in printed_switch_only if 'switch' not in r['config']]
md.append(f"| base | 8 | {'/'.join(map(str, a))} (median {st.median(a):.0f}) | |")
md.append(f"| templated chunks only | 8 | {'/'.join(map(str, bj))} (median {st.median(bj):.0f}) | no tok/s change visible; the loop sent more chunks (fewer coalesced: 27.9-30.7k against 23.9-27.3k) at about 35 us CPU each against 43-47 |")
md.append(f"| base + switch 0.5 ms (no templated chunks) | 3 vs 3 | {'/'.join(map(str, bsw))} vs base {'/'.join(map(str, ab))} | alternating with base in the same minutes (printed by an earlier version of the run script) |")
md.append(f"| templated chunks + switch 0.5 ms | 3 | {'/'.join(map(str, cs))} (median {st.median(cs):.0f}) | same round as the last 3 base and templated-only runs above |")
sv = {}
for r in switch_values:
    sv.setdefault(r['switch_interval_s'], []).append(round(r['out_tok_s']))
for k in sorted(sv):
    md.append(f"| after, switch {k * 1e3:.1f} ms | {len(sv[k])} | {'/'.join(map(str, sv[k]))} (median {st.median(sv[k]):.0f}) | switch values side by side (load 7-8); within the noise of each other |")
h = [round(r['out_tok_s']) for r in httptools if 'httptools' in r['config']]; hn = [round(r['out_tok_s']) for r in httptools if 'httptools' not in r['config']]
md.append(f"| after + httptools 0.9.0 installed (uvicorn picks it over h11) | 3 vs 3 | {'/'.join(map(str, h))} vs {'/'.join(map(str, hn))} | loop CPU 32-37 vs 36-41 us / chunk; not a dependency of the project, not changed |")
c_old = [round(r['out_tok_s']) for r in client if 'committed' in r['config']]; c_new = [round(r['out_tok_s']) for r in client if 'tried' in r['config']]
md.append(f"| client splitting SSE lines from raw bytes instead of httpx `aiter_lines` | 3 vs 3 | {'/'.join(map(str, c_new))} vs {'/'.join(map(str, c_old))} | client CPU not lower (2.72-3.00 s vs 2.59-2.83 s): the cost is httpx's read path, not line splitting; reverted |")
md += ["", "## What is left", "",
       "- On one H100 the gap is not there at main (serve_vs_offline_h100.md: 0.93-1.03 of offline, Llama-3-8B shape, 800 x 1024/128, "
       "switch interval 5 ms or 0.5 ms alike); what remains is a CPU-machine and small-model effect, where the per-chunk work is large "
       "against the step.",
       "- On this 2-core machine the serve run is CPU-bound (server about 3.4-4.1 s CPU, client 2.5-3.2 s, another session 1-2 cores): "
       "any CPU taken off the per-chunk path shows up, but the ratio depends on the load as much as on the code.",
       "- The per-chunk cost that remains is mostly outside the server's own code (uvloop's write, h11, Starlette's send wrappers, "
       "the task wake-up), and it runs on the same GIL as the engine's Python. The structural fix is vLLM v1's: the engine core in "
       "its own process (outputs over ZMQ or a pipe), so the API process's per-chunk work overlaps the engine step on another core "
       "instead of interleaving with it; further, several API processes. Not built here.",
       "- Smaller items measured but not changed: the server builds a cumulative RequestOutput per request per step "
       "(about 10 us per token more engine-thread CPU than offline, without HTTP); `bench serve`'s httpx client costs about as much "
       "CPU per chunk as the server's loop.", ""]
open('/tmp/sg/out/serve_vs_offline_cpu.md', 'w').write('\n'.join(md))
