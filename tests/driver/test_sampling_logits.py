"""The sampler's logit processing and log-probabilities, shared by the Driver and the serving engine: OpenAI's
presence and frequency penalties and transformers' repetition penalty against a float64 numpy reimplementation
on the logits each token was sampled from, and token log-probabilities against torch.log_softmax of the model's
logits recomputed from scratch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.sampling_drivers import PROMPT, prompt_lookup, serve_recorded, solo_and_engine
from poot_core import GenerateRequest, RequestError, Sampler
from poot_core.driver.sampling import token_logprobs

NEW = 24
LOGIT_BOUND = 1e-4  # float32 logits: paged or decode steps against a full prefill


@pytest.fixture(scope="module")
def drivers(tiny_checkpoint):
    return solo_and_engine(tiny_checkpoint("llama", torch.float32))


def _reference_logits(logits, history, prompt_len, presence, frequency, repetition):
    """OpenAI's formula over the generated tokens, transformers' repetition penalty over prompt and output."""
    x = np.array(logits, dtype=np.float64)
    for t in set(history):
        x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    generated = history[prompt_len:]
    for t in set(generated):
        x[t] -= frequency * generated.count(t) + presence
    return x


CASES = [  # presence, frequency, repetition
    (0.0, 1.5, 1.0),
    (1.2, 0.0, 1.0),
    (-0.8, 0.6, 1.3),
]


@pytest.mark.parametrize(("presence", "frequency", "repetition"), CASES)
def test_penalties_follow_the_openai_formula(drivers, presence, frequency, repetition):
    solo, engine = drivers
    sampler = Sampler(temperature=0.0, presence_penalty=presence, frequency_penalty=frequency,
                      repeat_penalty=repetition, repeat_last_n=-1)
    request = GenerateRequest(PROMPT, NEW, sampler, ignore_eos=True)
    served, recorded = serve_recorded(engine, request)
    assert len(recorded) == len(served.tokens) == NEW
    history = list(PROMPT)
    for row, token in zip(recorded, served.tokens, strict=True):
        ref = _reference_logits(row, history, len(PROMPT), presence, frequency, repetition)
        assert token == int(np.argmax(ref))
        history.append(token)
    # one implementation: the contiguous Driver picks the same tokens
    assert solo.generate(GenerateRequest(PROMPT, NEW, sampler, ignore_eos=True)).tokens == served.tokens
    plain = solo.generate(GenerateRequest(PROMPT, NEW, Sampler.greedy(), ignore_eos=True)).tokens
    assert plain != served.tokens  # the penalties changed the reply (else this test checks nothing)


def test_penalised_distribution_at_a_temperature():
    rng = np.random.default_rng(3)
    row = rng.normal(size=256).astype(np.float32) * 3
    history = [*PROMPT, 9, 9, 4, 17, 9]
    sampler = Sampler(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0, presence_penalty=0.5,
                      frequency_penalty=0.9, repeat_penalty=1.2, repeat_last_n=-1)
    ids, probs = sampler.distribution(row, history, len(PROMPT))
    ref = _reference_logits(row, history, len(PROMPT), 0.5, 0.9, 1.2) / 0.7
    ref = np.exp(ref - ref.max())
    ref /= ref.sum()
    np.testing.assert_allclose(probs, ref[ids], rtol=1e-12, atol=1e-15)


def test_penalty_settings_are_checked():
    for kwargs in ({"presence_penalty": 2.5}, {"frequency_penalty": -2.01}):
        with pytest.raises(RequestError):
            Sampler(**kwargs)
    with pytest.raises(ValueError, match="prompt_len"):
        Sampler(presence_penalty=1.0).sample(np.zeros(8), [1, 2])


@pytest.mark.parametrize("top", [0, 5])
def test_logprobs_equal_log_softmax_of_the_model(drivers, top):
    solo, engine = drivers
    sampler = Sampler(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0, seed=11, frequency_penalty=0.5)
    request = GenerateRequest(PROMPT, 12, sampler, ignore_eos=True, logprobs=top)
    solo_gen = solo.generate(request)
    sampler.reset()
    engine_gen = engine.generate(GenerateRequest(PROMPT, 12, sampler, ignore_eos=True, logprobs=top))
    assert engine_gen.tokens == solo_gen.tokens
    logits = torch.from_numpy(solo.logits(PROMPT + solo_gen.tokens[:-1])[len(PROMPT) - 1 :]).double()
    ref = torch.log_softmax(logits, dim=-1)  # raw model distribution: before penalties and temperature
    for gen in (solo_gen, engine_gen):
        assert gen.logprobs is not None and len(gen.logprobs) == len(gen.tokens)
        for i, (lp, token) in enumerate(zip(gen.logprobs, gen.tokens, strict=True)):
            assert lp.token == token
            assert abs(lp.logprob - ref[i, token].item()) < LOGIT_BOUND
            assert len(lp.top) == top
            if top:
                values, ids = torch.topk(ref[i], top)
                assert [t for t, _ in lp.top] == ids.tolist()
                np.testing.assert_allclose([v for _, v in lp.top], values.numpy(), atol=LOGIT_BOUND)


def test_logprobs_of_a_masked_row():
    row = np.array([1.0, -np.inf, 2.0, 0.5])
    lp = token_logprobs(row, 2, top=4)
    finite = np.array([1.0, 2.0, 0.5])
    ref = finite - np.log(np.exp(finite).sum())
    assert lp.logprob == pytest.approx(ref[1], abs=1e-12)
    assert [t for t, _ in lp.top] == [2, 0, 3, 1] and lp.top[-1][1] == -np.inf


def test_speculation_keeps_penalties_and_logprobs(drivers):
    """Prompt lookup on a repetitive prompt: verify steps run, and greedy tokens with penalties and their
    log-probabilities equal plain decoding's."""
    solo, _ = drivers
    spec = prompt_lookup(solo)
    prompt = PROMPT[:6] * 4
    sampler = Sampler(temperature=0.0, presence_penalty=0.3, frequency_penalty=0.2)
    want = solo.generate(GenerateRequest(prompt, NEW, sampler, ignore_eos=True, logprobs=3))
    got = spec.generate(GenerateRequest(prompt, NEW, sampler, ignore_eos=True, logprobs=3))
    assert got.timings.verify_steps > 0
    assert got.tokens == want.tokens
    assert got.logprobs is not None and want.logprobs is not None and len(got.logprobs) == len(got.tokens)
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert a.token == b.token and abs(a.logprob - b.logprob) < LOGIT_BOUND
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
