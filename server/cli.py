"""`jaxengine serve [MODEL]` (and `python -m jaxengine.server`): flags, YAML config, start-up, shutdown.

Settings come from three places, strongest first: command-line flags, the `--config` YAML file
(the same keys as the long flags, with dashes or underscores), then defaults. To tell "given on
the command line" from "argparse's default", every default is wrapped in `_Default` until the
YAML file has been merged.

Shutdown: SIGINT / SIGTERM make uvicorn stop accepting connections, and in-flight requests get up
to `--shutdown-timeout` seconds to finish; what is still running then is
aborted (clients get a last chunk with finish_reason "abort"); a second signal aborts at once.
The process exits 0, without a stack trace. If the engine loop dies, the server shuts down the
same way and exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import yaml

from jaxengine.arg_utils import add_engine_args, engine_kwargs
from jaxengine.distributed import add_multihost_args, multihost_config
from jaxengine.server.limits import DEFAULT_MAX_REQUEST_BODY_BYTES, ServerLimits
from jaxengine.server.reasoning_parsers import REASONING_PARSERS
from jaxengine.server.serving_lora import LoRAModulePath, load_lora_modules, parse_lora_modules
from jaxengine.server.serving_tools import ToolSettings
from jaxengine.server.tool_parsers import TOOL_PARSERS

if TYPE_CHECKING:
    from jaxengine.async_engine import AsyncEngine
    from jaxengine.engine import LLMEngine
    from jaxengine.lora import LoRARequest
    from jaxengine.pooling import PoolingEngineBase

logger = logging.getLogger(__name__)

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
API_KEY_ENV = "JAXENGINE_API_KEY"
METRICS_VLLM_NAMES_ENV = "JAXENGINE_METRICS_VLLM_NAMES"
# How long CPython lets one thread hold the GIL while another waits for it (its default: 5 ms). The
# engine thread gives the GIL up at every device call and wait of a step and must get it back from
# the event loop, which streams one chunk per request per step: with 5 ms, each of those hand-backs
# may wait 5 ms behind the loop. At rate inf on the 2-core CPU (256 streams, tiny model) 0.5 ms gave
# 1.2-1.5x the output tok/s in alternating rounds; on one H100 (Llama-3-8B shape, 48 ms steps) it made
# no difference (benchmarks/results/serve_vs_offline_{cpu,h100}.md).
SERVER_SWITCH_INTERVAL_S = 0.0005
# The cyclic collector's thresholds while serving (CPython's default: 700, 10, 10). Streaming
# allocates a few objects per token: at the default, a rate-inf run of 1000 requests x 64 tokens
# (tiny model, 2-core CPU) ran ~570 young, ~52 middle and 4-5 full collections (up to 82 ms each,
# holding the GIL), 0.45-0.7 s in all, 10-14% of the run; with young collections every 50,000
# allocations, 4-5 collections and 0.04-0.1 s (benchmarks/results/serve_vs_offline_cpu.md).
SERVER_GC_THRESHOLD = (50_000, 10, 10)
_NOT_CONFIGURABLE = {"help", "config", "func", "_serve_actions"}


class _Default:
    """An argparse default, as opposed to a value given on the command line."""

    __slots__ = ("value",)

    def __init__(self, value: object):
        self.value = value

    def __repr__(self) -> str:
        return f"default({self.value!r})"

    def __str__(self) -> str:  # what --help shows as the default
        return str(self.value)


def _unwrap(value: object) -> object:
    return value.value if isinstance(value, _Default) else value


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The `serve` flags (server and engine) on `parser`."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="HF folder, GGUF file or hub id (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--model", default=None,
                        help="the model, as a flag (same as MODEL; default: the embedded model)")
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    g.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1 routes (or set ${API_KEY_ENV})")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use as `model` (default: the model argument)")
    g.add_argument("--chat-template", default=None,
                   help="Jinja chat template: a file, or the template itself (default: the model's own)")
    g.add_argument("--config", default=None,
                   help="YAML file with any of these flags as keys; flags on the command line win (default: none)")
    g.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS,
                   help="log level of the HTTP server (uvicorn)")
    g.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests may take to finish on SIGINT/SIGTERM before they are aborted")
    g.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help="larger request bodies get 413 before they are read")
    g.add_argument("--max-queued-requests", type=int, default=None,
                   help="requests held beyond the max-num-seqs running ones; more get 503 "
                        "(default: no limit, they wait)")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters served as models (needs --enable-lora): name=path, or vLLM's JSON "
                        "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}' per item (default: none)")
    g.add_argument("--metrics-vllm-names", action=argparse.BooleanOptionalAction, default=None,
                   help="/metrics also exposes every metric under vLLM's `vllm:` name, for dashboards built "
                        f"for vLLM (or set ${METRICS_VLLM_NAMES_ENV}=1)")
    g.add_argument("--enable-auto-tool-choice", action="store_true", default=False,
                   help='let the model decide when to call tools (tool_choice "auto", the default with tools); '
                        "needs a tool call parser, given or picked from the chat template")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="how the model writes tool calls (default: picked from the chat template with "
                        "--enable-auto-tool-choice)")
    g.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split the model's <think>...</think> into reasoning_content (default: none)")
    g.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="run the engine in its own process, so HTTP streaming and the engine loop do not "
                        "share one GIL, as vLLM's engine-core process (generative models on one host; "
                        "pooling models and several hosts keep one process). Default: on where this "
                        f"process may use at least {ENGINE_PROCESS_MIN_CPUS} CPUs")
    add_engine_args(parser)
    add_multihost_args(parser)
    actions = [a for a in parser._actions if a.dest not in _NOT_CONFIGURABLE or a.dest == "config"]
    for a in actions:
        if a.default is not argparse.SUPPRESS:
            a.default = _Default(a.default)
    parser.set_defaults(func=cmd_serve, _serve_actions=actions)


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds `jaxengine serve` to the main CLI."""
    p = subparsers.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                              description="OpenAI-compatible HTTP server (completions, chat, tokenize, metrics; with "
                                          "--runner pooling: embeddings, pooling, classify, score, rerank)")
    add_serve_args(p)
    return p


# -- configuration ------------------------------------------------------------------------------
def _convert(action: argparse.Action, key: str, value: object) -> object:
    """A YAML value checked and converted like argparse would treat the flag's text."""
    if value is None:
        return None
    where = f"config key {key!r}"
    if isinstance(action, (argparse.BooleanOptionalAction, argparse._StoreTrueAction)):
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, got {value!r}")
        return value
    if action.nargs in ("+", "*"):
        items = value if isinstance(value, list) else [value]
        return [_convert_scalar(action, where, v) for v in items]
    return _convert_scalar(action, where, value)


def _convert_scalar(action: argparse.Action, where: str, value: object) -> object:
    tp = action.type or str
    if isinstance(value, bool) or isinstance(value, (list, dict)):
        raise ValueError(f"{where} must be a {tp.__name__}, got {value!r}")
    if tp is int and isinstance(value, float):
        raise ValueError(f"{where} must be an integer, got {value!r}")
    try:
        out = tp(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where} must be a {tp.__name__}, got {value!r}") from e
    if action.choices is not None and out not in action.choices:
        raise ValueError(f"{where} must be one of {', '.join(map(str, action.choices))}, got {value!r}")
    return out


def load_config_file(path: str) -> dict[str, object]:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"cannot read config file {path}: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise ValueError(f"config file {path} is not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of flag names to values")
    return data


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Merges the YAML config under the command-line flags; returns plain values."""
    values = dict(vars(args))
    actions = {a.dest: a for a in values.get("_serve_actions", [])}
    path = _unwrap(values.get("config"))
    if path:
        for key, value in load_config_file(str(path)).items():
            dest = str(key).replace("-", "_")
            if dest == "model_tag" or dest in _NOT_CONFIGURABLE or dest not in actions:
                raise ValueError(f"unknown key {key!r} in config file {path}")
            if dest == "model" and not isinstance(values.get("model_tag"), _Default):
                continue  # the positional MODEL on the command line wins too
            if isinstance(values.get(dest), _Default):
                values[dest] = _convert(actions[dest], str(key), value)
    out = argparse.Namespace(**{k: _unwrap(v) for k, v in values.items()})
    if out.model_tag is not None and out.model is not None and out.model_tag != out.model:
        raise ValueError(f"two models given: {out.model_tag!r} and --model {out.model!r}")
    out.model = out.model_tag if out.model_tag is not None else out.model
    if out.api_key is None:
        out.api_key = os.environ.get(API_KEY_ENV) or None
    if out.metrics_vllm_names is None:
        out.metrics_vllm_names = _env_bool(METRICS_VLLM_NAMES_ENV)
    return out


def _env_bool(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"${name} must be 1/true/yes/on or 0/false/no/off, got {os.environ[name]!r}")


def load_chat_template(value: str | None) -> str | None:
    """A template file's text, or the value itself when it is a Jinja template."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{%" in value or "{{" in value:
        return value
    raise ValueError(f"chat template {value!r} is neither a file nor a Jinja template")


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_names: tuple[str, ...] | None = None
    chat_template: str | None = None  # the template text
    uvicorn_log_level: str = "info"
    shutdown_timeout: float = 10.0
    model: str | None = None
    limits: ServerLimits = dataclasses.field(default_factory=ServerLimits)
    metrics_vllm_names: bool = False  # /metrics also under vLLM's `vllm:` names
    lora_modules: tuple[LoRAModulePath, ...] = ()  # --lora-modules, loaded at start-up
    tools: ToolSettings = dataclasses.field(default_factory=ToolSettings)  # tool call / reasoning parsers
    engine_process: bool | None = None  # --engine-process: the engine in a child process (None: by CPU count)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerSettings:
        names = tuple(args.served_model_name) if args.served_model_name else None
        lora_modules = parse_lora_modules(args.lora_modules)
        if lora_modules and not args.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        return cls(host=args.host, port=args.port, api_key=args.api_key, served_model_names=names,
                   chat_template=load_chat_template(args.chat_template), uvicorn_log_level=args.uvicorn_log_level,
                   shutdown_timeout=args.shutdown_timeout, model=args.model,
                   limits=ServerLimits(max_request_body_bytes=args.max_request_body_bytes,
                                       max_queued_requests=args.max_queued_requests),
                   metrics_vllm_names=bool(args.metrics_vllm_names), lora_modules=lora_modules,
                   tools=ToolSettings(enable_auto_tool_choice=bool(args.enable_auto_tool_choice),
                                      tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser),
                   engine_process=args.engine_process)


# -- running ----------------------------------------------------------------------------------------
# The engine process's default needs this many CPUs: with two, the HTTP process and the engine's
# process compete for them, and one process served 0.72-0.77 of offline's output tok/s at rate inf
# against 0.63-0.66 (benchmarks/results/serve_vs_offline_cpu.md); on a 16-CPU host the engine
# process served 0.99-1.01 against 0.84-0.98 (serve_vs_offline_h100.md).
ENGINE_PROCESS_MIN_CPUS = 4


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return os.cpu_count() or 1


def wants_engine_process(choice: bool | None) -> bool:
    """--engine-process / --no-engine-process as given, else on with ENGINE_PROCESS_MIN_CPUS or more."""
    if choice is not None:
        return choice
    n = usable_cpus()
    if n < ENGINE_PROCESS_MIN_CPUS:
        logger.info("the engine runs in this process: %d CPU(s) here, the engine process needs %d to pay "
                    "(--engine-process starts it anyway)", n, ENGINE_PROCESS_MIN_CPUS)
        return False
    return True


def cmd_serve(args: argparse.Namespace) -> int:
    """Builds the engine (model load + compile), then serves until SIGINT / SIGTERM.

    A generative model on one host is served from an engine in its own process (--engine-process,
    the default with at least ENGINE_PROCESS_MIN_CPUS usable CPUs; --no-engine-process keeps it in
    this one). A pooling model (--runner pooling, --task embed|classify|score|encode, or an encoder
    folder) gets the pooling engine, on this process only. Across hosts (--num-hosts > 1) every
    rank builds the generating engine; rank 0 serves HTTP and the others follow its steps
    (jaxengine/distributed.py) until rank 0 stops.
    """
    from jaxengine import distributed
    from jaxengine.config import EngineConfig
    from jaxengine.engine import LLMEngine
    from jaxengine.pooling import make_pooling_engine, wants_pooling

    args = resolve_args(args)
    settings = ServerSettings.from_args(args)
    config = EngineConfig(model=args.model, **engine_kwargs(args))
    pooling = wants_pooling(config)
    if pooling and (args.num_hosts != 1 or getattr(args, "distributed_executor_backend", "uni") != "uni"):
        raise ValueError("pooling models are served by one process: drop --num-hosts and "
                         "--distributed-executor-backend")
    if not pooling:
        distributed.start_local_workers(args)  # --distributed-executor-backend mp: one process per GPU
    mh = multihost_config(args)
    if wants_engine_process(settings.engine_process):
        if not (pooling or mh.enabled or getattr(args, "distributed_executor_backend", "uni") != "uni"):
            return _serve_from_engine_process(config, settings)
        logger.info("the engine runs in this process (--engine-process covers generative models on one host)")
    distributed.initialize(mh)
    with _interrupt_on_sigterm():
        try:
            engine = make_pooling_engine(config) if pooling else LLMEngine(config)
        except KeyboardInterrupt:
            logger.info("interrupted while starting; exiting")
            return 130
    lora_requests = load_lora_modules(engine, settings.lora_modules)  # on every rank, before any step
    if not mh.enabled:
        return run_server(engine, settings, lora_requests=lora_requests)
    channel = distributed.StepChannel()
    if not channel.leader:
        return distributed.run_follower(engine, channel)
    return run_server(engine, settings, channel=channel, lora_requests=lora_requests)


def _serve_from_engine_process(config, settings: ServerSettings) -> int:
    """--engine-process: the engine (and the start-up adapters) built in a child process."""
    import functools

    from jaxengine.engine_process import ProcessAsyncEngine

    setup = functools.partial(load_lora_modules, modules=settings.lora_modules) if settings.lora_modules else None
    with _interrupt_on_sigterm():
        try:
            engine = ProcessAsyncEngine.launch(config, setup=setup)
        except KeyboardInterrupt:
            logger.info("interrupted while starting; exiting")
            return 130
    return run_server(engine, settings, lora_requests=engine.setup_result or ())


def run_server(engine: LLMEngine | PoolingEngineBase | AsyncEngine, settings: ServerSettings,
               sockets: Sequence[socket.socket] | None = None, channel=None,
               lora_requests: Sequence[LoRARequest] = ()) -> int:
    """Serves `engine` until a signal or the engine's death; returns the exit status. `channel`:
    rank 0's `StepChannel` when the engine spans several processes (generative models only).
    `engine` may be an `AsyncEngine` already (a `ProcessAsyncEngine`), served as it is.
    `lora_requests`: the adapters `load_lora_modules` added to `engine`, served by name."""
    import prometheus_client
    import uvicorn

    from jaxengine.server.api_server import build_app
    from jaxengine.async_engine import AsyncEngine
    from jaxengine.async_pooling import AsyncPoolingEngine
    from jaxengine.pooling import PoolingEngineBase
    from jaxengine.server.uvicorn_server import DrainingServer

    prometheus_client.disable_created_metrics()  # no `*_created` series, as in vLLM (process-wide)
    if isinstance(engine, AsyncEngine):  # already wrapped (--engine-process)
        async_engine = engine
    elif isinstance(engine, PoolingEngineBase):
        async_engine = AsyncPoolingEngine(engine)
    else:
        async_engine = AsyncEngine(engine, channel=channel)
    server: DrainingServer | None = None
    app = build_app(async_engine, served_model_names=list(settings.served_model_names or []) or None,
                    model_path=settings.model, api_key=settings.api_key, chat_template=settings.chat_template,
                    shutdown_drain_timeout=settings.shutdown_timeout,
                    exit_requested=lambda: server is not None and server.should_exit, limits=settings.limits,
                    metrics_vllm_names=settings.metrics_vllm_names, lora_requests=lora_requests,
                    tool_settings=settings.tools)
    # The app drains and aborts by itself (see build_app); uvicorn's own timeout is only a backstop
    # for connections that would still hang after that.
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.uvicorn_log_level,
                            timeout_graceful_shutdown=settings.shutdown_timeout + 5.0, lifespan="on")
    server = DrainingServer(config, async_engine)

    def on_death(_: BaseException) -> None:
        server.should_exit = True  # polled by uvicorn's main loop; starts the graceful shutdown

    async_engine.on_death = on_death
    # From here on one engine serves this process, and what exists now lives as long as it: collect
    # once, then freeze it out of the collector's view, so the collections the step loop triggers
    # walk only what requests allocate (vLLM does the same after its start-up).
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVER_GC_THRESHOLD)  # process-wide, as the switch interval: one engine per process
    sys.setswitchinterval(SERVER_SWITCH_INTERVAL_S)
    with _quiet_signals():
        server.run(sockets=list(sockets) if sockets else None)
    if async_engine.error is not None:
        logger.error("exiting because the engine loop died: %s: %s", type(async_engine.error).__name__,
                     async_engine.error)
        return 1
    return 0


@contextlib.contextmanager
def _quiet_signals() -> Iterator[None]:
    """SIGINT / SIGTERM handlers that do nothing, for the duration of `server.run`.

    uvicorn installs its own handlers while it runs and, after its graceful shutdown, restores
    the previous ones and re-raises the signal it caught. With Python's defaults that re-raise
    would be a KeyboardInterrupt traceback (SIGINT) or death by signal (SIGTERM); with these the
    shutdown that already happened is the whole effect.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _interrupt_on_sigterm() -> Iterator[None]:
    """During start-up, SIGTERM interrupts like Ctrl+C does (a clean exit instead of a kill)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    """`python -m jaxengine.server ...`"""
    from jaxengine.arg_utils import HelpFormatter, normalize_flags

    parser = argparse.ArgumentParser(prog="python -m jaxengine.server",
                                     description="OpenAI-compatible HTTP server for jaxengine",
                                     formatter_class=HelpFormatter)
    add_serve_args(parser)

    argv = normalize_flags(sys.argv[1:] if argv is None else list(argv))
    args = parser.parse_args(argv)
    args.argv, args.prog_module = argv, "jaxengine.server"  # for worker processes that repeat the command
    try:
        return cmd_serve(args)
    except ValueError as e:
        parser.exit(2, f"error: {e}\n")
        return 2
