# Does one server slow from run to run? (issue #32, 256/256 x 1000 at rate inf, Llama-3-8B shape, one
# H100): offline once; server A: warm-up and three runs; a fresh server B: warm-up and two runs.
# Engine step timing read around each run (lab/serve_gap/srv.py). Run after the wheel line; prints
# one line a run and writes only $OUT/drift/summary.json.
O=/tmp/drift;D=/tmp/sg;mkdir -p $O $D $OUT/drift; export SERVE_GAP_DIR=$D
source lab/serve_gap/h100_env.sh; off $O
for s in A B; do
  python3 lab/serve_gap/srv.py llama-3-8b $E --port 8000 --uvicorn-log-level warning >$O/srv_$s.log 2>&1 & P=$!
  for i in $(seq 300);do curl -sf localhost:8000/health>/dev/null&&break;sleep 1;done
  b ${s}warm "--num-prompts 64 --input-len 256 --output-len 256"
  for r in $(seq $([ $s = A ] && echo 3 || echo 2)); do
    timed $s$r; grep VmRSS /proc/$P/status | tr -s ' '
  done
  kill $P; wait $P 2>/dev/null
done
python3 - <<'P' > $OUT/drift/summary.json
import json,glob,os
o={'offline':json.load(open('/tmp/drift/off.json'))['results']}
for f in sorted(glob.glob('/tmp/drift/s_[AB][0-9].json')):
    k=os.path.basename(f)[2:-5]; o[k]={kk:v for kk,v in json.load(open(f))['results'].items() if not isinstance(v,list)}
    a=json.load(open(f'/tmp/drift/t0_{k}.json'));b=json.load(open(f'/tmp/drift/t1_{k}.json')); o[k]['engine']={'t0':a,'t1':b}
print(json.dumps(o))
P
