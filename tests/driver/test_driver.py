"""The Driver's contract: sampling semantics, stops, streaming, capacity, prefix reuse, callbacks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from poot_core import (
    CapacityError,
    Driver,
    DriverOptions,
    GenerateRequest,
    GenerationControl,
    ModelHandle,
    RequestError,
    Sampler,
    open_executor,
)
from poot_core.driver.stops import StopMatcher
from poot_core.executor import device_greedy

PROMPT = [(5 * i + 11) % 240 + 3 for i in range(24)]


@pytest.fixture(scope="module")
def driver(tiny_checkpoint):
    handle = ModelHandle.load(tiny_checkpoint("llama", torch.float32))
    return Driver(handle, open_executor("cpu"), DriverOptions(capacity=96, prefill_chunk=8)).serve()


def test_seeded_sampling_repeats(driver):
    def run(seed):
        s = Sampler(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, seed=seed)
        return driver.generate(GenerateRequest(PROMPT, max_new=12, sampler=s, ignore_eos=True)).tokens

    assert run(7) == run(7)
    assert run(7) != run(8) or run(7) != run(9)


def test_greedy_equals_argmax_of_logits(driver):
    tokens = driver.generate(GenerateRequest(PROMPT, max_new=6, ignore_eos=True)).tokens
    seq = list(PROMPT)
    for t in tokens:
        assert t == int(np.argmax(driver.logits(seq)[-1]))
        seq.append(t)


class _PicksOnDevice:
    """The CPU executor plus an optional greedy_token that deliberately picks the argmin, so its use shows."""

    def __init__(self, inner):
        self._inner = inner
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def greedy_token(self, output):
        self.calls += 1
        return int(np.argmin(self._inner.to_numpy(output)[0, -1]))


def test_the_executors_greedy_token_makes_greedy_picks_only(driver):
    assert device_greedy(driver.executor) is None  # the CPU executor has none: the sampler picks on the host
    executor = _PicksOnDevice(driver.executor)
    picking = Driver(driver.handle, executor, DriverOptions(capacity=96, prefill_chunk=8))
    tokens = picking.generate(GenerateRequest(PROMPT, max_new=4, ignore_eos=True)).tokens
    seq = list(PROMPT)
    for t in tokens:
        assert t == int(np.argmin(driver.logits(seq)[-1]))
        seq.append(t)
    assert executor.calls == 4

    def sampled(d):
        s = Sampler(temperature=0.9, top_k=20, seed=3)
        return d.generate(GenerateRequest(PROMPT, max_new=4, sampler=s, ignore_eos=True)).tokens

    assert sampled(picking) == sampled(driver)
    assert executor.calls == 4


def test_prefix_reuse_prefills_only_new_tokens(driver):
    first = driver.generate(GenerateRequest(PROMPT, max_new=4, ignore_eos=True))
    follow = PROMPT + first.tokens[:-1] + [17, 18, 19]
    again = driver.generate(GenerateRequest(follow, max_new=4, ignore_eos=True))
    assert again.timings.reused_tokens == len(PROMPT) + len(first.tokens) - 1
    assert again.timings.prefill_tokens == 3
    fresh = Driver(driver.handle, driver.executor, DriverOptions(capacity=96, prefill_chunk=8)).serve()
    assert fresh.generate(GenerateRequest(follow, max_new=4, ignore_eos=True)).tokens == again.tokens


def test_capacity_refused_up_front(driver):
    with pytest.raises(CapacityError):
        driver.generate(GenerateRequest(PROMPT, max_new=96 - len(PROMPT) + 1))
    with pytest.raises(RequestError):
        driver.generate(GenerateRequest([], max_new=1))
    with pytest.raises(RequestError):
        driver.generate(GenerateRequest([10**6], max_new=1))


def test_callback_break_stops_after_that_token(driver):
    seen = []

    def on_token(token, piece):
        seen.append(token)
        return GenerationControl.BREAK if len(seen) == 3 else GenerationControl.CONTINUE

    result = driver.generate(GenerateRequest(PROMPT, max_new=10, ignore_eos=True), on_token)
    assert result.stop_reason == "callback" and len(result.tokens) == 3


def test_streamed_pieces_equal_text_and_never_split_utf8(driver):
    text = driver.handle.text()
    pieces = []
    result = driver.generate(GenerateRequest(PROMPT, max_new=24, ignore_eos=True),
                             lambda t, p: pieces.append(p))
    assert "".join(pieces) == result.text == text.decode(result.tokens)
    # Byte-level tokens of one multi-byte character arrive one by one: no piece may hold half of it.
    ids = text.encode("東京🙂", add_special=False)
    stream = text.stream()
    out = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(out) == "東京🙂"
    assert all("\ufffd" not in p for p in out)


def test_stop_strings_never_leak_partially():
    m = StopMatcher(["STOP", "END!"])
    out = []
    for piece in ["hello S", "T", "O", "x and E", "N", "D!", "tail"]:
        emit, hit = m.push(piece)
        out.append(emit)
        if hit:
            break
    assert "".join(out) == "hello STOx and "
    assert hit


def test_stop_string_in_generation(driver):
    base = driver.generate(GenerateRequest(PROMPT, max_new=16, ignore_eos=True))
    assert len(base.text) > 4
    stop = base.text[2:4]
    cut = driver.generate(GenerateRequest(PROMPT, max_new=16, stops=[stop], ignore_eos=True))
    assert cut.stop_reason == "stop"
    assert cut.text == base.text[: base.text.index(stop)]


def test_repeat_penalty_follows_llama_cpp():
    s = Sampler(temperature=0.0, repeat_penalty=2.0)
    logits = np.array([4.0, 3.0, -1.0, -0.5])
    # token 0 (positive) is divided, token 3 (negative) multiplied: 2.0, 3.0, -1.0, -1.0 -> argmax 1
    assert s.sample(logits, [0, 3]) == 1


def test_sampler_rejects_bad_settings():
    for kwargs in ({"temperature": -1}, {"top_p": 0.0}, {"min_p": 2.0}, {"top_k": -1}, {"repeat_penalty": 0}):
        with pytest.raises(RequestError):
            Sampler(**kwargs)


def test_each_step_shape_is_traced_and_prepared_once(driver, monkeypatch):
    from poot_core.cpu.executor import CpuExecutor

    fresh = Driver(driver.handle, open_executor("cpu"), DriverOptions(capacity=96, prefill_chunk=8, max_programs=3))
    prepared = []
    original = CpuExecutor.prepare
    monkeypatch.setattr(CpuExecutor, "prepare", lambda self, g, w: prepared.append(g.shape) or original(self, g, w))
    fresh.serve()
    fresh.generate(GenerateRequest(PROMPT, max_new=6, ignore_eos=True))  # chunks of 8 (x3), then decode steps
    fresh.generate(GenerateRequest(PROMPT[:8], max_new=6, ignore_eos=True))
    assert len(prepared) == len(set(prepared)) == 2  # the decode step and the 8-token chunk, once each
    for n in (1, 2, 3, 4, 5):  # more shapes than max_programs: the oldest are dropped, the cache stays bounded
        fresh.logits(PROMPT[:n])
    assert len(fresh._programs) <= 3


def test_an_op_the_executor_cannot_run_is_refused_before_any_work(driver):
    from poot_core import Reason, Unsupported

    class Strange(type(driver.family)):
        def trace(self, config, t, shape):
            tokens = t.input("tokens", (shape.rows, shape.tokens))
            t.output(t.op("warp_drive", (tokens,), (shape.rows, shape.tokens)))

    handle = driver.handle
    original = handle.family
    handle.family = Strange("strange", "llama", ("Strange",))
    try:
        with pytest.raises(Unsupported) as err:
            Driver(handle, open_executor("cpu"), DriverOptions(capacity=32, prefill_chunk=8)).serve()
        assert err.value.reason is Reason.OPERATION and err.value.name == "warp_drive"
    finally:
        handle.family = original
