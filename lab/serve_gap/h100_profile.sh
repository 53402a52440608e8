# Where the server's host time goes at rate inf on one H100 (Llama-3-8B shape, 256/256, issue #32):
# one server (lab/serve_gap/srv.py: engine-timing side door), a warm-up, then two `bench serve` runs of
# 1000 prompts: per-thread CPU (/proc) and the engine's timing around each; the second under
# `py-spy record --gil --threads --nonblocking` (samples only the thread holding the GIL). Writes $OUT/prof/.
O=$OUT/prof;D=/tmp/sg;mkdir -p $O $D;R=$PWD;export SERVE_GAP_DIR=$D
cp lab/serve_gap/cpu/thr.py lab/serve_gap/cpu/timing.sh lab/serve_gap/srv.py $D/; chmod +x $D/timing.sh
python3 -c "from jaxengine.benchmarks.gpu_suite import synthetic_tokenizer as s;s('/tmp/tok',128256)"
E="--load-format dummy --dtype bfloat16 --max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 2048 --tokenizer /tmp/tok --compilation-cache-dir /tmp/xc"
W="--num-prompts 1000 --input-len 256 --output-len 256"
python3 $D/srv.py llama-3-8b $E --port 8000 --uvicorn-log-level warning >$O/srv.log 2>&1 & P=$!
for i in $(seq 300);do curl -sf localhost:8000/health>/dev/null&&break;sleep 1;done
b(){ python3 -m jaxengine.cli bench serve --base-url http://127.0.0.1:8000 $2 --request-rate inf --vocab-size 128256 --output-json $O/s_$1.json >$O/s_$1.log 2>&1;}
b warm "--num-prompts 64 --input-len 256 --output-len 256"
for r in 1 2; do
  python3 $D/thr.py snap $P $D/thr0.json; $D/timing.sh 8000 $O/tim0_$r.json
  [ $r = 2 ] && { /tmp/site/bin/py-spy record --gil --threads --nonblocking -r 200 -d 40 --format raw -o $O/gil.txt --pid $P >$O/pyspy.log 2>&1 & }
  b $r "$W"; python3 $D/thr.py diff $D/thr0.json $P | tee $O/thr_$r.txt; $D/timing.sh 8000 $O/tim1_$r.json
  echo "serve $r: $(grep -E 'Output token thr|Mean TPOT' $O/s_$r.log|tr -s ' '|tr '\n' ';')"
  python3 -c "import json;a=json.load(open('$O/tim0_$r.json'));b=json.load(open('$O/tim1_$r.json'));print({k:round(b[k]-a[k],3) for k in a if isinstance(a[k],(int,float)) and k!='switch'})"
done
sleep 2; kill $P; wait; tail -3 $O/pyspy.log
python3 lab/serve_gap/cpu/agg.py $O/gil.txt > $O/gil_agg.txt 2>&1; head -3 $O/gil_agg.txt
