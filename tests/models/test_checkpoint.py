"""Safetensors checkpoints and open_checkpoint: tiny random Llama saved by transformers itself."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
import transformers

from jaxengine.models.checkpoint import Checkpoint, SafetensorsCheckpoint, open_checkpoint


def _tiny_llama(seed: int = 0) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                   max_position_embeddings=128, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).eval()


def _save_tokenizer(folder: Path) -> None:
    """A tiny word-level tokenizer, saved like any HF tokenizer (no hub needed)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>",
                                                bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One random model saved three ways: single file, sharded, bf16; plus a tokenizer folder."""
    model = _tiny_llama()
    root = tmp_path_factory.mktemp("ckpt")
    state = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="100KB")
    model.to(torch.bfloat16).save_pretrained(root / "bf16")
    _save_tokenizer(root / "tok")
    return {"root": root, "state": state}


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_names_shapes_values_equal_torch_state_dict(saved: dict, layout: str) -> None:
    folder = saved["root"] / layout
    if layout == "sharded":  # the fixture really produced a multi-shard checkpoint
        assert (folder / "model.safetensors.index.json").is_file()
        assert len(list(folder.glob("*.safetensors"))) > 2
    ckpt = open_checkpoint(str(folder))
    assert isinstance(ckpt, SafetensorsCheckpoint) and isinstance(ckpt, Checkpoint)
    state = saved["state"]
    assert sorted(ckpt.tensor_names()) == sorted(state)
    for name, ref in state.items():
        assert ckpt.tensor_shape(name) == ref.shape
        got = ckpt.get_tensor(name)
        assert got.dtype == np.float32 and ckpt.tensor_dtype(name) == np.float32
        assert got.flags.writeable, name
        np.testing.assert_array_equal(got, ref, err_msg=name)
    assert ckpt.hf_config["architectures"] == ["LlamaForCausalLM"]
    assert ckpt.hf_config["hidden_size"] == 64 and ckpt.hf_config["num_key_value_heads"] == 2
    assert ckpt.path == str(folder)


def test_bf16_read_back_as_bf16(saved: dict) -> None:
    ckpt = open_checkpoint(saved["root"] / "bf16")
    name = "model.layers.1.self_attn.k_proj.weight"
    got = ckpt.get_tensor(name)
    assert got.dtype == ml_dtypes.bfloat16 and ckpt.tensor_dtype(name) == ml_dtypes.bfloat16
    assert got.flags.writeable
    assert got.shape == (32, 64) == ckpt.tensor_shape(name)
    ref = saved["state"][name].astype(ml_dtypes.bfloat16)  # round-to-nearest-even, like torch
    np.testing.assert_array_equal(got.view(np.uint16), ref.view(np.uint16))


def test_generation_config_and_tokenizer(saved: dict) -> None:
    ckpt = open_checkpoint(saved["root"] / "single")
    gen = ckpt.generation_config()
    assert isinstance(gen, dict) and gen.get("bos_token_id") == ckpt.hf_config.get("bos_token_id")
    # tokenizer= overrides where the tokenizer comes from
    tok = open_checkpoint(saved["root"] / "single", tokenizer=str(saved["root"] / "tok")).load_tokenizer()
    assert tok.encode("hello world", add_special_tokens=False) == [3, 4]
    assert tok.eos_token_id == 2


def test_missing_tokenizer_is_a_clear_error(saved: dict, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer"):
        open_checkpoint(saved["root"] / "single", tokenizer=str(tmp_path / "none")).load_tokenizer()


def test_generation_config_absent_is_empty(saved: dict, tmp_path: Path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(saved["root"] / "single", folder)
    (folder / "generation_config.json").unlink(missing_ok=True)
    assert open_checkpoint(folder).generation_config() == {}


def test_unknown_tensor_names_it(saved: dict) -> None:
    ckpt = open_checkpoint(saved["root"] / "sharded")
    with pytest.raises(ValueError, match="model.layers.9.mlp.up_proj.weight"):
        ckpt.get_tensor("model.layers.9.mlp.up_proj.weight")
    with pytest.raises(ValueError, match="nope"):
        ckpt.tensor_shape("nope")
    assert "model.norm.weight" in ckpt and "nope" not in ckpt


def test_missing_paths(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does_not_exist"):
        open_checkpoint(str(tmp_path / "does_not_exist"))
    with pytest.raises(ValueError, match="missing.gguf"):
        open_checkpoint(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="config.json"):
        open_checkpoint(tmp_path)  # an empty folder
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        open_checkpoint(tmp_path / "weights.bin")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="no model.safetensors"):
        open_checkpoint(tmp_path)


def test_truncated_and_corrupt_files(saved: dict, tmp_path: Path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(saved["root"] / "single", folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"truncated.*model\.safetensors"):
        open_checkpoint(folder)
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ValueError, match=r"corrupt.*model\.safetensors"):
        open_checkpoint(folder)
    weights.write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        open_checkpoint(folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        open_checkpoint(folder)


def test_index_naming_a_missing_shard(saved: dict, tmp_path: Path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(saved["root"] / "sharded", folder)
    shard = sorted(folder.glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ValueError, match=shard.name):
        open_checkpoint(folder)


def test_index_placing_a_tensor_in_the_wrong_shard(saved: dict, tmp_path: Path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(saved["root"] / "sharded", folder)
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, f in index["weight_map"].items() if f == shards[0])
    index["weight_map"][name] = shards[-1]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        open_checkpoint(folder)


def test_hub_id_offline_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match=r"jaxengine-tests/no-such-model.*neither a local path nor reachable"):
        open_checkpoint("jaxengine-tests/no-such-model")


def test_generic_fast_tokenizer_folder_skips_autotokenizer(tmp_path: Path, monkeypatch) -> None:
    """A folder whose tokenizer_config names the generic fast class (Llama 3's) loads with that class
    directly, as AutoTokenizer would build it, without importing AutoTokenizer's model machinery;
    any other class still goes through AutoTokenizer."""
    from jaxengine.benchmarks.gpu_suite import synthetic_tokenizer
    from jaxengine.models.checkpoint import load_hf_tokenizer

    folder = synthetic_tokenizer(str(tmp_path / "tok"), 300)
    config = json.loads((Path(folder) / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (Path(folder) / "tokenizer_config.json").write_text(json.dumps(config))
    want = transformers.AutoTokenizer.from_pretrained(folder)

    def refuse(*a, **k):
        raise AssertionError("AutoTokenizer used")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    got = load_hf_tokenizer(folder)
    text = "w1 w2 w299 w17 unknown"
    assert type(got) is type(want) and got(text).input_ids == want(text).input_ids
    assert (got.bos_token_id, got.eos_token_id, got.decode(got(text).input_ids)) == (
        want.bos_token_id, want.eos_token_id, want.decode(want(text).input_ids))

    config["tokenizer_class"] = "GPT2Tokenizer"  # another class: AutoTokenizer decides
    (Path(folder) / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(AssertionError, match="AutoTokenizer used"):
        load_hf_tokenizer(folder)
