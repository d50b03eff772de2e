"""Token sampling with llama.cpp's semantics, and the logit processing every sampler shares.

Order of the chain, as llama.cpp's default: the logit bias and the penalties (`penalize`), then top-k, top-p
and min-p on the untempered distribution, then temperature, then a draw. Temperature 0 is greedy (argmax), and
the bias and penalties still apply there.

Logit bias (OpenAI's `logit_bias`): token id -> a value in [-100, 100] added to that token's logit, before the
penalties (vLLM applies its logit-bias processor before them too). An id outside the logits is a RequestError.

Penalties: the repeat penalty (llama.cpp's and transformers' `repetition_penalty`: positive logits divided by
it, negative ones multiplied) over the last `repeat_last_n` tokens of prompt and output (-1: all of them);
OpenAI's presence and frequency penalties over the generated tokens only:
logit[t] -= frequency_penalty * count(t) + presence_penalty * (count(t) > 0). They need to know where the
prompt ends, so callers pass `prompt_len` whenever either is set.

`token_logprobs` gives a token's log-probability and the top alternatives of the model's own distribution
(log-softmax of the logits as the sampler received them, before penalties and temperature): vLLM's default
`raw_logprobs`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from poot_core.errors import RequestError


@dataclass
class Sampler:
    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    seed: int | None = None
    repeat_last_n: int = 64  # -1: the whole history (transformers' and vLLM's repetition_penalty)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    _rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.temperature < 0 or not np.isfinite(self.temperature):
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top-p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise RequestError(f"min-p must be in [0, 1], got {self.min_p}")
        if self.top_k < 0:
            raise RequestError(f"top-k must be >= 0 (0 disables it), got {self.top_k}")
        if self.repeat_penalty <= 0:
            raise RequestError(f"repeat penalty must be > 0, got {self.repeat_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise RequestError(f"{name.replace('_', ' ')} must be in [-2, 2], got {value}")
        for token, bias in (self.logit_bias or {}).items():
            if isinstance(token, bool) or not isinstance(token, int | np.integer) or token < 0:
                raise RequestError(f"logit bias token ids must be integers >= 0, got {token!r}")
            if not -100.0 <= bias <= 100.0:  # also refuses NaN
                raise RequestError(f"logit bias values must be in [-100, 100], got {bias} for token {token}")
        self.reset()

    @classmethod
    def greedy(cls) -> Sampler:
        return cls(temperature=0.0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 and not self.penalized

    @property
    def penalized(self) -> bool:
        """Whether `penalize` changes the logits (then greedy is not the raw argmax)."""
        return (self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias))

    @property
    def needs_prompt_len(self) -> bool:
        """The presence and frequency penalties count only generated tokens: the caller must say where the
        prompt ends."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def reset(self) -> None:
        """Restart the random stream: a fixed seed gives the same tokens again."""
        seed = self.seed if self.seed is not None else np.random.SeedSequence().entropy
        self._rng = np.random.default_rng(seed)

    def sample(self, logits: np.ndarray, history: list[int], prompt_len: int | None = None) -> int:
        """logits: float [vocab] of the next position; history: the tokens so far (prompt + generated), of
        which the first prompt_len are the prompt."""
        ids, probs = self.distribution(logits, history, prompt_len)
        if self.temperature == 0.0:
            return int(ids[0])
        return self.draw(ids, probs)

    def distribution(self, logits: np.ndarray, history: list[int],
                     prompt_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The distribution `sample` draws from: (token ids, float64 probabilities summing to 1), the ids
        in order of decreasing logit. Greedy (temperature 0) is the point mass on the argmax."""
        x = self.penalize(logits, history, prompt_len)
        if self.temperature == 0.0:
            return np.array([int(np.argmax(x))]), np.ones(1)
        ids = np.arange(x.size)
        if self.top_k > 0 and self.top_k < x.size:
            keep = np.argpartition(-x, self.top_k - 1)[: self.top_k]
            ids, x = ids[keep], x[keep]
        order = np.argsort(-x, kind="stable")
        ids, x = ids[order], x[order]
        probs = _softmax(x)
        if self.top_p < 1.0:
            cut = int(np.searchsorted(np.cumsum(probs), self.top_p) + 1)
            ids, x, probs = ids[:cut], x[:cut], probs[:cut]
        if self.min_p > 0.0:
            keep = probs >= self.min_p * probs[0]
            ids, x = ids[keep], x[keep]
        return ids, _softmax(x / self.temperature)

    def penalize(self, logits: np.ndarray, history: list[int], prompt_len: int | None = None) -> np.ndarray:
        """The logits (float64, a copy) after the logit bias, then the repeat, frequency and presence penalties."""
        x = np.asarray(logits, dtype=np.float64).copy()
        if self.logit_bias:
            ids = np.fromiter(self.logit_bias.keys(), dtype=np.int64, count=len(self.logit_bias))
            if ids.max() >= x.size:
                raise RequestError(f"logit bias names token {int(ids.max())}, outside the vocabulary of {x.size}")
            x[ids] += np.fromiter(self.logit_bias.values(), dtype=np.float64, count=ids.size)
        if self.repeat_penalty != 1.0 and self.repeat_last_n != 0:
            window = history if self.repeat_last_n < 0 else history[-self.repeat_last_n :]
            recent = np.unique(np.asarray(window, dtype=np.int64))
            recent = recent[(recent >= 0) & (recent < x.size)]
            vals = x[recent]
            x[recent] = np.where(vals > 0, vals / self.repeat_penalty, vals * self.repeat_penalty)
        if self.needs_prompt_len:
            if prompt_len is None:
                raise ValueError("presence and frequency penalties need prompt_len (where the prompt ends)")
            generated = np.asarray(history[prompt_len:], dtype=np.int64)
            generated = generated[(generated >= 0) & (generated < x.size)]
            ids, counts = np.unique(generated, return_counts=True)
            x[ids] -= self.frequency_penalty * counts + self.presence_penalty
        return x

    def draw(self, ids: np.ndarray, probs: np.ndarray) -> int:
        """One id drawn from (ids, probs) on this sampler's random stream."""
        return int(ids[self._rng.choice(probs.size, p=probs)])

    def uniform(self) -> float:
        """A uniform draw in [0, 1) on this sampler's random stream (the accept test of speculative decoding)."""
        return float(self._rng.random())


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's log-probability and the `len(top)` most likely tokens (best first), from the
    log-softmax of the logits the sampler received (-inf where a constraint refused a token)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits: np.ndarray, token: int, top: int = 0) -> TokenLogprobs:
    x = np.asarray(logits, dtype=np.float64)
    finite = x[np.isfinite(x)]
    peak = finite.max() if finite.size else 0.0
    logp = x - (peak + np.log(np.exp(finite - peak).sum()))
    best: list[tuple[int, float]] = []
    if top > 0:
        k = min(top, x.size)
        ids = np.argpartition(-logp, k - 1)[:k]
        ids = ids[np.lexsort((ids, -logp[ids]))]  # by decreasing log-probability, ties by id
        best = [(int(i), float(logp[i])) for i in ids]
    return TokenLogprobs(int(token), float(logp[token]), best)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()
