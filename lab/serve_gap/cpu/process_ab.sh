# CPU A/B (2026-11-27, third session): the engine in its own process (the server's default) against
# --no-engine-process, tiny Llama (dummy f32, /tmp/sg/tiny: a config.json and the SmolLM2
# tokenizer), 256 x 16/128 at rate inf; offline first, then both servers up, runs alternating.
# Writes /tmp/prcpu/*.json; summary: python lab/serve_gap/cpu/summ.py-style grep of the logs.
cd /work/main
export JAX_PLATFORMS=cpu HF_HUB_OFFLINE=1 SERVE_GAP_DIR=/tmp/prcpu; mkdir -p /tmp/prcpu
F="--load-format dummy --dtype float32 --max-model-len 256 --max-num-seqs 256 --max-num-batched-tokens 2048 --compilation-cache-dir /tmp/sg/xla"
python -m jaxengine.cli bench throughput --model /tmp/sg/tiny $F --num-prompts 256 --input-len 16 --output-len 128 --output-json /tmp/prcpu/off.json > /tmp/prcpu/off.log 2>&1
echo "offline $(grep Throughput /tmp/prcpu/off.log)"
start(){ nohup python lab/serve_gap/srv.py /tmp/sg/tiny $F $3 --port $2 --served-model-name tiny --uvicorn-log-level warning > /tmp/prcpu/srv_$1.log 2>&1 & echo $! > /tmp/prcpu/pid_$1
  for i in $(seq 300); do curl -sf localhost:$2/health >/dev/null && break; sleep 1; done; }
start process 8141 ""; start inproc 8142 --no-engine-process
b(){ python -m jaxengine.cli bench serve --base-url http://127.0.0.1:$2 --num-prompts 256 --input-len 16 --output-len 128 --request-rate inf --vocab-size 512 --output-json /tmp/prcpu/s_$1.json > /tmp/prcpu/s_$1.log 2>&1; echo "$1 $(grep -E 'Output token thr' /tmp/prcpu/s_$1.log | tr -s ' ') load $(cut -d' ' -f1 /proc/loadavg)"; }
b warm_p 8141; b warm_i 8142
for r in 1 2 3; do b process_$r 8141; b inproc_$r 8142; done
kill -INT $(cat /tmp/prcpu/pid_process) $(cat /tmp/prcpu/pid_inproc)
