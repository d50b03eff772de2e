"""The FastAPI application: the gate in front of every route (loaded yet? which tenant?), and the small
routes: /health, /metrics, /v1/models, /tokenize, /detokenize. Generation and the encoders are routers of
their own (completions.py, encoders.py).

The model loads in a thread after the server starts listening, so /health answers 503 until it is ready;
/health and /metrics never need a key.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from poot_core.server import completions, encoders, errors
from poot_core.server.errors import APIError
from poot_core.server.generation import message_dicts
from poot_core.server.schemas import DetokenizeRequest, TokenizeRequest
from poot_core.server.state import Loaded, ServerState
from poot_core.server.tenants import DEFAULT
from poot_core.text.services import TextServices

log = logging.getLogger("poot.server")
OPEN_PATHS = ("/health", "/metrics")

Loader = Callable[[ServerState], Loaded]


class Gate:
    """Pure ASGI middleware (a BaseHTTPMiddleware would get in the way of streaming and disconnects): open
    paths pass; every other path needs a known key when keys are configured, and names its tenant."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        tenant = DEFAULT
        if self.state.keys is not None:
            found = self.state.keys.tenant(_bearer(scope))
            if found is None:
                error = APIError(401, "Incorrect API key provided. Pass a key from the server's key file as "
                                      "`Authorization: Bearer KEY`.", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
            tenant = found
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


def _bearer(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            text = value.decode("latin-1").strip()
            scheme, _, key = text.partition(" ")
            return key.strip() if scheme.lower() == "bearer" else None
        if name == b"x-api-key":
            return value.decode("latin-1").strip()
    return None


def create_app(state: ServerState, loader: Loader, on_load_failure: Callable[[str], None] | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        def load() -> None:
            try:
                state.loaded = loader(state)
                log.info("model %s loaded", state.settings.model)
            except Exception as exc:  # noqa: BLE001 - any failure to load is reported, then the server exits
                state.failed = f"the model failed to load: {exc}"
                log.error(state.failed)
                if on_load_failure is not None:
                    on_load_failure(state.failed)

        threading.Thread(target=load, name="poot-load", daemon=True).start()
        yield
        if state.loaded is not None:
            state.loaded.bridge.stop(0.0)  # whatever still runs gets its error event
            for worker in (state.loaded.encoder, state.loaded.reranker):
                if worker is not None:
                    worker.close()

    app = FastAPI(title="poot", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    errors.install(app)
    app.add_middleware(Gate, state=state)
    app.include_router(completions.router)
    app.include_router(encoders.router)

    @app.get("/health")
    async def health() -> Response:
        if state.ready:
            return Response(status_code=200)
        why = state.failed or ("the engine stopped" if state.loaded else "the model is loading")
        return APIError(503, why, code="not_ready").response()

    @app.get("/metrics")
    async def metrics() -> Response:
        from poot_core.server.metrics import CONTENT_TYPE

        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        loaded = state.need()
        data = [_model_card(state.settings.model, state.created, loaded.window)]
        data += [_model_card(w.name, state.created, None) for w in (loaded.encoder, loaded.reranker) if w is not None]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        loaded = state.serving(body.model)
        ids = _tokenize(loaded.text, body)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": loaded.window})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        return JSONResponse({"prompt": state.serving(body.model).text.decode(body.tokens)})

    return app


def _model_card(name: str, created: int, window: int | None) -> dict[str, Any]:
    card: dict[str, Any] = {"id": name, "object": "model", "created": created, "owned_by": "poot", "root": name,
                            "parent": None}
    if window is not None:
        card["max_model_len"] = window
    return card


def _tokenize(text: TextServices, body: TokenizeRequest) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt")
    if body.prompt is not None:
        return text.encode(body.prompt, add_special=body.add_special_tokens)
    messages = message_dicts(body.messages or [])
    rendered = text.render_chat_value(messages, add_generation_prompt=body.add_generation_prompt)
    return text.encode_chat(rendered)

