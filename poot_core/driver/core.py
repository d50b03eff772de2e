"""The Driver: one model on one executor. Owns the KV state, chunked prefill, the decode loop, sampling,
stops and timings.

Each step shape is traced once by the family and prepared once by the executor; prepared programs live in
a bounded cache. The KV state of row 0 remembers which tokens it holds, so a follow-up request that starts
with the same tokens (the next turn of a conversation) prefills only what is new.

Hybrid families also carry fixed-size recurrent state (convolution windows, SSM states: graph.RECURRENT_KINDS)
beside KV. It summarizes every token the sequence holds and cannot be cut back, so a new sequence (a step at
position 0) gets a fresh state, a follow-up request reuses it only when it extends every cached token, and
speculation (which rolls back rejected tokens) is refused for such models. The paged layout gives each running
sequence a state slot (state_pool.py) and runs without a prefix cache.

With a draft policy (DriverOptions.draft) decode proposes several tokens and verifies them in one step of
the target (see speculation.py); the tokens then go through the same stop, limit and callback path one by
one, and the cache bookkeeping drops what was rejected (the next step writes over those positions).
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import TYPE_CHECKING

import numpy as np

from poot_core.driver.constraints import Constraint, Matcher, compile_constraint
from poot_core.driver.embeddings import PromptEmbeddings
from poot_core.driver.sampling import Sampler, TokenLogprobs, token_logprobs
from poot_core.driver.speculation import (
    Draft,
    DraftPolicy,
    Proposal,
    Speculation,
    accept,
    check_draft,
    make_speculation,
)
from poot_core.driver.stops import StopMatcher
from poot_core.driver.token_masks import TokenMasks
from poot_core.errors import CapacityError, PootError, Reason, RequestError, Unsupported
from poot_core.executor import Executor, Output, Program, State, Weights, device_greedy
from poot_core.graph import Graph, StepShape, Tracer

if TYPE_CHECKING:
    from poot_core.checkpoint.handle import ModelHandle
    from poot_core.distributed import Coordinator, Placement
    from poot_core.driver.engine import ServingDriver


class Layout(StrEnum):
    CONTIGUOUS = "contiguous"
    PAGED = "paged"


class GenerationControl(Enum):
    CONTINUE = "continue"
    BREAK = "break"


@dataclass
class DriverOptions:
    capacity: int = 2048  # KV positions: prompt plus new tokens
    # None here (and in step_tokens, max_running, kv_fraction): the executor's RunDefaults (128 on the CPU)
    prefill_chunk: int | None = None  # new tokens per prefill step
    max_programs: int = 16  # prepared step programs kept at once
    draft: Draft = DraftPolicy.OFF  # speculative decoding: DraftPolicy.PromptLookup(...), .DraftModel(...), .Mtp(k)
    # Serving (Layout.PAGED, see engine.py): the KV pool, in blocks of block_size positions: kv_blocks of them,
    # or as many as kv_fraction of the device's free memory holds (never more than max_running full windows)
    block_size: int = 16
    kv_blocks: int | None = None
    kv_fraction: float | None = None
    # recurrent state (hybrid families): slots of fixed-size state, one per running sequence, so at most this many
    # run at once (None: max_running, fewer when kv_fraction cannot hold them; their bytes count in its budget)
    state_slots: int | None = None
    step_tokens: int | None = None  # token budget of one serving step (decode tokens and prefill chunks)
    max_running: int | None = None  # sequences one serving step may hold
    prefix_cache: bool = True
    draft_max_batch: int = 8  # serving: sequences speculate while at most this many run (0: never)
    # serving on a layer pipeline (Driver.placed, Placement.PIPELINE): each step's sequences run as this many
    # micro-batches, so the first stage works on the second while the next stage works on the first. 1 (whole
    # steps) by default: where a step reads its weights at the memory's speed (decode), each part reads them again
    # and takes nearly as long as the whole step (bench/multi_device.py --serve: 142 against 172 output tok/s on
    # the CPU, 24 layers, 32 requests, two parts); parts pay where a step is compute-bound (long prefills)
    micro_batches: int = 1


def with_defaults(options: DriverOptions, executor: Executor) -> DriverOptions:
    """A copy of `options` with every field left as None set to the executor's RunDefaults."""
    defaults = executor.capabilities().defaults
    unset = {name: getattr(defaults, name) for name in ("prefill_chunk", "step_tokens", "max_running", "kv_fraction")
             if getattr(options, name) is None}
    return dataclasses.replace(options, **unset)


@dataclass
class GenerateRequest:
    prompt: list[int]
    max_new: int = -1  # -1: until end-of-sequence, a stop string, or the end of the window
    sampler: Sampler = field(default_factory=Sampler.greedy)
    stops: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    # Structured output: the reply follows a JSON schema, a regex, a choice or a grammar (constraints.py); it
    # ends when the constraint is complete (reason "eos") or at end-of-sequence where the constraint allows it.
    constraint: Constraint | None = None
    # Log-probabilities of every generated token and of the `logprobs` most likely alternatives (None: off;
    # 0: the token's own only), from the logits the token was picked from (sampling.token_logprobs).
    logprobs: int | None = None
    # Embeddings given for some prompt positions (image features): the serving engine only, see PromptEmbeddings.
    embeddings: PromptEmbeddings | None = None


@dataclass
class Timings:
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    reused_tokens: int = 0  # prompt tokens whose K/V was already in the cache
    proposed: int = 0  # speculative decoding: tokens proposed to verify steps
    accepted: int = 0  # ... and kept by them
    verify_steps: int = 0

    @staticmethod
    def _rate(n: int, s: float) -> float:
        return n / s if s > 0 else 0.0

    @property
    def prefill_tok_s(self) -> float:
        return self._rate(self.prefill_tokens, self.prefill_seconds)

    @property
    def decode_tok_s(self) -> float:
        return self._rate(self.decode_tokens, self.decode_seconds)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


@dataclass
class Generation:
    tokens: list[int]
    text: str
    stop_reason: str  # "eos" | "stop" | "length" | "capacity" | "callback" (serving: also "abort", "error")
    timings: Timings
    logprobs: list[TokenLogprobs] | None = None  # one per token, when the request asked for them
    error: PootError | None = None  # what failed, when stop_reason is "error"


OnToken = Callable[[int, str], GenerationControl | None]


def trace_step(handle: ModelHandle, shape: StepShape, shapes: dict[str, tuple[int, ...]] | None = None) -> Graph:
    """The family's graph for one step shape; a weight the family needs and the checkpoint lacks is a typed
    refusal."""
    tracer = Tracer(shape, handle.store().shapes() if shapes is None else shapes)
    try:
        handle.family.trace(handle.config(), tracer, shape)
    except KeyError as exc:
        raise Unsupported(Reason.SHAPE, f"{handle.family.name} step {shape}",
                          f"the checkpoint lacks weight {exc.args[0]}") from exc
    return tracer.graph


class Driver:
    def __init__(self, handle: ModelHandle, executor: Executor, options: DriverOptions | None = None) -> None:
        self.handle = handle
        self.executor = executor
        self.options = with_defaults(options or DriverOptions(), executor)
        if self.options.capacity < 1 or self.options.prefill_chunk < 1:
            raise RequestError("capacity and prefill_chunk must be positive")
        config = handle.config()
        if self.options.capacity > config.max_positions:
            raise CapacityError(f"capacity {self.options.capacity} exceeds the model's "
                                f"{config.max_positions} positions")
        self.config = config
        self.family = handle.family
        check_draft(self.options.draft, handle)  # before any tensor is read
        self.weights: Weights = executor.upload(handle.store())
        # Greedy picks on the device when the executor can (one id crosses to the host, not the logits).
        self._greedy = device_greedy(executor)
        self.masks = TokenMasks(executor)  # constraint masks, on the device where the executor can
        self._shapes = handle.store().shapes()
        self._programs: OrderedDict[StepShape, Program] = OrderedDict()
        self._state: dict[int, State] = {}  # rows -> executor state
        self._state_graph: dict[int, Graph] = {}  # rows -> the graph its state was allocated for
        self._recurrent: bool | None = None  # whether the model carries recurrent state (see `recurrent`)
        self._cached: list[int] = []  # tokens whose K/V row 0 holds, in order
        self._encode_prepared: dict[StepShape, tuple[Program, Graph, State]] = {}  # own states: see prepare_encode
        self.layout: Layout | None = None
        # MTP speculation reads the final hidden state of every position the target runs: then every step
        # carries it (StepShape.carry_hidden) to the proposer's `record`.
        self._hidden_sink: Callable[[int, np.ndarray], None] | None = None
        self._speculation: Speculation | None = make_speculation(self.options.draft, self)
        if self._speculation is not None:
            self._hidden_sink = getattr(self._speculation.proposer, "record", None)

    @classmethod
    def placed(cls, handle: ModelHandle, coordinator: Coordinator, placement: Placement,
               executor: Executor | None = None, options: DriverOptions | None = None, *,
               split: list[float] | None = None) -> Driver:
        """One model over the ranks of `coordinator` (this process is one of them and every rank makes the same
        calls): a layer pipeline or a tensor-parallel group, each rank fitted to its own device's free memory by
        capacity.Planner (refused, naming the device and the bytes, before any weight moves). `split`: the
        share of each rank (--tensor-split 3,1); the planner chooses without it. See poot_core.distributed."""
        from poot_core.distributed.placed import place

        return place(cls, handle, coordinator, placement, executor, options, split)

    # --- programs -------------------------------------------------------------------------------------
    def _trace(self, shape: StepShape) -> Graph:
        return trace_step(self.handle, shape, self._shapes)

    def program(self, shape: StepShape) -> Program:
        prog = self._programs.get(shape)
        if prog is not None:
            self._programs.move_to_end(shape)
            return prog
        graph = self._trace(shape)
        prog = self.executor.prepare(graph, self.weights)
        self._programs[shape] = prog
        while len(self._programs) > self.options.max_programs:
            self._programs.popitem(last=False)
        if shape.rows not in self._state:
            self._state[shape.rows] = self.executor.allocate_state(graph)
            self._state_graph[shape.rows] = graph
        return prog

    @property
    def recurrent(self) -> bool:
        """Whether the model's steps carry fixed-size recurrent state beside (or instead of) KV."""
        if self._recurrent is None:
            graph = self._state_graph.get(1) or self._trace(StepShape(1, 1, self.options.capacity))
            self._recurrent = graph.recurrent()
        return self._recurrent

    def serve(self, layout: Layout = Layout.CONTIGUOUS) -> Driver | ServingDriver:
        """CONTIGUOUS: this driver, one sequence at a time. PAGED: the serving driver (engine.py), many
        sequences per step over a pool of KV blocks."""
        if self._speculation is not None and self.recurrent:  # in either layout
            raise Unsupported(Reason.SHAPE, f"speculative decoding of {self.family.name}",
                              "its recurrent state cannot roll back rejected tokens; use DraftPolicy.OFF")
        if Layout(layout) is Layout.PAGED:
            from poot_core.driver.engine import ServingDriver

            return ServingDriver(self)
        self.layout = Layout.CONTIGUOUS
        # Prepare the decode step now, so an op the executor cannot run is refused before any work.
        self.program(self._step_shape(1, False))
        return self

    def _step_shape(self, tokens: int, all_logits: bool) -> StepShape:
        return StepShape(1, tokens, self.options.capacity, all_logits=all_logits,
                         carry_hidden=self._hidden_sink is not None)

    def _run(self, tokens: list[int], start: int, all_logits: bool) -> Output:
        prog = self.program(self._step_shape(len(tokens), all_logits))
        if start == 0 and self._state_graph[1].recurrent():  # a new sequence: its recurrent state starts at zeros
            self._state[1] = self.executor.allocate_state(self._state_graph[1])
        inputs = {"tokens": np.asarray([tokens], dtype=np.int64),
                  "positions": np.arange(start, start + len(tokens), dtype=np.int64)[None, :]}
        outputs = prog.run(self._state[1], inputs)
        if self._hidden_sink is not None:
            self._hidden_sink(start, self.executor.to_numpy(outputs[1])[0])
        return outputs[0]

    def _prefill(self, tokens: list[int], start: int, all_logits: bool = False) -> list[Output]:
        """Prefill `tokens` at positions from `start` in chunks; returns each chunk's output."""
        outs = []
        chunk = self.options.prefill_chunk
        for i in range(0, len(tokens), chunk):
            outs.append(self._run(tokens[i : i + chunk], start + i, all_logits))
        return outs

    # --- public ---------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget what the KV cache holds: the next request prefills its whole prompt."""
        self._cached = []

    def logits(self, token_ids: list[int]) -> np.ndarray:
        """float32 [positions, vocab]: the logits after every position of `token_ids`, from an empty cache."""
        ids = self._check_ids(token_ids)
        if len(ids) > self.options.capacity:
            raise CapacityError(f"{len(ids)} tokens do not fit the capacity of {self.options.capacity}")
        self._cached = []
        outs = self._prefill(ids, 0, all_logits=True)
        self._cached = list(ids)
        return np.concatenate([self.executor.to_numpy(o)[0] for o in outs], axis=0).astype(np.float32)

    def _check_ids(self, ids: list[int]) -> list[int]:
        ids = [int(i) for i in ids]
        if not ids:
            raise RequestError("the prompt is empty")
        vocab = self.config.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise RequestError(f"token ids outside the vocabulary of {vocab}: {bad[:5]}")
        return ids

    def generate(self, request: GenerateRequest, on_token: OnToken | None = None) -> Generation:
        if self.layout is None:
            self.serve()
        prompt = self._check_ids(request.prompt)
        if request.embeddings is not None:
            raise Unsupported(Reason.SHAPE, "prompt embeddings in the contiguous layout",
                              "they run in the serving engine: Driver.serve(Layout.PAGED)")
        cap = self.options.capacity
        if request.max_new < -1:
            raise RequestError(f"max_new must be -1 or >= 0, got {request.max_new}")
        if len(prompt) + max(request.max_new, 0) > cap or len(prompt) >= cap:
            raise CapacityError(f"prompt of {len(prompt)} tokens plus {request.max_new} new tokens does not fit "
                                f"the KV capacity of {cap}; raise the capacity (-c) or shorten the request")
        matcher = self.constraint_matcher(request)  # a constraint that does not compile: refused before any work
        timings = Timings()
        sampler = request.sampler
        text = self.handle.text()
        t0 = time.perf_counter()
        if self._hidden_sink is not None:
            self._cached = []  # the MTP layer reads the hidden state of every prompt position: run them all
        last, timings.reused_tokens = self._extend(prompt)
        timings.prefill_tokens = len(prompt) - timings.reused_tokens
        spec = self._speculation
        if spec is not None:
            spec.begin(prompt)  # a draft model prefills the prompt into its own cache here
        timings.prefill_seconds = time.perf_counter() - t0

        stop_ids = self.stop_ids(request)
        stops = StopMatcher(request.stops)
        stream = text.stream(prompt)
        history = list(prompt)
        generated: list[int] = []
        pieces: list[str] = []
        reason = "length"
        complete = False  # the constraint admits nothing more
        limit = request.max_new if request.max_new >= 0 else cap - len(prompt)
        decided: list[int] = []  # tokens a verify step already chose; their K/V is in the cache but the last's
        logprobs: list[TokenLogprobs] | None = None if request.logprobs is None else []
        decided_logprobs: list[TokenLogprobs] = []  # ... and their log-probabilities, when asked for
        t1 = time.perf_counter()
        while len(generated) < limit:
            if decided:
                token = decided.pop(0)
                if logprobs is not None:
                    logprobs.append(decided_logprobs.pop(0))
            elif logprobs is not None:
                row = self._last_row(last, matcher)
                token = sampler.sample(row, history, len(prompt))
                logprobs.append(token_logprobs(row, token, request.logprobs or 0))
            else:
                token = self.next_token(last, sampler, history, matcher, len(prompt))
            generated.append(token)
            history.append(token)
            if token in stop_ids:
                reason = "eos"
                break
            if matcher is not None:
                matcher.advance(token)
            emit, hit = stops.push(stream.push(token))
            pieces.append(emit)
            control = on_token(token, emit) if on_token else None
            if hit:
                reason = "stop"
                break
            if control is GenerationControl.BREAK:
                reason = "callback"
                break
            if matcher is not None and matcher.done:
                reason, complete = "eos", True
                break
            if len(generated) >= limit:
                break
            position = len(history) - 1
            if position >= cap:
                reason = "capacity"
                break
            timings.decode_tokens += 1
            if decided:
                continue
            if matcher is not None:
                matcher.prefetch()  # the next mask is computed while the step runs
            if spec is not None:
                spec.clock(time.perf_counter())
            proposal = None if spec is None else spec.propose(
                history, min(limit - len(generated), cap - position) - 1, sampler)
            if proposal is None:
                last = self.step(token, position)
                continue
            if matcher is not None:  # drafts past the first one the constraint refuses are not verified
                proposal = matcher.trim(proposal)
            decided, decided_logprobs = self._verify(proposal, position, sampler, history, matcher, len(prompt),
                                                     request.logprobs)
            spec.kept(len(proposal.tokens), len(decided) - 1)
            timings.verify_steps += 1
            timings.proposed += len(proposal.tokens)
            timings.accepted += len(decided) - 1
        else:
            if request.max_new < 0:
                reason = "capacity"
        if reason in ("length", "capacity", "callback", "eos") or complete:
            # the text the stream and the stop matcher still hold is part of the reply (a stop string never
            # completed); at eos only what the stream held for a clean-up of spaces, not an unfinished character
            whole = reason != "eos" or complete
            tail, _ = stops.push(stream.flush() if whole else stream.release())
            tail += stops.flush()
            if tail:
                pieces.append(tail)
                if on_token:
                    on_token(-1, tail)
        timings.decode_seconds = time.perf_counter() - t1
        return Generation(generated, "".join(pieces), reason, timings, logprobs)

    def stop_ids(self, request: GenerateRequest) -> set[int]:
        """The ids that end `request` as "eos": none under ignore_eos."""
        return set() if request.ignore_eos else self._eos_ids()

    def _eos_ids(self) -> set[int]:
        return set(self.handle.text().vocab.stop_ids) | set(self.config.eos_ids)

    def constraint_matcher(self, request: GenerateRequest) -> Matcher | None:
        """The request's constraint compiled against this model's tokenizer (None without one); RequestError
        when it does not compile. End-of-sequence is allowed where the constraint is complete, unless
        ignore_eos."""
        if request.constraint is None:
            return None
        return compile_constraint(request.constraint, self.handle.text().vocab.tokenizer, self.config.vocab_size,
                                  self._eos_ids(), allow_eos=not request.ignore_eos)

    def _extend(self, tokens: list[int]) -> tuple[Output, int]:
        """Make the cache hold `tokens`, running only what it does not hold yet (always at least the last
        token, for its logits). Returns the last position's output and how many tokens were reused."""
        reuse = self._reusable(tokens)
        self._cached = self._cached[:reuse]
        last = self._prefill(tokens[reuse:], reuse)[-1]
        self._cached = list(tokens)
        return last, reuse

    def _reusable(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` the cached state serves (at least the last is always run).
        Recurrent state holds all of the cached tokens at once: all of them, when `tokens` extends them, or
        none."""
        common = _common_prefix(self._cached, tokens)
        if self._cached and self.recurrent:
            return len(self._cached) if common == len(self._cached) < len(tokens) else 0
        return min(common, len(tokens) - 1)

    def prefill_cache(self, tokens: list[int]) -> Output:
        """The output after `tokens`, reusing the cached prefix they share (a draft model catching up)."""
        return self._extend(tokens)[0]

    def step(self, token: int, position: int) -> Output:
        """One decode step: `token` at `position`, which must be the cache's length."""
        last = self._run([token], position, False)
        self._cached.append(token)
        return last

    def _verify(self, proposal: Proposal, position: int, sampler: Sampler, history: list[int],
                matcher: Matcher | None = None, prompt_len: int | None = None,
                top: int | None = None) -> tuple[list[int], list[TokenLogprobs]]:
        """Run history's last token and the proposal as one step at `position`, read the logits of every
        position and return the tokens the rule keeps (see speculation.accept). The cache then holds the kept
        tokens; the rejected positions are dropped from the bookkeeping and written over by the next step. Under
        a constraint each position's logits are masked by the constraint's state after the drafts before it
        (the state itself is rolled back; the loop advances it by the kept tokens). With `top` (the request's
        logprobs), also each kept token's log-probabilities from its row."""
        tokens = [history[-1], *proposal.tokens]
        out = self._run(tokens, position, True)
        if matcher is None:
            logits = self.executor.to_numpy(out)[0]
        else:
            logits = self.masks.apply(out, np.arange(len(tokens)), matcher.masks_along(proposal.tokens)).host()
        decided = accept(logits, proposal, sampler, history, prompt_len)
        self._cached = self._cached[:position] + tokens[: len(decided)]
        if top is None:
            return decided, []
        return decided, [token_logprobs(logits[i], t, top) for i, t in enumerate(decided)]

    def next_token(self, logits: Output, sampler: Sampler, history: list[int], matcher: Matcher | None = None,
                   prompt_len: int | None = None) -> int:
        """Greedy picks on the device when the executor has greedy_token; otherwise the sampler on the host,
        over the logits the constraint allows (if any). prompt_len: where the prompt ends in `history` (the
        presence and frequency penalties need it)."""
        if matcher is None:
            if sampler.is_greedy and self._greedy is not None:
                return int(self._greedy(logits))
            return sampler.sample(self.executor.to_numpy(logits)[0, -1], history, prompt_len)
        masked = self.masks.apply(logits, [-1], matcher.row_mask()[None])
        if masked.on_device and sampler.is_greedy and self._greedy is not None:
            return int(self._greedy(masked.output))  # the packed mask crossed to the device, one id comes back
        return sampler.sample(masked.host()[-1], history, prompt_len)

    def _last_row(self, logits: Output, matcher: Matcher | None) -> np.ndarray:
        """The logits of the output's last position on the host, masked by the constraint (if any)."""
        if matcher is None:
            return self.executor.to_numpy(logits)[0, -1]
        return self.masks.apply(logits, [-1], matcher.row_mask()[None]).host()[-1]

    # --- encode: the final hidden state of every position (embeddings) ---------------------------------
    def prepare_encode(self, rows: int, longest: int) -> None:
        """Prepare the encode step for `rows` token rows of up to `longest` tokens. Each prepared shape has
        its own state, so encoding never disturbs the decode cache."""
        if rows < 1 or longest < 1:
            raise RequestError(f"prepare_encode needs positive rows and longest, got {rows} and {longest}")
        if longest > self.config.max_positions:
            raise CapacityError(f"{longest} tokens exceed the model's {self.config.max_positions} positions")
        programs = self._encode_prepared
        shape = StepShape(rows, longest, longest, hidden=True)
        if shape in programs:
            return
        graph = self._trace(shape)
        programs[shape] = (self.executor.prepare(graph, self.weights), graph, self.executor.allocate_state(graph))

    def encode(self, token_rows: list[list[int]], token_types: list[list[int]] | None = None) -> list[np.ndarray]:
        """float32 [len(row), D] per row: the final hidden state of every position. Runs the smallest
        prepared shape that holds the rows (padded at the end, masked out); never prepares one itself.
        `token_types` (segment ids, same lengths as the rows) matter to encoders that read them."""
        rows = [self._check_ids(r) for r in token_rows]
        if not rows:
            raise RequestError("encode needs at least one token row")
        if token_types is not None and [len(t) for t in token_types] != [len(r) for r in rows]:
            raise RequestError("token_types must have one id per token of each row")
        longest = max(len(r) for r in rows)
        fitting = [s for s in self._encode_prepared if s.rows >= len(rows) and s.tokens >= longest]
        if not fitting:
            prepared = ", ".join(f"{s.rows}x{s.tokens}" for s in self._encode_prepared) or "none"
            raise Unsupported(Reason.SHAPE, f"encode of {len(rows)} rows up to {longest} tokens",
                              f"no prepared encode shape holds it (prepared rows x tokens: {prepared}); "
                              "call prepare_encode first or send fewer or shorter rows")
        shape = min(fitting, key=lambda s: (s.rows * s.tokens, s.rows))
        prog, graph, state = self._encode_prepared[shape]
        if graph.recurrent():  # every row is a new sequence: recurrent state (hybrid families) starts at zeros
            state = self.executor.allocate_state(graph)
        inputs = self._encode_inputs(shape, rows, token_types)
        out = self.executor.to_numpy(prog.run(state, {k: v for k, v in inputs.items() if k in graph.inputs})[0])
        return [np.asarray(out[i, : len(r)], dtype=np.float32) for i, r in enumerate(rows)]

    def _encode_inputs(self, shape: StepShape, rows: list[list[int]],
                       token_types: list[list[int]] | None) -> dict[str, np.ndarray]:
        """tokens, positions, token_types and mask [R, T]; padding rows keep one real token so that no
        attention row is empty. Families whose position table starts later set params.position_offset."""
        tokens = np.zeros((shape.rows, shape.tokens), dtype=np.int64)
        types = np.zeros_like(tokens)
        mask = np.zeros_like(tokens)
        mask[:, 0] = 1
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = r
            mask[i, : len(r)] = 1
            if token_types is not None:
                types[i, : len(r)] = token_types[i]
        offset = int(getattr(self.config.params, "position_offset", 0) or 0)
        positions = np.broadcast_to(np.arange(shape.tokens, dtype=np.int64) + offset, tokens.shape).copy()
        return {"tokens": tokens, "positions": positions, "token_types": types, "mask": mask}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
