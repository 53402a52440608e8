"""LoRA adapters served as models, as vLLM serves them.

One adapter's life:
1. Start-up: `--enable-lora --lora-modules sql=/adapters/sql` (or vLLM's JSON form,
   `'{"name": "sql", "path": "/adapters/sql", "base_model_name": "..."}'`) is parsed by
   `parse_lora_modules` into `LoRAModulePath`s. `load_lora_modules(engine, modules)` gives each a
   `lora_int_id` (1, 2, ... in the order given) and loads it with `LLMEngine.add_lora` before the
   engine loop starts: a bad folder or a rank above `--max-lora-rank` stops start-up, naming the
   module.
2. `build_app(..., lora_requests=...)` wraps them in one `LoRAAdapters` per app: adapter name ->
   `LoRARequest`. An adapter's name is a model name like the base model's served names.
3. A completion or chat completion whose `model` is an adapter's name runs with that
   `LoRARequest` (the engine loads it again if it fell out of the host cache) and reports the
   adapter's name as `model`. `/v1/models` lists the base model, then each adapter with
   `root` = its folder and `parent` = the base model's served name.
4. With `VLLM_ALLOW_RUNTIME_LORA_UPDATING` (or `JAXENGINE_ALLOW_RUNTIME_LORA_UPDATING`) true,
   `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` add and remove adapters while
   serving. The engine work (reading the folder, forgetting the adapter) runs on the engine
   thread between steps (`AsyncEngine.call`), never on the event loop and never beside a step.
   Unloading an adapter that unfinished requests still use is refused (409): their next steps
   need its weights.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import operator
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from fastapi.responses import PlainTextResponse

from jaxengine.lora import LoRARequest
from jaxengine.server.errors import OpenAIError
from jaxengine.server.protocol import ModelCard

if TYPE_CHECKING:
    from jaxengine.async_engine import AsyncEngine
    from jaxengine.engine import LLMEngine

logger = logging.getLogger(__name__)

RUNTIME_UPDATING_ENVS = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "JAXENGINE_ALLOW_RUNTIME_LORA_UPDATING")


@dataclasses.dataclass(frozen=True)
class LoRAModulePath:
    """One `--lora-modules` item (vLLM's fields)."""

    name: str  # the model name clients send
    path: str  # the PEFT adapter folder
    base_model_name: str | None = None  # a served name of the base model (the adapter's `parent`)


def parse_lora_module(item: str) -> LoRAModulePath:
    """`name=path`, or a JSON object with `name`, `path` and optionally `base_model_name`."""
    text = item.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules {item!r} is not valid JSON: {e}") from e
        if not isinstance(data, dict):
            raise ValueError(f"--lora-modules {item!r}: a JSON item must be an object")
        unknown = sorted(set(data) - {"name", "path", "base_model_name"})
        if unknown:
            raise ValueError(f"--lora-modules {item!r}: unknown key(s) {', '.join(unknown)} (known: name, path, "
                             "base_model_name)")
        name, path, base = data.get("name"), data.get("path"), data.get("base_model_name")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"--lora-modules {item!r}: 'name' and 'path' must be non-empty strings")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"--lora-modules {item!r}: 'base_model_name' must be a string")
        return LoRAModulePath(name, path, base)
    name, eq, path = text.partition("=")
    if not eq or not name or not path:
        raise ValueError(f"--lora-modules {item!r}: expected name=path or a JSON object "
                         "'{\"name\": ..., \"path\": ...}'")
    return LoRAModulePath(name, path)


def parse_lora_modules(items: Sequence[str] | None) -> tuple[LoRAModulePath, ...]:
    """Every `--lora-modules` item; two modules with one name are a ValueError."""
    modules = tuple(parse_lora_module(i) for i in items or ())
    names = [m.name for m in modules]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--lora-modules names {', '.join(twice)} more than once; each adapter needs its own name")
    return modules


def load_lora_modules(engine: LLMEngine, modules: Sequence[LoRAModulePath]) -> list[LoRARequest]:
    """Loads the start-up adapters into `engine` (before its loop runs), with lora_int_id 1, 2, ...
    A folder the engine cannot serve is a ValueError naming the module."""
    if not modules:
        return []
    if not getattr(engine.config, "enable_lora", False) or not hasattr(engine, "add_lora"):
        raise ValueError("--lora-modules needs --enable-lora (and a generative model)")
    requests = []
    for i, m in enumerate(modules, start=1):
        request = LoRARequest(m.name, i, m.path, m.base_model_name)
        try:
            engine.add_lora(request)
        except (ValueError, OSError) as e:
            raise ValueError(f"--lora-modules {m.name}={m.path}: {e}") from e
        logger.info("LoRA adapter %r (lora_int_id %d) loaded from %s", m.name, i, m.path)
        requests.append(request)
    return requests


def runtime_lora_updating_allowed() -> bool:
    """vLLM's switch for /v1/load_lora_adapter and /v1/unload_lora_adapter (either variable)."""
    return any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on") for name in RUNTIME_UPDATING_ENVS)


class LoRAAdapters:
    """The adapters an app serves by name (one per app; used on the event loop only)."""

    def __init__(self, engine: AsyncEngine, base_names: Sequence[str], requests: Sequence[LoRARequest] = (),
                 max_model_len: int | None = None):
        self.engine = engine
        self.base_names = list(base_names)
        self.max_model_len = max_model_len
        self._by_name: dict[str, LoRARequest] = {}
        for r in requests:
            self._check_name(r.lora_name)
            if r.base_model_name is not None and r.base_model_name not in self.base_names:
                raise ValueError(f"LoRA adapter {r.lora_name!r}: base_model_name {r.base_model_name!r} is not a "
                                 f"served model name ({', '.join(self.base_names)})")
            self._by_name[r.lora_name] = r
        self._next_id = max((r.lora_int_id for r in requests), default=0) + 1  # never reused
        self._lock = asyncio.Lock()  # one load or unload at a time

    def _check_name(self, name: str) -> None:
        if name in self.base_names:
            raise ValueError(f"LoRA adapter name {name!r} is already the base model's served name")
        if name in self._by_name:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")

    def get(self, name: str) -> LoRARequest | None:
        return self._by_name.get(name)

    def cards(self) -> list[ModelCard]:
        """vLLM's model cards of the adapters, in load order."""
        return [self.card(r) for r in self._by_name.values()]

    def card(self, r: LoRARequest) -> ModelCard:
        return ModelCard(id=r.lora_name, root=r.lora_path, parent=r.base_model_name or self.base_names[0],
                         max_model_len=self.max_model_len)

    def _check_runtime(self) -> None:
        if getattr(self.engine, "channel", None) is not None:
            raise OpenAIError("Loading and unloading LoRA adapters at runtime is not supported when the engine "
                              "spans several processes.", 400)
        if not getattr(self.engine.engine.config, "enable_lora", False):
            raise OpenAIError("LoRA adapters need the server to be started with --enable-lora.", 400)

    async def load(self, name: str, path: str) -> PlainTextResponse:
        """Loads the adapter on the engine thread; 400 for a taken name or a folder the engine
        cannot serve (the message says why)."""
        if not name or not path:
            raise OpenAIError("Both 'lora_name' and 'lora_path' must be provided.", 400,
                              param="lora_path" if name else "lora_name")
        self._check_runtime()
        async with self._lock:
            try:
                self._check_name(name)
            except ValueError as e:
                raise OpenAIError(str(e), 400, param="lora_name") from e
            request = LoRARequest(name, self._next_id, path)
            self._next_id += 1
            try:
                await self.engine.call(operator.methodcaller("add_lora", request))
            except (ValueError, OSError) as e:
                raise OpenAIError(str(e), 400, param="lora_path") from e
            self._by_name[name] = request
        logger.info("loaded LoRA adapter %r (lora_int_id %d) from %s", name, request.lora_int_id, path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, name: str) -> PlainTextResponse:
        """Forgets the adapter on the engine thread; 404 for an unknown name, 409 while unfinished
        requests use it."""
        if not name:
            raise OpenAIError("'lora_name' must be provided.", 400, param="lora_name")
        self._check_runtime()
        async with self._lock:
            request = self._by_name.get(name)
            if request is None:
                raise OpenAIError(f"The lora adapter '{name}' cannot be found.", 404, param="lora_name",
                                  code="model_not_found")
            try:
                known = await self.engine.call(operator.methodcaller("remove_lora", request.lora_int_id))
            except ValueError as e:
                raise OpenAIError(f"The lora adapter '{name}' cannot be unloaded now: {e}", 409,
                                  param="lora_name", code="lora_adapter_in_use") from e
            del self._by_name[name]
        if not known:
            logger.warning("LoRA adapter %r was no longer known to the engine", name)
        logger.info("unloaded LoRA adapter %r", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
