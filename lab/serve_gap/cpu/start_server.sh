#!/bin/bash
# start_server.sh TREE PORT [SWITCH]
cd /tmp/sg && export PYTHONPATH=$1 JAX_PLATFORMS=cpu HF_HUB_OFFLINE=1 XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" SG_SWITCH=${3:-0}
nohup python /tmp/sg/srv.py /tmp/sg/tiny --load-format dummy --dtype float32 --max-model-len 256 --max-num-seqs 256 --max-num-batched-tokens 2048 --port $2 --served-model-name tiny --uvicorn-log-level warning --compilation-cache-dir /tmp/sg/xla --warmup > /tmp/sg/server_$2.log 2>&1 &
echo $! > /tmp/sg/server_$2.pid
