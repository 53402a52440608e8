"""`jaxengine serve` / `python -m jaxengine.server`: flags and the YAML config (flags win), a real
process serving the tiny model and shutting down cleanly on a signal, and what happens when the
engine loop dies (503 on /health, errors to in-flight requests, exit status 1)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import yaml

from jaxengine.server.api_server import build_app, default_served_name
from jaxengine.async_engine import AsyncEngine
from jaxengine.server.cli import ServerSettings, load_chat_template, resolve_args
from jaxengine.server.serving_tools import ToolSettings
from jaxengine.server.serving_lora import LoRAModulePath
from tests.server.conftest import LiveServer, free_port
from tests.server.fake_engine import FakeEngine

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse(argv: list[str]):  # noqa: ANN201
    from jaxengine.cli import build_parser
    args = build_parser().parse_args(["serve", *argv])
    return resolve_args(args)


# -- flags and config file -----------------------------------------------------------------------------
def test_flags_beat_config_file_beats_defaults(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": "/models/x", "port": 8001, "host": "0.0.0.0", "max-num-seqs": 4,
                                   "enable_prefix_caching": False, "served-model-name": ["a", "b"],
                                   "max_model_len": 512, "uvicorn-log-level": "debug"}))
    args = parse(["--config", str(cfg), "--port", "9000", "--max-model-len", "256"])
    assert (args.model, args.port, args.host, args.max_num_seqs) == ("/models/x", 9000, "0.0.0.0", 4)
    assert args.enable_prefix_caching is False and args.served_model_name == ["a", "b"]
    assert args.max_model_len == 256 and args.uvicorn_log_level == "debug"
    # a flag given explicitly wins even when it equals the default
    args = parse(["--config", str(cfg), "--max-num-seqs", "256", "--enable-prefix-caching", "other/model"])
    assert (args.max_num_seqs, args.enable_prefix_caching, args.model) == (256, True, "other/model")
    settings = ServerSettings.from_args(args)
    assert settings.served_model_names == ("a", "b") and settings.port == 8001


def test_defaults_and_embedded_model():
    args = parse([])
    assert args.model is None and args.host == "127.0.0.1" and args.port == 8000 and args.api_key is None
    assert args.max_num_seqs == 256 and args.enable_prefix_caching is True
    assert default_served_name(None) == "SmolLM2-135M-Instruct"
    assert default_served_name("/path/m") == "/path/m"
    assert parse(["--model", "m"]).model == "m"


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("JAXENGINE_API_KEY", "from-env")
    assert parse([]).api_key == "from-env"
    assert parse(["--api-key", "flag"]).api_key == "flag"


@pytest.mark.parametrize("content, message", [
    ({"no_such_flag": 1}, "unknown key 'no_such_flag'"),
    ({"port": "eighty"}, "config key 'port' must be a int"),
    ({"port": 80.5}, "must be an integer"),
    ({"enable-prefix-caching": "yes"}, "must be true or false"),
    ({"uvicorn-log-level": "loud"}, "must be one of"),
    (["a", "b"], "must hold a mapping"),
])
def test_bad_config_files(tmp_path, content, message):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(content))
    with pytest.raises(ValueError, match=message):
        parse(["--config", str(cfg)])
    with pytest.raises(ValueError, match="cannot read config file"):
        parse(["--config", str(tmp_path / "missing.yaml")])


def test_lora_flags():
    args = parse(["--enable-lora", "--max-loras", "2", "--max-lora-rank", "32", "--max-cpu-loras", "4",
                  "--lora-modules", "a=/x", '{"name":"b","path":"/y"}',
                  '{"name": "c", "path": "/z", "base_model_name": "m"}'])
    assert (args.enable_lora, args.max_loras, args.max_lora_rank, args.max_cpu_loras) == (True, 2, 32, 4)
    assert ServerSettings.from_args(args).lora_modules == (
        LoRAModulePath("a", "/x"), LoRAModulePath("b", "/y"), LoRAModulePath("c", "/z", "m"))
    assert ServerSettings.from_args(parse([])).lora_modules == ()
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        ServerSettings.from_args(parse(["--lora-modules", "a=/x"]))
    for bad, message in (("a", "expected name=path"), ('{"name": "a"}', "'name' and 'path'"),
                         ('{"name": "a", "path": "/x", "rank": 8}', "unknown key"), ("{oops", "not valid JSON")):
        with pytest.raises(ValueError, match=message):
            ServerSettings.from_args(parse(["--enable-lora", "--lora-modules", bad]))
    with pytest.raises(ValueError, match="more than once"):
        ServerSettings.from_args(parse(["--enable-lora", "--lora-modules", "a=/x", "a=/y"]))


def test_tool_and_reasoning_flags(tmp_path):
    assert ServerSettings.from_args(parse([])).tools == ToolSettings()
    args = parse(["--enable-auto-tool-choice", "--tool-call-parser", "mistral", "--reasoning-parser", "deepseek_r1"])
    assert ServerSettings.from_args(args).tools == ToolSettings(True, "mistral", "deepseek_r1")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"enable-auto-tool-choice": True, "reasoning_parser": "qwen3"}))
    assert ServerSettings.from_args(parse(["--config", str(cfg)])).tools == ToolSettings(True, None, "qwen3")
    cfg.write_text(yaml.safe_dump({"tool-call-parser": "nope"}))
    with pytest.raises(ValueError, match="must be one of"):
        parse(["--config", str(cfg)])
    # with no parser given, the chat template's tool format picks one
    assert ToolSettings(True).resolved("...<tool_call>...").tool_call_parser == "hermes"
    assert ToolSettings(False).resolved("{{ messages }}").tool_call_parser is None


def test_auto_tool_choice_picks_the_parser_from_the_chat_template():
    import logging

    from jaxengine.async_engine import AsyncEngine
    from jaxengine.server.api_server import build_app

    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        build_app(AsyncEngine(FakeEngine()), tool_settings=ToolSettings(True))  # the fake template has no tools
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("jaxengine.server.serving_tools")
    log.addHandler(handler)
    level = log.level
    log.setLevel(logging.INFO)
    try:
        app = build_app(AsyncEngine(FakeEngine()), tool_settings=ToolSettings(True),
                        chat_template="{{ messages }}[TOOL_CALLS]")
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert app.state.ctx.tools.tool_call_parser == "mistral"
    assert logged == ["tool call parser 'mistral' chosen from the chat template"]


def test_lora_modules_without_enable_lora_exits_before_loading():
    from jaxengine.server.cli import main
    with pytest.raises(SystemExit) as e:
        main(["--lora-modules", "a=/x", "--load-format", "dummy"])
    assert e.value.code == 2


def test_chat_template_file_or_inline(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(f)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{%")
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template("missing.jinja")


def test_chat_template_flag_is_used():
    engine = FakeEngine()
    app = build_app(AsyncEngine(engine), chat_template="[{% for m in messages %}{{ m['content'] }}|{% endfor %}]")
    with LiveServer(app) as srv:
        r = httpx.post(srv.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert "".join(map(chr, r["tokens"])) == "[hi|]"


# -- engine death -------------------------------------------------------------------------------------
def test_engine_death_gives_errors_and_503():
    engine = FakeEngine(fail_at_step=5, max_model_len=4096)
    app = build_app(AsyncEngine(engine))
    with LiveServer(app) as srv:
        assert httpx.get(srv.url + "/health").status_code == 200
        lines = []
        with httpx.stream("POST", srv.url + "/v1/completions",
                          json={"prompt": "x", "max_tokens": 100, "stream": True}, timeout=30) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        error = json.loads(lines[-2][6:])["error"]
        assert lines[-1] == "data: [DONE]" and "simulated device failure" in error["message"]
        assert error["type"] == "server_error"
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and "simulated" in health.json()["error"]["message"]
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"


FAKE_SERVER = """
import sys
from tests.server.fake_engine import FakeEngine
from jaxengine.server.cli import ServerSettings, run_server
port, fail, timeout = int(sys.argv[1]), int(sys.argv[2]) or None, float(sys.argv[3])
engine = FakeEngine(step_delay=0.01, fail_at_step=fail, max_model_len=4096)
sys.exit(run_server(engine, ServerSettings(port=port, uvicorn_log_level="info", shutdown_timeout=timeout)))
"""


def start(cmd: list[str], port: int, timeout: float = 150.0) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", PYTHONPATH=REPO)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"server did not start (rc {proc.returncode}):\n{out}\n{err}")
        time.sleep(0.2)


def stream_in_background(url: str, body: dict, started: threading.Event, headers: dict | None = None) -> dict:
    result: dict[str, object] = {}

    def run() -> None:
        lines = []
        try:
            with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60, headers=headers) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
                        started.set()
        except httpx.HTTPError as e:
            result["error"] = e
        result["lines"] = lines
        started.set()

    result["thread"] = threading.Thread(target=run)
    result["thread"].start()
    return result


def finish_reason(lines: list[str]) -> str | None:
    for line in reversed(lines):
        if line != "data: [DONE]":
            choices = json.loads(line[6:])["choices"]
            if choices:
                return choices[0]["finish_reason"]
    return None


@pytest.mark.parametrize("signals, max_tokens, timeout, reason", [
    ([signal.SIGTERM], 1000, 0.5, "abort"),  # too long to drain: aborted, and the client is told
    ([signal.SIGINT], 60, 20.0, "length"),  # short enough: finished before the process exits
    ([signal.SIGINT, signal.SIGINT], 3000, 60.0, "abort"),  # a second Ctrl+C: abort now, still cleanly
])
def test_signal_shutdown_is_clean(signals, max_tokens, timeout, reason):
    port = free_port()
    proc = start([sys.executable, "-c", FAKE_SERVER, str(port), "0", str(timeout)], port, timeout=60)
    started = threading.Event()
    res = stream_in_background(f"http://127.0.0.1:{port}/v1/completions",
                               {"prompt": "x", "max_tokens": max_tokens}, started)
    assert started.wait(30)
    for sig in signals:
        proc.send_signal(sig)
        time.sleep(0.3)
    out, err = proc.communicate(timeout=30)
    res["thread"].join(30)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "Traceback" not in out, err
    lines = res["lines"]
    assert lines[-1] == "data: [DONE]" and finish_reason(lines) == reason, (res, err)


def test_engine_death_exits_nonzero():
    port = free_port()
    proc = start([sys.executable, "-c", FAKE_SERVER, str(port), "20", "5"], port, timeout=60)
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x", "max_tokens": 100}, timeout=30)
    assert r.status_code == 503
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "the engine loop died" in err


# -- the real thing -------------------------------------------------------------------------------------
SECRET = "sk-test-7f3a9c1e"


def test_serve_tiny_model_from_config_file(tiny_llama, xla_cache_dir, tmp_path):
    port = free_port()
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(yaml.safe_dump({
        "port": 1,  # overridden by the flag below
        "served-model-name": "tiny", "max-model-len": 256, "max_num_seqs": 8, "max-num-batched-tokens": 64,
        "num-kv-blocks": 128, "compilation-cache-dir": xla_cache_dir, "shutdown-timeout": 30,
        "uvicorn-log-level": "info", "api-key": SECRET}))
    proc = start([sys.executable, "-m", "jaxengine.server", tiny_llama, "--config", str(cfg), "--port", str(port)],
                 port)
    try:
        wrong = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong-key", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=SECRET, max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=4, temperature=0)
        assert out.choices[0].finish_reason in ("length", "stop")
        started = threading.Event()
        res = stream_in_background(f"http://127.0.0.1:{port}/v1/completions",
                                   {"prompt": "Count:", "max_tokens": 100, "temperature": 0, "ignore_eos": True},
                                   started, headers={"Authorization": f"Bearer {SECRET}"})
        assert started.wait(60)
        proc.send_signal(signal.SIGINT)
        out_text, err = proc.communicate(timeout=90)
        res["thread"].join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err, err
    assert res["lines"][-1] == "data: [DONE]" and finish_reason(res["lines"]) == "length"
    # the key guarded every call above (streaming too) and never reached the logs, even at info level
    assert SECRET not in out_text and SECRET not in err


def test_run_server_freezes_what_start_up_allocated(monkeypatch):
    """Before serving, the start-up's objects are collected once and frozen out of the garbage
    collector's view (gc.freeze), so collections during serving walk only requests' objects; the
    collector's young generation is collected less often (SERVER_GC_THRESHOLD); and the GIL switch
    interval is the server's short one (the engine thread gets the GIL back sooner)."""
    import gc

    from jaxengine.server import uvicorn_server
    from jaxengine.server.cli import SERVER_GC_THRESHOLD, SERVER_SWITCH_INTERVAL_S, ServerSettings, run_server
    from tests.server.fake_engine import FakeEngine

    seen = []
    monkeypatch.setattr(uvicorn_server.DrainingServer, "run", lambda self, sockets=None: seen.append(
        (gc.get_freeze_count(), sys.getswitchinterval(), gc.get_threshold())))
    interval, threshold = sys.getswitchinterval(), gc.get_threshold()
    try:
        assert run_server(FakeEngine(max_model_len=64), ServerSettings(port=0)) == 0
    finally:
        gc.unfreeze()  # the test process goes on to build other engines
        sys.setswitchinterval(interval)
        gc.set_threshold(*threshold)
    assert len(seen) == 1 and seen[0][0] > 0
    assert seen[0][1] == pytest.approx(SERVER_SWITCH_INTERVAL_S) and SERVER_SWITCH_INTERVAL_S < interval
    assert seen[0][2] == SERVER_GC_THRESHOLD and SERVER_GC_THRESHOLD[0] > threshold[0]
