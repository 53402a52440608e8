# Sourced by the serve-gap H100 scripts (issue #32): prints the host CPU, writes the synthetic
# tokenizer of the Llama-3-8B shape to /tmp/tok, and sets E (the engine flags, as the GPU suite's)
# and W (the 256/256 x 1000 workload). `off DIR`: `bench throughput` into DIR/off.json and .log.
lscpu | grep -E "Model name" | tr -s ' '
python3 -c "from jaxengine.benchmarks.gpu_suite import synthetic_tokenizer as s;s('/tmp/tok',128256)"
E="--load-format dummy --dtype bfloat16 --max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 2048 --tokenizer /tmp/tok --compilation-cache-dir /tmp/xc"
W="--num-prompts 1000 --input-len 256 --output-len 256"
off(){ python3 -m jaxengine.cli bench throughput --model llama-3-8b $E $W --output-json $1/off.json >$1/off.log 2>&1
  echo "offline: $(grep Throughput $1/off.log)"; }
