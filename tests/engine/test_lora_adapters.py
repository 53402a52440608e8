"""LoRA host side: requests and limits validated, PEFT folders read exactly (shapes, layouts,
scaling) or refused by name, and white-box tests of the host and slot LRU bookkeeping."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxengine.lora import (LORA_TARGETS, LoRAConfig, LoRAManager, LoRARequest, LoRAWeights, load_adapter,
                            stack_for_slot, target_dims)
from jaxengine.models.config import ModelConfig

D, F, N, K, H, L = 64, 128, 4, 2, 16, 2  # tests/tiny_checkpoints.py's shapes
HF_CONFIG = dict(architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=D, intermediate_size=F,
                 num_hidden_layers=L, num_attention_heads=N, num_key_value_heads=K, max_position_embeddings=512)
CFG = ModelConfig.from_hf_dict(HF_CONFIG)
# PEFT's (in, out) per target, torch Linear layout: lora_A [r, in], lora_B [out, r]
DIMS = {"q_proj": (D, N * H), "k_proj": (D, K * H), "v_proj": (D, K * H), "o_proj": (N * H, D),
        "gate_proj": (D, F), "up_proj": (D, F), "down_proj": (F, D)}


def peft_name(layer: int, target: str, ab: str) -> str:
    parent = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"base_model.model.model.layers.{layer}.{parent}.{target}.lora_{ab}.weight"


def write_adapter(path: Path, *, r: int = 4, alpha: float = 8, targets=("q_proj", "v_proj"), layers=range(L),
                  seed: int = 0, tensors: dict | None = None, **config) -> tuple[str, dict[str, np.ndarray]]:
    """A PEFT-style adapter folder; returns (path, the tensors written)."""
    rng = np.random.default_rng(seed)
    if tensors is None:
        tensors = {}
        for i in layers:
            for t in targets:
                d_in, d_out = DIMS[t]
                tensors[peft_name(i, t, "A")] = rng.standard_normal((r, d_in)).astype(np.float32)
                tensors[peft_name(i, t, "B")] = rng.standard_normal((d_out, r)).astype(np.float32)
    cfg = dict(peft_type="LORA", r=r, lora_alpha=alpha, target_modules=list(targets), bias="none",
               task_type="CAUSAL_LM", base_model_name_or_path="tiny-llama")
    cfg.update(config)
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return str(path), tensors


def request(path: str, i: int = 1) -> LoRARequest:
    return LoRARequest(f"adapter-{i}", i, path)


# -- requests and limits ------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, field", [
    (dict(lora_name="", lora_int_id=1), "lora_name"),
    (dict(lora_name="a", lora_int_id=0), "lora_int_id"),
    (dict(lora_name="a", lora_int_id=True), "lora_int_id"),
    (dict(lora_name="a", lora_int_id=1, lora_path=Path("/x")), "lora_path"),
])
def test_request_validation(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        LoRARequest(**kwargs)


def test_request_fields_in_vllm_order() -> None:
    req = LoRARequest("sql", 3, "/adapters/sql", "base")
    assert (req.lora_name, req.lora_int_id, req.lora_path, req.base_model_name) == ("sql", 3, "/adapters/sql", "base")
    assert (req.adapter_id, req.name, req.path) == (3, "sql", "/adapters/sql")


@pytest.mark.parametrize("rank", [1, 2, 8, 16, 64, 256, 512])
def test_config_accepts_powers_of_two(rank) -> None:
    assert LoRAConfig(max_lora_rank=rank).max_lora_rank == rank


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_lora_rank=12), "max_lora_rank"), (dict(max_lora_rank=1024), "max_lora_rank"),
    (dict(max_lora_rank=0), "max_lora_rank"), (dict(max_loras=0), "max_loras"),
    (dict(max_loras=4, max_cpu_loras=3), "max_cpu_loras"),
])
def test_config_validation(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        LoRAConfig(**kwargs)


def test_cpu_loras_defaults_to_max_loras() -> None:
    assert LoRAConfig(max_loras=3).cpu_loras == 3 and LoRAConfig(max_loras=3, max_cpu_loras=5).cpu_loras == 5


# -- reading adapters ---------------------------------------------------------------------------
def test_shapes_layout_and_scaling(tmp_path) -> None:
    path, t = write_adapter(tmp_path / "a", r=4, alpha=8, targets=LORA_TARGETS)
    w = load_adapter(request(path), CFG, LoRAConfig(max_lora_rank=8))
    assert isinstance(w, LoRAWeights) and (w.name, w.int_id, w.rank) == ("adapter-1", 1, 4)
    assert len(w.layers) == L and w.targets() == frozenset(LORA_TARGETS)
    assert target_dims(CFG) == DIMS
    x = np.random.default_rng(1).standard_normal((3, D)).astype(np.float32)
    for i in range(L):
        for target, (d_in, d_out) in DIMS.items():
            a, b = w.layers[i][target]
            assert a.shape == (d_in, 4) and b.shape == (4, d_out) and a.dtype == b.dtype == np.float32
            np.testing.assert_allclose(a, t[peft_name(i, target, "A")].T)
            np.testing.assert_allclose(b, t[peft_name(i, target, "B")].T * 2.0, rtol=1e-6)  # alpha / r
        # PEFT's delta for q: scale * B @ A x, in HF's head-major [N*H] order, as ours flattens [N, H]
        a, b = w.layers[i]["q_proj"]
        want = 2.0 * x @ t[peft_name(i, "q_proj", "A")].T @ t[peft_name(i, "q_proj", "B")].T
        np.testing.assert_allclose(x @ a @ b, want, rtol=1e-5, atol=1e-5)


def test_rslora_scaling(tmp_path) -> None:
    path, t = write_adapter(tmp_path / "a", r=16, alpha=8, targets=("q_proj",), use_rslora=True)
    w = load_adapter(request(path), CFG, LoRAConfig(max_lora_rank=16))
    np.testing.assert_allclose(w.layers[0]["q_proj"][1], t[peft_name(0, "q_proj", "B")].T * (8 / math.sqrt(16)),
                               rtol=1e-6)


def test_bf16_tensors_and_missing_layers(tmp_path) -> None:
    import ml_dtypes

    path, t = write_adapter(tmp_path / "a", targets=("down_proj",), layers=[1])
    bf = {k: v.astype(ml_dtypes.bfloat16) for k, v in t.items()}
    save_file(bf, str(Path(path) / "adapter_model.safetensors"))
    w = load_adapter(request(path), CFG, LoRAConfig())
    assert w.layers[0] == {} and set(w.layers[1]) == {"down_proj"}
    a, _ = w.layers[1]["down_proj"]
    assert a.dtype == np.float32
    np.testing.assert_array_equal(a, bf[peft_name(1, "down_proj", "A")].astype(np.float32).T)


@pytest.mark.parametrize("target_modules, targets", [
    ("all-linear", LORA_TARGETS),
    (r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)", LORA_TARGETS),
    (r"model\.layers\.\d+\.mlp\..*", ("gate_proj", "up_proj", "down_proj")),
    (["self_attn.q_proj", "down_proj"], ("q_proj", "down_proj")),
])
def test_target_module_forms(tmp_path, target_modules, targets) -> None:
    path, _ = write_adapter(tmp_path / "a", targets=targets, target_modules=target_modules)
    assert load_adapter(request(path), CFG, LoRAConfig()).targets() == frozenset(targets)


def test_kv_head_replicas_repeat_b(tmp_path) -> None:
    path, t = write_adapter(tmp_path / "a", targets=("k_proj",))
    cfg = CFG.with_kv_head_replicas(2)  # K = 4 model heads from 2 stored ones
    _, b = load_adapter(request(path), cfg, LoRAConfig()).layers[0]["k_proj"]
    stored = (t[peft_name(0, "k_proj", "B")].T * 2.0).reshape(4, K, H)
    np.testing.assert_allclose(b.reshape(4, 2 * K, H), np.repeat(stored, 2, axis=1), rtol=1e-6)


def _wrong_shape(t: dict) -> dict:
    t = dict(t)
    t[peft_name(1, "v_proj", "B")] = np.zeros((K * H + 1, 4), np.float32)
    return t


def _unmappable(t: dict) -> dict:
    return {**t, "base_model.model.lm_head.lora_A.weight": np.zeros((4, D), np.float32)}


def _lonely_a(t: dict) -> dict:
    return {k: v for k, v in t.items() if k != peft_name(0, "q_proj", "B")}


def _layer_out_of_range(t: dict) -> dict:
    return {**t, peft_name(L, "q_proj", "A"): np.zeros((4, D), np.float32),
            peft_name(L, "q_proj", "B"): np.zeros((N * H, 4), np.float32)}


def _wrong_parent(t: dict) -> dict:
    return {**t, "base_model.model.model.layers.0.mlp.q_proj.lora_A.weight": np.zeros((4, D), np.float32)}


@pytest.mark.parametrize("config, edit, match", [
    (dict(r=32), None, "r = 32 exceeds max_lora_rank=16"),
    (dict(target_modules=["q_proj", "embed_tokens"]), None, "'embed_tokens': not supported"),
    (dict(target_modules=["lm_head"]), None, "'lm_head': not supported"),
    (dict(target_modules=r".*(q_proj|lm_head)"), None, "target_modules.*lm_head.*not supported"),
    (dict(target_modules=r"nothing_here"), None, "target_modules.*matches none"),
    (dict(target_modules="("), None, "target_modules.*regular expression"),
    (dict(modules_to_save=["lm_head"]), None, "modules_to_save"),
    (dict(bias="lora_only"), None, "bias"),
    (dict(use_dora=True), None, "DoRA"),
    (dict(layers_to_transform=[0]), None, "layers_to_transform"),
    (dict(layers_pattern="layers"), None, "layers_pattern"),
    (dict(fan_in_fan_out=True), None, "fan_in_fan_out"),
    (dict(rank_pattern={"q_proj": 8}), None, "rank_pattern"),
    (dict(peft_type="PREFIX_TUNING"), None, "peft_type"),
    (dict(r=0), None, "'r'|r must"),
    ({}, _wrong_shape, r"layers\.1\.self_attn\.v_proj\.lora_B\.weight.*\(33, 4\).*\(32, 4\)"),
    ({}, _unmappable, r"cannot map tensor 'base_model\.model\.lm_head\.lora_A\.weight'"),
    ({}, _lonely_a, r"q_proj\.lora_A\.weight' has no lora_B"),
    ({}, _layer_out_of_range, "layer 2.*2 layers"),
    ({}, _wrong_parent, r"mlp\.q_proj: not supported"),
])
def test_refusals_name_the_field_or_tensor(tmp_path, config, edit, match) -> None:
    config = dict(config)
    r = config.pop("r", 4)
    tensors = None
    if edit is not None:
        _, good = write_adapter(tmp_path / "good")
        tensors = edit(good)
    path, _ = write_adapter(tmp_path / "a", r=4 if r == 0 else r, tensors=tensors, **config)
    if r == 0:
        cfg = json.loads((Path(path) / "adapter_config.json").read_text())
        (Path(path) / "adapter_config.json").write_text(json.dumps({**cfg, "r": 0}))
    with pytest.raises(ValueError, match=match):
        load_adapter(request(path), CFG, LoRAConfig())


def test_refusals_of_the_folder(tmp_path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_adapter(request(str(tmp_path / "nowhere")), CFG, LoRAConfig())
    with pytest.raises(ValueError, match="does not exist"):
        load_adapter(request(""), CFG, LoRAConfig())
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no adapter_config.json"):
        load_adapter(request(str(tmp_path / "empty")), CFG, LoRAConfig())
    path, _ = write_adapter(tmp_path / "bin")
    (Path(path) / "adapter_model.safetensors").rename(Path(path) / "adapter_model.bin")
    with pytest.raises(ValueError, match=r"adapter_model\.bin.*not supported"):
        load_adapter(request(path), CFG, LoRAConfig())
    (Path(path) / "adapter_model.bin").unlink()
    with pytest.raises(ValueError, match="no adapter_model.safetensors"):
        load_adapter(request(path), CFG, LoRAConfig())


def test_peft_saved_adapter(tmp_path) -> None:
    """An adapter written by PEFT itself reads to the same delta PEFT applies."""
    peft = pytest.importorskip("peft")
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{k: v for k, v in HF_CONFIG.items()
                                                                         if k != "architectures"}))
    lcfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    pm = peft.get_peft_model(model, lcfg)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_()
    pm.save_pretrained(str(tmp_path / "peft"))
    w = load_adapter(request(str(tmp_path / "peft")), CFG, LoRAConfig())
    assert w.targets() == frozenset(LORA_TARGETS) and w.rank == 8
    decoder = pm.base_model.model.model.layers[1]
    for target in LORA_TARGETS:
        layer = getattr(decoder.self_attn if target in ("q_proj", "k_proj", "v_proj", "o_proj") else decoder.mlp,
                        target)
        x = torch.randn(3, DIMS[target][0])
        with torch.no_grad():
            want = (layer(x) - layer.base_layer(x)).numpy()
        a, b = w.layers[1][target]
        np.testing.assert_allclose(x.numpy() @ a @ b, want, rtol=1e-4, atol=1e-4)


# -- slot layout --------------------------------------------------------------------------------
def test_stack_for_slot_pads_rank_and_targets(tmp_path) -> None:
    path, _ = write_adapter(tmp_path / "a", r=4, targets=("q_proj", "down_proj"), layers=[0])
    w = load_adapter(request(path), CFG, LoRAConfig(max_lora_rank=16))
    slot = stack_for_slot(w, CFG, 16)
    assert len(slot) == L
    for i, layer in enumerate(slot):
        assert set(layer) == set(LORA_TARGETS)
        for target, (d_in, d_out) in DIMS.items():
            a, b = layer[target]
            assert a.shape == (d_in, 16) and b.shape == (16, d_out) and a.dtype == b.dtype == np.float32
            if i == 0 and target in ("q_proj", "down_proj"):
                la, lb = w.layers[0][target]
                np.testing.assert_array_equal(a[:, :4], la)
                np.testing.assert_array_equal(b[:4], lb)
                assert not a[:, 4:].any() and not b[4:].any()
            else:
                assert not a.any() and not b.any()
    with pytest.raises(ValueError, match="exceeds max_lora_rank=2"):
        stack_for_slot(w, CFG, 2)


# -- bookkeeping --------------------------------------------------------------------------------
@pytest.fixture
def adapters(tmp_path) -> list[LoRARequest]:
    """Six small adapters, int ids 1..6."""
    return [request(write_adapter(tmp_path / f"a{i}", r=2, targets=("q_proj",), layers=[0], seed=i)[0], i)
            for i in range(1, 7)]


def test_slots_are_one_to_max_loras_and_reused(adapters) -> None:
    mgr = LoRAManager(CFG, LoRAConfig(max_loras=2, max_cpu_loras=4))
    s1, w1 = mgr.slot_for(adapters[0])
    s2, w2 = mgr.slot_for(adapters[1])
    assert {s1, s2} == {1, 2} and w1.int_id == 1 and w2.int_id == 2
    assert mgr.slot_for(adapters[0]) == (s1, None)  # resident: nothing to write
    assert mgr.resident() == {1: s1, 2: s2}


def test_lru_slot_evicted_pinned_never(adapters) -> None:
    mgr = LoRAManager(CFG, LoRAConfig(max_loras=2, max_cpu_loras=4))
    mgr.slot_for(adapters[0])
    mgr.slot_for(adapters[1])
    mgr.unpin_all()
    mgr.slot_for(adapters[0])  # 1 is now more recently used than 2
    mgr.unpin_all()
    slot, w = mgr.slot_for(adapters[2])  # evicts 2, the least recently used
    assert w.int_id == 3 and mgr.resident() == {1: 1, 3: slot} and slot == 2
    assert mgr.slot_for(adapters[0]) == (1, None)  # the same step uses 1 too
    # 1 and 3 are pinned by this step: a fourth adapter does not fit
    assert not mgr.can_place(4)
    with pytest.raises(RuntimeError, match="max_loras=2 is too small for the step"):
        mgr.slot_for(adapters[3])
    assert mgr.resident() == {1: 1, 3: 2}
    mgr.unpin_all()
    mgr.pin([1])  # 1 is least recently used but pinned: 3 goes
    assert mgr.can_place(4)
    assert mgr.slot_for(adapters[3])[0] == 2 and mgr.resident() == {1: 1, 4: 2}


def test_remove_frees_its_slot(adapters) -> None:
    mgr = LoRAManager(CFG, LoRAConfig(max_loras=2))
    mgr.slot_for(adapters[0])
    mgr.slot_for(adapters[1])
    assert mgr.remove(1) and not mgr.remove(1) and not mgr.remove(99)
    assert mgr.resident() == {2: 2} and [r.lora_int_id for r in mgr.list()] == [2]
    slot, w = mgr.slot_for(adapters[2])  # the freed slot, with 2 still pinned
    assert slot == 1 and w is not None


def test_host_lru_with_max_cpu_loras(adapters) -> None:
    mgr = LoRAManager(CFG, LoRAConfig(max_loras=1, max_cpu_loras=3))
    w1 = mgr.add(adapters[0])
    for r in adapters[1:3]:
        mgr.add(r)
    assert mgr.add(adapters[0]) is w1  # cached, and now most recently used
    mgr.add(adapters[3])  # evicts 2, the least recently used
    assert mgr.on_host() == [1, 3, 4]
    mgr.slot_for(adapters[2])  # 3 goes into the slot (and is pinned)
    mgr.unpin_all()
    mgr.add(adapters[0])
    mgr.add(adapters[3])
    mgr.add(adapters[4])  # the host LRU is 3 (in a slot), 1, 4: 1 goes, not 3
    assert mgr.on_host() == [3, 4, 5] and mgr.resident() == {3: 1}


def test_host_eviction_of_a_resident_copy_frees_its_slot(adapters) -> None:
    mgr = LoRAManager(CFG, LoRAConfig(max_loras=2))  # max_cpu_loras = 2 too
    mgr.slot_for(adapters[0])
    mgr.slot_for(adapters[1])
    mgr.unpin_all()
    slot, w = mgr.slot_for(adapters[2])  # both host copies are resident: 1 (the oldest) goes entirely
    assert w.int_id == 3 and slot == 1 and mgr.resident() == {2: 2, 3: 1}
    assert mgr.on_host() == [2, 3] and [r.lora_int_id for r in mgr.list()] == [1, 2, 3]  # 1 reloads on use


def test_int_id_conflict(adapters) -> None:
    mgr = LoRAManager(CFG, LoRAConfig(max_loras=2))
    mgr.add(adapters[0])
    with pytest.raises(ValueError, match="lora_int_id 1 already names adapter 'adapter-1'"):
        mgr.add(LoRARequest("other", 1, adapters[1].lora_path))
