# Where the engine loop's host time goes on the SmolLM2 shape (issue #32's idle figure), one H100:
# `bench throughput` of 4096 x 256/256 at the suite's engine flags, sampled by py-spy (all threads
# but idle ones, no native frames, nonblocking) for 10 s once the engine is ready. Run after the
# wheel line; writes $OUT/smolprof/ (raw stacks, the bench log).
O=$OUT/smolprof; mkdir -p $O
python3 -c "from jaxengine.benchmarks.gpu_suite import synthetic_tokenizer as s;s('/tmp/tok_smol',49152)"
python3 -m jaxengine.cli bench throughput --model smollm2-135m --load-format dummy --dtype bfloat16 --max-model-len 2048 \
  --max-num-seqs 256 --max-num-batched-tokens 2048 --tokenizer /tmp/tok_smol --num-prompts 4096 --input-len 256 \
  --output-len 256 >$O/bench.log 2>&1 & P=$!
for i in $(seq 240); do grep -q "ready in" $O/bench.log && break; sleep 0.5; done; sleep 4
/tmp/site/bin/py-spy record --threads --nonblocking -r 250 -d 10 --format raw -o $O/stacks.txt --pid $P >$O/pyspy.log 2>&1
wait $P; grep -E "Throughput|engine" $O/bench.log | tail -3; tail -2 $O/pyspy.log
