"""OpenAI's logit_bias in the one sampler the Driver, the serving engine and speculation share: each token is the
argmax of a float64 numpy reimplementation (logits + bias, then the repetition penalty, as vLLM orders them) on
the logits the engine recorded for it; the contiguous Driver and prompt-lookup speculation pick the same tokens;
a bias changes the sampled distribution exactly as the formula says."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.sampling_drivers import PROMPT, prompt_lookup, serve_recorded, solo_and_engine
from poot_core import GenerateRequest, RequestError, Sampler

NEW = 16


@pytest.fixture(scope="module")
def drivers(tiny_checkpoint):
    return solo_and_engine(tiny_checkpoint("llama", torch.float32))


def _reference(logits: np.ndarray, bias: dict[int, float], history: list[int], repetition: float) -> np.ndarray:
    x = np.array(logits, dtype=np.float64)
    for t, b in bias.items():
        x[t] += b
    for t in set(history):
        x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    return x


def _bias(solo) -> dict[int, float]:
    """Push the plain reply's first tokens down and two others up: the biased reply must differ."""
    plain = solo.generate(GenerateRequest(PROMPT, NEW, Sampler.greedy(), ignore_eos=True)).tokens
    bias = {t: -6.0 for t in plain[:3]}
    bias.update({11: 4.0, 57: 3.5})
    return bias


@pytest.mark.parametrize("repetition", [1.0, 1.4])
def test_greedy_with_bias_follows_the_formula(drivers, repetition):
    solo, engine = drivers
    bias = _bias(solo)
    sampler = Sampler(temperature=0.0, logit_bias=bias, repeat_penalty=repetition, repeat_last_n=-1)
    assert not sampler.is_greedy  # the device's argmax of raw logits would ignore the bias
    served, recorded = serve_recorded(engine, GenerateRequest(PROMPT, NEW, sampler, ignore_eos=True))
    assert len(recorded) == len(served.tokens) == NEW
    history = list(PROMPT)
    for row, token in zip(recorded, served.tokens, strict=True):
        assert token == int(np.argmax(_reference(row, bias, history, repetition)))
        history.append(token)
    assert solo.generate(GenerateRequest(PROMPT, NEW, sampler, ignore_eos=True)).tokens == served.tokens
    plain = solo.generate(GenerateRequest(PROMPT, NEW, Sampler.greedy(), ignore_eos=True)).tokens
    assert plain != served.tokens


def test_speculation_keeps_the_bias(drivers):
    solo, _ = drivers
    spec = prompt_lookup(solo)
    prompt = PROMPT[:6] * 4
    sampler = Sampler(temperature=0.0, logit_bias={PROMPT[0]: -3.0, 42: 2.0})
    want = solo.generate(GenerateRequest(prompt, NEW, sampler, ignore_eos=True))
    got = spec.generate(GenerateRequest(prompt, NEW, sampler, ignore_eos=True))
    assert got.timings.verify_steps > 0
    assert got.tokens == want.tokens


def test_biased_distribution_at_a_temperature():
    rng = np.random.default_rng(5)
    row = rng.normal(size=300).astype(np.float32) * 2
    bias = {3: 100.0, 7: -100.0, 250: 1.5}
    history = [*PROMPT, 3, 9]
    sampler = Sampler(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.1, repeat_last_n=-1,
                      logit_bias=bias)
    ids, probs = sampler.distribution(row, history, len(PROMPT))
    ref = _reference(row, bias, history, 1.1) / 0.8
    ref = np.exp(ref - ref.max())
    ref /= ref.sum()
    np.testing.assert_allclose(probs, ref[ids], rtol=1e-12, atol=1e-15)


def test_bias_settings_are_checked():
    for bias in ({1: 100.5}, {1: float("nan")}, {-1: 1.0}, {"5": 1.0}):
        with pytest.raises(RequestError):
            Sampler(logit_bias=bias)  # type: ignore[arg-type]
    with pytest.raises(RequestError, match="outside the vocabulary"):
        Sampler(logit_bias={8: 1.0}).sample(np.zeros(8), [1, 2])
