"""Constraint masks on the executor's device (token_masks.py, the CPU executor's mask_logits): the packed words
unpack to the tokens llguidance's bits name, the device path masks exactly what the host path masks, and the
Driver, the serving engine (pipelined or not, constrained rows beside unconstrained ones, greedy and sampled) and
speculation give exactly the same tokens either way. A request that fails keeps its error in its Generation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.constraint_doubles import fail_after
from poot_core import (
    Constraint,
    DraftPolicy,
    Driver,
    DriverOptions,
    GenerateRequest,
    Layout,
    ModelHandle,
    RequestError,
    Sampler,
    open_executor,
)
from poot_core.driver import token_masks
from poot_core.executor import device_mask

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}
NEW = 120  # above the longest reply SCHEMA and the regex admit


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return ModelHandle.load(tiny_checkpoint("llama", torch.float32))


def _prompt(tiny: ModelHandle, i: int) -> list[int]:
    return tiny.text().encode(["Numbers: 0 1 2", "The capital of", "def add(a, b):"][i % 3])


def _sampled(seed: int) -> Sampler:
    return Sampler(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=seed)


def test_unpack_reads_bit_b_of_word_w_as_token_32w_plus_b():
    rng = np.random.default_rng(0)
    bitmask = rng.integers(-(2**31), 2**31, size=(3, 4), dtype=np.int64).astype(np.int32)
    vocab = 117
    expected = np.array([[(int(bitmask[r, t // 32]) >> (t % 32)) & 1 for t in range(vocab)] for r in range(3)],
                        dtype=bool)
    assert np.array_equal(token_masks.unpack(bitmask, vocab), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_mask_logits_equals_the_host_path(dtype):
    rng = np.random.default_rng(1)
    rows, vocab = 5, 300
    bitmask = rng.integers(-(2**31), 2**31, size=(3, token_masks.words(vocab)), dtype=np.int64).astype(np.int32)
    slots = np.array([4, 0, -3])
    logits = torch.from_numpy(rng.standard_normal((1, rows, vocab)).astype(np.float32)).to(dtype)
    ex = open_executor("cpu")
    assert device_mask(ex) is not None
    host = token_masks.TokenMasks(ex)
    host.device = None
    want = host.apply(logits.clone(), slots, bitmask).host()
    got = token_masks.TokenMasks(ex).apply(logits.clone(), slots, bitmask)
    assert got.on_device and np.array_equal(got.host(), want)
    allowed = token_masks.unpack(bitmask, vocab)
    ref = logits[0].float().numpy().copy()
    for i, r in enumerate(slots):
        ref[r] = np.where(allowed[i], ref[r], -np.inf)
    assert np.array_equal(want, ref)


def _both(make, run):
    """run(make()) with the masks on the device, then with the host path (a Driver or a serving engine)."""
    device = make()
    assert getattr(device, "driver", device).masks.device is not None
    on_device = run(device)
    host = make()
    getattr(host, "driver", host).masks.device = None
    return on_device, run(host)


def _same(a, b):
    assert [(g.tokens, g.text, g.stop_reason) for g in a] == [(g.tokens, g.text, g.stop_reason) for g in b]


@pytest.mark.parametrize("pipeline", [True, False])
def test_engine_device_masks_give_the_host_paths_tokens(tiny, pipeline):
    """Eight requests in one engine: JSON schema, regex and unconstrained rows, greedy and sampled, one with
    logprobs, one with ignore_eos (its mask never allows end-of-sequence)."""
    ex = open_executor("cpu")
    constraints = [Constraint.json_schema(SCHEMA), Constraint.regex(r"[a-z]{2,6}[0-9]"), None]

    def requests():
        out = []
        for i in range(8):
            c = constraints[i % 3]
            sampler = _sampled(i) if i % 2 else Sampler.greedy()
            out.append(GenerateRequest(_prompt(tiny, i), NEW if c is not None else 20, sampler, constraint=c,
                                       logprobs=2 if i == 4 else None, ignore_eos=c is None or i == 6))
        out[6].max_new = 24  # a regex under ignore_eos runs to its limit once complete
        return out

    def make():
        engine = Driver(tiny, ex, DriverOptions(capacity=320, prefill_chunk=16, block_size=8, kv_blocks=256,
                                                step_tokens=64, max_running=8)).serve(Layout.PAGED)
        engine.pipeline = pipeline
        return engine

    on_device, host = _both(make, lambda e: e.generate_batch(requests()))
    _same(on_device, host)
    assert [g.stop_reason for g in on_device].count("eos") >= 4  # the constraints completed
    assert on_device[4].logprobs == host[4].logprobs
    solo = Driver(tiny, ex, DriverOptions(capacity=320, prefill_chunk=16)).serve()
    _same(on_device, [solo.generate(r) for r in requests()])


def test_driver_and_speculation_device_masks_give_the_host_paths_tokens(tiny):
    ex = open_executor("cpu")
    prompt = tiny.text().encode('{"name": "ab", "n": 7} {"name": "ab", "n": 7} {"name": ')

    def requests():  # new samplers each time: a seeded sampler's generator advances as it draws
        return [GenerateRequest(prompt, NEW, Sampler.greedy(), constraint=Constraint.json_schema(SCHEMA)),
                GenerateRequest(prompt, NEW, _sampled(3), constraint=Constraint.json_schema(SCHEMA), logprobs=1)]

    for draft in (DraftPolicy.OFF, DraftPolicy.PromptLookup(k=4, min_k=2)):
        def make(draft=draft):
            return Driver(tiny, ex, DriverOptions(capacity=320, prefill_chunk=32, draft=draft)).serve()

        on_device, host = _both(make, lambda d: [d.generate(r) for r in requests()])
        _same(on_device, host)
        assert on_device[1].logprobs == host[1].logprobs
        if draft is not DraftPolicy.OFF:
            assert on_device[0].timings.verify_steps > 0


def test_generate_batch_carries_the_error(tiny, monkeypatch):
    """A request whose constraint stops allowing any token ends with reason "error", the error in its
    Generation (generate_batch and generate), beside an unconstrained request that finishes."""
    engine = Driver(tiny, open_executor("cpu"), DriverOptions(capacity=320, prefill_chunk=16, block_size=8,
                                                             kv_blocks=128, max_running=4)).serve(Layout.PAGED)
    real = engine.driver.constraint_matcher
    monkeypatch.setattr(engine.driver, "constraint_matcher", lambda request: fail_after(real(request), 3, "empty"))
    bad = GenerateRequest(_prompt(tiny, 1), NEW, Sampler.greedy(), constraint=Constraint.json_schema(SCHEMA))
    good = GenerateRequest(_prompt(tiny, 0), 8, Sampler.greedy(), ignore_eos=True)
    failed, fine = engine.generate_batch([bad, good])
    assert failed.stop_reason == "error" and isinstance(failed.error, RequestError), failed
    assert "allows no next token" in str(failed.error) and len(failed.tokens) == 3
    assert fine.stop_reason == "length" and fine.error is None
    alone = engine.generate(bad)
    assert alone.stop_reason == "error" and isinstance(alone.error, RequestError)
