"""OpenAI-compatible HTTP server: `jaxengine serve` / `python -m jaxengine.server`.

`build_app(AsyncEngine(LLMEngine(config)))` gives the FastAPI app; `cli.run_server` runs it with
uvicorn. Modules: protocol (request/response models), errors (OpenAI error JSON), async_engine
(the engine loop thread), serving_* (endpoints), metrics (Prometheus), api_server (the app), cli.
"""
