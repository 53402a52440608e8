# The server's GIL switch interval at rate inf on 256/256 x 1000 (Llama-3-8B shape, one H100; issue
# #32): offline once, then one server (lab/serve_gap/srv.py: the interval is set at run time through
# a file, and the engine's timing read before and after each run) and `bench serve` alternating
# 0.5 ms (the server's default), 0.1 ms and 0.02 ms, twice. Run after the wheel line; writes $OUT/sw/.
O=$OUT/sw;D=/tmp/sg;mkdir -p $O $D; export SERVE_GAP_DIR=$D
source lab/serve_gap/h100_env.sh; off $O
python3 lab/serve_gap/srv.py llama-3-8b $E --port 8000 --uvicorn-log-level warning >$O/srv.log 2>&1 & P=$!
for i in $(seq 300);do curl -sf localhost:8000/health>/dev/null&&break;sleep 1;done
b warm "--num-prompts 64 --input-len 256 --output-len 256"
for r in 1 2; do for sw in 0.0005 0.0001 0.00002; do
  echo $sw > $D/switch_8000; sleep 0.3; bash lab/serve_gap/cpu/timing.sh 8000 $O/t0_${r}_$sw.json
  b ${r}_$sw "$W"; bash lab/serve_gap/cpu/timing.sh 8000 $O/t1_${r}_$sw.json
  echo "$r sw=$sw $(grep -E 'Output token thr|Mean TPOT' $O/s_${r}_$sw.log|tr -s ' '|tr '\n' ';') engine $(python3 -c "import json;a=json.load(open('$O/t0_${r}_$sw.json'));b=json.load(open('$O/t1_${r}_$sw.json'));n=b['steps']-a['steps'];print(n,'steps',round(1e3*(b['step_s']-a['step_s'])/n,2),'ms/step, wait',round(1e3*(b['device_wait_s']-a['device_wait_s'])/n,2),'switch',b['switch_interval_s'])")"
done; done
kill $P; wait $P 2>/dev/null; rm -f $O/*.log.gz
