# gcrun.sh PORT THRESHOLD(or "") RUNS
cd /tmp/sg && export JAX_PLATFORMS=cpu HF_HUB_OFFLINE=1 XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
SG_GC_THRESHOLD=$2 nohup python /tmp/sg/gcsrv.py /tmp/sg/tiny --load-format dummy --dtype float32 --max-model-len 256 --max-num-seqs 256 --max-num-batched-tokens 2048 --port $1 --served-model-name tiny --uvicorn-log-level warning --compilation-cache-dir /tmp/sg/xla --warmup > /tmp/sg/gcsrv_$1.log 2>&1 &
P=$!
for i in $(seq 200); do curl -sf localhost:$1/health >/dev/null && break; sleep 1; done
A="bench serve --base-url http://127.0.0.1:$1 --num-prompts 1000 --input-len 16 --output-len 64 --request-rate inf --vocab-size 512"
python -m jaxengine.cli $A --num-prompts 64 > /dev/null 2>&1
for r in $(seq $3); do
  touch /tmp/sg/gc_req_$1; sleep 0.3
  python -m jaxengine.cli $A --output-json /tmp/sg/gc_r.json > /dev/null 2>&1
  touch /tmp/sg/gc_req_$1; sleep 0.3
  echo "thr=[$2] run $r: $(python ttft.py gc_r.json | cut -c1-45) rss_MB $(( $(awk "/VmRSS/{print \$2}" /proc/$P/status) / 1024 )) tracked $(python -c "import json;print(json.load(open('/tmp/sg/gc_$1.json'))['tracked'])")"
done
kill $P; wait $P 2>/dev/null
