"""`jaxengine bench ...` end to end on a tiny random Llama: every subcommand runs and writes
well-formed JSON with the device, versions, configuration and its results."""

from __future__ import annotations

import csv
import json

import pytest

from jaxengine.cli import main
from tests.server.conftest import LiveServer, make_engine

ENGINE_FLAGS = ["--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
                "--num-kv-blocks", "128", "--dtype", "float32"]


@pytest.fixture(scope="module")
def tiny(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


def _load(path) -> dict:
    with open(path) as f:
        data = json.load(f)
    assert data["environment"]["backend"] == "cpu"
    assert data["environment"]["jax"]
    assert isinstance(data["args"], dict)
    return data


def test_throughput(tiny, xla_cache_dir, tmp_path, capsys):
    out = tmp_path / "tp.json"
    rc = main(["bench", "throughput", "--model", tiny, "--num-prompts", "6", "--input-len", "24", "--output-len",
               "6", "--range-ratio", "0.5", "--num-warmup", "2", "--output-json", str(out),
               "--compilation-cache-dir", xla_cache_dir, *ENGINE_FLAGS])
    assert rc == 0
    data = _load(out)
    res = data["results"]
    assert res["num_requests"] == 6
    assert 6 * 3 <= res["total_output_tokens"] <= 6 * 9
    assert res["requests_per_s"] > 0 and res["output_tokens_per_s"] > 0
    assert res["total_tokens_per_s"] > res["output_tokens_per_s"]
    assert data["engine_config"]["max_num_batched_tokens"] == 64
    assert "requests/s" in capsys.readouterr().out


def test_throughput_sharegpt(tiny, xla_cache_dir, tmp_path):
    conv = [{"conversations": [{"from": "human", "value": f"Tell me a story about the number {i} and a cat."},
                               {"from": "gpt", "value": "Once upon a time there was a cat who counted."}]}
            for i in range(5)] + [{"conversations": [{"from": "human", "value": "only one turn"}]}]
    ds = tmp_path / "sharegpt.jsonl"
    ds.write_text("\n".join(json.dumps(c) for c in conv))
    out = tmp_path / "tp_sharegpt.json"
    rc = main(["bench", "throughput", "--model", tiny, "--dataset", str(ds), "--num-prompts", "10",
               "--output-json", str(out), "--compilation-cache-dir", xla_cache_dir, *ENGINE_FLAGS])
    assert rc == 0
    assert _load(out)["results"]["num_requests"] == 5  # the one-turn conversation is skipped


def test_latency(tiny, xla_cache_dir, tmp_path, capsys):
    out = tmp_path / "lat.json"
    rc = main(["bench", "latency", "--model", tiny, "--batch-size", "1", "4", "--input-len", "16",
               "--output-len", "8", "--num-iters", "2", "--num-iters-warmup", "1", "--bandwidth-bytes", str(4 << 20),
               "--output-json", str(out), "--compilation-cache-dir", xla_cache_dir, *ENGINE_FLAGS])
    assert rc == 0
    data = _load(out)
    assert data["bandwidth"]["copy_bandwidth_GBps"] > 0 and "CPU" in data["bandwidth"]["kind"]
    assert data["weight_bytes"] > 0 and data["kv_bytes_per_token"] > 0
    assert [(r["batch_size"], r["input_len"], r["output_len"]) for r in data["results"]] == [(1, 16, 8), (4, 16, 8)]
    for r in data["results"]:
        assert r["ttft_ms"]["median"] > 0
        assert r["decode_steps_measured"] > 0
        assert 0 < r["decode_step_ms"]["median"] <= r["decode_step_ms"]["p99"]
        assert r["tokens_per_s"] > 0 and r["fraction_of_roofline"] > 0
        assert r["roofline_step_ms_all_weights"] >= r["roofline_step_ms"]  # the older formula reads the whole table
    assert "roofline" in capsys.readouterr().out


def test_sweep(tiny, xla_cache_dir, tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps({"input_len": n, "output_len": 4, "timestamp": i})
                               for i, n in enumerate([5, 40, 17, 60, 9, 33])))
    stem = tmp_path / "sweep"
    rc = main(["bench", "sweep", "--model", tiny, "--schedule", "32:8:16", "--schedule", "64:8:16",
               "--trace", str(trace), "--bucket-iters", "3", "--bucket-warmup", "1", "--output-prefix", str(stem),
               "--compilation-cache-dir", xla_cache_dir, *ENGINE_FLAGS])
    assert rc == 0
    data = _load(str(stem) + ".json")
    assert [s["label"] for s in data["schedules"]] == ["32:8:16", "64:8:16"]
    assert data["schedules"][0]["token_buckets"] == [1, 16, 32]  # the CPU's buckets start at 1
    for s in data["schedules"]:
        assert [b["bucket"] for b in s["buckets"]] == s["token_buckets"]
        assert all(b["step_ms"]["median"] > 0 and b["compile_s"] >= 0 for b in s["buckets"])
        rep = s["replay"]
        assert rep["output_tokens"] == 24 and 0 <= rep["padding_waste"] < 1
        assert rep["scheduled_tokens"] >= 164  # every prompt token at least once, plus decode steps
    assert data["workload"]["num_requests"] == 6
    assert data["recommended"]["label"] in ("32:8:16", "64:8:16")
    out = capsys.readouterr().out
    assert "recommended schedule" in out and "--max-num-batched-tokens" in out
    with open(str(stem) + "_schedules.csv") as f:
        assert len(list(csv.DictReader(f))) == 2
    with open(str(stem) + "_buckets.csv") as f:
        assert len(list(csv.DictReader(f))) == 3 + 4  # buckets 1, 16, 32 and 1, 16, 32, 64 (the CPU's)


def test_serve_against_live_server(tiny, xla_cache_dir, tmp_path, capfd):
    from jaxengine.server.api_server import build_app
    from jaxengine.async_engine import AsyncEngine

    engine = make_engine(tiny, xla_cache_dir)
    app = build_app(AsyncEngine(engine), served_model_names=["tiny"], model_path=tiny)
    out, out_chat = tmp_path / "serve.json", tmp_path / "serve_chat.json"
    with LiveServer(app) as srv:
        rc = main(["bench", "serve", "--base-url", srv.url, "--num-prompts", "6", "--input-len", "12",
                   "--output-len", "5", "--request-rate", "50", "--goodput", "ttft:60000", "tpot:0.001",
                   "--output-json", str(out)])
        rc_chat = main(["bench", "serve", "--base-url", srv.url, "--endpoint", "chat", "--tokenizer", tiny,
                        "--num-prompts", "3", "--input-len", "10", "--output-len", "4", "--max-concurrency", "2",
                        "--output-json", str(out_chat)])
    assert rc == 0 and rc_chat == 0
    data = _load(out)
    m = data["results"]
    assert data["model"] == "tiny"
    assert m["completed"] == 6 and m["total_output_tokens"] == 30
    assert m["total_input_tokens"] == 6 * 12
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(m[key]) >= {"mean", "median", "p99"}
    assert 0 < m["ttft_ms"]["median"] <= m["e2el_ms"]["median"]
    assert m["request_throughput"] > 0 and m["output_throughput"] > 0
    assert m["good_requests"] == 0  # a 1 µs TPOT SLO is out of reach
    assert all(len(r["itl_s"]) >= 1 for r in data["requests"])
    chat = _load(out_chat)["results"]
    assert chat["completed"] == 3 and chat["total_output_tokens"] == 12
    assert "Time to First Token" in capfd.readouterr().out
