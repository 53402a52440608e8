"""The serving metric definitions (TTFT, TPOT, ITL, E2EL, goodput) on hand-made timestamps."""

from __future__ import annotations

import math

import pytest

from jaxengine.benchmarks.common import random_requests
from jaxengine.benchmarks.serve import arrival_offsets
from jaxengine.benchmarks.serving_metrics import RequestResult, compute_metrics, parse_goodput


def test_per_request_definitions():
    r = RequestResult(prompt_len=10, success=True, output_tokens=5, chunk_times=[0.2, 0.3, 0.45, 0.5, 0.6])
    assert r.ttft == pytest.approx(0.2)
    assert r.latency == pytest.approx(0.6)
    assert r.itl == pytest.approx([0.1, 0.15, 0.05, 0.1])
    assert r.tpot == pytest.approx((0.6 - 0.2) / 4)
    one = RequestResult(prompt_len=3, success=True, output_tokens=1, chunk_times=[0.4])
    assert one.tpot is None and one.itl == []


def test_chunks_with_several_tokens_tpot_uses_token_count():
    # 2 chunks carrying 7 tokens: ITL has one gap, TPOT divides by the 6 decode tokens.
    r = RequestResult(prompt_len=4, success=True, output_tokens=7, chunk_times=[0.1, 0.7])
    assert r.itl == pytest.approx([0.6])
    assert r.tpot == pytest.approx(0.1)


def test_aggregates_and_goodput():
    a = RequestResult(prompt_len=10, success=True, output_tokens=3, chunk_times=[0.1, 0.2, 0.3])   # tpot 0.1
    b = RequestResult(prompt_len=20, success=True, output_tokens=3, chunk_times=[0.5, 0.9, 1.3])   # tpot 0.4
    c = RequestResult(prompt_len=30, success=True, output_tokens=1, chunk_times=[0.2])             # tpot none
    d = RequestResult(prompt_len=40, success=False, error="HTTP 500")
    m = compute_metrics([a, b, c, d], duration_s=2.0, goodput_slo_ms={"ttft": 300, "tpot": 200})
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 60 and m["total_output_tokens"] == 7
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(3.5)
    assert m["total_token_throughput"] == pytest.approx(33.5)
    assert m["ttft_ms"]["mean"] == pytest.approx((100 + 500 + 200) / 3)
    assert m["ttft_ms"]["median"] == pytest.approx(200)
    assert m["tpot_ms"]["mean"] == pytest.approx(250)  # c has no TPOT, so it is not averaged in
    assert m["itl_ms"]["mean"] == pytest.approx((100 + 100 + 400 + 400) / 4)
    assert m["e2el_ms"]["median"] == pytest.approx(300)
    # a: ttft 100 <= 300, tpot 100 <= 200 -> good; b: ttft 500 fails; c: ttft 200, tpot counted as 0 -> good
    assert m["good_requests"] == 2
    assert m["request_goodput"] == pytest.approx(1.0)
    assert compute_metrics([a], 1.0)["request_goodput"] is None


def test_percentile_p99_interpolates():
    rs = [RequestResult(prompt_len=1, success=True, output_tokens=1, chunk_times=[t / 100]) for t in range(1, 101)]
    m = compute_metrics(rs, 1.0)
    assert m["ttft_ms"]["p99"] == pytest.approx(990.1)
    assert math.isnan(m["tpot_ms"]["mean"])


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "tpot:50.5", "e2el:1000"]) == {"ttft": 500, "tpot": 50.5, "e2el": 1000}
    assert parse_goodput(None) == {}
    for bad in (["itl:5"], ["ttft"], ["ttft:x"], ["tpot:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_arrivals_and_random_lengths():
    assert arrival_offsets(4, float("inf")) == [0.0] * 4
    t = arrival_offsets(2000, 10.0, seed=1)
    assert t[0] == 0 and all(b >= a for a, b in zip(t, t[1:]))
    assert t[-1] / 1999 == pytest.approx(0.1, rel=0.1)  # mean gap 1/rate
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0)
    reqs = random_requests(50, 100, 20, 0.5, vocab_size=1000, seed=0)
    assert all(50 <= r.prompt_len <= 150 and 10 <= r.output_len <= 30 for r in reqs)
    assert all(10 <= t < 1000 for r in reqs for t in r.prompt_token_ids)
    with pytest.raises(ValueError):
        random_requests(1, 10, 10, 1.0, vocab_size=100)


def test_sweep_plots_are_skipped_without_matplotlib(monkeypatch, tmp_path):
    import sys

    from jaxengine.benchmarks import sweep
    from jaxengine.benchmarks.sweep import Schedule, write_plots

    logged: list[str] = []  # the package logger does not propagate, so caplog would see nothing
    monkeypatch.setattr(sweep.logger, "warning", lambda msg, *a: logged.append(msg % a))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    assert write_plots(str(tmp_path / "x"), []) == []
    assert any("matplotlib is not installed" in m for m in logged)
    assert Schedule.parse("512:64:16").flags == "--max-num-batched-tokens 512 --max-num-seqs 64 --block-size 16"
    for bad in ("512:64", "a:b:c", "0:8:16"):
        with pytest.raises(ValueError):
            Schedule.parse(bad)
