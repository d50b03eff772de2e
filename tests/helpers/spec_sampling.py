"""The sampled-speculation check shared by the contiguous and the paged speculation tests: a seeded sampler, the
exact joint distribution of the next few tokens enumerated from a driver's logits, and a chi-square fit."""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy import stats

from poot_core import Sampler


def sampler(seed: int) -> Sampler:
    return Sampler(temperature=0.8, top_k=3, top_p=1.0, min_p=0.0, repeat_penalty=1.3, seed=seed)


def exact_joint(driver: Any, prompt: list[int], n: int) -> dict[tuple[int, ...], float]:
    """P(next n tokens) of the plain sampler, enumerated in float64 from the model's logits: repeat penalty over
    the history, the 3 largest, softmax at temperature 0.8 (written out here, not the Sampler's code)."""
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(n):
        grown = {}
        for seq, p in joint.items():
            history = prompt + list(seq)
            x = driver.logits(history)[-1].astype(np.float64)
            recent = np.unique(history[-64:])
            x[recent] = np.where(x[recent] > 0, x[recent] / 1.3, x[recent] * 1.3)
            top = np.argsort(-x)[:3]
            e = np.exp((x[top] - x[top].max()) / 0.8)
            for t, q in zip(top, e / e.sum(), strict=True):
                grown[(*seq, int(t))] = p * q
        joint = grown
    return joint


def chi_square_p(counts: dict[tuple[int, ...], int], joint: dict[tuple[int, ...], float], draws: int) -> float:
    """Goodness of fit of the observed outcomes to `joint`; outcomes expected fewer than 5 times, and any
    outside joint's support, pooled into one bin."""
    keys = [k for k in sorted(joint, key=lambda k: -joint[k]) if joint[k] * draws >= 5]
    expected = np.array([joint[k] * draws for k in keys] + [draws - sum(joint[k] * draws for k in keys)])
    observed = np.array([counts.get(k, 0) for k in keys] + [draws - sum(counts.get(k, 0) for k in keys)])
    return float(stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue)
