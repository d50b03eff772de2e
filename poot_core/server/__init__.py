"""`poot serve`: an OpenAI-compatible HTTP server over the batched engine (FastAPI, uvicorn, pydantic,
prometheus_client; install with `pip install 'poot-core[serve]'`).

    app.py          the application: the gate (ready? which tenant?), /health, /metrics, /v1/models, tokenize
    completions.py  /v1/chat/completions and /v1/completions, whole and streamed (server-sent events)
    encoders.py     /v1/embeddings and /v1/rerank over poot's encoders, each in its own thread
    generation.py   request body -> prompt ids, sampler, stops, token limit; refusals of what poot lacks
    schemas.py      the request bodies (pydantic)
    errors.py       OpenAI's error shape for every error
    bridge.py       the engine's own thread: the only code that steps the ServingDriver
    state.py        what the routes share; admission (tenant limits, bounded queue) and accounting
    tenants.py      API keys (digests, constant-time compare), tenants and their limits
    metrics.py      Prometheus metrics under vLLM's names with a `poot:` prefix
"""
