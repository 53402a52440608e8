"""benchmarks/gpu_suite.py and plot_results.py: the sweep part's smoke run (CPU, tiny model),
the serving plan's arithmetic, and the serving client against a server without a tokenizer (the
dummy-preset case the suite's serve part meets)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os

from jaxengine.benchmarks import gpu_suite, plot_results


def test_plan_counts_fit_the_time():
    plan = [(1.0, 100), (4.0, 300), (16.0, 800), (float("inf"), 1000)]
    full = gpu_suite.plan_counts(plan, time_left=1000.0, tail_s=15.0, inf_s=90.0)
    assert full == plan  # 100 + 75 + 50 + 3 x 15 + 90 = 360 s fits
    cut = gpu_suite.plan_counts(plan, time_left=270.0, tail_s=15.0, inf_s=90.0)
    assert cut[-1] == (float("inf"), 1000)  # the inf run keeps its count, the finite ones shrink
    assert sum(n / r + 15.0 for r, n in cut[:-1]) <= 270.0 - 90.0 + 1e-6
    assert all(n >= 10 for _, n in cut)


def test_serve_client_counts_token_only_chunks(tiny_model_factory, xla_cache_dir):
    """A server without a tokenizer streams completions chunks with empty text: each still counts
    as a token's arrival (as vLLM's client counts them), so TTFT/ITL/TPOT exist."""
    from jaxengine.benchmarks.common import random_requests
    from jaxengine.benchmarks.serve import run_serve
    from jaxengine.benchmarks.serving_metrics import compute_metrics
    from jaxengine.server.api_server import build_app
    from jaxengine.async_engine import AsyncEngine
    from tests.server.conftest import LiveServer, make_engine

    engine = make_engine(tiny_model_factory("llama"), xla_cache_dir, skip_tokenizer_init=True)
    assert engine.tokenizer is None
    app = build_app(AsyncEngine(engine), served_model_names=["tiny"])
    reqs = random_requests(4, 12, 5, 0.0, 1000, seed=3)
    with LiveServer(app) as srv:
        results, duration = asyncio.run(run_serve(srv.url, "completions", "tiny", reqs, float("inf"), 1.0, None))
    assert all(r.success for r in results), [r.error for r in results]
    assert all(r.output_tokens == 5 and len(r.chunk_times) >= 2 for r in results)
    m = compute_metrics(results, duration)
    assert m["completed"] == 4 and m["total_output_tokens"] == 20
    assert m["tpot_ms"]["median"] >= 0 and m["ttft_ms"]["median"] > 0


def test_smoke_sweep_part_then_plots(tmp_path):
    """The sweep part end to end on the CPU (about 25 s: it runs `jaxengine bench sweep` in a
    subprocess, as on the GPU), then the plots its JSON allows. The other parts' smokes take
    minutes on 2 cores: run them by hand (`python benchmarks/gpu_suite.py all --smoke`)."""
    out = tmp_path / "out"
    assert gpu_suite.main(["sweep", "--smoke", "--out", str(out), "--budget-s", "120"]) == 0
    sweep = json.loads((out / "suite_sweep_smoke.json").read_text())
    assert sweep["smoke"] and not sweep["partial"]
    assert sweep["ceilings"]["copy_bandwidth_GBps"] > 0 and sweep["ceilings"]["bf16_matmul_TFLOPs"] > 0
    assert sweep["versions"]["jax"] and sweep["parameters"]["sweep"]["schedules"] == ["32:8:16", "64:8:16"]
    res = sweep["results"]
    assert res["returncode"] == 0, res["stderr_tail"]
    assert [s["label"] for s in res["schedules"]] == ["32:8:16", "64:8:16"]
    assert res["recommended"]["label"] in ("32:8:16", "64:8:16")
    assert any("--max-num-batched-tokens" in line for line in res["printed_recommendation"])
    assert (out / "suite_sweep_smoke.md").read_text().startswith("# Bucket sweep")
    if importlib.util.find_spec("matplotlib") is not None:
        plots = tmp_path / "plots"
        assert plot_results.main([str(out), "--out-dir", str(plots)]) == 0
        assert (plots / "suite_sweep.png").stat().st_size > 0
        assert not (plots / "suite_throughput.png").exists()  # no engine JSON: skipped, not faked


def test_plot_results_without_json(tmp_path):
    assert plot_results.main([str(tmp_path), "--out-dir", str(tmp_path / "p")]) == 1
    assert not os.path.exists(tmp_path / "p" / "suite_sweep.png")
