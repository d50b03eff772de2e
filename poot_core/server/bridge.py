"""The engine's own thread, and the only code that touches the ServingDriver.

HTTP handlers never step the engine: they hand it commands (submit, abort) through a thread-safe queue and
read what it produces from a per-request asyncio queue, filled from the engine thread with
`call_soon_threadsafe`. The engine thread takes the commands between steps, runs a step whenever anything is
in flight, and sleeps on the command queue when nothing is. An abort frees the request's KV blocks at once
(the next step does not include it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from poot_core.driver.core import GenerateRequest
from poot_core.driver.embeddings import ImagePrompts
from poot_core.driver.engine import Event, FinishedEvent, ServingDriver, TokenEvent
from poot_core.driver.prompt_logprobs import PromptEvent
from poot_core.driver.sampling import TokenLogprobs
from poot_core.errors import PootError, RequestError
from poot_core.server.logprobs import PromptStep, prompt_steps
from poot_core.server.ranks import Lead

log = logging.getLogger("poot.server")


@dataclass(frozen=True)
class Accepted:
    request_id: int


@dataclass(frozen=True)
class Rejected:
    error: Exception


@dataclass(frozen=True)
class Piece:
    token: int  # -1: the held-back tail of the text at the end
    text: str
    at: float  # perf_counter when the engine produced it
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class Done:
    event: FinishedEvent
    queue_seconds: float  # submit to the first step that ran it (0 when none did)
    at: float


Item = Accepted | Rejected | Piece | Done


@dataclass(eq=False)
class Ticket:
    """One request in flight: where its items go, in the event loop that waits for them."""

    loop: asyncio.AbstractEventLoop
    request: GenerateRequest
    priority: int = 0
    salt: str | None = None
    tenant: str | None = None  # the scheduler shares admissions fairly between tenants of one priority
    prompt_top: int | None = None  # the prompt's log-probabilities with this many alternatives (None: not needed)
    # ... set on the engine thread before the request's first Piece or its Done (its prompt's prefill gives them)
    prompt_steps: list[PromptStep | None] | None = None
    on_item: Callable[[Ticket, Item], None] | None = None  # runs in the loop, before the item is queued
    images: list[Any] = field(default_factory=list)  # their features become the request's prompt embeddings
    items: asyncio.Queue[Item] = field(default_factory=asyncio.Queue)
    submitted: float = field(default_factory=time.perf_counter)
    request_id: int | None = None
    admitted: float = 0.0
    finished: bool = False

    def deliver(self, item: Item) -> None:
        if isinstance(item, Done | Rejected):
            self.finished = True
        if self.on_item is not None:
            try:
                self.on_item(self, item)
            except Exception:  # noqa: BLE001 - accounting must never keep an item from its request
                log.exception("accounting failed")
        self.items.put_nowait(item)


def _deliver_all(items: list[tuple[Ticket, Item]]) -> None:
    for ticket, item in items:
        ticket.deliver(item)


@dataclass(frozen=True)
class EngineStats:
    running: int = 0
    waiting: int = 0
    blocks: int = 0
    held: int = 0
    preemptions: int = 0
    cache_queries: int = 0
    cache_hits: int = 0
    steps: int = 0
    state_slots: int = 0
    state_held: int = 0


class EngineBridge:
    def __init__(self, engine: ServingDriver, idle_wait: float = 0.5, images: ImagePrompts | None = None,
                 lead: Lead | None = None) -> None:
        """images: the model's ImagePrompts, whose vision tower this thread runs for requests with images.
        lead: on rank 0 of a placed engine, what tells the other ranks to do as this engine does (ranks.py)."""
        self.images = images
        self.lead = lead
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[str, Ticket]] = queue.SimpleQueue()
        self._tickets: dict[int, Ticket] = {}
        self._idle_wait = idle_wait
        self._stop = threading.Event()
        self._drain_until = 0.0
        self._thread = threading.Thread(target=self._loop, name="poot-engine", daemon=True)
        self.stats = self._stats()
        self.failure: BaseException | None = None  # the bug that stopped the engine thread, if one did

    # --- called from the event loop -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, ticket: Ticket) -> None:
        self._commands.put(("submit", ticket))

    def abort(self, ticket: Ticket) -> None:
        if not ticket.finished:
            self._commands.put(("abort", ticket))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.failure is None

    def begin_stop(self, drain_seconds: float) -> None:
        """Refuse new requests from now on; those in flight may finish for `drain_seconds`, then get an error."""
        deadline = time.perf_counter() + drain_seconds
        self._drain_until = min(self._drain_until, deadline) if self._stop.is_set() else deadline
        self._stop.set()
        self._commands.put(("wake", None))  # type: ignore[arg-type]

    def stop(self, drain_seconds: float = 0.0) -> None:
        """begin_stop, and wait for the engine thread to end."""
        self.begin_stop(drain_seconds)
        if self._thread.is_alive():
            self._thread.join(timeout=drain_seconds + 30)

    # --- the engine thread ----------------------------------------------------------------------------
    def _push(self, ticket: Ticket, item: Item) -> None:
        try:
            ticket.loop.call_soon_threadsafe(ticket.deliver, item)
        except RuntimeError:  # the loop is closed: nobody waits for this request any more
            pass

    def _push_all(self, pushes: list[tuple[Ticket, Item]]) -> None:
        """A step's items, in order: one wake-up of each event loop for all of them, not one an item (a step of
        hundreds of sequences would otherwise wake the loop, and take the interpreter from this thread, as often)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Ticket, Item]]] = {}
        for ticket, item in pushes:
            by_loop.setdefault(ticket.loop, []).append((ticket, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver_all, items)
            except RuntimeError:  # the loop is closed: nobody waits for these requests any more
                pass

    def _loop(self) -> None:
        try:
            while True:
                busy = self.engine.in_flight > 0
                if self._stop.is_set() and (not busy or time.perf_counter() >= self._drain_until):
                    break
                self._take_commands(block=not busy)
                self._run_step()
        except BaseException as exc:  # a bug: every waiting request gets an error instead of hanging
            self.failure = exc
            log.exception("the engine thread stopped")
        finally:
            self._fail_all()

    def _take_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=self._idle_wait) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, ticket = command
            if kind == "submit":
                self._submit(ticket)
            elif kind == "abort" and ticket.request_id is not None and ticket.request_id in self._tickets:
                self._abort(ticket.request_id)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _submit(self, ticket: Ticket) -> None:
        if self._stop.is_set():
            self._push(ticket, Rejected(RuntimeError("the server is shutting down")))
            return
        top = ticket.prompt_top
        try:
            if ticket.images:  # the vision tower runs here, on the thread that owns the executor
                if self.images is None:
                    raise RequestError("this model reads text only")
                embeddings = self.images.embeddings(ticket.request.prompt, ticket.images)
                ticket.request = dataclasses.replace(ticket.request, embeddings=embeddings)
            if top is not None and self.engine.speculation is not None:  # verify steps read no prompt rows yet:
                ticket.prompt_steps = prompt_steps(self.engine.driver, ticket.request.prompt, top)  # own prefill
                top = None
            kwargs = {"priority": ticket.priority, "cache_salt": ticket.salt, "tenant": ticket.tenant,
                      "prompt_logprobs": top}
            if self.lead is not None:
                ticket.request = self.lead.seeded(ticket.request)
            rid = self.engine.submit(ticket.request, **kwargs)
        except PootError as exc:
            self._push(ticket, Rejected(exc))
            return
        except Exception as exc:  # a bug (the vision tower's, say): this request gets the error too, then the rest
            self._push(ticket, Rejected(RuntimeError(f"engine failure: {exc!r}")))
            raise
        if self.lead is not None:
            self.lead.submitted(rid, ticket.request, kwargs)
        ticket.request_id = rid
        self._tickets[rid] = ticket
        self._push(ticket, Accepted(rid))

    def _abort(self, request_id: int) -> None:
        self.engine.abort(request_id)
        if self.lead is not None:
            self.lead.aborted(request_id)

    def _step(self) -> list[Event]:
        if self.lead is not None:
            self.lead.step()
        return self.engine.step()

    def _run_step(self) -> None:
        started = time.perf_counter()
        events = self._step()
        now = time.perf_counter()
        for seq in self.engine.scheduler.running:  # admitted by this step's schedule, at its start
            ticket = self._tickets.get(seq.id)
            if ticket is not None and not ticket.admitted:
                ticket.admitted = started
        pushes: list[tuple[Ticket, Item]] = []
        for event in events:
            ticket = self._tickets.get(event.request_id)
            if ticket is None:
                continue
            if isinstance(event, PromptEvent):  # comes before the request's first piece
                ticket.prompt_steps = event.steps
            elif isinstance(event, TokenEvent):
                pushes.append((ticket, Piece(event.token, event.text, now, event.logprobs)))
            elif isinstance(event, FinishedEvent):
                del self._tickets[event.request_id]
                waited = (ticket.admitted or started) - ticket.submitted
                pushes.append((ticket, Done(event, waited, now)))
        self._push_all(pushes)
        self.stats = self._stats()

    def _stats(self) -> EngineStats:
        counters = self.engine.counters()
        return EngineStats(len(self.engine.scheduler.running), len(self.engine.scheduler.waiting), counters.blocks,
                           counters.held, counters.preemptions, counters.cache.queries, counters.cache.hits,
                           self.engine.steps, counters.state_slots, counters.state_held)

    def _fail_all(self) -> None:
        """At the end of the thread: whatever is still in flight or queued gets an error, never silence."""
        reason = "the server is shutting down" if self.failure is None else f"engine failure: {self.failure!r}"
        for rid, ticket in list(self._tickets.items()):
            try:
                self._abort(rid)
            except Exception:  # noqa: BLE001 - the engine may be the thing that broke
                pass
            self._push(ticket, Rejected(RuntimeError(reason)))
        self._tickets.clear()
        while True:
            try:
                kind, ticket = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                self._push(ticket, Rejected(RuntimeError(reason)))
        try:
            self._step()  # collect the aborts' events so the pool is whole again
            self.stats = self._stats()
        except Exception:  # noqa: BLE001
            pass
        if self.lead is not None:
            try:
                self.lead.stop()  # the other ranks end their loops
            except Exception:  # noqa: BLE001 - a rank that is gone already: nothing left to tell
                pass
