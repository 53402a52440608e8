"""Live servers for the server tests: uvicorn on 127.0.0.1, on a port the OS picks, in a thread."""

from __future__ import annotations

import socket
import threading
import time

import pytest

# Small enough to compile and run fast on a 2-core CPU; see tests/engine/test_engine.py.
ENGINE_KW = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=128, block_size=16)


class LiveServer:
    """Runs an ASGI app with uvicorn in a background thread (`with LiveServer(app) as srv:`)."""

    def __init__(self, app, *, graceful_timeout: float = 5.0):  # noqa: ANN001
        import uvicorn

        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        # log_config=None: uvicorn would otherwise re-run logging.dictConfig, which closes every
        # existing handler, including ones bound to pytest's capture streams.
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=graceful_timeout,
                                log_config=None)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


def make_engine(path: str, cache: str, **kw):  # noqa: ANN201
    from jaxengine.config import EngineConfig
    from jaxengine.engine import LLMEngine

    args = dict(ENGINE_KW)
    args.update(kw)
    return LLMEngine(EngineConfig(model=path, compilation_cache_dir=cache, **args))
