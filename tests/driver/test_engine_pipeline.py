"""The pipelined serving step (the next step launched before the read one is detokenized) against each request
run alone on the contiguous driver: a stop string that ends a request while its next row is already launched
gives that request's tokens, text and reason exactly, and no event for the dropped row; an abort between steps
drops the row in flight and frees its blocks; seeded samplers beside other requests give their own tokens."""

from __future__ import annotations

import pytest
import torch

from poot_core import Driver, DriverOptions, GenerateRequest, Layout, ModelHandle, Sampler, open_executor
from poot_core.driver.engine import FinishedEvent, ServingDriver, TokenEvent

CAPACITY = 96


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return ModelHandle.load(tiny_checkpoint("llama", torch.float32))


def _drivers(handle: ModelHandle) -> tuple[Driver, ServingDriver]:
    ex = open_executor("cpu")
    solo = Driver(handle, ex, DriverOptions(capacity=CAPACITY, prefill_chunk=8)).serve()
    options = DriverOptions(capacity=CAPACITY, prefill_chunk=8, block_size=4, step_tokens=48, max_running=12,
                            kv_blocks=300)
    return solo, Driver(handle, ex, options).serve(Layout.PAGED)


def _prompt(i: int) -> list[int]:
    return [(7 * i + 3 * j + 1) % 250 + 2 for j in range(3 + (i * 11) % 30)]


def _sampler(i: int) -> Sampler:
    if i % 2 == 0:
        return Sampler.greedy()
    return Sampler(temperature=0.9, top_k=40, top_p=0.95, seed=1000 + i)


def _request(i: int, stops: list[str], max_new: int = 14) -> GenerateRequest:
    return GenerateRequest(_prompt(i), max_new=max_new, sampler=_sampler(i), stops=stops, ignore_eos=True)


def _stop_of(solo: Driver, i: int) -> list[str]:
    """A stop string from the request's own unstopped text, so that it ends part-way."""
    text = solo.generate(_request(i, [])).text
    return [text[4:6]] if len(text) >= 8 else []


def _run(engine: ServingDriver, requests: list[GenerateRequest], abort_at: dict[int, int] | None = None):
    """Submit all, step to the end; per request id its finished event and its token events. An abort of
    request r at step s (abort_at {r: s}) happens between steps, while the engine has a step in flight."""
    ids = [engine.submit(r) for r in requests]
    finished: dict[int, FinishedEvent] = {}
    tokens: dict[int, list[TokenEvent]] = {rid: [] for rid in ids}
    dropped: set[int] = set()  # requests a stop ended while a row of theirs was in flight
    step = 0
    while len(finished) < len(ids):
        for rid, at in (abort_at or {}).items():
            if at == step:
                inflight = engine._inflight
                assert inflight is not None and rid in {seq.id for seq, _ in inflight.batch}
                assert engine.abort(rid)
        events = engine.step()
        running = set() if engine._inflight is None else {seq.id for seq, _ in engine._inflight.batch}
        for event in events:
            assert event.request_id not in finished, "an event after the request finished"
            if isinstance(event, TokenEvent):
                tokens[event.request_id].append(event)
            else:
                finished[event.request_id] = event
                if event.reason == "stop" and event.request_id in running:
                    dropped.add(event.request_id)
        step += 1
        assert step < 500
    for _ in range(2):  # the step left in flight is read; it gives nothing for finished requests
        assert engine.step() == []
    assert engine.counters().held == 0, "blocks still held after every request finished"
    return ids, finished, tokens, dropped


def test_stop_strings_mid_pipeline_give_the_tokens_and_text_alone(llama):
    solo, engine = _drivers(llama)
    count = 12
    stops = [_stop_of(solo, i) if i % 3 != 0 else [] for i in range(count)]
    refs = [solo.generate(_request(i, stops[i])) for i in range(count)]
    assert sum(r.stop_reason == "stop" for r in refs) >= 4, "the case must stop part-way"
    ids, finished, tokens, dropped = _run(engine, [_request(i, stops[i]) for i in range(count)])
    for i, rid in enumerate(ids):
        gen, ref = finished[rid].generation, refs[i]
        assert (gen.tokens, gen.text, gen.stop_reason) == (ref.tokens, ref.text, ref.stop_reason), f"request {i}"
        events = tokens[rid]
        assert [e.token for e in events if e.token >= 0] == ref.tokens, f"request {i}: one event per kept token"
        assert "".join(e.text for e in events) == ref.text
    stopped = {rid for i, rid in enumerate(ids) if refs[i].stop_reason == "stop"}
    assert dropped and dropped <= stopped, "a stop must have ended a request with its next row in flight"


def test_pipelined_equals_the_old_order(llama):
    solo, engine = _drivers(llama)
    count = 9
    stops = [_stop_of(solo, i) for i in range(count)]
    engine.pipeline = False
    old_ids, old, _, _ = _run(engine, [_request(i, stops[i]) for i in range(count)])
    engine.pipeline = True
    new_ids, new, _, _ = _run(engine, [_request(i, stops[i]) for i in range(count)])
    for a, b in zip([old[r] for r in old_ids], [new[r] for r in new_ids], strict=True):
        assert (a.generation.tokens, a.generation.text, a.reason) == (b.generation.tokens, b.generation.text,
                                                                      b.reason)


def test_abort_between_steps_drops_the_row_in_flight(llama):
    solo, engine = _drivers(llama)
    count = 6
    refs = [solo.generate(_request(i, [], max_new=20)) for i in range(count)]
    # request 2 aborted at step 6 (its prompt ran, some of its tokens too), request 4 at step 3
    ids, finished, tokens, _ = _run(engine, [_request(i, [], max_new=20) for i in range(count)], {2: 6, 4: 3})
    for i, rid in enumerate(ids):
        gen = finished[rid].generation
        if i in (2, 4):
            assert finished[rid].reason == "abort"
            assert gen.tokens == refs[i].tokens[: len(gen.tokens)] and len(gen.tokens) < len(refs[i].tokens)
            assert [e.token for e in tokens[rid]] == gen.tokens, "no event for the row dropped by the abort"
        else:
            assert (gen.tokens, gen.text, gen.stop_reason) == (refs[i].tokens, refs[i].text, refs[i].stop_reason)


def test_seeded_sampling_beside_others_gives_its_own_tokens(llama):
    solo, engine = _drivers(llama)
    count = 10  # odd requests seeded, even greedy; each seeded one alone against it among the others
    refs = [solo.generate(_request(i, [], max_new=18)) for i in range(count)]
    ids, finished, _, _ = _run(engine, [_request(i, [], max_new=18) for i in range(count)])
    for i, rid in enumerate(ids):
        assert finished[rid].generation.tokens == refs[i].tokens, f"request {i}"
    alone = _drivers(llama)[1]
    _, single, _, _ = _run(alone, [_request(1, [], max_new=18)])
    assert next(iter(single.values())).generation.tokens == refs[1].tokens
