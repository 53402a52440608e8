"""`python -m jaxengine.server ARGS` with a side door for measurements (issue #32), nothing else changed.

Files in $SERVE_GAP_DIR (default /tmp/serve_gap), polled every 50 ms by a daemon thread:
- `timing_req_<port>` appears -> `timing_<port>.json` gets `LLMEngine.timing` (steps, step_s,
  device_wait_s) and the GIL switch interval now (through `AsyncEngine.call_threadsafe`, so
  `--engine-process` works too: the timing is the child's);
- `switch_<port>` appears holding seconds -> `sys.setswitchinterval(seconds)`, then it is removed.
Environment: `SG_UVICORN_LOOP=asyncio` runs uvicorn on asyncio's own loop instead of uvloop.
Used by lab/serve_gap/h100_switch.sh and the CPU runs of benchmarks/results/serve_vs_offline_cpu.md.
"""

import json
import operator
import os
import runpy
import sys
import threading
import time

import jaxengine.async_engine as async_engine

DIR = os.environ.get("SERVE_GAP_DIR", "/tmp/serve_gap")
_engine = {}
_init = async_engine.AsyncEngine.__init__


def _remember(self, engine, **kwargs):
    _engine["engine"] = self
    _init(self, engine, **kwargs)


def _poll(PORT: str) -> None:
    req, switch = os.path.join(DIR, f"timing_req_{PORT}"), os.path.join(DIR, f"switch_{PORT}")
    out = os.path.join(DIR, f"timing_{PORT}.json")
    while True:
        time.sleep(0.05)
        if os.path.exists(switch):
            with open(switch) as f:
                sys.setswitchinterval(float(f.read()))
            os.remove(switch)
        if os.path.exists(req) and "engine" in _engine:
            os.remove(req)
            timing = dict(_engine["engine"].call_threadsafe(operator.attrgetter("timing"), 30),
                          switch_interval_s=sys.getswitchinterval())
            with open(out + ".tmp", "w") as f:
                json.dump(timing, f)
            os.replace(out + ".tmp", out)


if __name__ == "__main__":  # (the engine process is spawned: it imports this file as __mp_main__)
    if os.environ.get("SG_UVICORN_LOOP"):  # e.g. "asyncio": uvicorn's event loop instead of its "auto" (uvloop)
        import uvicorn

        _config_init = uvicorn.Config.__init__

        def _config(self, *a, **kw):
            kw["loop"] = os.environ["SG_UVICORN_LOOP"]
            _config_init(self, *a, **kw)

        uvicorn.Config.__init__ = _config
    os.makedirs(DIR, exist_ok=True)
    async_engine.AsyncEngine.__init__ = _remember
    threading.Thread(target=_poll, args=(sys.argv[sys.argv.index("--port") + 1],), daemon=True).start()
    sys.argv = ["jaxengine.server"] + sys.argv[1:]
    runpy.run_module("jaxengine.server", run_name="__main__")
