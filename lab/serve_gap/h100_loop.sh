# uvloop against asyncio's own event loop in the server (issue #32, 256/256 x 1000 at rate inf,
# Llama-3-8B shape, one H100): py-spy --gil put 22% of the asyncio thread's GIL samples on uvloop's
# socket write (serve_vs_offline_h100.md, "Where the server's GIL goes now"); asyncio's socket.send
# releases the GIL during the write. Offline, then a server per loop (warm-up, two runs each),
# engine timing around each run. Not run yet. Writes $OUT/loop/summary.json.
O=/tmp/lp;D=/tmp/sg;mkdir -p $O $D $OUT/loop; export SERVE_GAP_DIR=$D
source lab/serve_gap/h100_env.sh; off $O
for l in uvloop asyncio; do
  SG_UVICORN_LOOP=$l python3 lab/serve_gap/srv.py llama-3-8b $E --port 8000 --uvicorn-log-level warning >$O/srv_$l.log 2>&1 & P=$!
  for i in $(seq 300);do curl -sf localhost:8000/health>/dev/null&&break;sleep 1;done
  b w$l "--num-prompts 64 --input-len 256 --output-len 256"
  for r in 1 2; do
    timed $l$r
  done
  kill $P; wait $P 2>/dev/null
done
python3 lab/serve_gap/summary.py /tmp/lp > $OUT/loop/summary.json
