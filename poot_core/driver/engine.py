"""The serving driver: many sequences per step over a pool of paged KV blocks (Layout.PAGED).

`Driver(handle, executor, options).serve(Layout.PAGED)` returns one. Requests are submitted and the engine is
stepped: each step the scheduler (scheduler.py) picks decode tokens and prefill chunks of many sequences under
one token budget, the step runs as one flat batch of tokens whose attention reads each sequence's own blocks
(StepShape.paging; the executor's business, families do not change), and every sequence that reached the end
of its tokens gets its next token from its own sampler, stops and limits, as Driver.generate would give it.

Step shapes are bucketed (token counts and sequence slots in powers of two up to the budgets), so few programs
are ever prepared; padding tokens belong to no sequence and write nothing.

A model with recurrent state (hybrid families) also holds one state slot per running sequence (state_pool.py);
the prefix cache and speculation are off for it.

Steps are pipelined (`_step_pipelined`): once a step's ids are read and each sequence's tokens, eos and length
are settled on ids, the next step is scheduled and launched, and only then is the read step detokenized and
matched against stop strings while the device runs the next one. A request a stop string ends thus has one
more row in the launched step; that row is dropped when read (its request is gone). Constraints pipeline too:
the next step's input is the token alone, so a constraint takes it (and starts computing its next mask) while
the next step runs, and a request it completes has one more row there, dropped likewise. Speculation, token
callbacks and prompt scoring keep the old order (`_serial`): their next step depends on the text.

The constrained rows of a step are masked together: their packed masks (computed on worker threads while the
step runs, see constraints.Matcher.prefetch) go to the executor's device as one int32 array (token_masks.py),
so a greedy constrained row takes the device's argmax like an unconstrained one, and unconstrained rows pay
nothing.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from poot_core.driver import ahead, constraints, embeddings
from poot_core.driver.constraints import Matcher
from poot_core.driver.core import Generation, GenerationControl, Timings  # core imports this module lazily
from poot_core.driver.kv_pool import KVPool
from poot_core.driver.prefix_cache import CacheCounters, PrefixCache
from poot_core.driver.prompt_logprobs import PromptEvent, PromptScores, RowPlan
from poot_core.driver.sampling import TokenLogprobs, token_logprobs
from poot_core.driver.scheduler import Limits, Scheduler, Sequence
from poot_core.driver.speculative_engine import engine_speculation
from poot_core.driver.state_pool import StatePool, pool_sizes, slot_index
from poot_core.driver.stops import StopMatcher
from poot_core.driver.token_masks import Masked
from poot_core.errors import CapacityError, PootError, Reason, RequestError, Unsupported
from poot_core.executor import Output, Program, device_greedy_rows
from poot_core.graph import EMBED_ROWS, EMBED_VALUES, GROUPS, Paging, StepShape

if TYPE_CHECKING:
    from collections.abc import Callable

    from poot_core.driver.core import Driver, GenerateRequest, OnToken

    _Accept = Callable[["_Request", int, TokenLogprobs | None], list["Event"]]


@dataclass(frozen=True)
class TokenEvent:
    """A generated token and the text it makes safe to show (token -1: the held-back tail at the end)."""

    request_id: int
    token: int
    text: str
    logprobs: TokenLogprobs | None = None  # when the request asked for log-probabilities


@dataclass(frozen=True)
class FinishedEvent:
    """reason: eos | stop | length | capacity | callback | abort | error (then `error` says what failed)."""

    request_id: int
    reason: str
    generation: Generation
    ttft: float  # seconds from submit to the first token (0 without one)
    tpot: float  # seconds per output token after the first (0 with fewer than two)
    preemptions: int = 0
    error: PootError | None = None


Event = TokenEvent | FinishedEvent | PromptEvent  # PromptEvent: submit(prompt_logprobs=k)


@dataclass
class PoolCounters:
    blocks: int
    held: int
    idle_cached: int
    preemptions: int
    cache: CacheCounters
    state_slots: int = 0  # recurrent state slots in all (hybrid families; 0 without recurrent state)
    state_held: int = 0  # of them held by running sequences
    state_kept: int = 0  # of them kept with finished sequences' states for a next turn (given back when needed)
    kept_blocks: int = 0  # KV blocks kept with those states (not in `held`)


@dataclass(eq=False)
class _Request:
    seq: Sequence
    request: GenerateRequest
    prompt_len: int
    limit: int
    stop_ids: set[int]
    matcher: StopMatcher
    stream: object
    submitted: float
    on_token: OnToken | None = None
    constraint: Matcher | None = None  # the request's compiled constraint, if any
    generated: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    first_token: float = 0.0
    logprobs: list[TokenLogprobs] | None = None
    proposed: int = 0  # speculative decoding: draft tokens verified, kept, and the runs that verified them
    accepted: int = 0
    verify_steps: int = 0


@dataclass
class _Launched:
    """A step launched on the executor whose output is not read yet."""

    batch: list[tuple[Sequence, int]]
    out: Output
    rows: RowPlan | None
    picks: list[tuple[int, _Request]]  # slots whose token is picked from this step, with their requests


@dataclass
class _Held:
    """A token settled on ids whose text, stop strings and event wait until the next step is launched."""

    req: _Request
    token: int
    logprobs: TokenLogprobs | None
    end: str | None  # "eos" or "length" when the ids alone end the request
    # what the request's constraint made of the token (engine._constrain)
    refused: PootError | None = None  # taking it failed: the request ends, the token's text not given
    error: PootError | None = None  # asking whether the grammar is complete failed: the text goes out, then it ends
    complete: bool = False  # the grammar admits nothing more

    @property
    def next_mask(self) -> bool:
        """The request goes on under its constraint: its next mask is wanted (engine._emit_all prefetches it)."""
        return (self.req.constraint is not None and self.end is None and self.refused is None
                and self.error is None and not self.complete)


def _step_tokens(seq: Sequence, count: int) -> list[int]:
    """The `count` tokens a sequence runs in a step: its uncomputed tokens, then its draft."""
    start = seq.computed
    if count <= len(seq.tokens) - start:
        return seq.tokens[start : start + count]
    return (seq.tokens[start:] + seq.draft)[:count]


def _buckets(limit: int) -> list[int]:
    sizes = [1 << i for i in range(max(limit, 1).bit_length()) if 1 << i < limit]
    return [*sizes, limit]


def _bucket(buckets: list[int], n: int) -> int:
    return next(b for b in buckets if b >= n)


def _micro_batches(executor: Any, options: Any) -> int:
    """How many parts a step runs as: DriverOptions.micro_batches on a layer pipeline of several ranks, else 1."""
    from poot_core.distributed.executor import PlacedExecutor

    if options.micro_batches < 1:
        raise RequestError(f"micro_batches must be at least 1, got {options.micro_batches}")
    stages = executor.stages if isinstance(executor, PlacedExecutor) else 1
    return options.micro_batches if stages > 1 else 1


def micro_batches(batch: list[tuple[Sequence, int]], parts: int) -> list[list[tuple[Sequence, int]]]:
    """The step's sequences in at most `parts` runs of neighbours, each cut between two sequences (a sequence's
    chunk is never cut) where the tokens before it come nearest to an equal share; none empty."""
    counts = list(itertools.accumulate(count for _, count in batch))
    cuts: list[int] = []
    for k in range(1, min(parts, len(batch))):
        target = counts[-1] * k / parts
        lo = cuts[-1] + 1 if cuts else 1
        best = min(range(lo, len(batch)), key=lambda b: abs(counts[b - 1] - target), default=None)
        if best is not None:
            cuts.append(best)
    edges = [0, *cuts, len(batch)]
    return [batch[a:b] for a, b in zip(edges, edges[1:], strict=False) if b > a]


class ServingDriver:
    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        executor, options = driver.executor, driver.options
        if "paged" not in getattr(executor.capabilities(), "layouts", frozenset()):
            raise Unsupported(Reason.SHAPE, "paged KV layout (Layout.PAGED)",
                              f"the {executor.name} backend does not run paged steps; use Layout.CONTIGUOUS")
        if options.block_size < 1:
            raise RequestError(f"block_size must be positive, got {options.block_size}")
        self.block_size = options.block_size
        self.max_blocks = -(-options.capacity // self.block_size)  # block table width: one full window
        self.limits = Limits(options.step_tokens, options.max_running, options.prefill_chunk)
        self._token_buckets = _buckets(options.step_tokens)
        self._seq_buckets = _buckets(options.max_running)
        recurrent = driver.recurrent  # recurrent state: exact prefix reuse only, so no prefix cache (state_pool.py)
        blocks, slots = pool_sizes(driver, self.block_size, self.max_blocks, recurrent)
        self.slots = StatePool(slots) if recurrent else None
        self.pool = KVPool(blocks, self.block_size, PrefixCache() if options.prefix_cache and not recurrent else None)
        self.scheduler = Scheduler(self.pool, self.limits, self.slots)
        # the longest a sequence may grow: its window, and never more than the whole pool
        self.capacity = min(options.capacity, blocks * self.block_size)
        self._programs: OrderedDict[StepShape, Program] = OrderedDict()
        self._state = None
        self._requests: dict[int, _Request] = {}
        self._backlog: list[Event] = []
        self._next_id = 0
        self.keep_logits = False  # tests: keep the logits each sampled token came from, per request
        self.logits: dict[int, list[np.ndarray]] = {}
        self.steps = 0
        self.speculation = engine_speculation(self)  # None without a draft policy (speculative_engine.py)
        self.prompt_scores = PromptScores(self)  # prompt log-probabilities from the prefill (prompt_logprobs.py)
        self._greedy_rows = device_greedy_rows(executor)
        self.pipeline = True  # False: every step in the old order (read, detokenize, then schedule the next)
        self._inflight: _Launched | None = None
        self._held: list[_Held] = []
        self.ahead = ahead.StepsAhead(self)  # the next step launched before the ids are read (ahead.py)
        self._tables: dict[int, tuple[list[int], np.ndarray]] = {}  # sequence id -> its blocks, and as an array
        self._callbacks = 0  # requests in flight with a token callback (generate(on_token=...))
        self._embedded: set[int] = set()  # requests in flight with prompt embeddings (steps without any skip them)
        # each run of a request's embeddings attends to itself both ways (Gemma 3's images): never split
        self._grouped = driver.handle.family.embedding_groups(driver.config)
        self._micro = _micro_batches(executor, options)
        self.program(self._shape(1, 1))  # an op the executor cannot run is refused now, before any work

    # --- programs -------------------------------------------------------------------------------------
    def _shape(self, tokens: int, seqs: int, decode: bool = False, embedded: int = 0,
               sections: int = 0, grouped: bool = False) -> StepShape:
        paging = Paging(self.pool.blocks, self.block_size, seqs, self.max_blocks, decode,
                        self.slots.slots if self.slots is not None else 0)
        return StepShape(1, tokens, self.max_blocks * self.block_size, paging=paging, embedded=embedded,
                         sections=sections, grouped=grouped)

    def program(self, shape: StepShape) -> Program:
        prog = self._programs.get(shape)
        if prog is not None:
            self._programs.move_to_end(shape)
            return prog
        graph = self.driver._trace(shape)
        prog = self.driver.executor.prepare(graph, self.driver.weights)
        if self._state is None:  # every bucket's graph has the same pools
            self._state = self.driver.executor.allocate_state(graph)
        self._programs[shape] = prog
        while len(self._programs) > self.driver.options.max_programs:
            self._programs.popitem(last=False)
        return prog

    # --- requests -------------------------------------------------------------------------------------
    def _check(self, request: GenerateRequest) -> tuple[GenerateRequest, list[int]]:
        """The request as the engine runs it (prompt embeddings checked, as int64 rows and float32 values) and
        its prompt ids, or a typed refusal."""
        prompt = self.driver._check_ids(request.prompt)
        if request.max_new < -1:
            raise RequestError(f"max_new must be -1 or >= 0, got {request.max_new}")
        if request.embeddings is not None:
            if self.speculation is not None:
                raise Unsupported(Reason.SHAPE, "prompt embeddings with speculative decoding",
                                  "a verify step splices no embeddings")
            family = self.driver.handle.family
            request = dataclasses.replace(request, embeddings=embeddings.checked(
                request.embeddings, len(prompt), self.driver.config.hidden_size, family.name,
                family.prompt_embeddings(self.driver.config), family.rope_sections(self.driver.config)))
            longest = max((b - a for a, b in embeddings.spans(request.embeddings)), default=0)
            if self._grouped and longest > self.limits.step_tokens:
                raise CapacityError(f"an image of {longest} tokens must run in one step, which holds at most "
                                    f"{self.limits.step_tokens}; raise the step budget (step_tokens)")
        cap = self.capacity
        if len(prompt) + max(request.max_new, 0) > cap or len(prompt) >= cap:
            where = ("the KV capacity" if cap == self.driver.options.capacity
                     else f"the KV pool ({self.pool.blocks} blocks of {self.block_size})")
            raise CapacityError(f"prompt of {len(prompt)} tokens plus {request.max_new} new tokens can never fit "
                                f"{where}: {cap} positions; raise the capacity or the pool, or shorten it")
        return request, prompt

    def submit(self, request: GenerateRequest, priority: int = 0, cache_salt: str | None = None,
               tenant: str | None = None, prompt_logprobs: int | None = None) -> int:
        """Queue a request; returns its id. A request that can never fit is a CapacityError here, a constraint
        that does not compile a RequestError. Admission is fair between the tenants of one priority.
        prompt_logprobs=k: a PromptEvent with the prompt's log-probabilities and k alternatives each comes
        before the first token (computed in the prompt's own prefill, which then reads no cached block)."""
        request, prompt = self._check(request)
        return self._submit(request, prompt, self.driver.constraint_matcher(request), priority, cache_salt, tenant,
                            prompt_logprobs)

    def _submit(self, request: GenerateRequest, prompt: list[int], matcher: Matcher | None, priority: int = 0,
                cache_salt: str | None = None, tenant: str | None = None, prompt_logprobs: int | None = None) -> int:
        if prompt_logprobs is not None and self.speculation is not None:
            raise Unsupported(Reason.SHAPE, "prompt_logprobs with speculative decoding in the paged layout",
                              "verify steps read no prompt rows; Driver.logits gives them with a prefill of its own")
        rid = self._next_id
        self._next_id += 1
        cache_salt = embeddings.salted(cache_salt, request.embeddings)
        if prompt_logprobs is not None:
            cache_salt = self.prompt_scores.begin(rid, prompt, prompt_logprobs, cache_salt)
        seq = Sequence(rid, list(prompt), priority=priority, salt=cache_salt, tenant=tenant, arrival=rid)
        if request.embeddings is not None and self._grouped:
            seq.whole = embeddings.spans(request.embeddings)
        limit = request.max_new if request.max_new >= 0 else self.capacity - len(prompt)
        req = _Request(seq, request, len(prompt), limit, self.driver.stop_ids(request),
                       StopMatcher(request.stops), self.driver.handle.text().stream(prompt), time.perf_counter(),
                       constraint=matcher)
        if request.logprobs is not None:
            req.logprobs = []
        self._requests[rid] = req
        if request.embeddings is not None:
            self._embedded.add(rid)
        if self.speculation is not None:
            self.speculation.begin(req)
        if self.keep_logits:
            self.logits[rid] = []
        if limit == 0 and not self.prompt_scores.scoring(rid):  # else it finishes when its prompt has run
            self._backlog.extend(self._finish(req, "length" if request.max_new >= 0 else "capacity"))
        else:
            self.scheduler.add(seq)
        return rid

    def abort(self, request_id: int) -> bool:
        """Stop a request; its finished event (reason "abort") comes with the next step. False when it is not
        in flight."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        self._backlog.extend(self._finish(req, "abort"))
        return True

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    def counters(self) -> PoolCounters:
        cache = self.pool.cache
        slots = self.slots
        kept = self.scheduler.kept
        kept_slots, kept_blocks = (len(kept), kept.blocks) if kept is not None else (0, 0)
        return PoolCounters(self.pool.blocks, self.pool.held - kept_blocks, cache.idle_blocks if cache else 0,
                            self.scheduler.preemptions, cache.counters if cache else CacheCounters(),
                            slots.slots if slots else 0, slots.held - kept_slots if slots else 0, kept_slots,
                            kept_blocks)

    # --- stepping -------------------------------------------------------------------------------------
    def step(self) -> list[Event]:
        """Run one step; returns the events since the last call (token pieces, finished requests)."""
        events, self._backlog = self._backlog, []
        return events + self._step()

    def _step(self) -> list[Event]:
        if not self._serial():
            return self._step_pipelined()
        events = [] if self._inflight is None else self._collect(self._inflight)  # a step left by the pipeline
        self._inflight = None
        return events + self._step_serial()

    def _serial(self) -> bool:
        """Whether this step keeps the old order: speculation proposes from the text's tokens, a callback's answer
        follows each token's text, prompt scoring reads rows at once."""
        if not self.pipeline or self.speculation is not None:
            return True
        return self._callbacks > 0 or self.prompt_scores.open()  # counts, not a scan of every request

    def _step_serial(self) -> list[Event]:
        if self.speculation is not None:
            self.speculation.propose()
        batch = self._schedule()
        if not batch:
            return []
        if self.speculation is not None and any(seq.draft for seq, _ in batch):
            return self.speculation.verify(batch)  # some sequences run their drafts: every position's logits
        launched = self._launch(batch)
        return self._failed(batch, launched) if isinstance(launched, PootError) else self._collect(launched)

    def _step_pipelined(self) -> list[Event]:
        """Read the step in flight (launching one first when none is), settle its tokens on ids, launch the next
        step, then make the read step's text and events while the next one runs."""
        events: list[Event] = []
        done = self._inflight
        if done is None:
            done = self._launch_next(events)
            if done is None:
                return events
        self._inflight = None
        if self.ahead.ready(done):
            return events + self._step_ahead(done)
        if done.rows is not None:  # none while pipelining (prompt scoring keeps the old order); kept for safety
            events.extend(self.prompt_scores.score(done.rows, done.out))
        events.extend(self._sample(done.batch, done.out, self._hold))  # only failures: tokens are held
        held, self._held = self._held, []
        batch = self._schedule()
        launched = self._launch(batch) if batch else None
        if isinstance(launched, _Launched):
            self._inflight = launched
        events.extend(self._emit_all(held))
        if isinstance(launched, PootError):  # after the text, so that each request's generation is whole
            events.extend(self._failed(batch, launched))
        return events

    def _step_ahead(self, done: _Launched) -> list[Event]:
        """Launch the next step fed from `done`'s ids on the device, then read and settle them, then make their
        text and events while the next step runs (ahead.py)."""
        events, ids, batch, launched = self.ahead.launch(done)
        if isinstance(launched, _Launched):
            self._inflight = launched
        self.ahead.settle(done, ids)
        held, self._held = self._held, []
        events.extend(self._emit_all(held))
        if isinstance(launched, PootError):  # after the text, so that each request's generation is whole
            events.extend(self._failed(batch, launched))
        return events

    def _launch_next(self, events: list[Event]) -> _Launched | None:
        batch = self._schedule()
        if not batch:
            return None
        launched = self._launch(batch)
        if isinstance(launched, PootError):
            events.extend(self._failed(batch, launched))
            return None
        return launched

    def _schedule(self) -> list[tuple[Sequence, int]]:
        batch = self.scheduler.schedule()
        if not batch and self.scheduler.waiting:
            raise RuntimeError("the scheduler admitted nothing with the pool free (a bug)")
        return batch

    def _launch(self, batch: list[tuple[Sequence, int]], fed: tuple | None = None) -> _Launched | PootError:
        """Build the step's inputs and run it; on the Triton executor this returns before the device is done
        (nothing here reads device memory), the wait is in reading the output. fed: token slots whose ids the
        executor takes from the step in flight (ahead.py)."""
        n = sum(count for _, count in batch)
        chunks: list[embeddings.Chunk] = []
        given, groups, extra = None, None, {}
        if self._embedded:  # a request with prompt embeddings is in flight: its rows (and rope positions)
            chunks = [(self._requests[seq.id].request.embeddings, seq.computed, count) for seq, count in batch]
            given = embeddings.step_rows(chunks, lambda e: _bucket(self._token_buckets, e))
            extra["embedded"] = 0 if given is None else len(given[0])
            if any(e is not None and e.positions is not None for e, _, _ in chunks):
                extra["sections"] = self.driver.handle.family.rope_sections(self.driver.config)
            groups = embeddings.step_groups(((seq.whole, seq.computed, count) for seq, count in batch), n) \
                if self._grouped else None
            extra["grouped"] = groups is not None
        rows = self.prompt_scores.plan(batch)
        if self._micro > 1 and fed is None and rows is None and not chunks and len(batch) > 1:
            return self._launch_parts(batch)
        shape = self._step_shape(batch, extra)
        if rows is not None and rows.extra:  # one more sequence slot per scored prompt position
            shape = self._shape(_bucket(self._token_buckets, n),
                                _bucket(self.prompt_scores.slot_buckets, len(batch) + len(rows.extra)), **extra)
        inputs = self._inputs(shape, batch)
        if given is not None:
            inputs[EMBED_ROWS], inputs[EMBED_VALUES] = given
        if shape.grouped:
            inputs[GROUPS] = np.pad(groups, ((0, 0), (0, shape.tokens - n)), constant_values=-1)
        if shape.sections:
            inputs |= embeddings.section_positions(chunks, shape.sections, shape.tokens)
            inputs |= self.driver.handle.family.step_constants(self.driver.config, shape)
        if rows is not None:
            self.prompt_scores.point(rows, inputs["logit_index"])
        self._prefetch(batch)
        try:
            program = self.program(shape)
            out = (program.run(self._state, inputs) if fed is None
                   else self.ahead.run(program, self._state, inputs, fed))[0]
        except PootError as exc:
            return exc
        self.steps += 1
        self.scheduler.advance(batch)
        return _Launched(batch, out, rows, ahead.picks(self._requests, batch))

    def _prefetch(self, batch: list[tuple[Sequence, int]]) -> None:
        """The masks of the rows this step samples, built while it runs."""
        constraints.prefetch(
            matcher for seq, count in batch
            if (matcher := self._requests[seq.id].constraint) is not None and seq.computed + count == len(seq.tokens))

    def _step_shape(self, batch: list[tuple[Sequence, int]], extra: dict[str, Any]) -> StepShape:
        n = sum(count for _, count in batch)
        if n == len(batch):  # decode tokens only: one shape for both counts, so token i sits in slot i
            width = _bucket(self._seq_buckets, n)
            return self._shape(width, width, decode=True, **extra)
        return self._shape(_bucket(self._token_buckets, n), _bucket(self._seq_buckets, len(batch)), **extra)

    def _launch_parts(self, batch: list[tuple[Sequence, int]]) -> _Launched | PootError:
        """A step on a layer pipeline as micro-batches of its sequences, run one after another: each rank sends a
        part on as soon as it has run it, so the next stage works on it while this one runs the next part. Each
        row's arithmetic is its own (the steps are batch-invariant), so the tokens are those of the whole step."""
        from poot_core.distributed.executor import Parts

        parts = micro_batches(batch, self._micro)
        self._prefetch(batch)
        outs = []
        try:
            for part in parts:
                shape = self._step_shape(part, {})
                outs.append(self.program(shape).run(self._state, self._inputs(shape, part))[0])
        except PootError as exc:
            return exc
        self.steps += 1
        self.scheduler.advance(batch)
        return _Launched(batch, Parts(outs, [len(p) for p in parts]), None, ahead.picks(self._requests, batch))

    def _failed(self, batch: list[tuple[Sequence, int]], exc: PootError) -> list[Event]:
        """A step that failed to run: its sequences fail, each with the error in its own event."""
        events: list[Event] = []
        for seq, _ in batch:
            req = self._requests.get(seq.id)
            if req is not None:
                events.extend(self._finish(req, "error", exc))
        return events

    def _collect(self, launched: _Launched) -> list[Event]:
        rows, out = launched.rows, launched.out
        scored = [] if rows is None else self.prompt_scores.score(rows, out)  # before the first token's event
        return scored + self._sample(launched.batch, out, self._accept)

    def _inputs(self, shape: StepShape, batch: list[tuple[Sequence, int]]) -> dict[str, np.ndarray]:
        """The step's host inputs, built with whole-array numpy operations (a step may hold hundreds of
        sequences, and this runs between device steps)."""
        paging = shape.paging
        assert paging is not None
        slots = len(batch)
        counts = np.fromiter((count for _, count in batch), dtype=np.int64, count=slots)
        starts = np.fromiter((seq.computed for seq, _ in batch), dtype=np.int64, count=slots)
        n = int(counts.sum())
        ends = np.cumsum(counts)  # one past each sequence's last token in the step
        tokens = np.zeros((1, shape.tokens), dtype=np.int64)
        tokens[0, :n] = list(itertools.chain.from_iterable(_step_tokens(seq, count) for seq, count in batch))
        positions = np.zeros((1, shape.tokens), dtype=np.int64)
        positions[0, :n] = np.arange(n) + np.repeat(starts - (ends - counts), counts)
        seq_index = np.full(shape.tokens, -1, dtype=np.int64)
        seq_index[:n] = np.repeat(np.arange(slots), counts)
        arrays = [self._table(seq) for seq, _ in batch]
        widths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=slots)
        held = int(widths.sum())
        tables = np.zeros((paging.seqs, paging.max_blocks), dtype=np.int64)
        rows = np.repeat(np.arange(slots), widths)
        columns = np.arange(held) - np.repeat(np.cumsum(widths) - widths, widths)
        tables[rows, columns] = np.concatenate(arrays)
        logit_index = np.zeros(paging.seqs, dtype=np.int64)
        logit_index[:slots] = ends - 1
        inputs = {"tokens": tokens, "positions": positions, "seq_index": seq_index, "block_tables": tables,
                  "logit_index": logit_index}
        if self.slots is not None:
            inputs["state_slots"] = slot_index(batch, paging.seqs)
        return inputs

    def _table(self, seq: Sequence) -> np.ndarray:
        """The sequence's blocks as an array, kept between steps: a list of blocks is only ever appended to
        (the scheduler gives a sequence a new list when it frees or cuts back its blocks), so only the blocks
        added since the last step are converted."""
        blocks, cached = seq.blocks, self._tables.get(seq.id)
        if cached is not None and cached[0] is blocks and len(cached[1]) <= len(blocks):
            array = cached[1]
            if len(array) == len(blocks):
                return array
            array = np.concatenate((array, np.array(blocks[len(array) :], dtype=np.int64)))
        else:
            array = np.array(blocks, dtype=np.int64)
            if len(self._tables) > 2 * len(self._requests) + 64:  # forget finished sequences now and then
                self._tables = {i: t for i, t in self._tables.items() if i in self._requests}
        self._tables[seq.id] = (blocks, array)
        return array

    def _on_device(self, req: _Request, masked_on_device: bool) -> bool:
        """Whether the row's token can be the executor's argmax (the logits then never cross to the host)."""
        return (self._greedy_rows is not None and not self.keep_logits and req.logprobs is None
                and req.request.sampler.is_greedy and (req.constraint is None or masked_on_device))

    def _masked(self, rows: list[tuple[int, _Request]], out: Output, events: list[Event]) -> Masked | None:
        """The step's logits with every constrained row masked at once (None when no row is constrained). A
        request whose constraint allows no token or failed ends here, and leaves `rows`."""
        slots, masks = [], []
        for slot, req in list(rows):
            if req.constraint is None:
                continue
            try:
                masks.append(req.constraint.row_mask())
            except PootError as exc:  # this request's own failure: it ends; the step's other rows go on
                events.extend(self._finish(req, "error", exc))
                rows.remove((slot, req))
                continue
            slots.append(slot)
        return self.driver.masks.apply(out, slots, np.stack(masks)) if slots else None

    def _sample(self, batch: list[tuple[Sequence, int]], out: Output, accept: _Accept | None = None) -> list[Event]:
        """Pick each row's token and hand it to `accept` (default `_accept`: the whole path at once)."""
        accept = accept or self._accept
        rows = []  # (slot, request)
        for slot, (seq, _) in enumerate(batch):
            # pending: a prefill chunk short of the prompt's end, nothing to pick yet; a request its prompt's
            # scoring finished (max_new 0), an abort or a stop string while the step ran ended is gone
            if not seq.pending and seq.id in self._requests:
                rows.append((slot, self._requests[seq.id]))
        events: list[Event] = []
        masked = self._masked(rows, out, events)
        if masked is not None:
            out = masked.output
        picking = [(slot, req, self._on_device(req, masked is None or masked.on_device)) for slot, req in rows]
        greedy = self._greedy_rows(out) if any(dev for _, _, dev in picking) else None
        logits = None
        if not all(dev for _, _, dev in picking):
            logits = self.driver.executor.to_numpy(out)[0] if masked is None else masked.host()
        for slot, req, on_device in picking:
            try:
                if on_device:
                    events.extend(accept(req, int(greedy[slot]), None))
                    continue
                if self.keep_logits:
                    self.logits[req.seq.id].append(logits[slot].copy())
                events.extend(self._pick(req, logits[slot], accept))
            except PootError as exc:  # this request's own failure (its constraint failed taking the token):
                events.extend(self._finish(req, "error", exc))  # it ends; the step's other rows go on
        return events

    def _pick(self, req: _Request, row: np.ndarray, accept: _Accept) -> list[Event]:
        """The row's token from its logits (masked by its constraint already) by its own sampler."""
        token = req.request.sampler.sample(row, req.seq.tokens, req.prompt_len)
        logprobs = None
        if req.logprobs is not None:
            logprobs = token_logprobs(row, token, req.request.logprobs or 0)
            req.logprobs.append(logprobs)
        return accept(req, token, logprobs)

    def _take(self, req: _Request, token: int) -> str | None:
        """A new token on ids alone: the sequence's tokens, then "eos" or "length" when that ends it (its
        sequence then leaves the scheduler, so no later step runs it)."""
        if not req.generated:
            req.first_token = time.perf_counter()
        req.generated.append(token)
        if ahead.fill(req.seq, token):  # a step already launched ran it
            self.scheduler.known(req.seq)
        else:
            req.seq.tokens.append(token)
        end = "eos" if token in req.stop_ids else "length" if len(req.generated) >= req.limit else None
        if end is not None:
            self.scheduler.remove(req.seq, keep=True)
        return end

    def _text(self, req: _Request, token: int, logprobs: TokenLogprobs | None) -> tuple[list[Event], bool]:
        """The token's piece of text through the stop strings: its event, and whether a stop string matched."""
        emit, hit = req.matcher.push(req.stream.push(token))  # type: ignore[attr-defined]
        req.pieces.append(emit)
        return [TokenEvent(req.seq.id, token, emit, logprobs)], hit

    def _hold(self, req: _Request, token: int, logprobs: TokenLogprobs | None) -> list[Event]:
        self._held.append(_Held(req, token, logprobs, self._take(req, token)))
        return []

    def _emit_all(self, held: list[_Held]) -> list[Event]:
        """The held tokens' text and events. Their constraints take the tokens first, so that the next masks (of
        the rows of the step just launched) are computed in one batch while the text is made and the step runs."""
        for h in held:
            self._constrain(h)
        constraints.prefetch(h.req.constraint for h in held if h.next_mask)
        events: list[Event] = []
        for h in held:
            events.extend(self._emit(h))
        return events

    def _constrain(self, held: _Held) -> None:
        """The held token taken by its request's constraint (while the next step runs: that step's input is the
        token alone): whether taking it failed, or completed the grammar."""
        req = held.req
        if held.end == "eos" or req.constraint is None:
            return
        try:
            req.constraint.advance(held.token)
        except PootError as exc:  # as _accept: the token is kept, its text is not given
            held.refused = exc
            return
        try:
            held.complete = req.constraint.done
        except PootError as exc:  # the token's text still goes out before the error
            held.error = exc

    def _emit(self, held: _Held) -> list[Event]:
        """A held token's text and events after _constrain, in the order _accept gives them (stop, then the
        constraint, then length); a request that ends has one more row in the running step, dropped when read."""
        req = held.req
        if held.end == "eos":
            return self._finish(req, "eos")
        if held.refused is not None:
            return self._finish(req, "error", held.refused)
        events, hit = self._text(req, held.token, held.logprobs)
        if hit:  # the step now running has one more row of this request: dropped when read
            return events + self._finish(req, "stop")
        if held.error is not None:
            return events + self._finish(req, "error", held.error)
        if held.complete:  # the constraint admits nothing more
            return events + self._finish(req, "eos", flush=True)
        if held.end == "length":
            return events + self._finish(req, "length")
        return events

    def _accept(self, req: _Request, token: int, logprobs: TokenLogprobs | None = None) -> list[Event]:
        """One new token through the path Driver.generate takes: eos, stop strings, callback, limits."""
        end = self._take(req, token)
        if end == "eos":
            return self._finish(req, "eos")
        if req.constraint is not None:
            req.constraint.advance(token)
        events, hit = self._text(req, token, logprobs)
        control = req.on_token(token, events[0].text) if req.on_token else None  # type: ignore[union-attr]
        if hit:
            return events + self._finish(req, "stop")
        if control is GenerationControl.BREAK:
            return events + self._finish(req, "callback")
        if req.constraint is not None:
            try:
                complete = req.constraint.done
            except PootError as exc:  # the piece above still goes out before the error
                return events + self._finish(req, "error", exc)
            if complete:  # the constraint admits nothing more
                return events + self._finish(req, "eos", flush=True)
        if end == "length":
            return events + self._finish(req, "length")
        return events

    def _finish(self, req: _Request, reason: str, error: PootError | None = None, flush: bool = False) -> list[Event]:
        events: list[Event] = []
        tail = ""
        if flush or reason in ("length", "capacity", "callback", "eos"):
            # the text the stream and the stop matcher still hold is part of the reply (a stop string never
            # completed); at eos only what the stream held for a clean-up of spaces, not an unfinished character
            whole = flush or reason != "eos"
            tail, _ = req.matcher.push(req.stream.flush() if whole else req.stream.release())  # type: ignore[attr-defined]
            tail += req.matcher.flush()
        if tail:
            req.pieces.append(tail)
            events.append(TokenEvent(req.seq.id, -1, tail))
            if req.on_token:
                req.on_token(-1, tail)
        # a request that ended well leaves its recurrent state for a next turn (state_pool.KeptStates)
        self.scheduler.remove(req.seq, keep=reason in ("eos", "length", "stop", "callback"))
        self._callbacks -= req.on_token is not None
        if self.speculation is not None:
            self.speculation.end(req.seq.id)
        self.prompt_scores.end(req.seq.id)
        del self._requests[req.seq.id]
        self._embedded.discard(req.seq.id)
        now = time.perf_counter()
        first = req.first_token or now
        count = len(req.generated)
        timings = Timings(prefill_tokens=req.prompt_len - req.seq.reused, prefill_seconds=first - req.submitted,
                          decode_tokens=max(count - 1, 0), decode_seconds=now - first if count else 0.0,
                          reused_tokens=req.seq.reused)
        timings.proposed, timings.accepted, timings.verify_steps = req.proposed, req.accepted, req.verify_steps
        generation = Generation(list(req.generated), "".join(req.pieces), reason, timings,
                                None if req.logprobs is None else list(req.logprobs), error)
        tpot = (now - first) / (count - 1) if count > 1 else 0.0
        events.append(FinishedEvent(req.seq.id, reason, generation, first - req.submitted if count else 0.0, tpot,
                                    req.seq.preemptions, error))
        return events

    # --- whole requests -------------------------------------------------------------------------------
    def generate_batch(self, requests: list[GenerateRequest], cache_salt: str | None = None) -> list[Generation]:
        """Run every request to its end, sharing steps; generations in the requests' order. Each is checked
        before any is queued. cache_salt: as submit's (their prefix-cache blocks are shared only under it)."""
        checked = [(*self._check(r), self.driver.constraint_matcher(r)) for r in requests]
        ids = [self._submit(*c, cache_salt=cache_salt) for c in checked]
        done: dict[int, Generation] = {}
        pending = set(ids)
        while pending:
            for event in self.step():
                if isinstance(event, FinishedEvent):
                    if event.request_id in pending:
                        done[event.request_id] = event.generation
                        pending.discard(event.request_id)
                    else:
                        self._backlog.append(event)
                elif event.request_id not in pending:
                    self._backlog.append(event)
        return [done[i] for i in ids]

    def generate(self, request: GenerateRequest, on_token: OnToken | None = None) -> Generation:
        """One request to its end (other requests in flight keep running; their events wait for step())."""
        rid = self.submit(request)
        req = self._requests.get(rid)
        if req is not None:
            req.on_token = on_token
            self._callbacks += on_token is not None
        while True:
            events, self._backlog = self._backlog, []
            events += self._step()
            for event in events:
                if event.request_id != rid:
                    self._backlog.append(event)
                elif isinstance(event, FinishedEvent):
                    self._backlog.extend(e for e in events[events.index(event) + 1 :] if e.request_id != rid)
                    return event.generation
