#!/bin/bash
cd /tmp/sg && export PYTHONPATH=/tmp/sg/base JAX_PLATFORMS=cpu HF_HUB_OFFLINE=1 XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
python -m jaxengine.cli bench throughput --model /tmp/sg/tiny --load-format dummy --dtype float32 --max-model-len 256 --max-num-seqs 256 --max-num-batched-tokens 2048 --num-prompts ${N:-256} --input-len 16 --output-len 128 --num-warmup ${N:-256} --compilation-cache-dir /tmp/sg/xla --warmup --output-json /tmp/sg/off_$1.json > /tmp/sg/off_$1.log 2>&1
echo "$1: $(grep Throughput /tmp/sg/off_$1.log) load $(cut -d' ' -f1 /proc/loadavg)"
