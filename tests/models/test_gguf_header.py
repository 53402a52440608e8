"""models/gguf_header.py reads what the gguf package's reader reads: every field's contents and
every tensor's name, type, dims and data (float and quantized)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from jaxengine.models.gguf_header import FAST_DEQUANTIZE, GGUFHeader


def test_header_matches_the_gguf_reader(tmp_path):
    path = str(tmp_path / "m.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_int64("x.i64", -5)
    w.add_bool("x.flag", True)
    w.add_string("tokenizer.chat_template", "{{ messages }} é")
    w.add_array("tokenizer.ggml.tokens", ["a", "bé", "", "<|im_end|>"])
    w.add_array("tokenizer.ggml.token_type", [1, 1, 3, 3])
    w.add_array("tokenizer.ggml.scores", [0.5, -1.0, 0.0, 2.0])
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((8, 32)).astype(np.float32))
    w.add_tensor("output_norm.weight", rng.standard_normal(32).astype(np.float16))
    q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    fast, ref = GGUFHeader(path), gguf.GGUFReader(path, "r")
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]  # the reader's own pseudo-fields
    assert list(fast.fields) == keys
    for k in keys:
        assert fast.fields[k].contents() == ref.fields[k].contents(), k
    assert len(fast.tensors) == len(ref.tensors) == 3
    for a, b in zip(fast.tensors, ref.tensors):
        assert (a.name, a.tensor_type, a.shape.tolist()) == (b.name, b.tensor_type, b.shape.tolist())
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data)
        np.testing.assert_array_equal(gguf.quants.dequantize(a.data, a.tensor_type),
                                      gguf.quants.dequantize(b.data, b.tensor_type))


def test_not_gguf_raises(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"NOPE" + bytes(32))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFHeader(str(tmp_path / "x.gguf"))


@pytest.mark.parametrize("name", sorted(FAST_DEQUANTIZE))
def test_fast_dequantize_matches_gguf(name):
    qtype = gguf.GGMLQuantizationType[name]
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((6, 64)) * rng.uniform(0.01, 3, (6, 1))).astype(np.float32)
    q = gguf.quants.quantize(w, qtype)
    want = gguf.quants.dequantize(q, qtype).reshape(-1)
    np.testing.assert_array_equal(FAST_DEQUANTIZE[name](q), want)
    assert np.abs(want - w.reshape(-1)).max() < 0.5
