"""What the routes share: the loaded model and engine bridge, the tenants' limits, the metrics, and the
admission of a request (tenant limits, the bounded queue) with its accounting when it ends.

A request's tenant slot and its metrics are settled when its last item reaches the event loop (Ticket.on_item),
not by the handler that waits for it, so a client that vanishes before its response starts leaks nothing.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from poot_core.driver.core import GenerateRequest
from poot_core.errors import PootError
from poot_core.server.bridge import Accepted, Done, EngineBridge, EngineStats, Item, Piece, Rejected, Ticket
from poot_core.server.errors import APIError, from_poot
from poot_core.server.metrics import Metrics
from poot_core.server.tenants import KeyRing, Limiter, OverLimit, Tenant
from poot_core.text.services import TextServices


@dataclass
class Settings:
    model: str  # the served model name
    max_queued: int = 64  # requests accepted beyond those the engine may run at once
    max_running: int = 32
    drain_seconds: float = 30.0  # SIGTERM: how long requests in flight may take to finish
    tool_call_parser: str | None = None  # --tool-call-parser; None: the chat template's format


@dataclass
class Loaded:
    text: TextServices
    bridge: EngineBridge
    window: int  # positions a request may use: prompt plus new tokens
    encoder: Any = None  # encoders.EncoderWorker of --embedding-model
    reranker: Any = None  # ... of --rerank-model
    images: Any = None  # the model's ImagePrompts when it takes images (Family.image_prompts)


@dataclass
class ServerState:
    settings: Settings
    keys: KeyRing | None = None
    limiter: Limiter = field(default_factory=Limiter)
    loaded: Loaded | None = None
    failed: str | None = None  # why loading failed
    created: int = field(default_factory=lambda: int(time.time()))
    accepted: int = 0  # requests accepted and not finished (all tenants)
    metrics: Metrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.settings.model, self.stats)

    def stats(self) -> EngineStats:
        return self.loaded.bridge.stats if self.loaded else EngineStats()

    @property
    def ready(self) -> bool:
        return self.loaded is not None and self.loaded.bridge.alive

    def need(self) -> Loaded:
        if self.loaded is None or not self.loaded.bridge.alive:
            why = self.failed or ("the engine stopped" if self.loaded else "the model is loading")
            raise APIError(503, why, code="not_ready", headers={"Retry-After": "5"})
        return self.loaded

    def check_model(self, model: str | None) -> None:
        name = self.settings.model
        if model is not None and model != name:
            raise APIError(404, f"The model `{model}` does not exist. This server serves `{name}`.",
                           param="model", code="model_not_found")

    def serving(self, model: str | None) -> Loaded:
        """The loaded model for a request that names `model` (or none): 404 for another name, then 503 while
        the model is not ready."""
        self.check_model(model)
        return self.need()

    # --- admission ------------------------------------------------------------------------------------
    async def submit(self, tenant: Tenant, requests: list[GenerateRequest],
                     prompt_tops: list[int | None] | None = None,
                     images: list[list[Any]] | None = None) -> list[Ticket]:
        """Queue the requests of one HTTP request (all or none); 429 over a tenant limit or a full queue.
        prompt_tops: per request, the alternatives its prompt's log-probabilities need (None: none); images: per
        request, the images whose features its image tokens take (on the engine's thread)."""
        loaded = self.need()
        n = len(requests)
        limit = self.settings.max_running + self.settings.max_queued
        if self.accepted + n > limit:
            self.metrics.rejected.labels(self.settings.model, tenant.name, "queue_full").inc()
            raise APIError(429, f"the server's queue is full ({self.accepted} requests in flight, at most "
                                f"{limit}); retry later", code="queue_full", headers={"Retry-After": "1"})
        try:
            self.limiter.admit(tenant, n)
        except OverLimit as exc:
            self.metrics.rejected.labels(self.settings.model, tenant.name, "tenant_limit").inc()
            raise APIError(429, str(exc), code="rate_limit_exceeded",
                           headers={"Retry-After": str(exc.retry_after)}) from None
        self.accepted += n
        loop = asyncio.get_running_loop()
        account = _Accounting(self, tenant)
        salt = tenant.salt if self.keys else None
        tickets = [Ticket(loop, r, tenant.priority, salt, tenant.name, top, on_item=account, images=pics)
                   for r, top, pics in zip(requests, prompt_tops or [None] * n, images or [[]] * n, strict=True)]
        for t in tickets:
            loaded.bridge.submit(t)
        for t in tickets:  # every one accepted, or the whole request is refused
            first = await t.items.get()
            if isinstance(first, Rejected):
                for other in tickets:
                    loaded.bridge.abort(other)
                err = first.error
                raise from_poot(err) if isinstance(err, PootError) else APIError(503, str(err), code="not_ready")
        return tickets

    def abort(self, tickets: list[Ticket]) -> None:
        if self.loaded is not None:
            for t in tickets:
                self.loaded.bridge.abort(t)


class _Accounting:
    """Runs in the event loop for every item of one tenant's tickets: metrics, token counts, the slot."""

    def __init__(self, state: ServerState, tenant: Tenant) -> None:
        self.state, self.tenant = state, tenant
        self.last: dict[int, float] = {}

    def __call__(self, ticket: Ticket, item: Item) -> None:
        m, labels = self.state.metrics, (self.state.settings.model, self.tenant.name)
        if isinstance(item, Accepted):
            m.prompt_tokens.labels(*labels).inc(len(ticket.request.prompt))
            self.state.limiter.count_tokens(self.tenant, len(ticket.request.prompt))
        elif isinstance(item, Piece) and item.token >= 0:
            previous = self.last.get(id(ticket))
            if previous is not None:
                m.itl.labels(*labels).observe(item.at - previous)
            self.last[id(ticket)] = item.at
        elif isinstance(item, Done | Rejected):
            self.last.pop(id(ticket), None)
            self.state.accepted -= 1
            self.state.limiter.release(self.tenant)
            if isinstance(item, Done):
                event = item.event
                count = len(event.generation.tokens)
                m.generation_tokens.labels(*labels).inc(count)
                self.state.limiter.count_tokens(self.tenant, count)
                m.request_success.labels(*labels, event.reason).inc()
                m.queue_time.labels(*labels).observe(item.queue_seconds)
                m.e2e.labels(*labels).observe(item.at - ticket.submitted)
                if count:
                    m.ttft.labels(*labels).observe(event.ttft)
