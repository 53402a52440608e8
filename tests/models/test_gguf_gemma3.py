"""Gemma 3 from GGUF: a tiny random Gemma 3 written the way llama.cpp's converter writes it (its
tensor names, norm scales stored as 1 + weight, the global rope and the window in the metadata),
read back to the same tensors as transformers' own GGUF loading, the same config as the original
folder, and the same logits as transformers on that folder."""

from __future__ import annotations

from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

from jaxengine.models.checkpoint import open_checkpoint
from jaxengine.models.config import ModelConfig
from jaxengine.models.gguf_reader import GGUFCheckpoint
from jaxengine.models.loader import load_params
from tests.hf_gguf import cached_gguf_name_map
from tests.model_harness import PagedRunner
from tests.tiny_checkpoints import load_reference, make_checkpoint

VOCAB = 256
# HF layer tensor -> llama.cpp's name (convert_hf_to_gguf.py's Gemma 3 table)
_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
          "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down"}


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_NAMES[rest.rsplit('.', 1)[0]]}.weight"


def _convert(folder: str, out: Path) -> dict[str, np.ndarray]:
    """The folder's model as llama.cpp writes a Gemma 3 GGUF (float32 tensors); returns the HF tensors."""
    cfg = transformers.AutoConfig.from_pretrained(folder)
    tensors = load_file(str(Path(folder) / "model.safetensors"))
    w = gguf.GGUFWriter(str(out), "gemma3")
    w.add_name("tiny gemma3")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_sliding_window(cfg.sliding_window)
    glob = cfg.rope_parameters["full_attention"]
    w.add_rope_freq_base(glob["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(glob["factor"])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, arr in tensors.items():
        stored = arr + np.float32(1.0) if name.endswith("norm.weight") else arr  # Gemma's (1 + weight)
        w.add_tensor(_gguf_name(name), np.ascontiguousarray(stored, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory) -> tuple[str, Path, dict[str, np.ndarray]]:
    """(the HF folder, its GGUF, its tensors): 6 layers in llama.cpp's fixed pattern (5 local, 1
    global), local rope base 10000, query_pre_attn_scalar = head_dim (llama.cpp stores neither)."""
    folder = make_checkpoint("gemma3", str(tmp_path_factory.mktemp("gemma3_hf")), num_layers=6, vocab_size=VOCAB,
                             layer_types=None, rope_local_base_freq=10000.0, query_pre_attn_scalar=16)
    path = tmp_path_factory.mktemp("gemma3_gguf") / "tiny-gemma3.gguf"
    return folder, path, _convert(folder, path)


def test_config_is_the_folders(gemma3_gguf):
    folder, path, _ = gemma3_gguf
    ckpt = open_checkpoint(str(path))
    assert isinstance(ckpt, GGUFCheckpoint)
    got = ModelConfig.from_hf_dict(ckpt.hf_config)
    want = ModelConfig.from_hf_dict(open_checkpoint(folder).hf_config)
    assert got.layer_types == want.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    for field in ("architecture", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "sliding_window", "rope_theta", "rope_scaling", "local_rope_theta", "local_rope_scaling",
                  "query_pre_attn_scalar", "qk_norm", "tie_word_embeddings", "hidden_act", "norm_eps",
                  "attn_logit_softcapping", "final_logit_softcapping", "max_position_embeddings"):
        assert getattr(got, field) == pytest.approx(getattr(want, field)), field


def test_tensors_equal_the_folder_and_transformers_gguf_loading(gemma3_gguf):
    """Names mapped (Gemma's four norms per layer and the q/k norms), 1 taken off every norm scale,
    as transformers' GGUF loader does: its tensors and ours are equal."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, path, tensors = gemma3_gguf
    ckpt = open_checkpoint(str(path))
    assert sorted(ckpt.tensor_names()) == sorted(tensors)
    for name, want in tensors.items():
        np.testing.assert_allclose(ckpt.get_tensor(name), want, rtol=0, atol=1e-6, err_msg=name)
    hf_cfg = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        meta = transformers.Gemma3ForCausalLM(hf_cfg)
    with cached_gguf_name_map():
        ref = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=meta)
    assert sorted(ref["tensors"]) == sorted(tensors)
    for name, t in ref["tensors"].items():
        np.testing.assert_array_equal(ckpt.get_tensor(name), t.numpy(), err_msg=name)
    assert ref["config"]["model_type"] == "gemma3_text"
    assert ref["config"]["sliding_window"] == hf_cfg.sliding_window


def test_logits_equal_transformers_on_the_folder(gemma3_gguf):
    folder, path, _ = gemma3_gguf
    ckpt = open_checkpoint(str(path))
    cfg = ModelConfig.from_hf_dict(ckpt.hf_config)
    graphdef, state = load_params(ckpt, cfg, jnp.float32)
    ids = [int(t) for t in np.random.default_rng(0).integers(0, VOCAB, size=40)]
    got = PagedRunner(graphdef, state, cfg).step([(0, ids, 0)])[0]
    with torch.no_grad():
        want = load_reference(folder)(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)


@pytest.mark.parametrize("layers, window", [(62, 1024), (4, None)], ids=["27b-scale", "no-window"])
def test_what_llama_cpp_fixes_rather_than_stores(tmp_path, layers, window):
    """The 27B's score scale is (hidden / heads)^-0.5, every other's head_dim^-0.5; a file without
    a window has only global layers; a stored final soft cap is read."""
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "gemma3")
    for key, value in (("add_block_count", layers), ("add_embedding_length", 5376), ("add_feed_forward_length", 64),
                       ("add_head_count", 32), ("add_head_count_kv", 16), ("add_key_length", 128),
                       ("add_final_logit_softcapping", 30.0), ("add_token_list", [f"t{i}" for i in range(VOCAB)])):
        getattr(w, key)(value)
    if window:
        w.add_sliding_window(window)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cfg = ModelConfig.from_hf_dict(open_checkpoint(str(tmp_path / "m.gguf")).hf_config)
    assert cfg.query_pre_attn_scalar == (168 if layers == 62 else 128)
    assert cfg.sliding_window == window and cfg.final_logit_softcapping == 30.0
    assert cfg.layer_types.count("full_attention") == (layers // 6 if window else layers)
