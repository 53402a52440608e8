"""Mixture-of-experts models on two simulated CPU devices: tensor parallelism (each expert's F
split) and expert parallelism (whole experts per device) give one device's greedy tokens, and the
stacked expert weights are placed as the rules table says."""

from __future__ import annotations

import pytest
import transformers

from jaxengine.models.config import ModelConfig
from jaxengine.models.presets import PRESETS
from jaxengine.sharding import make_plan
from tests.parallel.test_tensor_parallel import _close, _run_worker
from tests.tiny_checkpoints import make_checkpoint

# Qwen3-MoE: a dense layer (mlp_only_layers) and a sparse one, q/k norm; Mixtral's layer differs
# only by its router rule, which runs the same under either split.
CASES = {"qwen3-moe": {}}
SIZES = ("1", "2", "2ep")


@pytest.fixture(scope="module")
def moe_results(tmp_path_factory, smollm2_tokenizer_dir) -> dict:
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    root = tmp_path_factory.mktemp("moe_tp")
    paths = {name: make_checkpoint(name, str(root / name), tokenizer=tok, **kw) for name, kw in CASES.items()}
    res = _run_worker([(paths[name], SIZES) for name in CASES], devices=2, warmup=False)
    return {name: res[paths[name]] for name in CASES}


@pytest.mark.parametrize("family", sorted(CASES))
def test_tp2_and_ep2_match_single_device(family, moe_results):
    res = moe_results[family]
    for size in ("2", "2ep"):
        got = res[size]
        assert got["bad_shardings"] == [], got["bad_shardings"][:5]
        for i in range(len(res["1"]["tokens"])):
            assert _close(got["tokens"][i], res["1"]["tokens"][i], got["top5"][i], res["1"]["top5"][i]), (size, i)
    tp, ep = res["2"]["specs"], res["2ep"]["specs"]
    assert tp and set(tp) == set(ep)
    for name in tp:  # TP splits F (last axis of gate/up, middle of down); EP splits E (the first axis)
        assert ("'model')" in tp[name]) == (not name.endswith("experts_down")), (name, tp[name])
        assert ep[name].split("(", 1)[1].startswith("'model'"), (name, ep[name])


def test_expert_parallel_settings_are_checked():
    moe = ModelConfig.from_hf_dict(dict(PRESETS["mixtral-8x7b"], num_hidden_layers=1, num_local_experts=6))
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by tensor_parallel_size=4"):
        make_plan(moe, 4, devices=list(range(4)), expert_parallel=True)
    assert make_plan(moe, 2, devices=list(range(2)), expert_parallel=True).expert_parallel
    qwen = ModelConfig.from_hf_dict(dict(PRESETS["qwen3-30b-a3b"], num_hidden_layers=1, moe_intermediate_size=770))
    with pytest.raises(ValueError, match="moe_intermediate_size=770 is not divisible by tensor_parallel_size=4"):
        make_plan(qwen, 4, devices=list(range(4)))
    assert make_plan(qwen, 4, devices=list(range(4)), expert_parallel=True).model_config(qwen).expert_parallel
    dense = ModelConfig.from_hf_dict(PRESETS["llama-3-8b"])
    with pytest.raises(ValueError, match="has no experts"):
        make_plan(dense, 2, devices=list(range(2)), expert_parallel=True)
