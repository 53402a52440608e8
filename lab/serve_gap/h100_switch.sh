#!/usr/bin/env bash
# Issue #32 on one H100: offline vs `bench serve` at rate inf, Llama-3-8B shape (dummy bf16), random
# 1024 in / 128 out, max_num_seqs 256, max_num_batched_tokens 2048, the suite's synthetic tokenizer.
# One server (this tree) serves every run; lab/serve_gap/srv.py switches its GIL switch interval
# between CPython's 5 ms and the server's 0.5 ms before each run, alternating, so the two share
# the process, its compiled programs and the machine. Writes to $OUT; prints a table last.
#   usage (device, repo root, .whl carried): bash lab/serve_gap/h100_switch.sh [NUM_PROMPTS] [ROUNDS]
set -u
N=${1:-1000}; ROUNDS=${2:-2}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export SERVE_GAP_DIR=/tmp/serve_gap; mkdir -p $SERVE_GAP_DIR
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} || exit 1
TOK=/tmp/tok; XLA=/tmp/xla_cache
python3 -c "from jaxengine.benchmarks.gpu_suite import synthetic_tokenizer as s; s('$TOK', 128256)" || exit 1
ENG="--load-format dummy --dtype bfloat16 --max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 2048 --tokenizer $TOK --compilation-cache-dir $XLA"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
echo "[$(date +%T)] offline" | tee -a "$OUT/log.txt"
python3 -m jaxengine.cli bench throughput --model llama-3-8b $ENG --num-prompts "$N" --input-len 1024 --output-len 128 \
  --output-json "$OUT/offline.json" > "$OUT/offline.log" 2>&1; tail -3 "$OUT/offline.log" | tee -a "$OUT/log.txt"
echo "[$(date +%T)] server" | tee -a "$OUT/log.txt"
python3 lab/serve_gap/srv.py llama-3-8b $ENG --port 8000 --served-model-name llama-3-8b --uvicorn-log-level warning \
  > "$OUT/server.log" 2>&1 &
SRV=$!
for i in $(seq 300); do curl -sf localhost:8000/health >/dev/null && break; sleep 1; done
echo "[$(date +%T)] server ready" | tee -a "$OUT/log.txt"
bench() {  # bench TAG PROMPTS
  python3 -m jaxengine.cli bench serve --base-url http://127.0.0.1:8000 --num-prompts "$2" --input-len 1024 \
    --output-len 128 --request-rate inf --vocab-size 128256 --output-json "$OUT/serve_$1.json" > "$OUT/serve_$1.log" 2>&1
}
timing() {  # timing FILE: the engine's timing dict from the server
  rm -f $SERVE_GAP_DIR/timing_8000.json; touch $SERVE_GAP_DIR/timing_req_8000
  for i in $(seq 100); do [ -f $SERVE_GAP_DIR/timing_8000.json ] && break; sleep 0.05; done
  cp $SERVE_GAP_DIR/timing_8000.json "$1"
}
bench warm 64
for r in $(seq "$ROUNDS"); do
  for sw in 0.005 0.0005; do
    echo "$sw" > $SERVE_GAP_DIR/switch_8000; sleep 0.3
    tag="r${r}_sw${sw}"; timing "$OUT/t0_$tag.json"
    bench "$tag" "$N"; timing "$OUT/t1_$tag.json"
    echo "[$(date +%T)] $tag: $(grep -E 'Output token throughput' "$OUT/serve_$tag.log")" | tee -a "$OUT/log.txt"
  done
done
kill $SRV; wait $SRV 2>/dev/null
python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
off = json.load(open(f"{out}/offline.json"))["results"]
t = off["engine_timing"]
print(f"offline: {off['output_tokens_per_s']:.0f} out tok/s, step {t['step_s'] / t['steps'] * 1e3:.1f} ms "
      f"(device wait {t['device_wait_s'] / t['steps'] * 1e3:.1f})")
for f in sorted(glob.glob(f"{out}/serve_r*.json")):
    tag = os.path.basename(f)[6:-5]
    m = json.load(open(f))["results"]
    a, b = json.load(open(f"{out}/t0_{tag}.json")), json.load(open(f"{out}/t1_{tag}.json"))
    steps = b["steps"] - a["steps"]
    print(f"{tag}: {m['output_throughput']:.0f} out tok/s ({m['output_throughput'] / off['output_tokens_per_s']:.2f} of offline), "
          f"TPOT mean {m['tpot_ms']['mean']:.1f} ms, TTFT mean {m['ttft_ms']['mean']:.0f} ms, engine step "
          f"{(b['step_s'] - a['step_s']) / steps * 1e3:.1f} ms (device wait {(b['device_wait_s'] - a['device_wait_s']) / steps * 1e3:.1f}) "
          f"over {steps} steps, switch {b['switch_interval_s']}")
PY
