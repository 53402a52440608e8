"""Model correctness: logits against transformers (PyTorch, CPU, float32) on tiny random checkpoints
of every family, full forward equal to chunked prefill + paged decode, and loader errors."""

from __future__ import annotations

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxengine.attention_backend import select_attention_backend
from jaxengine.models.checkpoint import open_checkpoint
from jaxengine.models.config import ModelConfig
from jaxengine.models.loader import dummy_params, load_params
from jaxengine.sharding import LOGICAL_AXES
from tests.model_harness import PagedRunner
from tests.tiny_checkpoints import FAMILIES, load_reference, make_checkpoint

# float32 on both sides; differences come from summation order only.
ATOL = 2e-4


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_ckpt(request, tmp_path_factory):
    path = make_checkpoint(request.param, str(tmp_path_factory.mktemp(request.param)))
    return request.param, path


def _load(path: str, dtype=jnp.float32):
    ckpt = open_checkpoint(path)
    cfg = ModelConfig.from_hf_dict(ckpt.hf_config)
    graphdef, state = load_params(ckpt, cfg, dtype)
    return cfg, graphdef, state


def _reference_logits(ref, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float().numpy()


def test_logits_match_transformers_batched(family_ckpt):
    family, path = family_ckpt
    cfg, graphdef, state = _load(path)
    ref = load_reference(path)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, cfg.vocab_size, size=n)) for n in (5, 33, 17)]
    runner = PagedRunner(graphdef, state, cfg)
    got = runner.step([(i, p, 0) for i, p in enumerate(prompts)])
    for p, g in zip(prompts, got):
        want = _reference_logits(ref, p)
        np.testing.assert_allclose(g, want, atol=ATOL, rtol=0, err_msg=family)


def test_full_forward_equals_chunked_prefill_and_decode(family_ckpt):
    family, path = family_ckpt
    cfg, graphdef, state = _load(path)
    rng = np.random.default_rng(1)
    toks = [int(t) for t in rng.integers(0, cfg.vocab_size, size=40)]
    full = PagedRunner(graphdef, state, cfg, seed=1).step([(0, toks, 0)])[0]
    inc = PagedRunner(graphdef, state, cfg, seed=2)
    rows = []
    # prefill in chunks of 13 (crossing block boundaries), then one token at a time
    for start in range(0, 26, 13):
        rows.append(inc.step([(0, toks[:start + 13], start)])[0])
    for n in range(27, len(toks) + 1):
        rows.append(inc.step([(0, toks[:n], n - 1)])[0])
    np.testing.assert_allclose(np.concatenate(rows), full, atol=ATOL, rtol=0, err_msg=family)


def test_dummy_weights_have_checkpoint_shapes(family_ckpt):
    _, path = family_ckpt
    cfg, _, state = _load(path)
    _, dummy = dummy_params(cfg, jnp.bfloat16)
    a = {k: v.shape for k, v in nnx.to_flat_state(state)}
    b = {k: v.shape for k, v in nnx.to_flat_state(dummy)}
    assert a == b
    assert all(v.get_value().dtype == jnp.bfloat16 for _, v in nnx.to_flat_state(dummy))


def test_bfloat16_load_close_to_float32(tmp_path):
    path = make_checkpoint("llama", str(tmp_path / "m"))
    cfg, g32, s32 = _load(path)
    _, g16, s16 = _load(path, jnp.bfloat16)
    toks = list(range(3, 30))
    a = PagedRunner(g32, s32, cfg).step([(0, toks, 0)])[0]
    b = PagedRunner(g16, s16, cfg).step([(0, toks, 0)])[0]
    assert np.argmax(a[-1]) == np.argmax(b[-1]) or np.max(a[-1]) - a[-1][np.argmax(b[-1])] < 0.1
    assert np.abs(a - b).max() < 0.25


# -- errors -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_checkpoint("llama", str(tmp_path_factory.mktemp("llama_err")))


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def test_unknown_architecture(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path / "m")
    cfg = json.loads(open(os.path.join(path, "config.json")).read())
    cfg["architectures"] = ["FancyNetForCausalLM"]
    open(os.path.join(path, "config.json"), "w").write(json.dumps(cfg))
    with pytest.raises(ValueError, match="FancyNetForCausalLM.*supported: .*LlamaForCausalLM"):
        _load(path)


def _rewrite_tensors(path: str, edit) -> None:
    from safetensors.numpy import load_file, save_file
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def test_missing_and_unexpected_tensors_reported_together(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path / "m")

    def edit(t):
        del t["model.layers.1.mlp.up_proj.weight"]
        del t["model.norm.weight"]
        t["model.layers.0.extra.weight"] = np.zeros(3, np.float32)

    _rewrite_tensors(path, edit)
    with pytest.raises(ValueError) as e:
        _load(path)
    msg = str(e.value)
    assert "model.layers.1.mlp.up_proj" in msg and "model.norm.weight" in msg
    assert "model.layers.0.extra.weight" in msg


def test_wrong_shape(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path / "m")
    _rewrite_tensors(path, lambda t: t.__setitem__("model.layers.0.mlp.down_proj.weight",
                                                  np.zeros((64, 7), np.float32)))
    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj.weight.*shape"):
        _load(path)


def test_wrong_shape_of_a_fused_part(llama_dir, tmp_path):
    """q/k/v load into one fused parameter; a bad part is reported by its checkpoint name."""
    path = _copy(llama_dir, tmp_path / "m")
    _rewrite_tensors(path, lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight",
                                                  np.zeros((7, 64), np.float32)))
    with pytest.raises(ValueError, match="model.layers.0.self_attn.k_proj.weight.*shape"):
        _load(path)


def test_single_device_model_holds_fused_projections(llama_dir):
    cfg, _, state = _load(llama_dir)
    names = {str(k[-1]) for k, _ in nnx.to_flat_state(state)}
    assert {"qkv_proj", "gate_up_proj"} <= names
    assert not names & {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    layer = state["model"]["layers"][0]
    assert layer["self_attn"]["qkv_proj"].shape == (cfg.hidden_size, cfg.num_heads + 2 * cfg.num_kv_heads,
                                                    cfg.head_dim)
    assert layer["mlp"]["gate_up_proj"].shape == (cfg.hidden_size, 2 * cfg.intermediate_size)


def test_split_projections_load_the_same_model(llama_dir):
    """With fused_projections off (as under tensor parallelism) q/k/v and gate/up load as separate
    parameters, each with the sharding rules' name, and the logits do not change; the CPU
    attention path the engine takes by default gives the reference's logits."""
    cfg, graphdef, state = _load(llama_dir)
    split_cfg = cfg.with_split_projections()
    split_graphdef, split_state = load_params(open_checkpoint(llama_dir), split_cfg, jnp.float32)
    names = {str(k[-1]) for k, _ in nnx.to_flat_state(split_state)}
    assert {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"} <= names
    assert not names & {"qkv_proj", "gate_up_proj"}
    assert names - {"weight"} <= set(LOGICAL_AXES)
    toks = list(range(3, 40))
    fused = PagedRunner(graphdef, state, cfg).step([(0, toks, 0)])[0]
    split = PagedRunner(split_graphdef, split_state, split_cfg).step([(0, toks, 0)])[0]
    np.testing.assert_allclose(split, fused, atol=ATOL, rtol=0)
    cpu = select_attention_backend("auto", cfg, jnp.float32, 16)
    got = PagedRunner(graphdef, state, cfg, attention=cpu).step([(0, toks, 0)])[0]
    np.testing.assert_allclose(got, fused, atol=ATOL, rtol=0)


def test_unreadable_file(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path / "m")
    f = os.path.join(path, "model.safetensors")
    data = open(f, "rb").read()
    open(f, "wb").write(data[: len(data) // 3])
    with pytest.raises(ValueError):
        _load(path)
