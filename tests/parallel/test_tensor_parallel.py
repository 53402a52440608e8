"""Tensor parallelism on simulated CPU devices: TP=2, 4 and 8 give TP=1's (or TP=2's) greedy
outputs for two families, and every parameter is sharded as the rules table says."""

from __future__ import annotations

import dataclasses
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
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env(devices: int) -> dict:
    """A worker's environment: simulated CPU devices, and this checkout's code first on the path."""
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    return dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
                PYTHONPATH=path)


def _close(a: list[int], b: list[int], top_a: list[list[int]], top_b: list[list[int]]) -> bool:
    """Equal, or at the first divergence each token is in the other's top-5."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return y in top_a[i] and x in top_b[i]
    return len(a) == len(b)


def _run_worker(jobs: list[tuple[str, tuple[int, ...]]], devices: int) -> dict:
    """One worker process for every (checkpoint, sizes) job: {checkpoint: {tp: result}}."""
    env = _env(devices)
    args = [a for path, sizes in jobs for a in (path, ",".join(map(str, sizes)))]
    proc = subprocess.run([sys.executable, WORKER, *args], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _assert_same(res: dict, base: str, others: tuple[str, ...]) -> None:
    for tp in others:
        got = res[tp]
        assert got["bad_shardings"] == [], got["bad_shardings"][:5]
        assert "'model'" in got["kv_spec"], got["kv_spec"]
        for i in range(len(res[base]["tokens"])):
            assert _close(got["tokens"][i], res[base]["tokens"][i], got["top5"][i], res[base]["top5"][i]), (tp, i)


# llama: 4 KV heads split over 2 devices; qwen2 (q/k/v biases): 2 KV heads, split over 2 devices
# and, at TP=4, each KV head (weights, biases and cache) repeated on two. "llama70b": a tiny Llama
# with Llama-3-70B's head layout (8 query heads per KV head, 8 KV heads), one KV head a device at
# TP=8 (the case llama at TP=4 would repeat).
CASES = {"llama": ("llama", dict(num_attention_heads=8, num_key_value_heads=4), (1, 2)),
         "qwen2": ("qwen2", dict(num_attention_heads=8, num_key_value_heads=2), (1, 2, 4)),
         "llama70b": ("llama", dict(hidden_size=128, num_attention_heads=64, num_key_value_heads=8, head_dim=16,
                                    intermediate_size=256), (2, 8))}


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory, smollm2_tokenizer_dir) -> dict:
    """Every case's results from one worker process over 8 simulated devices (TP=N uses the first
    N), so the interpreter, JAX and transformers start once rather than once per case."""
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    root = tmp_path_factory.mktemp("tp")
    paths = {name: make_checkpoint(family, str(root / name), tokenizer=tok, **kw)
             for name, (family, kw, _) in CASES.items()}
    res = _run_worker([(paths[name], sizes) for name, (_, _, sizes) in CASES.items()], devices=8)
    return {name: res[paths[name]] for name in CASES}


@pytest.mark.parametrize("family,kv_heads", [("llama", 4), ("qwen2", 2)])
def test_tp_matches_single_device(family, kv_heads, tp_results):
    res = tp_results[family]
    sizes = [str(n) for n in CASES[family][2]]
    assert sorted(res) == sizes
    _assert_same(res, "1", tuple(sizes[1:]))
    if "4" in res:
        assert res["4"]["kv_heads"] == max(4, kv_heads)  # 2 KV heads x 2 copies at TP=4
    assert all(res[tp]["kv_shard_heads"] == res[tp]["kv_heads"] // int(tp) for tp in sizes[1:])
    # the KV-sizing profile compiles the step as placed over the mesh: one device's share, never 0
    assert all(0 < res[tp]["step_bytes"] <= res["1"]["step_bytes"] for tp in sizes[1:]), \
        [res[tp]["step_bytes"] for tp in sizes]


def test_tp8_matches_tp2_llama_70b_layout(tp_results):
    """The 8-GPU configuration's code path on 8 simulated devices: a tiny Llama with Llama-3-70B's
    head layout (8 query heads per KV head, 8 KV heads) at TP=8, one KV head per device, equals TP=2."""
    res = tp_results["llama70b"]
    assert sorted(res) == ["2", "8"]
    _assert_same(res, "2", ("8",))
    assert res["8"]["kv_shard_heads"] == 1


def test_impossible_settings_are_clear_errors():
    cfg = ModelConfig.from_hf_dict(PRESETS["smollm2-135m"])  # 9 heads, 3 KV heads
    with pytest.raises(ValueError, match="exceeds the 1 available devices"):
        make_plan(cfg, 2, devices=["d0"])
    with pytest.raises(ValueError, match="num_heads=9 is not divisible by tensor_parallel_size=2"):
        make_plan(cfg, 2, devices=["d0", "d1"])
    cfg8 = ModelConfig.from_hf_dict(PRESETS["llama-3-8b"])  # 32 heads, 8 KV heads
    with pytest.raises(ValueError, match="num_kv_heads=4 and tensor_parallel_size=6: one must divide the other"):
        make_plan(dataclasses.replace(cfg8, num_heads=24, num_kv_heads=4), 6, devices=list(range(6)))


DUMMY_CHECK = """
import json
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jaxengine.models.config import ModelConfig
from jaxengine.models.loader import dummy_params
from jaxengine.models.presets import PRESETS
from jaxengine.sharding import LOGICAL_AXES, make_plan
cfg = ModelConfig.from_hf_dict(dict(PRESETS["llama-3-8b"], hidden_size=256, intermediate_size=512, vocab_size=1024,
                                    num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=2))
plan = make_plan(cfg, 2)
cfg = plan.model_config(cfg)
_, whole = dummy_params(cfg, jnp.bfloat16)
_, placed = dummy_params(cfg, jnp.bfloat16, sharding_of=plan.param_sharding)
pairs = list(zip(nnx.to_flat_state(whole), nnx.to_flat_state(placed)))
print(json.dumps({
    "equal": all(np.array_equal(np.asarray(a.get_value()), np.asarray(b.get_value())) for (_, a), (_, b) in pairs),
    "bad": [".".join(map(str, p)) for (p, _), (_, b) in pairs
            if b.get_value().sharding != plan.param_sharding(p)],
    "split": sum(any(s is not None for s in b.get_value().sharding.spec) for _, (_, b) in pairs)}))
"""


def test_dummy_weights_are_made_in_their_shards():
    """Dummy weights under TP are generated in their shards (no whole copy on one device first),
    with the rules table's placement and the same values as unplaced generation."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", DUMMY_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["equal"] and res["bad"] == [] and res["split"] > 0, res


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM"])
def test_plan_model_config_has_rules_for_every_parameter(arch):
    """The model a plan shards holds q/k/v and gate/up apart (column shards of a fused weight
    would mix them), every parameter named in the rules table; without a plan the loader's fused
    parameters stand in for exactly those parts."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxengine.models.loader import abstract_model
    from jaxengine.models.weights import FUSED
    from jaxengine.sharding import LOGICAL_AXES

    # Qwen2 adds q/k/v biases, Qwen3 q/k norms; Phi-3 loads its fused checkpoint tensors into the same parts
    cfg = ModelConfig.from_hf_dict(dict(PRESETS["llama-3-8b"], architectures=[arch], num_hidden_layers=1))
    plan = make_plan(cfg, 1)
    split = plan.model_config(cfg)
    assert cfg.fused_projections and not split.fused_projections
    names = lambda c: {str(p[-1]) for p, _ in nnx.to_flat_state(abstract_model(c, jnp.bfloat16)[1])}
    assert names(split) <= set(LOGICAL_AXES)
    fused = names(cfg)
    fused_here = fused - set(LOGICAL_AXES)
    assert fused_here and fused_here <= set(FUSED)
    assert {part for f in fused_here for part in FUSED[f][0]} == names(split) - fused
    for p, _ in nnx.to_flat_state(abstract_model(split, jnp.bfloat16)[1]):
        plan.param_sharding(p)


@pytest.mark.parametrize("hf", [
    dict(architectures=["GPT2LMHeadModel"], vocab_size=512, n_embd=64, n_layer=1, n_head=4, n_positions=128),
    dict(architectures=["OPTForCausalLM"], vocab_size=512, hidden_size=64, ffn_dim=128, num_hidden_layers=1,
         num_attention_heads=4, max_position_embeddings=128, word_embed_proj_dim=32, do_layer_norm_before=False),
    # Gemma's four norms per layer and (Gemma 3) q/k norms: every one a replicated "weight"
    dict(architectures=["Gemma2ForCausalLM"], vocab_size=512, hidden_size=64, intermediate_size=128,
         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8),
    dict(architectures=["Gemma3ForCausalLM"], vocab_size=512, hidden_size=64, intermediate_size=128,
         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
         layer_types=["sliding_attention", "full_attention"]),
], ids=["gpt2", "opt", "gemma2", "gemma3"])
def test_learned_position_families_have_rules_for_every_parameter(hf):
    """GPT-2 and OPT under a plan: every parameter (biases, LayerNorms, positions, OPT's
    projections) named in the rules table, and each gets a sharding."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxengine.models.loader import abstract_model
    from jaxengine.sharding import LOGICAL_AXES

    cfg = ModelConfig.from_hf_dict(hf)
    plan = make_plan(cfg, 1)
    split = plan.model_config(cfg)
    state = abstract_model(split, jnp.float32)[1]
    assert {str(p[-1]) for p, _ in nnx.to_flat_state(state)} <= set(LOGICAL_AXES)
    for p, _ in nnx.to_flat_state(state):
        plan.param_sharding(p)


def test_attention_backend_is_kept_under_tensor_parallelism(monkeypatch):
    """Under tensor parallelism the attention backend stays as asked, "auto" included: the Mosaic
    prefill kernel runs per device under shard_map (checked on two H200 GPUs,
    lab/results/mosaic_engine_check_h200x2_tp2.json)."""
    import jax

    from jaxengine.config import EngineConfig
    from jaxengine.loading import derive_config

    cfg = ModelConfig.from_hf_dict(PRESETS["llama-3-8b"])

    def derived(backend, tp):
        return derive_config(EngineConfig(attention_backend=backend, tensor_parallel_size=tp), cfg).attention_backend

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for backend in ("auto", "pallas", "pallas-mosaic", "reference"):
        assert derived(backend, 2) == derived(backend, 1) == backend


def test_lora_tp2_matches_tp1(tmp_path, smollm2_tokenizer_dir):
    """LoRA under tensor parallelism: A replicated and B split for column-parallel projections, A
    split and B replicated for row-parallel ones; TP=2 gives TP=1's greedy tokens for a batch of
    two adapters and a row without one."""
    from tests.engine.test_lora import ALL, write_adapter
    from tests.tiny_checkpoints import load_reference

    tok = transformers.AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    path = make_checkpoint("llama", str(tmp_path / "m"), tokenizer=tok, num_attention_heads=8, num_key_value_heads=4)
    ref = load_reference(path)
    write_adapter(str(tmp_path / "a1"), ref, 4, 8.0, ("q_proj", "v_proj", "o_proj"), 1)
    write_adapter(str(tmp_path / "a2"), ref, 8, 16.0, ALL, 2)
    env = _env(2)
    worker = os.path.join(os.path.dirname(__file__), "lora_tp_worker.py")
    proc = subprocess.run([sys.executable, worker, path, str(tmp_path / "a1"), str(tmp_path / "a2"), "1,2"], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    one, two = res["1"], res["2"]
    from jaxengine.models.lora import TP_AXIS

    for name, spec in two["specs"].items():  # trailing unsplit axes may be left out of a spec
        axis = TP_AXIS[name]
        assert [i for i, a in enumerate(spec) if a == "model"] == ([] if axis is None else [axis]), (name, spec)
    for i in range(len(one["tokens"])):
        assert _close(two["tokens"][i], one["tokens"][i], two["top5"][i], one["top5"][i]), i
