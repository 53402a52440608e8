"""Tensor parallelism on simulated CPU devices: TP=2 and TP=4 give TP=1's greedy outputs for two
families, and every parameter is sharded as the rules table says."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import transformers

from jaxengine.models.config import ModelConfig
from jaxengine.models.presets import PRESETS
from jaxengine.sharding import make_plan
from tests.tiny_checkpoints import make_checkpoint

WORKER = os.path.join(os.path.dirname(__file__), "tp_worker.py")


def _close(a: list[int], b: list[int], top_a: list[list[int]], top_b: list[list[int]]) -> bool:
    """Equal, or at the first divergence each token is in the other's top-5."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return y in top_a[i] and x in top_b[i]
    return len(a) == len(b)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tp_matches_single_device(family, tmp_path, smollm2_tokenizer_dir):
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    path = make_checkpoint(family, str(tmp_path / family), tokenizer=tok, num_attention_heads=8,
                           num_key_value_heads=4)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, WORKER, path], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    base = res["1"]
    for tp in ("2", "4"):
        got = res[tp]
        assert got["bad_shardings"] == [], got["bad_shardings"][:5]
        assert got["kv_spec"] == "PartitionSpec(None, 'model', None, None)" or "'model'" in got["kv_spec"]
        for i in range(len(base["tokens"])):
            assert _close(got["tokens"][i], base["tokens"][i], got["top5"][i], base["top5"][i]), (tp, i)


def test_impossible_settings_are_clear_errors():
    cfg = ModelConfig.from_hf_dict(PRESETS["smollm2-135m"])  # 9 heads, 3 KV heads
    with pytest.raises(ValueError, match="exceeds the 1 available devices"):
        make_plan(cfg, 2, devices=["d0"])
    with pytest.raises(ValueError, match="num_heads=9 is not divisible by tensor_parallel_size=2"):
        make_plan(cfg, 2, devices=["d0", "d1"])
    cfg8 = ModelConfig.from_hf_dict(PRESETS["llama-3-8b"])  # 32 heads, 8 KV heads
    with pytest.raises(ValueError, match="num_kv_heads=8 is not divisible by tensor_parallel_size=16"):
        make_plan(cfg8, 16, devices=list(range(16)))
