"""OpenAI-compatible HTTP server: `jaxengine serve` / `python -m jaxengine.server`.

`build_app(AsyncEngine(LLMEngine(config)))` gives the FastAPI app (the engine loop thread,
`jaxengine.async_engine`, belongs to the engine); `cli.run_server` runs it with uvicorn.
Modules: protocol (request/response models), errors (OpenAI error JSON), serving_* (endpoints),
limits (hostile bodies), metrics (Prometheus), api_server (the app), cli.
"""
