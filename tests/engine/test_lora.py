"""LoRA end to end on a tiny random Llama: greedy tokens equal transformers' with each adapter merged
into the weights by hand (W + alpha/r * B A), for two adapters of different ranks and rows without
an adapter in one batch; adapters swapped through fewer device slots than adapters with zero
compiles after warm-up; the prefix cache never shares blocks across adapters."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from jaxengine import LLM, SamplingParams
from jaxengine.compile_monitor import compile_count
from jaxengine.lora import LoRARequest
from tests.tiny_checkpoints import load_reference

PROMPTS = ["Hello, my name is", "The capital of France is", "def add(a, b):", "1 2 3 4"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: str, ref, rank: int, alpha: float, targets: tuple[str, ...], seed: int) -> dict:
    """A PEFT LoRA folder for `ref`'s shapes; returns {hf weight name: delta [out, in]} to merge."""
    rng = np.random.default_rng(seed)
    tensors, deltas = {}, {}
    for name, p in ref.named_parameters():
        mod = name.split(".")[-2]
        if mod not in targets or not name.endswith(".weight"):
            continue
        out_f, in_f = p.shape
        a = (rng.standard_normal((rank, in_f)) * 0.3).astype(np.float32)
        b = (rng.standard_normal((out_f, rank)) * 0.3).astype(np.float32)
        base = "base_model.model." + name[: -len(".weight")]
        tensors[f"{base}.lora_A.weight"], tensors[f"{base}.lora_B.weight"] = a, b
        deltas[name] = (alpha / rank) * (b @ a)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
                   "bias": "none", "task_type": "CAUSAL_LM", "lora_dropout": 0.0}, f)
    return deltas


def merged_greedy(path: str, deltas: dict | None, tok, prompt: str, n: int) -> list[int]:
    model = load_reference(path)
    if deltas:
        with torch.no_grad():
            params = dict(model.named_parameters())
            for name, d in deltas.items():
                params[name] += torch.from_numpy(d)
    ids = torch.tensor([tok.encode(prompt)])
    out = model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def setup(tiny_model_factory, tmp_path_factory, xla_cache_dir):
    path = tiny_model_factory("llama")
    ref = load_reference(path)
    root = tmp_path_factory.mktemp("adapters")
    adapters = {
        "small": (LoRARequest("small", 1, str(root / "small")), write_adapter(str(root / "small"), ref, 4, 8.0,
                                                                              ("q_proj", "v_proj", "o_proj"), 1)),
        "big": (LoRARequest("big", 2, str(root / "big")), write_adapter(str(root / "big"), ref, 8, 16.0, ALL, 2)),
        "third": (LoRARequest("third", 3, str(root / "third")), write_adapter(str(root / "third"), ref, 2, 2.0,
                                                                              ("gate_proj", "down_proj"), 3)),
    }
    llm = LLM(path, enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=128, max_num_seqs=8,
              max_num_batched_tokens=64, num_kv_blocks=64, compilation_cache_dir=xla_cache_dir,
              warmup=True)  # every program at start-up: test_swapping_adapters_never_recompiles checks none later
    return path, llm, adapters


def test_mixed_batch_equals_merged_transformers(setup):
    path, llm, adapters = setup
    tok = llm.get_tokenizer()
    plan = [None, "small", "big", "small"]
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False,
                        lora_request=[adapters[a][0] if a else None for a in plan])
    for prompt, a, out in zip(PROMPTS, plan, outs):
        want = merged_greedy(path, adapters[a][1] if a else None, tok, prompt, GREEDY.max_tokens)
        assert out.outputs[0].token_ids == want, (prompt, a)
    base = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    changed = [b.outputs[0].token_ids != o.outputs[0].token_ids for b, o in zip(base, outs)]
    assert changed == [False, True, True, True]  # the adapters change what is generated; row 0 has none


def test_swapping_adapters_never_recompiles(setup):
    path, llm, adapters = setup
    tok = llm.get_tokenizer()
    before = compile_count()
    for names in (["third", "big"], ["small", "third"], ["big", "small"]):  # 3 adapters through 2 slots
        outs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=[adapters[n][0] for n in names])
        for prompt, n, out in zip(PROMPTS, names, outs):
            assert out.outputs[0].token_ids == merged_greedy(path, adapters[n][1], tok, prompt, GREEDY.max_tokens)
    assert compile_count() == before


def test_prefix_cache_is_per_adapter(setup):
    _, llm, adapters = setup
    prompt = "The capital of France is Paris, and the capital of Italy is Rome. " * 2
    first = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=adapters["small"][0])[0]
    again = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=adapters["small"][0])[0]
    other = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=adapters["big"][0])[0]
    base = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_lora_errors(setup, tmp_path, tiny_model_factory, xla_cache_dir):
    _, llm, adapters = setup
    with pytest.raises(ValueError):
        llm.generate("x", GREEDY, lora_request=LoRARequest("missing", 9, str(tmp_path / "nope")))
    with pytest.raises(ValueError, match="lora requests for"):
        llm.generate(["a", "b"], GREEDY, lora_request=[adapters["small"][0]])
    assert not llm.llm_engine.has_unfinished_requests()
    plain = LLM(tiny_model_factory("llama"), max_model_len=64, max_num_seqs=2, num_kv_blocks=16,
                compilation_cache_dir=xla_cache_dir)
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.generate("x", GREEDY, lora_request=adapters["small"][0])
