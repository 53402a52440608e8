# Order check for the serve-vs-offline ratio (issue #32, 256/256 x 1000 at rate inf, one H100): the
# runs of h100_drift.sh slowed with time on the machine, and offline always ran first. Here:
# server (warm-up, one run), offline, a fresh server (warm-up, one run), offline again.
O=/tmp/order;mkdir -p $O $OUT/order
source lab/serve_gap/h100_env.sh
off(){ python3 -m jaxengine.cli bench throughput --model llama-3-8b $E $W --output-json $O/off$1.json >$O/off$1.log 2>&1; echo "offline $1: $(grep Throughput $O/off$1.log) $(date +%T)"; }
srv(){ python3 -m jaxengine.server llama-3-8b $E --port 8000 --uvicorn-log-level warning >$O/srv$1.log 2>&1 & P=$!
  for i in $(seq 300);do curl -sf localhost:8000/health>/dev/null&&break;sleep 1;done
  python3 -m jaxengine.cli bench serve --base-url http://127.0.0.1:8000 --num-prompts 64 --input-len 256 --output-len 256 --request-rate inf --vocab-size 128256 >/dev/null 2>&1
  python3 -m jaxengine.cli bench serve --base-url http://127.0.0.1:8000 $W --request-rate inf --vocab-size 128256 --output-json $O/s$1.json >$O/s$1.log 2>&1
  echo "serve $1: $(grep -E 'Output token thr|Mean TPOT' $O/s$1.log|tr -s ' '|tr '\n' ';') $(date +%T)"; kill $P; wait $P 2>/dev/null; }
srv 1; off 1; srv 2; off 2
python3 -c "
import json,glob,os
o={os.path.basename(f)[:-5]:{k:v for k,v in json.load(open(f))['results'].items() if not isinstance(v,list)} for f in sorted(glob.glob('$O/*.json'))}
print(json.dumps(o))" > $OUT/order/summary.json
