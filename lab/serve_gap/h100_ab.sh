# `bench throughput` then `bench serve` at rate inf (Llama-3-8B shape, random 256/256 x 1000, one H100;
# issue #32) against two servers in turn: A with the project's own dependencies, B with uvloop and
# httptools added (uvicorn's "auto" picks them: vLLM's fastapi[standard] installs both). Wheels: .whl
# (the wheel line first) and .whl2 (uvloop, httptools), carried. Writes $OUT/ab/.
O=$OUT/ab;D=/tmp/sg;mkdir -p $O $D
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .whl2/*.whl
python3 -c "from jaxengine.benchmarks.gpu_suite import synthetic_tokenizer as s;s('/tmp/tok',128256)"
E="--load-format dummy --dtype bfloat16 --max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 2048 --tokenizer /tmp/tok --compilation-cache-dir /tmp/xc"
W="--num-prompts 1000 --input-len 256 --output-len 256"
python3 -m jaxengine.cli bench throughput --model llama-3-8b $E $W --output-json $O/off.json >$O/off.log 2>&1
echo "offline: $(grep Throughput $O/off.log)"
b(){ python3 -m jaxengine.cli bench serve --base-url http://127.0.0.1:8000 $2 --request-rate inf --vocab-size 128256 --output-json $O/s_$1.json >$O/s_$1.log 2>&1;}
for s in A B; do
  X=$PYTHONPATH; [ $s = B ] && X=/tmp/site2:$PYTHONPATH
  PYTHONPATH=$X python3 -c "import importlib.util as u;print('$s uvloop',bool(u.find_spec('uvloop')),'httptools',bool(u.find_spec('httptools')))"
  PYTHONPATH=$X python3 -m jaxengine.server llama-3-8b $E --port 8000 --uvicorn-log-level warning >$O/srv_$s.log 2>&1 & P=$!
  for i in $(seq 300);do curl -sf localhost:8000/health>/dev/null&&break;sleep 1;done
  b ${s}warm "--num-prompts 64 --input-len 256 --output-len 256"
  for r in 1 2;do b $s$r "$W";echo "serve $s$r: $(grep -E 'Output token thr|Mean TPOT' $O/s_$s$r.log|tr -s ' '|tr '\n' ';')";done
  kill $P; wait $P
done
