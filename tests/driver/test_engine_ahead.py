"""Steps ahead (driver/ahead.py): the next serving step launched before the ids of the one in flight are read, its
tokens fed from those ids by the executor. On an executor that feeds steps (helpers.fed_cpu: the CPU executor
with the FedSteps methods, which the Triton executor has on a GPU) every request gives the tokens, text and
reason it gives alone on the contiguous driver: greedy requests ending by end-of-sequence, stop strings and
length in steps launched ahead, seeded sampled ones beside them (those steps wait for the ids), with a pool small
enough to preempt and prefix-cache hits, and aborts between steps; no event comes after a request's end or for a
row dropped, no placeholder is left between steps and no block is held at the end."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from helpers.fed_cpu import FedCpu
from poot_core import Driver, DriverOptions, GenerateRequest, Layout, ModelHandle, Sampler
from poot_core.cpu.executor import CpuExecutor
from poot_core.driver.engine import FinishedEvent, ServingDriver, TokenEvent
from poot_core.executor import fed_steps

CAPACITY = 96


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return ModelHandle.load(tiny_checkpoint("llama", torch.float32))


def _prompt(i: int, shared: int) -> list[int]:
    return [(11 * j + 5) % 240 + 3 for j in range(shared)] + [(7 * i + 3 * j + 1) % 250 + 2
                                                                 for j in range(3 + (i * 11) % 30)]


def _sampler(i: int) -> Sampler:
    if i % 10 == 9:  # seeded draws: a step with such a row picks on the host and waits for it
        return Sampler(temperature=0.9, top_k=40, top_p=0.95, seed=1000 + i)
    return Sampler.greedy()


def _request(i: int, stops: list[str], shared: int = 0, ignore_eos: bool = True) -> GenerateRequest:
    return GenerateRequest(_prompt(i, shared), max_new=6 + (i * 7) % 15, sampler=_sampler(i), stops=stops,
                           ignore_eos=ignore_eos)


def _drivers(handle: ModelHandle, eos: set[int] | None = None, **serve) -> tuple[Driver, ServingDriver]:
    ex = FedCpu()
    assert fed_steps(ex) is ex
    solo = Driver(handle, CpuExecutor(), DriverOptions(capacity=CAPACITY, prefill_chunk=8)).serve()
    options = DriverOptions(capacity=CAPACITY, prefill_chunk=8, block_size=4, step_tokens=48, max_running=12,
                            kv_blocks=300)
    for k, v in serve.items():
        setattr(options, k, v)
    engine = Driver(handle, ex, options).serve(Layout.PAGED)
    if eos is not None:  # tokens the tiny model gives part-way end requests as end-of-sequence
        solo._eos_ids = engine.driver._eos_ids = lambda: eos
    return solo, engine


def _run(engine: ServingDriver, requests: list[GenerateRequest], arrive: int = 2,
         abort_at: dict[int, int] | None = None):
    """Submit `arrive` requests a step, step to the end; per request its finished event and token events, and the
    requests that ended while a row of theirs was in flight."""
    ids: list[int] = []
    finished: dict[int, FinishedEvent] = {}
    tokens: dict[int, list[TokenEvent]] = {}
    dropped: set[int] = set()
    step = 0
    while len(finished) < len(requests):
        for r in requests[len(ids) : len(ids) + arrive]:
            ids.append(engine.submit(r))
            tokens[ids[-1]] = []
        for index, at in (abort_at or {}).items():
            if at == step:
                assert engine.abort(ids[index])
        events = engine.step()
        running = set() if engine._inflight is None else {seq.id for seq, _ in engine._inflight.batch}
        for event in events:
            assert event.request_id not in finished, "an event after the request finished"
            if isinstance(event, TokenEvent):
                tokens[event.request_id].append(event)
            else:
                finished[event.request_id] = event
                if event.reason in ("eos", "stop") and event.request_id in running:
                    dropped.add(event.request_id)
        held = [s for s in engine.scheduler.running + engine.scheduler.waiting if s.unknown >= 0]
        assert not held, "a placeholder left between steps"
        step += 1
        assert step < 600
    for _ in range(2):  # the step left in flight is read; it gives nothing for finished requests
        assert engine.step() == []
    assert engine.counters().held == 0, "blocks still held after every request finished"
    return ids, finished, tokens, dropped


def _eos_set(solo: Driver, count: int, shared: int) -> set[int]:
    """The fourth token of every fourth request: as end-of-sequence ids they end requests part-way."""
    return {solo.generate(_request(i, [], shared)).tokens[3] for i in range(1, count, 4)}


@pytest.mark.parametrize("case", ["roomy", "preempting, prefix hits"])
def test_ahead_gives_each_request_its_solo_tokens_text_and_reason(llama, case):
    count, shared = 20, (0 if case == "roomy" else 12)
    serve = {} if case == "roomy" else {"kv_blocks": 40}
    solo, _ = _drivers(llama)
    eos = _eos_set(solo, count, shared)
    solo, engine = _drivers(llama, eos, **serve)
    stops = []
    for i in range(count):  # every third request stops at a string of its own text
        text = solo.generate(_request(i, [], shared, ignore_eos=i % 2 == 0)).text if i % 3 == 0 else ""
        stops.append([text[4:6]] if len(text) >= 8 else [])
    requests = [_request(i, stops[i], shared, ignore_eos=i % 2 == 0) for i in range(count)]
    refs = [solo.generate(_request(i, stops[i], shared, ignore_eos=i % 2 == 0)) for i in range(count)]
    reasons = Counter(r.stop_reason for r in refs)
    assert reasons["eos"] >= 3 and reasons["stop"] >= 2 and reasons["length"] >= 3, reasons
    ids, finished, tokens, dropped = _run(engine, requests)
    for i, rid in enumerate(ids):
        gen, ref = finished[rid].generation, refs[i]
        assert (gen.tokens, gen.text, gen.stop_reason) == (ref.tokens, ref.text, ref.stop_reason), f"request {i}"
        shown = ref.tokens[:-1] if ref.stop_reason == "eos" else ref.tokens  # an eos id has no token event
        assert [e.token for e in tokens[rid] if e.token >= 0] == shown, f"request {i}: one event a kept token"
        assert "".join(e.text for e in tokens[rid]) == ref.text
    assert engine.ahead.steps >= engine.steps // 3, (engine.ahead.steps, engine.steps)
    assert dropped, "an end must have come with the request's next row in flight"
    if case != "roomy":
        counters = engine.counters()
        assert counters.preemptions > 0 and counters.cache.hits > 0, counters


def test_abort_between_steps_ahead_drops_the_row_in_flight(llama):
    solo, engine = _drivers(llama)
    count = 6
    refs = [solo.generate(_request(i, [])) for i in range(count)]
    # request 2 aborted at step 6 (its prompt ran, some of its tokens too), request 4 at step 4
    ids, finished, tokens, _ = _run(engine, [_request(i, []) for i in range(count)], arrive=count,
                                    abort_at={2: 6, 4: 4})
    assert engine.ahead.steps > 0
    for i, rid in enumerate(ids):
        gen = finished[rid].generation
        if i in (2, 4):
            assert finished[rid].reason == "abort"
            assert gen.tokens == refs[i].tokens[: len(gen.tokens)] and len(gen.tokens) < len(refs[i].tokens)
            assert [e.token for e in tokens[rid]] == gen.tokens, "no event for the row dropped by the abort"
        else:
            assert (gen.tokens, gen.text, gen.stop_reason) == (refs[i].tokens, refs[i].text, refs[i].stop_reason)


def test_ahead_off_gives_the_same_steps_in_the_pipelined_order(llama):
    _, engine = _drivers(llama)
    engine.ahead.on = False
    requests = [_request(i, []) for i in range(8)]
    ids, finished, _, _ = _run(engine, requests)
    assert engine.ahead.steps == 0
    _, ahead = _drivers(llama)
    ahead_ids, ahead_finished, _, _ = _run(ahead, [_request(i, []) for i in range(8)])
    assert ahead.ahead.steps > 0 and ahead.steps == engine.steps
    assert [finished[r].generation.tokens for r in ids] == [ahead_finished[r].generation.tokens for r in ahead_ids]
