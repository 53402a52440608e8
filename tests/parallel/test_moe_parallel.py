"""Mixture-of-experts models on two simulated CPU devices: tensor parallelism (each expert's F
split) and expert parallelism (whole experts per device) give one device's greedy tokens and
logits, and the stacked expert weights are placed as the rules table says."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxengine.models.config import ModelConfig
from jaxengine.models.presets import PRESETS
from jaxengine.sharding import make_plan
from tests.parallel.test_tensor_parallel import _env
from tests.tiny_checkpoints import make_checkpoint

WORKER = os.path.join(os.path.dirname(__file__), "moe_worker.py")


def test_tp2_and_ep2_match_single_device(tmp_path):
    """A tiny Qwen3-MoE (a dense layer, a sparse one, q/k norm; Mixtral's layer differs only by its
    router rule) loaded and decoded as on one device, at TP=2 and at EP=2: the same 8 greedy tokens,
    logits within float32 summation-order noise."""
    path = make_checkpoint("qwen3-moe", str(tmp_path / "m"), vocab_size=512)
    proc = subprocess.run([sys.executable, WORKER, path], env=_env(2), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for mode in ("2", "2ep"):
        assert res[mode]["bad_shardings"] == [], res[mode]["bad_shardings"][:5]
        assert res[mode]["tokens"] == res["1"]["tokens"], mode
        np.testing.assert_allclose(res[mode]["logits"], res["1"]["logits"], atol=1e-4, rtol=0, err_msg=mode)
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


def test_expert_parallel_flag_on_a_dense_model_is_refused(tmp_path):
    from jaxengine.config import EngineConfig
    from jaxengine.loading import load_model

    path = make_checkpoint("llama", str(tmp_path / "m"), num_layers=1, vocab_size=512)
    with pytest.raises(ValueError, match="enable_expert_parallel: LlamaForCausalLM has no experts"):
        load_model(EngineConfig(model=path, enable_expert_parallel=True, skip_tokenizer_init=True,
                                compilation_cache_dir=None))


@pytest.mark.parametrize("preset", ["mixtral-8x7b", "qwen3-30b-a3b"])
def test_moe_plan_has_rules_for_every_parameter(preset):
    """Under a plan (TP or EP) every MoE parameter is named in the rules table; on one device the
    fused stacks stand in for exactly their parts."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxengine.models.loader import abstract_model
    from jaxengine.models.weights import FUSED
    from jaxengine.sharding import LOGICAL_AXES

    # Qwen3-MoE gets a dense first layer too (mlp_only_layers; Mixtral has none), so both MLP kinds appear
    cfg = ModelConfig.from_hf_dict(dict(PRESETS[preset], num_hidden_layers=2, mlp_only_layers=[0]))
    names = lambda c: {str(p[-1]) for p, _ in nnx.to_flat_state(abstract_model(c, jnp.bfloat16)[1])}  # noqa: E731
    for ep in (False, True):
        plan = make_plan(cfg, 1, expert_parallel=ep)
        split = names(plan.model_config(cfg))
        assert split <= set(LOGICAL_AXES) and {"router", "experts_gate", "experts_up", "experts_down"} <= split
    fused = names(cfg) - set(LOGICAL_AXES)
    assert fused <= set(FUSED) and "experts_gate_up" in fused
