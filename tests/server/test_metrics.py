"""`/metrics` on the model-free `FakeEngine`, where every count is known by hand: iteration tokens,
inter-token latency and the request phases; the vLLM-name export (`--metrics-vllm-names`): every
family also under its `vllm:` names with the same samples, and none of them without the option.
(The same histograms on a real engine: tests/server/test_api.py.)"""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from jaxengine.arg_utils import normalize_flags
from jaxengine.async_engine import AsyncEngine
from jaxengine.server.api_server import build_app
from jaxengine.server.cli import ServerSettings, resolve_args
from jaxengine.server.metrics import PREFIX, VLLM_NAMES, VLLM_PREFIX, ServerMetrics
from tests.server.conftest import LiveServer
from tests.server.fake_engine import FakeEngine

PHASES = ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
          "request_inference_time_seconds")


def scrape_text(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def families_of(text: str) -> dict[str, Metric]:
    """Name -> family, without the `*_created` series (prometheus_client's own; the server turns
    them off, as vLLM does)."""
    return {fam.name: fam for fam in text_string_to_metric_families(text) if not fam.name.endswith("_created")}


def value(samples: dict, name: str) -> float:
    (v,) = [v for (n, _), v in samples.items() if n == name]
    return v


def serve_requests(vllm_names: bool, max_tokens: tuple[int, ...]) -> tuple[dict, FakeEngine]:
    """Runs one request per entry of `max_tokens` (one after the other) and scrapes once idle."""
    engine = FakeEngine(max_model_len=64)
    app = build_app(AsyncEngine(engine), served_model_names=["fake"], metrics_vllm_names=vllm_names)
    with LiveServer(app) as srv:
        for m in max_tokens:
            r = httpx.post(srv.url + "/v1/completions", json={"model": "fake", "prompt": "hello", "max_tokens": m})
            assert r.status_code == 200, r.text
        srv.app.state.engine.call_threadsafe(lambda e: None, timeout=10)  # the loop finished its iteration
        return scrape_text(httpx.get(srv.url + "/metrics").text), engine


def test_step_and_phase_histograms_count_what_the_engine_did():
    max_tokens = (4, 1, 6)
    samples, engine = serve_requests(False, max_tokens)
    # One request at a time: request k takes max_tokens[k] steps, each scheduling tokens.
    assert value(samples, PREFIX + "iteration_tokens_total_count") == engine.steps == sum(max_tokens)
    assert value(samples, PREFIX + "iteration_tokens_total_sum") == engine.scheduled_tokens == \
        len(max_tokens) * len("hello") + sum(m - 1 for m in max_tokens)
    # An interval per output after the first one with tokens.
    assert value(samples, PREFIX + "inter_token_latency_seconds_count") == sum(m - 1 for m in max_tokens)
    for phase in PHASES:
        assert value(samples, PREFIX + phase + "_count") == len(max_tokens), phase
        assert value(samples, PREFIX + phase + "_sum") >= 0, phase
    inference = value(samples, PREFIX + "request_inference_time_seconds_sum")
    parts = value(samples, PREFIX + "request_prefill_time_seconds_sum") + \
        value(samples, PREFIX + "request_decode_time_seconds_sum")
    assert inference == pytest.approx(parts, abs=1e-9)
    assert not [n for n, _ in samples if n.startswith(VLLM_PREFIX)]  # not without the option


def test_vllm_names_repeat_every_sample():
    engine = FakeEngine(max_model_len=64)
    app = build_app(AsyncEngine(engine), served_model_names=["fake"], metrics_vllm_names=True)
    with LiveServer(app) as srv:
        for m in (3, 2):
            r = httpx.post(srv.url + "/v1/completions", json={"model": "fake", "prompt": "hello", "max_tokens": m})
            assert r.status_code == 200, r.text
        srv.app.state.engine.call_threadsafe(lambda e: None, timeout=10)
        text = httpx.get(srv.url + "/metrics").text
    families = families_of(text)
    ours = {n: f for n, f in families.items() if n.startswith(PREFIX)}
    assert set(families) == set(ours) | {VLLM_PREFIX + a for n in ours for a in VLLM_NAMES[n.removeprefix(PREFIX)]}

    def rows(fam: Metric) -> list[tuple]:
        return [(s.name[len(fam.name):], s.labels, s.value) for s in fam.samples]

    for name, fam in ours.items():
        for alias in VLLM_NAMES[name.removeprefix(PREFIX)]:
            theirs = families[VLLM_PREFIX + alias]
            assert theirs.type == fam.type and rows(theirs) == rows(fam), alias
    # The names vLLM's dashboards query, with the model_name label.
    samples = scrape_text(text)
    labels = (("model_name", "fake"),)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:iteration_tokens_total_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:time_per_output_token_seconds_count", "vllm:request_time_per_output_token_seconds_count",
                 "vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_prompt_tokens_count", "vllm:request_generation_tokens_count",
                 *(f"vllm:{p}_count" for p in PHASES)):
        assert (name, labels) in samples, name
    assert samples[("vllm:request_success_total", (("finished_reason", "length"), ("model_name", "fake")))] == 2
    assert samples[("vllm:generation_tokens_total", labels)] == 5
    assert samples[("vllm:iteration_tokens_total_count", labels)] == 5
    assert samples[("vllm:time_per_output_token_seconds_count", labels)] == 3  # per step, like vLLM's
    assert samples[("vllm:request_time_per_output_token_seconds_count", labels)] == 2  # per request
    assert samples[("vllm:request_queue_time_seconds_count", labels)] == 2


def test_every_family_has_a_vllm_mapping():
    """A new metric must say what vLLM calls it (or map to no name on purpose)."""
    def stats() -> dict:  # an engine with speculative decoding: every family shows
        return {"spec_num_drafts": 0, "spec_accepted_per_pos": [0]}

    families = {name.removeprefix(PREFIX) for name in families_of(ServerMetrics("m", 64, stats).render().decode())}
    assert families == set(VLLM_NAMES)


def test_flag_config_and_environment(monkeypatch, tmp_path):
    from jaxengine.cli import build_parser

    def parse(argv: list[str]) -> bool:
        args = resolve_args(build_parser().parse_args(["serve", *normalize_flags(argv)]))
        return ServerSettings.from_args(args).metrics_vllm_names

    monkeypatch.delenv("JAXENGINE_METRICS_VLLM_NAMES", raising=False)
    assert parse([]) is False
    assert parse(["--metrics-vllm-names"]) is True and parse(["--metrics_vllm_names"]) is True
    cfg = tmp_path / "c.yaml"
    cfg.write_text("metrics_vllm_names: true\n")
    assert parse(["--config", str(cfg)]) is True
    assert parse(["--config", str(cfg), "--no-metrics-vllm-names"]) is False
    monkeypatch.setenv("JAXENGINE_METRICS_VLLM_NAMES", "1")
    assert parse([]) is True and parse(["--no-metrics-vllm-names"]) is False
    monkeypatch.setenv("JAXENGINE_METRICS_VLLM_NAMES", "maybe")
    with pytest.raises(ValueError, match="JAXENGINE_METRICS_VLLM_NAMES"):
        parse([])
