# CPU A/B (2026-11-27, fifth session): uvloop vs asyncio's own loop in the server (lab/serve_gap/srv.py, SG_UVICORN_LOOP), tiny Llama (dummy f32), 256 x 16/128 at rate inf, both servers up, runs alternating
cd /work/main
export JAX_PLATFORMS=cpu HF_HUB_OFFLINE=1 SERVE_GAP_DIR=/tmp/lpcpu
start(){ SG_UVICORN_LOOP=$1 nohup python lab/serve_gap/srv.py /tmp/sg/tiny --load-format dummy --dtype float32 --max-model-len 256 --max-num-seqs 256 --max-num-batched-tokens 2048 --port $2 --served-model-name tiny --uvicorn-log-level warning --compilation-cache-dir /tmp/sg/xla > /tmp/lpcpu/srv_$1.log 2>&1 & echo $! > /tmp/lpcpu/pid_$1
  for i in $(seq 300); do curl -sf localhost:$2/health >/dev/null && break; sleep 1; done; }
start uvloop 8131; start asyncio 8132
b(){ python -m jaxengine.cli bench serve --base-url http://127.0.0.1:$2 --num-prompts 256 --input-len 16 --output-len 128 --request-rate inf --vocab-size 512 --output-json /tmp/lpcpu/s_$1.json > /tmp/lpcpu/s_$1.log 2>&1; echo "$1 $(grep -E 'Output token thr' /tmp/lpcpu/s_$1.log | tr -s ' ')"; }
b warm_u 8131; b warm_a 8132
for r in 1 2 3 4; do b uvloop_$r 8131; b asyncio_$r 8132; done
kill $(cat /tmp/lpcpu/pid_uvloop) $(cat /tmp/lpcpu/pid_asyncio)
