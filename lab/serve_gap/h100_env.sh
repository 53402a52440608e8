# Sourced by the serve-gap H100 scripts (issue #32): prints the host CPU, writes the synthetic
# tokenizer of the Llama-3-8B shape to /tmp/tok, and sets E (the engine flags, as the GPU suite's)
# and W (the 256/256 x 1000 workload). `off DIR`: `bench throughput` into DIR/off.json and .log.
lscpu | grep -E "Model name" | tr -s ' '
python3 -c "from jaxengine.benchmarks.gpu_suite import synthetic_tokenizer as s;s('/tmp/tok',128256)"
E="--load-format dummy --dtype bfloat16 --max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 2048 --tokenizer /tmp/tok --compilation-cache-dir /tmp/xc"
W="--num-prompts 1000 --input-len 256 --output-len 256"
off(){ python3 -m jaxengine.cli bench throughput --model llama-3-8b $E $W --output-json $1/off.json >$1/off.log 2>&1
  echo "offline: $(grep Throughput $1/off.log)"; }
# `b TAG ARGS`: `bench serve` at rate inf against :8000 into $O/s_TAG.json and .log. `timed TAG`:
# the 1000-prompt run as `b`, with the server's engine timing read around it (lab/serve_gap/srv.py,
# SERVE_GAP_DIR); prints throughput, TPOT and the engine's ms a step and device wait. Need O.
b(){ python3 -m jaxengine.cli bench serve --base-url http://127.0.0.1:8000 $2 --request-rate inf --vocab-size 128256 --output-json $O/s_$1.json >$O/s_$1.log 2>&1;}
timed(){ bash lab/serve_gap/cpu/timing.sh 8000 $O/t0_$1.json; b $1 "$W"; bash lab/serve_gap/cpu/timing.sh 8000 $O/t1_$1.json
  echo "$1: $(grep -E 'Output token thr|Mean TPOT' $O/s_$1.log|tr -s ' '|tr '\n' ';') engine $(python3 -c "import json;a=json.load(open('$O/t0_$1.json'));b=json.load(open('$O/t1_$1.json'));n=b['steps']-a['steps'];print(n,'steps',round(1e3*(b['step_s']-a['step_s'])/n,2),'ms/step, wait',round(1e3*(b['device_wait_s']-a['device_wait_s'])/n,2))")"; }
