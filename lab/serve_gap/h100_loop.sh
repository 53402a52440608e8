# uvloop against asyncio's own event loop in the server (issue #32, 256/256 x 1000 at rate inf,
# Llama-3-8B shape, one H100): py-spy --gil put 22% of the asyncio thread's GIL samples on uvloop's
# socket write (serve_vs_offline_h100.md, "Where the server's GIL goes now"); asyncio's socket.send
# releases the GIL during the write. Offline, then a server per loop (warm-up, two runs each),
# engine timing around each run. Not run yet. Writes $OUT/loop/summary.json.
O=/tmp/lp;D=/tmp/sg;mkdir -p $O $D $OUT/loop; export SERVE_GAP_DIR=$D
source lab/serve_gap/h100_env.sh; off $O
b(){ python3 -m jaxengine.cli bench serve --base-url http://127.0.0.1:8000 $2 --request-rate inf --vocab-size 128256 --output-json $O/s_$1.json >$O/s_$1.log 2>&1;}
for l in uvloop asyncio; do
  SG_UVICORN_LOOP=$l python3 lab/serve_gap/srv.py llama-3-8b $E --port 8000 --uvicorn-log-level warning >$O/srv_$l.log 2>&1 & P=$!
  for i in $(seq 300);do curl -sf localhost:8000/health>/dev/null&&break;sleep 1;done
  b w$l "--num-prompts 64 --input-len 256 --output-len 256"
  for r in 1 2; do
    bash lab/serve_gap/cpu/timing.sh 8000 $O/t0_$l$r.json; b $l$r "$W"; bash lab/serve_gap/cpu/timing.sh 8000 $O/t1_$l$r.json
    echo "loop=$l run $r: $(grep -E 'Output token thr|Mean TPOT' $O/s_$l$r.log|tr -s ' '|tr '\n' ';') engine $(python3 -c "import json;a=json.load(open('$O/t0_$l$r.json'));b=json.load(open('$O/t1_$l$r.json'));n=b['steps']-a['steps'];print(n,'steps',round(1e3*(b['step_s']-a['step_s'])/n,2),'ms/step, wait',round(1e3*(b['device_wait_s']-a['device_wait_s'])/n,2))")"
  done
  kill $P; wait $P 2>/dev/null
done
python3 - <<'P' > $OUT/loop/summary.json
import json,glob,os
o={'offline':json.load(open('/tmp/lp/off.json'))['results']}
for f in sorted(glob.glob('/tmp/lp/s_*[12].json')):
    k=os.path.basename(f)[2:-5]
    if k.startswith('w'): continue
    o[k]={kk:v for kk,v in json.load(open(f))['results'].items() if not isinstance(v,list)}
    o[k]['engine']={'t0':json.load(open(f'/tmp/lp/t0_{k}.json')),'t1':json.load(open(f'/tmp/lp/t1_{k}.json'))}
print(json.dumps(o))
P
