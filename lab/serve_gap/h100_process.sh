# The engine in its own process (the server's default since 2026-11-27; `--no-engine-process`
# keeps one process) at 256/256 x 1000, rate inf, Llama-3-8B shape, one H100 (issue #32): py-spy
# --gil put the engine loop (28%) and the output worker (17%) on the same GIL as the event loop
# (54%). Ceilings (in a subprocess), offline, then a server per mode (warm-up, three runs each),
# engine timing around each run (the child's in process mode); the GPU's compute processes listed
# while each server runs. MODES (default "process inproc") picks the servers and their order.
# Writes $OUT/proc/summary.json.
O=/tmp/pr;D=/tmp/sg;mkdir -p $O $D $OUT/proc; export SERVE_GAP_DIR=$D
source lab/serve_gap/h100_env.sh
python3 -c "import json;from jaxengine.benchmarks.ceilings import measure;print(json.dumps(measure()))" > $O/ceilings.json
echo "ceilings: $(cat $O/ceilings.json)"
off $O
for m in ${MODES:-process inproc}; do
  F=""; [ $m = inproc ] && F="--no-engine-process"
  python3 lab/serve_gap/srv.py llama-3-8b $E $F --port 8000 --uvicorn-log-level warning >$O/srv_$m.log 2>&1 & P=$!
  for i in $(seq 300);do curl -sf localhost:8000/health>/dev/null&&break;sleep 1;done
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader > $O/gpu_$m.txt; echo "$m GPU processes: $(tr '\n' ';' < $O/gpu_$m.txt)"
  b w$m "--num-prompts 64 --input-len 256 --output-len 256"
  for r in 1 2 3; do
    timed $m$r
  done
  kill $P; wait $P 2>/dev/null
done
python3 lab/serve_gap/summary.py /tmp/pr > $OUT/proc/summary.json
