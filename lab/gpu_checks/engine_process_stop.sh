# The server's stop with the engine in its own process, on one H100 (2026-11-27): start the
# Llama-3-8B shape (dummy weights), one completion, SIGINT; how long the exit takes, its status,
# and whether the server warned about the engine process (suite_serve.md: it did once, a second
# after the shutdown began, before the server polled for the child's exit). Prints a short report.
mkdir -p /tmp/eps
python3 -c "from jaxengine.benchmarks.gpu_suite import synthetic_tokenizer as s;s('/tmp/eps/tok',128256)"
python3 -m jaxengine.server llama-3-8b --load-format dummy --dtype bfloat16 --max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 2048 --tokenizer /tmp/eps/tok --port 8000 --uvicorn-log-level warning > /tmp/eps/srv.log 2>&1 & P=$!
for i in $(seq 300); do curl -sf localhost:8000/health > /dev/null && break; sleep 1; done
echo "GPU processes while serving: $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ';')"
curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' -d '{"model":"llama-3-8b","prompt":[1,2,3,4],"max_tokens":16}' | head -c 160; echo
t0=$(date +%s.%N); kill -INT $P; wait $P; rc=$?; t1=$(date +%s.%N)
echo "exit status $rc after $(python3 -c "print(round($t1-$t0,2))") s; GPU processes after: $(nvidia-smi --query-compute-apps=pid --format=csv,noheader | wc -l)"
grep -E "WARNING|ERROR|Traceback|engine process" /tmp/eps/srv.log | tail -5
