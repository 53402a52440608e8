"""Start-up on a tiny random Llama: the breakdown record, lazy compilation as the CPU default, the
program bundle (a fresh process with the same config traces and compiles nothing; a changed config
or a corrupt bundle is refused and rebuilt, with the same tokens) and `jaxengine bench startup`."""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest

from jaxengine import LLM, SamplingParams
from jaxengine.cli import main
from jaxengine.config import EngineConfig, token_buckets
from jaxengine.model_runner import SAMPLER_VARIANTS

ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=32, dtype="float32")
FLAGS = ["--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--num-kv-blocks", "32",
         "--dtype", "float32"]
GREEDY = SamplingParams(max_tokens=6, temperature=0)
PROMPT = "Hello, my name is"


def _tokens(llm: LLM) -> list[int]:
    return list(llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


def _num_programs(llm: LLM) -> int:
    return sum(len(t) for t in llm.llm_engine.runner._program_tables().values())


def test_warmup_default_is_lazy_on_cpu_and_ahead_when_asked(tiny_model_factory, tmp_path):
    path = tiny_model_factory("llama")
    lazy = LLM(path, compilation_cache_dir=str(tmp_path / "lazy"), **ENGINE)
    assert lazy.llm_engine.config.warmup is False and not lazy.llm_engine.startup.ahead_of_time
    assert _num_programs(lazy) == 0
    want = _tokens(lazy)
    buckets = token_buckets(32, "cpu")
    every = len(buckets) * 2 + len({min(t, 4) for t in buckets}) * len(SAMPLER_VARIANTS)
    assert 0 < _num_programs(lazy) < every  # a short run compiles the buckets it used, not all
    # greedy rows that ask for no logprobs take the lean greedy sampler (an argmax), and only it;
    # asking for logprobs takes the full sampler, with the same tokens
    runner = lazy.llm_engine.runner
    assert {key[4:] for key in runner._sample_fns} == {("greedy",)}
    with_lp = lazy.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0, logprobs=1), use_tqdm=False)[0]
    assert list(with_lp.outputs[0].token_ids) == want and len(with_lp.outputs[0].logprobs) == 6
    assert ((1, False, False, False) in runner._sample_fns) and _tokens(lazy) == want
    ahead = LLM(path, compilation_cache_dir=None, warmup=True, **{**ENGINE, "max_num_batched_tokens": 16})
    # token buckets 1 and 16: their forward and prompt-logprob programs; the samplers of rows 1 and 4
    every = 2 * 2 + 2 * len(SAMPLER_VARIANTS)
    assert _num_programs(ahead) == every and ahead.llm_engine.startup.warmup_s > 0
    assert _tokens(ahead) == want
    with pytest.raises(RuntimeError, match="was not compiled at start-up"):
        ahead.llm_engine.runner._get_forward(1 << 20)


def test_warmup_and_enforce_eager():
    assert EngineConfig(enforce_eager=True).resolve_warmup("gpu").warmup is False
    assert EngineConfig().resolve_warmup("gpu").warmup is True
    assert EngineConfig().resolve_warmup("cpu").warmup is False
    assert EngineConfig(warmup=True).resolve_warmup("cpu").warmup is True
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(warmup=True, enforce_eager=True)


def test_bundle_hit_in_a_fresh_process(tiny_model_factory, tmp_path, capsys):
    """`jaxengine bench startup`: the warm run loads every program from the bundle of the cold run."""
    out = tmp_path / "startup.json"
    rc = main(["bench", "startup", "--model", tiny_model_factory("llama"), "--prompt", PROMPT, "--max-tokens", "6",
               "--cold-runs", "1", "--warm-runs", "1", "--compilation-cache-dir", str(tmp_path / "cache"),
               "--output-json", str(out), *FLAGS])
    assert rc == 0
    data = json.loads(out.read_text())
    cold, warm = data["results"]["runs"]
    assert data["results"]["same_tokens"] and data["results"]["cache_dir"] == str(tmp_path / "cache")
    assert cold["after_request"]["xla_compiles"] > 0 and cold["after_request"]["programs_saved"] > 0
    w = warm["after_request"]
    assert (w["traces"], w["xla_compiles"], w["cache_hits"], w["programs_refused"]) == (0, 0, 0, 0)
    assert w["programs_loaded"] == cold["after_request"]["programs_saved"]
    assert "warm 1" in capsys.readouterr().out


def test_bench_startup_help_and_foreign_cache_dir(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "startup", "--help"])
    assert e.value.code == 0
    assert "--cold-runs" in capsys.readouterr().out
    (tmp_path / "precious").write_text("x")  # a folder this command did not make is never emptied
    assert main(["bench", "startup", "--compilation-cache-dir", str(tmp_path)]) == 2
    assert (tmp_path / "precious").exists()


def test_changed_config_and_corrupt_bundle_are_rebuilt(tiny_model_factory, tmp_path):
    path, cache = tiny_model_factory("llama"), str(tmp_path / "cache")
    first = LLM(path, compilation_cache_dir=cache, **ENGINE)
    want = _tokens(first)
    saved = first.llm_engine.runner.bundle.saved
    assert saved > 0
    other = LLM(path, compilation_cache_dir=cache, **{**ENGINE, "max_num_seqs": 2})  # another key: a new bundle
    assert _tokens(other) == want
    b = other.llm_engine.runner.bundle
    assert b.loaded == 0 and b.saved > 0 and b.dir != first.llm_engine.runner.bundle.dir
    # Tamper with the first bundle: one file truncated, one replaced by a program of the other bundle.
    files = sorted(glob.glob(os.path.join(first.llm_engine.runner.bundle.dir, "*.xla")))
    with open(files[0], "r+b") as f:
        f.truncate(os.path.getsize(files[0]) // 2)
    shutil.copy(sorted(glob.glob(os.path.join(b.dir, "*.xla")))[0], files[1])
    again = LLM(path, compilation_cache_dir=cache, **ENGINE)
    assert _tokens(again) == want
    b2 = again.llm_engine.runner.bundle
    assert b2.refused == 2 and b2.saved == 2 and b2.loaded == saved - 2
    healed = LLM(path, compilation_cache_dir=cache, **ENGINE)  # the rebuilt files are whole again
    assert _tokens(healed) == want
    assert (healed.llm_engine.runner.bundle.loaded, healed.llm_engine.runner.bundle.refused) == (saved, 0)


def test_bundle_key_holds_the_code_path_constants(monkeypatch):
    """A code-path constant changed at run time (which kernel fp8 decode rows run, the Triton GEMM
    threshold, a kernel's grid or tiling) changes the bundle key's fields, so no program built under
    the other value is reused."""
    from jaxengine import program_bundle, xla_options
    from jaxengine.models import quantization
    from jaxengine.pallas_kernels import ragged_paged_attention_gpu, weight_only_matmul_gpu

    before = program_bundle.switch_values()
    assert before["jaxengine.models.quantization.FP8_DECODE"] == repr(quantization.FP8_DECODE)
    monkeypatch.setattr(quantization, "FP8_DECODE", "kernel" if quantization.FP8_DECODE == "xla" else "xla")
    monkeypatch.setattr(xla_options, "TRITON_GEMM_MAX_ROWS", xla_options.TRITON_GEMM_MAX_ROWS * 2)
    monkeypatch.setattr(ragged_paged_attention_gpu, "PREFILL_PROGRAMS_CAPPED",
                        not ragged_paged_attention_gpu.PREFILL_PROGRAMS_CAPPED)
    monkeypatch.setattr(weight_only_matmul_gpu, "TARGET_PROGRAMS", weight_only_matmul_gpu.TARGET_PROGRAMS * 2)
    after = program_bundle.switch_values()
    assert {k for k in before if before[k] != after[k]} == {
        "jaxengine.models.quantization.FP8_DECODE", "jaxengine.xla_options.TRITON_GEMM_MAX_ROWS",
        "jaxengine.pallas_kernels.ragged_paged_attention_gpu.PREFILL_PROGRAMS_CAPPED",
        "jaxengine.pallas_kernels.weight_only_matmul_gpu.TARGET_PROGRAMS"}


def test_device_pool_is_sized_to_gpu_memory_utilization(monkeypatch):
    """vLLM's gpu_memory_utilization is a share of the card: the pool JAX reserves is sized to it
    before the backend starts, unless the user set its fraction; the budget stays within the pool."""
    from jax._src import xla_bridge

    from jaxengine import device_memory as loading

    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    loading.size_device_pool(0.85)
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.8500"
    keep = 1 - loading.POOL_HEADROOM
    assert loading.device_memory_budget(85 * 2**30, 0.85) == keep * 85 * 2**30  # the pool: 0.85 of 100 GiB
    loading.size_device_pool(0.5)  # the user's (or an earlier engine's) setting stands
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.8500"

    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: True)
    loading.size_device_pool(0.9)  # too late: the backend has its pool (JAX's default, 75%)
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ
    assert loading.device_memory_budget(75 * 2**30, 0.9) == keep * 75 * 2**30  # capped by the pool
    assert loading.device_memory_budget(75 * 2**30, 0.6) == keep * 60 * 2**30  # 0.6 of the 100 GiB card


def test_one_gpu_engine_gets_the_vmm_allocator_and_skip_temp_unless_the_user_chose(monkeypatch):
    """On one GPU, before the backend starts, the engine picks JAX's VMM allocator and XLA's
    SKIP_TEMP command-buffer updates; a user's allocator or update mode, several devices, no NVML
    (the KV cache could not be sized), no CUDA plugin or a started backend leave both alone."""
    from jaxengine import device_memory

    def fresh(**env):
        for name in ("XLA_PYTHON_CLIENT_ALLOCATOR", "XLA_FLAGS", "JAX_PLATFORMS"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)

    installed = {"pynvml", "jax_cuda12_plugin"}
    monkeypatch.setattr(device_memory, "_installed", lambda module: module in installed)
    monkeypatch.setattr(device_memory, "_backend_started", lambda: False)
    fresh(XLA_FLAGS="--xla_gpu_autotune_level=0")
    assert device_memory.choose_launch_allocator(1)
    assert os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"] == "vmm"
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_autotune_level=0 --xla_gpu_command_buffer_update_mode=SKIP_TEMP"
    for env in ({"XLA_PYTHON_CLIENT_ALLOCATOR": "default"},
                {"XLA_FLAGS": "--xla_gpu_command_buffer_update_mode=NONE"}, {"JAX_PLATFORMS": "cpu"}):
        fresh(**env)
        assert not device_memory.choose_launch_allocator(1)
        assert {k: os.environ.get(k) for k in ("XLA_PYTHON_CLIENT_ALLOCATOR", "XLA_FLAGS")} == \
            {k: env.get(k) for k in ("XLA_PYTHON_CLIENT_ALLOCATOR", "XLA_FLAGS")}
    fresh()
    assert not device_memory.choose_launch_allocator(2)
    installed.discard("pynvml")
    assert not device_memory.choose_launch_allocator(1)
    installed.add("pynvml")
    monkeypatch.setattr(device_memory, "_backend_started", lambda: True)
    assert not device_memory.choose_launch_allocator(1)
    assert "XLA_PYTHON_CLIENT_ALLOCATOR" not in os.environ and "XLA_FLAGS" not in os.environ


def test_accelerator_without_memory_statistics_asks_for_num_kv_blocks(monkeypatch):
    """An accelerator whose allocator reports no memory statistics (XLA's VMM allocator) cannot be
    sized from gpu_memory_utilization: a clear error names num_kv_blocks, instead of the CPU's
    fixed KV budget chosen silently."""
    import jax
    import jax.numpy as jnp

    from jaxengine import loading
    from jaxengine.attention_backend import select_attention_backend
    from jaxengine.models.config import ModelConfig
    from jaxengine.models.presets import PRESETS

    mc = ModelConfig.from_hf_dict(PRESETS["smollm2-135m"]).with_max_model_len(256)
    attention = select_attention_backend("auto", mc, jnp.float32, 16)
    config = EngineConfig(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)
    monkeypatch.setattr(loading.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(type(jax.local_devices()[0]), "memory_stats", lambda self: None)
    with pytest.raises(ValueError, match="no device memory statistics.*give num_kv_blocks"):
        loading.num_kv_blocks(config, mc, jnp.float32, None, {}, attention)


def test_kv_budget_comes_from_nvml_when_the_allocator_reports_nothing(monkeypatch):
    """Under the VMM allocator `memory_stats()` is None: the budget is gpu_memory_utilization of the
    card (less the compile headroom) less what the card already holds, for the GPU that
    CUDA_VISIBLE_DEVICES maps the JAX device to; JAX's pool statistics win when present."""
    import sys
    import types

    from jaxengine import device_memory

    calls = []

    class Info:
        total, used = 80 * 2**30, 20 * 2**30

    fake = types.SimpleNamespace(
        nvmlInit=lambda: calls.append("init"), nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetHandleByIndex=lambda i: calls.append(("index", i)) or i,
        nvmlDeviceGetHandleByUUID=lambda u: calls.append(("uuid", u)) or u,
        nvmlDeviceGetMemoryInfo=lambda h: Info)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(device_memory, "_installed", lambda name: name == "pynvml")
    gpu = types.SimpleNamespace(platform="gpu", local_hardware_id=1, memory_stats=lambda: None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    free, source = device_memory.free_for_kv_and_step(gpu, 0.5)
    keep = 1 - device_memory.POOL_HEADROOM
    assert free == keep * 0.5 * 80 * 2**30 - 20 * 2**30 and source == "the card (NVML)"
    assert calls == ["init", ("index", 6), "shutdown"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa,GPU-bbbb")
    device_memory.free_for_kv_and_step(gpu, 0.5)
    assert ("uuid", "GPU-bbbb") in calls
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    device_memory.free_for_kv_and_step(gpu, 0.5)
    assert calls[-2] == ("index", 1)

    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    pooled = types.SimpleNamespace(platform="gpu", local_hardware_id=0,
                                   memory_stats=lambda: {"bytes_limit": 40 * 2**30, "bytes_in_use": 2**30})
    free, source = device_memory.free_for_kv_and_step(pooled, 0.5)
    assert free == keep * 40 * 2**30 - 2**30 and source == "JAX's memory pool"
    cpu = types.SimpleNamespace(platform="cpu", local_hardware_id=0, memory_stats=lambda: None)
    assert device_memory.free_for_kv_and_step(cpu, 0.5) is None


def test_program_read_from_the_persistent_cache_is_not_bundled(tmp_path):
    """JAX opens its persistent cache once per process and then reads it whatever the thread's
    setting, so a bundle program can still come from that cache (whose executables do not
    re-serialize whole on CPU): such a program is not written to the bundle; a compiled one is."""
    import jax
    import jax.numpy as jnp

    from jaxengine.program_bundle import ProgramBundle

    bundle = ProgramBundle(str(tmp_path), {"test": 1})
    bundle.bind(8)
    compile_fn = jax.jit(lambda x: jnp.sort(x)).lower(jnp.ones(4)).compile
    with bundle.fresh_compile() as record:
        fn = compile_fn()
    assert not record.from_cache
    bundle.save("fresh", fn, from_cache=record.from_cache)
    with bundle.fresh_compile() as record:
        jax.monitoring.record_event("/jax/compilation_cache/cache_hits")  # what JAX records on a cache read
    assert record.from_cache
    bundle.save("read", fn, from_cache=record.from_cache)
    assert (bundle.saved, bundle.skipped) == (1, 1)
    assert bundle.load("read") is None and bundle.load("fresh") is not None


def test_program_options_keep_triton_gemms_for_small_programs_on_gpu(monkeypatch):
    """Plain weights on the GPU: Triton GEMMs (autotuned at compile time) only for programs of at
    most TRITON_GEMM_MAX_ROWS rows, cuBLAS above; an explicit XLA_FLAGS choice rules; FP8 weights
    use Triton GEMMs only at the decode rows of FP8_DECODE="xla"; weight-only weights and the CPU
    keep XLA's defaults."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxengine import xla_options
    from jaxengine.models import quantization
    from jaxengine.models.quantization import packed_from_groups, quantize_fp8
    from jaxengine.xla_options import TRITON_GEMM_MAX_ROWS, program_options

    plain = {"w": jnp.zeros((64, 64), jnp.bfloat16)}
    fp8 = {"w": quantize_fp8(np.ones((64, 64), np.float32), 1)}
    w4 = {"w": packed_from_groups(np.ones((64, 64), np.uint8), np.ones((1, 64), np.float32),
                                  np.zeros((1, 64), np.uint8), 4, 64)}
    off = {"xla_gpu_enable_triton_gemm": False}
    assert program_options(plain, 8192) == {} and program_options(fp8, 17) == off  # the CPU: defaults
    monkeypatch.setattr(xla_options.jax, "default_backend", lambda: "gpu")
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert program_options(plain, TRITON_GEMM_MAX_ROWS) == {}
    assert program_options(plain, TRITON_GEMM_MAX_ROWS + 1) == off and program_options(plain, 8192) == off
    assert program_options(fp8, 1) == {} and program_options(fp8, 8192) == off and program_options(w4, 8192) == {}
    monkeypatch.setattr(quantization, "FP8_DECODE", "kernel")
    assert program_options(fp8, 1) == off
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true")
    assert program_options(plain, 8192) == {}
    assert jax.default_backend() == "gpu"  # the patch held for the whole test


def test_first_engine_freezes_the_startup_heap(tiny_model_factory):
    """The first engine of a process moves the start-up heap into the collector's permanent
    generation; a second engine freezes nothing more (objects of released engines stay
    collectable). Run in a fresh process: engines of earlier tests would have frozen it here."""
    import subprocess
    import sys

    code = (
        "import gc, json, sys\n"
        "from jaxengine import LLM\n"
        "from jaxengine.startup import freeze_startup_heap\n"
        "kw = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=32,\n"
        "          compilation_cache_dir=None)\n"
        "assert gc.get_freeze_count() == 0\n"
        "LLM(sys.argv[1], **kw)\n"
        "first = gc.get_freeze_count()\n"
        "LLM(sys.argv[1], **kw)\n"
        "print(json.dumps([first, gc.get_freeze_count(), freeze_startup_heap()]))\n")
    out = subprocess.run([sys.executable, "-c", code, tiny_model_factory("llama")], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    first, after_second, again = json.loads(out.stdout.strip().splitlines()[-1])
    # nothing more frozen by the second engine (frozen objects freed by reference counting leave)
    assert first > 10_000 and after_second <= first and again == 0
