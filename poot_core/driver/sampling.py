"""Token sampling with llama.cpp's semantics.

Order of the chain, as llama.cpp's default: repeat penalty over the recent tokens, then top-k, top-p and
min-p on the untempered distribution, then temperature, then a draw. Temperature 0 is greedy (argmax),
and the repeat penalty still applies there.
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
    repeat_last_n: int = 64
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
        self.reset()

    @classmethod
    def greedy(cls) -> Sampler:
        return cls(temperature=0.0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 and self.repeat_penalty == 1.0

    def reset(self) -> None:
        """Restart the random stream: a fixed seed gives the same tokens again."""
        seed = self.seed if self.seed is not None else np.random.SeedSequence().entropy
        self._rng = np.random.default_rng(seed)

    def sample(self, logits: np.ndarray, history: list[int]) -> int:
        """logits: float [vocab] of the next position; history: the tokens so far (prompt + generated)."""
        ids, probs = self.distribution(logits, history)
        if self.temperature == 0.0:
            return int(ids[0])
        return self.draw(ids, probs)

    def distribution(self, logits: np.ndarray, history: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The distribution `sample` draws from: (token ids, float64 probabilities summing to 1), the ids
        in order of decreasing logit. Greedy (temperature 0) is the point mass on the argmax."""
        x = np.asarray(logits, dtype=np.float64).copy()
        if self.repeat_penalty != 1.0 and self.repeat_last_n != 0:
            recent = np.unique(np.asarray(history[-self.repeat_last_n :], dtype=np.int64))
            recent = recent[(recent >= 0) & (recent < x.size)]
            vals = x[recent]
            x[recent] = np.where(vals > 0, vals / self.repeat_penalty, vals * self.repeat_penalty)
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

    def draw(self, ids: np.ndarray, probs: np.ndarray) -> int:
        """One id drawn from (ids, probs) on this sampler's random stream."""
        return int(ids[self._rng.choice(probs.size, p=probs)])

    def uniform(self) -> float:
        """A uniform draw in [0, 1) on this sampler's random stream (the accept test of speculative decoding)."""
        return float(self._rng.random())


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()
