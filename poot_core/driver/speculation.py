"""Speculative decoding: the draft policies, their proposers, and the rule that verifies a proposal.

A proposer guesses the next few tokens; the target runs its last token and the guesses as one step whose
logits at every position are read, and the rule keeps the longest prefix the target agrees with plus one token
of the target's own. Greedy: a guess is kept when it equals the target's pick, so the output is the
non-speculative output token for token. Sampling: the standard rejection rule (keep a guess d with probability
min(1, p(d)/q(d)), else draw from the normalized max(0, p - q)), so every token is distributed exactly as the
target's sampler would draw it; p is the Sampler's own distribution (repeat penalty, top-k, top-p, min-p,
temperature). Prompt lookup proposes deterministically: q is a point mass and the rule keeps d with
probability p(d).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeAlias

import numpy as np

from poot_core.driver.sampling import Sampler
from poot_core.errors import Reason, RequestError, Unsupported
from poot_core.graph import StepShape, Tracer

if TYPE_CHECKING:
    from poot_core.checkpoint.handle import ModelHandle
    from poot_core.driver.core import Driver
    from poot_core.executor import Executor, Program, State

Distribution: TypeAlias = tuple[np.ndarray, np.ndarray]  # (ids, probabilities), as Sampler.distribution


# --- the policies (DriverOptions.draft) ---------------------------------------------------------------------
@dataclass(frozen=True)
class Off:
    """No speculation: one token per decode step."""

    def carry_window(self) -> int | None:
        return None


@dataclass(frozen=True)
class PromptLookup:
    """Propose the tokens that followed the latest earlier occurrence of the last n tokens (n from max_ngram
    down to min_ngram) in the prompt and the output so far (repeated when the match ends fewer than k
    tokens before the end). k: the most tokens proposed at once (15: a verify step of 16 tokens, the widest the
    CPU executor computes as decode rows, packed_linear.DECODE_ROWS; a copied passage is often kept 10-16 tokens
    at a time); how many are proposed follows the measured costs and how often proposals from a match of that
    length were kept (Speculation). min_k: a proposal shorter than this is dropped and the step is a plain
    decode step."""

    max_ngram: int = 3
    min_ngram: int = 1
    k: int = 15
    min_k: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise RequestError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {self.min_ngram} and "
                               f"{self.max_ngram}")
        _check_k(self.k, self.min_k)

    def carry_window(self) -> int | None:
        return None


@dataclass(frozen=True, eq=False)
class DraftModel:
    """A smaller model of the same vocabulary proposes k tokens, on its own KV cache and on `executor` (None:
    the target's executor)."""

    handle: ModelHandle
    k: int = 8
    min_k: int = 1
    executor: Executor | None = None

    def __post_init__(self) -> None:
        _check_k(self.k, self.min_k)

    def carry_window(self) -> int | None:
        return None


@dataclass(frozen=True)
class Mtp:
    """The family's multi-token-prediction layers propose k tokens from the target's last hidden state."""

    k: int = 1
    min_k: int = 1

    def __post_init__(self) -> None:
        _check_k(self.k, self.min_k)

    def carry_window(self) -> int | None:
        return 1


Draft: TypeAlias = Off | PromptLookup | DraftModel | Mtp


class DraftPolicy:
    """The choices for DriverOptions.draft: DraftPolicy.OFF, DraftPolicy.PromptLookup(...),
    DraftPolicy.DraftModel(handle, k) and DraftPolicy.Mtp(k)."""

    OFF = Off()
    PromptLookup = PromptLookup
    DraftModel = DraftModel
    Mtp = Mtp


def _check_k(k: int, min_k: int) -> None:
    if k < 1 or not 0 <= min_k <= k:
        raise RequestError(f"a draft policy needs k >= 1 and 0 <= min_k <= k, got k={k}, min_k={min_k}")


def check_draft(draft: Draft, target: ModelHandle) -> None:
    """Refuse a policy that cannot work with `target`, from configs and tokenizers only (no tensor is read)."""
    if isinstance(draft, DraftModel):
        check_same_vocabulary(target, draft.handle)
    elif isinstance(draft, Mtp):
        check_mtp(target)
    elif not isinstance(draft, Off | PromptLookup):
        raise RequestError(f"DriverOptions.draft must be a DraftPolicy, got {draft!r}")


def check_mtp(target: ModelHandle) -> None:
    """The checkpoint must have multi-token-prediction layers its family traces as a step (StepShape.mtp),
    with every weight that step reads: checked on the config and the stored shapes (no tensor is read)."""
    config = target.config()
    what = f"MTP speculation on {config.architecture}"
    if not int(getattr(config.params, "mtp_layers", 0) or 0):
        raise Unsupported(Reason.SHAPE, what, "the checkpoint has no multi-token-prediction (nextn) layers; use "
                          "prompt lookup or a draft model")
    shape = StepShape(1, 1, 1, mtp=True)
    tracer = Tracer(shape, target.store().shapes())
    try:
        target.family.trace(config, tracer, shape)
    except KeyError as exc:
        raise Unsupported(Reason.SHAPE, what, f"the checkpoint lacks the nextn layer's weight {exc.args[0]}; use "
                          "prompt lookup or a draft model") from exc
    if "hidden" not in tracer.graph.inputs or len(tracer.graph.outputs) != 2:
        raise Unsupported(Reason.SHAPE, what, f"the {target.family.name} family does not trace its nextn layers "
                          "as a draft step; use prompt lookup or a draft model")


def check_same_vocabulary(target: ModelHandle, draft: ModelHandle) -> None:
    """A draft model must give every id the same token as the target, or its proposals mean other text."""
    a, b = target.config().vocab_size, draft.config().vocab_size
    if a != b:
        raise RequestError(f"the draft model's vocabulary has {b} entries and the target's {a}: a draft must "
                           "share the target's tokenizer")
    ta, tb = target.text().vocab.tokenizer, draft.text().vocab.tokenizer
    if ta.get_vocab(with_added_tokens=True) != tb.get_vocab(with_added_tokens=True):
        raise RequestError("the draft model's tokenizer maps ids to other tokens than the target's: a draft "
                           "must share the target's tokenizer")


# --- proposers ------------------------------------------------------------------------------------------
@dataclass
class Proposal:
    tokens: list[int]
    # The proposer's distribution each token was drawn from; None: chosen deterministically (a point mass).
    q: list[Distribution] | None = None


class Proposer(Protocol):
    def begin(self, prompt: list[int]) -> None:
        """A new request starts with `prompt` (already in the target's cache)."""

    def grade(self, history: list[int]) -> int:
        """What kind of proposal would follow `history`, before it is made: proposals of one grade share an
        estimate of how often their tokens are kept (prompt lookup: the length of the n-gram matched, 0 for
        none; a model proposes at one grade, 0)."""

    def propose(self, history: list[int], k: int, sampler: Sampler) -> Proposal:
        """At most k tokens to follow `history` (prompt and output so far)."""


class LookupProposer:
    """Prompt lookup over an index of every n-gram of the history to where it last ended, kept up to date as
    the history grows (a new request rebuilds it)."""

    def __init__(self, policy: PromptLookup) -> None:
        self.policy = policy
        self._seen: list[int] = []
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> end of its latest occurrence with a successor

    def begin(self, prompt: list[int]) -> None:
        self._seen, self._ends = [], {}

    def _index(self, history: list[int]) -> None:
        seen = self._seen
        if history[: len(seen)] != seen:
            seen, self._ends = [], {}
        lo, hi = self.policy.min_ngram, self.policy.max_ngram
        # n-grams ending at e < len(history) have a successor (history[e]); index those not yet indexed.
        for end in range(max(len(seen), 1), len(history)):
            for n in range(lo, min(hi, end) + 1):
                self._ends[tuple(history[end - n : end])] = end
        self._seen = list(history)

    def _match(self, history: list[int]) -> tuple[int, int]:
        """(n, end): the longest n-gram ending the history that occurred before, and where its latest earlier
        occurrence ends; (0, 0) for none."""
        self._index(history)
        for n in range(min(self.policy.max_ngram, len(history)), self.policy.min_ngram - 1, -1):
            end = self._ends.get(tuple(history[-n:]))
            if end is not None:
                return n, end
        return 0, 0

    def grade(self, history: list[int]) -> int:
        return self._match(history)[0]

    def propose(self, history: list[int], k: int, sampler: Sampler) -> Proposal:
        n, end = self._match(history)
        if not n:
            return Proposal([])
        # What followed the match; a match closer to the end than k repeats that stretch, as a periodic text (a
        # run of one token, a repeated line) would go on.
        period = len(history) - end
        return Proposal([history[end + j % period] for j in range(k)])


class DraftModelProposer:
    """A draft model on its own Driver: it catches up with the accepted history (its cache keeps the longest
    prefix it shares), then decodes k tokens, greedily or drawing from its own sampler distribution."""

    def __init__(self, policy: DraftModel, target: Driver, driver: Driver | None = None) -> None:
        """driver: a draft model's Driver to share (the serving engine's sequences share one), else a new one."""
        from poot_core.driver.core import Driver, DriverOptions

        if driver is None:
            options = DriverOptions(capacity=target.options.capacity, prefill_chunk=target.options.prefill_chunk,
                                    max_programs=target.options.max_programs)
            driver = Driver(policy.handle, policy.executor or target.executor, options).serve()
        self.driver = driver
        self._prompt_len = 0

    def begin(self, prompt: list[int]) -> None:
        self._prompt_len = len(prompt)  # the presence and frequency penalties count only what follows it
        self.driver.prefill_cache(prompt)

    def grade(self, history: list[int]) -> int:
        return 0

    def propose(self, history: list[int], k: int, sampler: Sampler) -> Proposal:
        d = self.driver
        last = d.prefill_cache(history)
        seq = list(history)
        tokens: list[int] = []
        q: list[Distribution] | None = None if sampler.temperature == 0.0 else []
        for i in range(k):
            if q is None:
                token = d.next_token(last, sampler, seq, prompt_len=self._prompt_len)
            else:
                dist = sampler.distribution(d.executor.to_numpy(last)[0, -1], seq, self._prompt_len)
                token = sampler.draw(*dist)
                q.append(dist)
            tokens.append(token)
            seq.append(token)
            if i + 1 < k:
                last = d.step(token, len(seq) - 1)
        return Proposal(tokens, q)


class MtpProposer:
    """The target's own multi-token-prediction layer proposes: at position i it reads the token at i + 1 and
    the target's final hidden state at i, and predicts the token at i + 2; each further draft token reads the
    one before it and the layer's own output hidden state.

    The layer has its own KV cache, filled in order: before a proposal it catches up over every position the
    target ran since the last one (the target's steps carry their hidden states here through `record`), so its
    cache always holds the accepted history. Draft tokens past the first write positions the next catch-up
    writes over: a rejection costs no copy."""

    def __init__(self, policy: Mtp, target: Driver) -> None:
        self.target = target
        self._programs: dict[int, Program] = {}
        self._state: State | None = None
        self._valid = 0  # positions i whose entry (token i + 1, hidden i) the layer's cache holds
        self._hidden: dict[int, np.ndarray] = {}  # the target's final hidden state by position, not read yet
        self._program(1)  # an op the executor cannot run is refused now, before any work

    def _program(self, tokens: int) -> Program:
        prog = self._programs.get(tokens)
        if prog is None:
            t = self.target
            graph = t._trace(StepShape(1, tokens, t.options.capacity, mtp=True))
            prog = t.executor.prepare(graph, t.weights)
            if self._state is None:
                self._state = t.executor.allocate_state(graph)
            if len(self._programs) >= t.options.max_programs:
                self._programs.pop(next(iter(self._programs)))
            self._programs[tokens] = prog
        return prog

    def record(self, start: int, hidden: np.ndarray) -> None:
        """The target ran positions start.. and these are their final hidden states [T, D]."""
        for j, row in enumerate(hidden):
            self._hidden[start + j] = row

    def begin(self, prompt: list[int]) -> None:
        self._valid = 0  # the target ran the whole prompt (it reuses no cached prefix under MTP)
        self._hidden = {i: h for i, h in self._hidden.items() if i < len(prompt)}

    def grade(self, history: list[int]) -> int:
        return 0

    def _run(self, tokens: list[int], start: int, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Run the layer over `tokens` at positions from `start`; the last position's logits and hidden."""
        ex = self.target.executor
        inputs = {"tokens": np.asarray([tokens], dtype=np.int64),
                  "positions": np.arange(start, start + len(tokens), dtype=np.int64)[None, :],
                  "hidden": np.ascontiguousarray(hidden[None], dtype=np.float32)}
        logits, out = self._program(len(tokens)).run(self._state, inputs)
        return ex.to_numpy(logits)[0, -1], ex.to_numpy(out)[0, -1]

    def propose(self, history: list[int], k: int, sampler: Sampler) -> Proposal:
        n = len(history) - 1  # the last token's position: the target has not run it yet
        chunk = self.target.options.prefill_chunk
        logits = hidden = None
        for start in range(self._valid, n, chunk):  # catch up over positions valid .. n - 1
            stop = min(start + chunk, n)
            rows = np.stack([self._hidden.pop(i) for i in range(start, stop)])
            logits, hidden = self._run(history[start + 1 : stop + 1], start, rows)
        self._valid = n
        if logits is None:  # nothing new since the last proposal (cannot happen in the decode loop)
            return Proposal([])
        tokens = [int(np.argmax(logits))]
        while len(tokens) < k:
            logits, hidden = self._run(tokens[-1:], n + len(tokens) - 1, hidden[None])
            tokens.append(int(np.argmax(logits)))
        return Proposal(tokens)


def make_speculation(draft: Draft, target: Driver) -> Speculation | None:
    """The per-driver speculation state for a policy; None for OFF."""
    if isinstance(draft, PromptLookup):
        return Speculation(LookupProposer(draft), draft.k, draft.min_k)
    if isinstance(draft, DraftModel):
        return Speculation(DraftModelProposer(draft, target), draft.k, draft.min_k)
    if isinstance(draft, Mtp):
        return Speculation(MtpProposer(draft, target), draft.k, draft.min_k)
    return None


# --- the verify rule -----------------------------------------------------------------------------------------
def accept(logits: np.ndarray, proposal: Proposal, sampler: Sampler, history: list[int],
           prompt_len: int | None = None) -> list[int]:
    """The tokens to emit after one verify step: the kept prefix of the proposal, then one token of the
    target's own. logits [len(proposal) + 1, vocab]: row i is the target's next-token logits after the history
    and the first i proposed tokens; the first prompt_len tokens of history are the prompt."""
    drafts = proposal.tokens
    if sampler.temperature == 0.0:  # deterministic picks (greedy, with or without repeat penalty)
        out: list[int] = []
        for i in range(len(drafts) + 1):
            pick = (int(np.argmax(logits[i])) if sampler.is_greedy
                    else sampler.sample(logits[i], history + drafts[:i], prompt_len))
            out.append(pick)
            if i == len(drafts) or pick != drafts[i]:
                return out
    out = []
    for i, d in enumerate(drafts):
        p_ids, p = sampler.distribution(logits[i], history + drafts[:i], prompt_len)
        p_d = float(p[p_ids == d].sum())
        if proposal.q is None:
            q_ids, q = np.array([d]), np.ones(1)
        else:
            q_ids, q = proposal.q[i]
        q_d = float(q[q_ids == d].sum())
        if sampler.uniform() < min(1.0, p_d / q_d):
            out.append(d)
            continue
        out.append(_draw_residual(sampler, p_ids, p, q_ids, q))
        return out
    out.append(sampler.draw(*sampler.distribution(logits[len(drafts)], history + drafts, prompt_len)))
    return out


def _few_widths(width: int) -> bool:
    """Whether a verify step of this width is one of the few the length choice takes (2, 3, 4, 6, 8, 12, 16, ...:
    powers of two and three times them), besides those of min_k and k: each width is a program of its own, and
    a few keep the driver's bounded cache of prepared programs from evicting and re-tracing them."""
    base = width // 3 if width % 3 == 0 else width
    return base & (base - 1) == 0


def _draw_residual(sampler: Sampler, p_ids: np.ndarray, p: np.ndarray, q_ids: np.ndarray,
                   q: np.ndarray) -> int:
    """A draw from max(0, p - q), normalized: where the target puts more mass than the proposer did."""
    q_on_p = np.zeros_like(p)
    index = {int(t): j for j, t in enumerate(p_ids)}
    for t, mass in zip(q_ids, q, strict=True):
        j = index.get(int(t))
        if j is not None:
            q_on_p[j] = mass
    residual = np.maximum(p - q_on_p, 0.0)
    total = residual.sum()
    if not total > 0:  # p == q up to rounding: the rejection had probability ~0; p itself is the residual
        return sampler.draw(p_ids, p)
    return sampler.draw(p_ids, residual / total)


@dataclass
class Speculation:
    """A driver's proposer, and how many tokens to ask it for, chosen by expected speed.

    With a the estimated chance that the target keeps a proposed token (decayed counts of kept and rejected
    tokens, a geometric model), a proposal of k tokens yields 1 + a + ... + a^k tokens for k times the measured
    cost of proposing a token plus the measured cost of a target step of width k + 1; the k of most tokens per
    second wins, k = 0 being a plain decode step. The estimate is kept per grade of proposal (Proposer.grade):
    prompt lookup's proposals from a 3-gram match are kept far more often than from a 1-gram one (on SmolLM2
    rewriting a code file, runs of 10-16 tokens against mostly none), so a long match gets a long proposal and a
    short one a short proposal or none. The length grows up to twice the widest step measured at a time, so the
    costs are learnt from short proposals up, and a step not measured yet is taken to cost what the dearest
    narrower one did (a wider step never costs less). Only a few widths are taken (2, 3, 4, 6, 8, 12, 16, and
    those of min_k and k), so that their programs stay prepared. Where widths up to some size cost about a
    decode step and wider ones several, the length settles there; where proposals are rarely kept, or proposing costs
    about what it saves (a draft model as slow as the target), at none (a probe of one token every few decode
    steps keeps the estimate current). Lengths stay within [min_k, k]: min_k = k fixes them.

    Sampled requests keep their lengths a function of the tokens alone, so that a seed gives the same tokens
    on every run (the number of random draws follows the proposals): Hugging Face's heuristic schedule, 2
    more after a proposal kept whole, else one past what was kept. `scheduled` takes that schedule for greedy
    requests too (the serving engine, where a step's cost is shared by many sequences)."""

    proposer: Proposer
    k: int
    min_k: int
    scheduled: bool = False
    kept_tokens: dict[int, float] = field(default_factory=dict)  # grade -> decayed counts (from PRIOR)
    rejected: dict[int, float] = field(default_factory=dict)
    steps: dict[int, float] = field(default_factory=dict)  # target step width -> seconds (moving average)
    per_proposed: float | None = None  # seconds of proposing one token (moving average)
    idle: int = 0  # decode steps since the last proposal
    schedule: int = 0  # the sampled requests' length
    _width: int = 0  # the width of the step under way
    _proposing: float = 0.0  # the seconds of its proposal
    _since: float | None = None
    _grade: int = 0  # the grade of the proposal under way

    DECAY = 0.9
    PROBE_EVERY = 8
    PRIOR = (3.0, 1.0)  # kept and rejected counts of a grade not seen yet: a = 0.75

    def begin(self, prompt: list[int]) -> None:
        self._since, self._width, self.schedule = None, 0, self.k
        self.proposer.begin(prompt)

    def _step_cost(self, width: int) -> float:
        known = self.steps.get(width)
        if known is not None:
            return known
        return max((c for w, c in self.steps.items() if w < width), default=min(self.steps.values()))

    def acceptance(self, grade: int) -> float:
        """The estimated chance that a proposed token of this grade is kept."""
        kept, rejected = self.kept_tokens.get(grade, self.PRIOR[0]), self.rejected.get(grade, self.PRIOR[1])
        return kept / (kept + rejected)

    def length(self, grade: int = 0) -> int:
        """The proposal length of most expected tokens per second (0: a plain decode step)."""
        widest = max(self.steps, default=1)
        limit = min(self.k, max(self.min_k, 2 * widest - 1))  # steps up to twice the widest measured
        if not self.steps or self.per_proposed is None:
            return limit
        a = self.acceptance(grade)
        best, best_rate, expected = 0, 1.0 / self._step_cost(1), 1.0
        for k in range(1, limit + 1):
            expected += a**k
            if k < self.min_k or not (k in (self.min_k, self.k) or _few_widths(k + 1)):
                continue
            rate = expected / (k * self.per_proposed + self._step_cost(k + 1))
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def clock(self, now: float) -> None:
        """A decision point of the decode loop: the time since the last one was the last step's (its
        proposal, step and picks)."""
        if self._since is not None and self._width:
            seconds = max(now - self._since - self._proposing, 1e-9)
            old = self.steps.get(self._width)
            self.steps[self._width] = seconds if old is None else 0.7 * old + 0.3 * seconds
        self._since, self._proposing = now, 0.0

    def propose(self, history: list[int], room: int, sampler: Sampler) -> Proposal | None:
        """A proposal of at most `room` tokens, or None where a plain decode step is better."""
        grade = self._grade = self.proposer.grade(history)
        k = self.length(grade) if sampler.temperature == 0.0 and not self.scheduled else self.schedule
        if k == 0 and self.idle + 1 >= self.PROBE_EVERY:
            k = 1
        k = min(max(k, self.min_k) if k else 0, room)
        proposal = None
        if k >= max(self.min_k, 1):
            t0 = time.perf_counter()
            proposal = self.proposer.propose(history, k, sampler)
            self._proposing = time.perf_counter() - t0
            per = self._proposing / k
            self.per_proposed = per if self.per_proposed is None else 0.7 * self.per_proposed + 0.3 * per
        if proposal is None or len(proposal.tokens) < max(self.min_k, 1):
            self.idle += 1
            self._width = 1
            return None
        self.idle = 0
        return proposal

    def kept(self, proposed: int, accepted: int) -> None:
        self._width = proposed + 1
        g = self._grade
        self.kept_tokens[g] = self.DECAY * self.kept_tokens.get(g, self.PRIOR[0]) + accepted
        self.rejected[g] = self.DECAY * self.rejected.get(g, self.PRIOR[1]) + (accepted < proposed)
        self.schedule = min(self.k, self.schedule + 2) if accepted == proposed else max(1, accepted + 1)
