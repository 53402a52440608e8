# `bench serve` at rate inf against `bench throughput` on the Llama-3-8B shape, random 256/256 x 1000
# (issue #32), one H100; run from the checkout with .whl carried, after the wheel line. Writes $OUT/serve256/.
O=$OUT/serve256;D=/tmp/sg;mkdir -p $O $D
python3 -c "from jaxengine.benchmarks.gpu_suite import synthetic_tokenizer as s;s('/tmp/tok',128256)"
E="--load-format dummy --dtype bfloat16 --max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 2048 --tokenizer /tmp/tok --compilation-cache-dir /tmp/xc"
W="--num-prompts 1000 --input-len 256 --output-len 256"
python3 -m jaxengine.cli bench throughput --model llama-3-8b $E $W --output-json $O/off.json >$O/off.log 2>&1
echo "offline: $(grep Throughput $O/off.log)"
python3 -m jaxengine.server llama-3-8b $E --port 8000 --uvicorn-log-level warning >$O/srv.log 2>&1 &
for i in $(seq 300);do curl -sf localhost:8000/health>/dev/null&&break;sleep 1;done
b(){ python3 -m jaxengine.cli bench serve --base-url http://127.0.0.1:8000 $2 --request-rate inf --vocab-size 128256 --output-json $O/s_$1.json >$O/s_$1.log 2>&1;}
b warm "--num-prompts 64 --input-len 256 --output-len 256"
for r in 1 2;do b $r "$W";echo "serve $r: $(grep -E 'Output token thr|Mean TPOT|Mean TTFT' $O/s_$r.log|tr -s ' '|tr '\n' ';')";done
kill %1
