"""Per-layer KV-cache scales from a checkpoint (models/kv_scales.py) for kv_cache_dtype="fp8": the
names vLLM reads, their validation, and that a layer's scales are applied where its K/V are
written and read (a model whose keys and values lie far beyond e4m3's +-448)."""

from __future__ import annotations

import json
import logging
import os

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxengine.attention_backend import select_attention_backend
from jaxengine.models import layer_call
from jaxengine.models.attention import AttentionMetadata
from jaxengine.models.kv_scales import read_kv_scales
from tests.model_harness import PagedRunner
from tests.models.test_model import _load
from tests.tiny_checkpoints import make_checkpoint


class _Ckpt:
    """A checkpoint's tensor listing (the reader asks nothing else)."""

    path = "ckpt"

    def __init__(self, tensors: dict[str, np.ndarray]):
        self.tensors = tensors

    def tensor_names(self) -> list[str]:
        return list(self.tensors)

    def get_tensor(self, name: str) -> np.ndarray:
        return self.tensors[name]


def test_every_name_vllm_reads():
    """compressed-tensors (k_scale / v_scale), AutoFP8 (kv_scale: both), Quark (k/v_proj.output_scale),
    ModelOpt (k_proj.k_scale / v_proj.v_scale); q_scale and weights are not KV scales."""
    one = lambda x: np.asarray(x, np.float32)  # noqa: E731
    ckpt = _Ckpt({
        "model.layers.0.self_attn.k_scale": one(0.5), "model.layers.0.self_attn.v_scale": one([0.25]),
        "model.layers.1.self_attn.kv_scale": one(2.0),
        "model.layers.2.self_attn.k_proj.output_scale": one(3.0),
        "model.layers.2.self_attn.v_proj.output_scale": one(4.0),
        "model.layers.3.self_attn.k_proj.k_scale": one(5.0), "model.layers.3.self_attn.v_proj.v_scale": one(6.0),
        "model.layers.3.self_attn.q_scale": one(9.0), "model.layers.3.self_attn.k_proj.weight": np.ones((2, 2)),
    })
    assert read_kv_scales(ckpt, 4) == ((0.5, 0.25), (2.0, 2.0), (3.0, 4.0), (5.0, 6.0))
    assert read_kv_scales(_Ckpt({"model.layers.0.self_attn.k_proj.weight": np.ones((2, 2))}), 1) is None


@pytest.mark.parametrize("tensors, message", [
    ({"model.layers.0.self_attn.k_scale": np.ones(4, np.float32),
      "model.layers.0.self_attn.v_scale": np.ones((), np.float32)}, r"k_scale has shape \(4,\), expected one number"),
    ({"model.layers.0.self_attn.kv_scale": np.asarray(0.0, np.float32)}, "kv_scale is 0.0, expected a positive"),
    ({"model.layers.0.self_attn.kv_scale": np.asarray(np.nan, np.float32)}, "is nan, expected a positive"),
    ({"model.layers.0.self_attn.k_scale": np.asarray(1.0, np.float32)}, "some layers only; none for layer.s. 0.v_scale"),
    ({"model.layers.0.self_attn.kv_scale": np.asarray(1.0, np.float32),
      "model.layers.2.self_attn.kv_scale": np.asarray(1.0, np.float32)}, "names layer 2, the model has 2 layers"),
    ({"model.layers.0.self_attn.kv_scale": np.asarray(1.0, np.float32)}, "1.k_scale, 1.v_scale"),
])
def test_bad_scales_are_refused_by_name(tensors, message):
    with pytest.raises(ValueError, match=message):
        read_kv_scales(_Ckpt(tensors), 2)


# keys and values of this size overflow e4m3 (largest finite 448) unless scaled
BIG = 400.0


@pytest.fixture(scope="module")
def big_kv_checkpoint(tmp_path_factory):
    """A tiny Llama whose keys and values are BIG times larger (k_proj / v_proj weights times BIG,
    q_proj / o_proj divided by it: the same function, with keys and values in the thousands),
    written once without and once with per-layer scales that bring them under 448 (a
    compressed-tensors checkpoint that quantizes its KV cache only)."""
    root = tmp_path_factory.mktemp("kvscales")
    plain = make_checkpoint("llama", str(root / "plain"), vocab_size=512, num_layers=2)
    file = os.path.join(plain, "model.safetensors")
    tensors = load_file(file)
    for name in list(tensors):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            tensors[name] = tensors[name] * BIG
        elif name.endswith(("q_proj.weight", "o_proj.weight")):
            tensors[name] = tensors[name] / BIG
    save_file(tensors, file, metadata={"format": "pt"})
    scaled = root / "scaled"
    scaled.mkdir()
    for f in os.listdir(plain):
        if f != "model.safetensors":
            with open(os.path.join(plain, f), "rb") as src, open(scaled / f, "wb") as dst:
                dst.write(src.read())
    with_scales = dict(tensors)
    for i in range(2):
        with_scales[f"model.layers.{i}.self_attn.k_scale"] = np.asarray(BIG / 8 * (i + 1), np.float32)
        with_scales[f"model.layers.{i}.self_attn.v_scale"] = np.asarray(BIG / 4 * (i + 1), np.float32)
    save_file(with_scales, str(scaled / "model.safetensors"), metadata={"format": "pt"})
    config = json.load(open(scaled / "config.json"))  # as llm-compressor writes a KV-cache-only recipe
    config["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {},
                                     "kv_cache_scheme": KV_CACHE_SCHEME, "format": "float-quantized"}
    json.dump(config, open(scaled / "config.json", "w"))
    return plain, str(scaled)


KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def test_a_kv_cache_only_checkpoint_has_plain_linears():
    """compressed-tensors with a kv_cache_scheme and no weight group: no weight quantization (its
    KV scales are read apart); no weight group and no KV scheme is still refused."""
    from jaxengine.models.quant_formats import resolve_quantization

    qc = {"quant_method": "compressed-tensors", "config_groups": {}, "kv_cache_scheme": KV_CACHE_SCHEME}
    assert resolve_quantization(None, {"quantization_config": qc}) is None
    assert resolve_quantization("compressed-tensors", {"quantization_config": qc}) is None
    with pytest.raises(ValueError, match="exactly one config group with weights"):
        resolve_quantization(None, {"quantization_config": {**qc, "kv_cache_scheme": None}})


def _logits(graphdef, state, cfg, toks, attention=None) -> np.ndarray:
    runner = PagedRunner(graphdef, state, cfg, attention=attention)
    # a prefill, then decode steps reading what the earlier steps wrote
    return np.concatenate([runner.step([(0, toks[:24], 0)])[0]] +
                          [runner.step([(0, toks[:n], n - 1)])[0] for n in range(25, 28)])


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want ** 2)))


def test_scales_are_applied_where_the_cache_is_written_and_read(big_kv_checkpoint):
    """Keys and values far beyond +-448: an fp8 cache at scale 1.0 clips them (logits far off the
    float cache's), with each layer's scales it holds them (within e4m3's rounding, as an fp8
    cache of a plain model is: test_kv_cache_fp8.KV_FP8_RTOL)."""
    from tests.engine.test_kv_cache_fp8 import KV_FP8_RTOL

    _, scaled = big_kv_checkpoint
    cfg, graphdef, state = _load(scaled)  # the scale tensors are not weights: the loader passes them by
    toks = [int(t) for t in np.random.default_rng(0).integers(0, cfg.vocab_size, size=27)]
    want = _logits(graphdef, state, cfg, toks)
    from jaxengine.models.checkpoint import open_checkpoint

    scales = read_kv_scales(open_checkpoint(scaled), cfg.num_layers)
    assert scales == ((BIG / 8, BIG / 4), (BIG / 4, BIG / 2))
    unscaled = select_attention_backend("reference", cfg, jnp.float32, 16, kv_cache_dtype="fp8")
    with_scales = select_attention_backend("reference", cfg, jnp.float32, 16, kv_cache_dtype="fp8", kv_scales=scales)
    md = AttentionMetadata(*(jnp.zeros(1, jnp.int32) for _ in range(5)))
    assert np.asarray(with_scales.layer_metadata(md, 1).kv_scale).tolist() == [BIG / 4, BIG / 2]
    assert unscaled.layer_metadata(md, 1) is md
    err_unscaled = _rel_err(_logits(graphdef, state, cfg, toks, unscaled), want)
    traces = layer_call._apply._cache_size()
    err_scaled = _rel_err(_logits(graphdef, state, cfg, toks, with_scales), want)
    # the two layers' scales differ, yet they share one layer trace (the scales are traced values)
    assert layer_call._apply._cache_size() - traces <= 1
    assert err_scaled < KV_FP8_RTOL < err_unscaled, (err_scaled, err_unscaled)
    print(f"relative logit error: {err_scaled:.4f} with the scales, {err_unscaled:.4f} without")
    with pytest.raises(ValueError, match="4 layers' scales for a model of 2 layers"):
        select_attention_backend("reference", cfg, jnp.float32, 16, kv_cache_dtype="fp8", kv_scales=scales * 2)


def test_engine_reads_the_scales_for_an_fp8_cache_only(big_kv_checkpoint, xla_cache_dir, monkeypatch):
    """LLM(kv_cache_dtype="fp8") on the scaled checkpoint runs its scales (greedy tokens of the
    float cache); with kv_cache_dtype="auto" they are loaded past and not used; the checkpoint
    without them runs at 1.0 with a warning."""
    from jaxengine import LLM, SamplingParams

    records: list[tuple[str, str]] = []
    log = logging.getLogger("jaxengine.loading")
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda r: records.append((r.levelname, r.getMessage()))
    monkeypatch.setattr(log, "handlers", [handler])
    monkeypatch.setattr(log, "level", logging.INFO)
    plain, scaled = big_kv_checkpoint
    kw = dict(dtype="float32", max_model_len=64, num_kv_blocks=16, max_num_seqs=2, max_num_batched_tokens=32,
              compilation_cache_dir=xla_cache_dir, skip_tokenizer_init=True)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": [int(t) for t in np.random.default_rng(1).integers(0, 512, size=20)]}
    runs, said = {}, {}
    for name, path, kv in (("float", scaled, "auto"), ("fp8", scaled, "fp8"), ("fp8, no scales", plain, "fp8")):
        records.clear()
        llm = LLM(path, kv_cache_dtype=kv, **kw)
        runs[name] = (llm.llm_engine.runner.attention, llm.generate([prompt], params, use_tqdm=False)[0])
        said[name] = [(lvl, msg) for lvl, msg in records if "scale" in msg]
        del llm
    assert runs["float"][0].kv_scales is None and runs["fp8, no scales"][0].kv_scales is None
    assert runs["fp8"][0].kv_scales == ((BIG / 8, BIG / 4), (BIG / 4, BIG / 2))
    assert runs["fp8"][0].description.endswith("fp8 KV cache, the checkpoint's per-layer KV scales")
    assert runs["fp8"][1].outputs[0].token_ids == runs["float"][1].outputs[0].token_ids
    assert [lvl for lvl, _ in said["float"]] == ["INFO"] and "not used" in said["float"][0][1]
    assert said["fp8"] == [("INFO", "fp8 KV cache: the checkpoint's scales, k_scale 50-100, v_scale 100-200 over 2 layers")]
    assert [lvl for lvl, _ in said["fp8, no scales"]] == ["WARNING"]


def test_scales_join_the_program_bundle_key(big_kv_checkpoint):
    """Two checkpoints alike but for their scales never share compiled programs."""
    from jaxengine import program_bundle
    from jaxengine.config import EngineConfig
    from jaxengine.models.config import ModelConfig

    cfg = ModelConfig.from_hf_dict(json.load(open(os.path.join(big_kv_checkpoint[0], "config.json"))))
    fields = [program_bundle.bundle_key_fields(EngineConfig(), cfg, jnp.float32, select_attention_backend(
        "reference", cfg, jnp.float32, 16, kv_cache_dtype="fp8", kv_scales=((1.0, v),) * 2), None, {})
        for v in (2.0, 3.0)]
    assert {k for k in fields[0] if fields[0][k] != fields[1][k]} == {"kv_scales"}


def test_triton_kernels_read_a_scaled_cache_as_the_reference_does():
    """The GPU backend (Triton kernels, interpreted) with a layer's scales: the same e4m3 cache
    and the same output as the jnp reference backend with those scales."""
    import dataclasses
    import functools

    import jax

    from jaxengine.attention_backend import AttentionBackend
    from jaxengine.pallas_kernels import ragged_paged_attention_gpu as rpa_gpu
    from jaxengine.pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
    from tests.engine.test_attention_backend import _step

    b, k, v, md = _step(np.random.default_rng(5))
    k, v = k * 300.0, v * 900.0  # beyond e4m3's 448 unscaled
    md = dataclasses.replace(md, kv_scale=jnp.asarray([40.0, 120.0], jnp.float32))  # as layer_metadata gives it
    caches = (b.k_cache.astype(jnp.float8_e4m3fn), b.v_cache.astype(jnp.float8_e4m3fn))
    fp8 = jnp.dtype(jnp.float8_e4m3fn)
    gpu = AttentionBackend("pallas", "gpu", functools.partial(rpa_gpu.ragged_paged_attention_gpu, interpret=True),
                           cache_dtype=fp8)
    ref = dataclasses.replace(gpu, fn=ragged_paged_attention_reference)
    o, (kc, vc) = jax.jit(lambda *a: gpu.attend(*a, sm_scale=0.25 / 300.0))(b.q, k, v, caches, md)
    o_ref, (kc_ref, vc_ref) = jax.jit(lambda *a: ref.attend(*a, sm_scale=0.25 / 300.0))(b.q, k, v, caches, md)
    np.testing.assert_array_equal(np.asarray(kc.astype(jnp.float32)), np.asarray(kc_ref.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(vc.astype(jnp.float32)), np.asarray(vc_ref.astype(jnp.float32)))
    assert float(jnp.max(jnp.abs(kc.astype(jnp.float32)))) < 448  # held, not clipped
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), rtol=2e-5, atol=2e-3)
