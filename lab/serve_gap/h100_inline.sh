# The command sent to the H100 for benchmarks/results/serve_vs_offline_h100.md (run from the main checkout, .whl carried).
O=$OUT;D=/tmp/sg;mkdir -p $D
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl;export PYTHONPATH=/tmp/site:$PWD
python3 -c "from jaxengine.benchmarks.gpu_suite import synthetic_tokenizer as s;s('/tmp/tok',128256)"
E="--load-format dummy --dtype bfloat16 --max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 2048 --tokenizer /tmp/tok --compilation-cache-dir /tmp/xc"
nvidia-smi --query-gpu=name --format=csv,noheader;date +%T
python3 -m jaxengine.cli bench throughput --model llama-3-8b $E --num-prompts 800 --input-len 1024 --output-len 128 --output-json $D/off.json >$O/off.log 2>&1
grep Throughput $O/off.log;date +%T
cat >$D/s.py <<'P'
import sys,os,threading,time,runpy
def p():
 while 1:
  time.sleep(.05)
  if os.path.exists('/tmp/sg/sw'):sys.setswitchinterval(float(open('/tmp/sg/sw').read()));os.remove('/tmp/sg/sw')
threading.Thread(target=p,daemon=True).start()
sys.argv=['x']+sys.argv[1:];runpy.run_module('jaxengine.server',run_name='__main__')
P
python3 $D/s.py llama-3-8b $E --port 8000 --uvicorn-log-level warning >$O/srv.log 2>&1 &
for i in $(seq 300);do curl -sf localhost:8000/health>/dev/null&&break;sleep 1;done;date +%T
b(){ python3 -m jaxengine.cli bench serve --base-url http://127.0.0.1:8000 --num-prompts $2 --input-len 1024 --output-len 128 --request-rate inf --vocab-size 128256 --output-json $D/s_$1.json >$D/s_$1.log 2>&1;}
b w 64
for r in 1 2;do for sw in 0.005 0.0005;do echo $sw>$D/sw;sleep .3;b ${r}_$sw 800;echo "$r sw=$sw $(grep -E 'Output token thr|Mean TPOT|Mean TTFT' $D/s_${r}_$sw.log|tr -s ' '|tr '\n' ';') $(date +%T)";done;done
python3 -c "import json;t=json.load(open('$D/off.json'))['results']['engine_timing'];print(t)"
tar czf $O/all.tgz -C $D .
