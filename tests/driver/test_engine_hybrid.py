"""The serving engine (Layout.PAGED) on the hybrid families: their recurrent state (convolution windows, SSM and
delta-rule states) in a pool of slots, one per running sequence, beside paged KV. Each request of a batch of mixed
prompt lengths (some longer than a prefill chunk, so their state crosses steps in its slot) gives the tokens of
the contiguous Driver run alone and logits within float32 rounding of it; the same when the pool is so small that
sequences are preempted and recomputed; slots come back at abort and bound the running sequences. A finished
request's state is kept: a next turn that extends its tokens continues from it and gives a fresh run's tokens and
logits, and kept states give way to new requests."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from poot_core import (
    Driver,
    DriverOptions,
    GenerateRequest,
    Layout,
    ModelHandle,
    Sampler,
    StepShape,
    open_executor,
)
from poot_core.driver.engine import FinishedEvent, ServingDriver
from poot_core.graph import Paging

ARCHS = ["lfm2", "mamba2", "granitemoehybrid", "granite_moe", "granite_rope", "bamba", "qwen3next"]
CAPACITY, CHUNK, NEW = 128, 16, 6
LENGTHS = [41, 5, 1, 23, 17, 33]  # 41, 23, 17 and 33 take more than one prefill chunk
SAMPLED = 3  # the request that samples (seeded); the others are greedy
LOGIT_BOUND = 1e-5  # max |paged - contiguous| / max |contiguous|, float32


def _prompt(i: int, length: int) -> list[int]:
    return [(7 * j + 13 * i + 3) % 250 + 2 for j in range(length)]


def _sampler(i: int) -> Sampler:
    if i == SAMPLED:
        return Sampler(temperature=0.9, top_k=40, top_p=0.95, seed=1234)  # a fresh stream per request object
    return Sampler.greedy()


def _requests() -> list[GenerateRequest]:
    return [GenerateRequest(_prompt(i, n), max_new=NEW, sampler=_sampler(i), ignore_eos=True)
            for i, n in enumerate(LENGTHS)]


def _contiguous(path) -> Driver:
    return Driver(ModelHandle.load(path), open_executor("cpu"), DriverOptions(capacity=CAPACITY, prefill_chunk=CHUNK))


def _engine(path, **options) -> ServingDriver:
    base = DriverOptions(capacity=CAPACITY, prefill_chunk=CHUNK, block_size=8, step_tokens=40, max_running=8,
                         kv_blocks=96)
    engine = Driver(ModelHandle.load(path), open_executor("cpu"), dataclasses.replace(base, **options)).serve(
        Layout.PAGED)
    engine.keep_logits = True
    return engine


def _teacher_logits(solo: Driver, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """The contiguous Driver's logits before each of `tokens`: the prompt in chunks, then one step a token."""
    solo.reset()
    last = solo.prefill_cache(prompt)
    rows = []
    for i, token in enumerate(tokens):
        rows.append(solo.executor.to_numpy(last)[0, -1])
        if i + 1 < len(tokens):
            last = solo.step(token, len(prompt) + i)
    return np.stack(rows)


_SOLO: dict[str, list[tuple[list[int], np.ndarray]]] = {}


def _solo(path, arch: str) -> list[tuple[list[int], np.ndarray]]:
    """Each request alone on the contiguous Driver: its tokens and the logits they were picked from."""
    if arch not in _SOLO:
        solo = _contiguous(path).serve()
        runs = []
        for request in _requests():
            solo.reset()
            tokens = solo.generate(request).tokens
            runs.append((tokens, _teacher_logits(solo, request.prompt, tokens)))
        _SOLO[arch] = runs
    return _SOLO[arch]


def _check_batch(engine: ServingDriver, runs: list[tuple[list[int], np.ndarray]]) -> None:
    generations = engine.generate_batch(_requests())
    for rid, (gen, (tokens, logits)) in enumerate(zip(generations, runs, strict=True)):
        assert gen.tokens == tokens, f"request {rid}"
        seen = np.stack(engine.logits[rid])
        err = np.abs(seen - logits).max() / np.abs(logits).max()
        assert err <= LOGIT_BOUND, f"request {rid}: {err}"
    counters = engine.counters()  # what finished is kept for a next turn, counted apart from what runs
    assert counters.held == 0 and counters.state_held == 0
    assert engine.slots.held == counters.state_kept == len(engine.scheduler.kept)
    assert engine.pool.held == counters.kept_blocks


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_lengths_give_their_solo_tokens_and_logits(hybrid_checkpoint, arch):
    path = hybrid_checkpoint(arch)
    runs = _solo(path, arch)
    engine = _engine(path)
    assert engine.pool.cache is None  # recurrent state: exact reuse or none, so no prefix cache
    _check_batch(engine, runs)
    assert engine.counters().preemptions == 0
    # the seeded request alone gives what it gave beside the others
    alone = _engine(path).generate(_requests()[SAMPLED])
    assert alone.tokens == runs[SAMPLED][0]


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_pool_preempts_and_still_gives_the_same_tokens(hybrid_checkpoint, arch):
    path = hybrid_checkpoint(arch)
    runs = _solo(path, arch)
    engine = _engine(path, kv_blocks=9)  # the longest request needs 6 blocks of 8
    _check_batch(engine, runs)
    assert engine.counters().preemptions > 0


def test_slot_count_limits_running_sequences(hybrid_checkpoint):
    path = hybrid_checkpoint("bamba")
    runs = _solo(path, "bamba")
    engine = _engine(path, state_slots=2)
    ids = [engine.submit(r) for r in _requests()]
    done: dict[int, list[int]] = {}
    most = 0
    while len(done) < len(ids):
        for event in engine.step():
            if isinstance(event, FinishedEvent):
                done[event.request_id] = event.generation.tokens
        most = max(most, len(engine.scheduler.running))
        counters = engine.counters()
        assert counters.state_held == len(engine.scheduler.running) <= 2
        assert engine.slots.held == counters.state_held + counters.state_kept
        assert counters.state_slots == 2
    assert most == 2
    assert [done[i] for i in ids] == [tokens for tokens, _ in runs]
    assert engine.counters().state_held == 0 and engine.counters().state_kept == 2
    assert engine.scheduler.kept.reused == 0  # no prompt extends another's tokens: kept states only gave way


def test_abort_frees_the_slot(hybrid_checkpoint):
    path = hybrid_checkpoint("lfm2")
    runs = _solo(path, "lfm2")
    engine = _engine(path, state_slots=3)
    requests = _requests()
    done: dict[int, FinishedEvent] = {}

    def step() -> None:
        done.update((e.request_id, e) for e in engine.step() if isinstance(e, FinishedEvent))

    ids = [engine.submit(r) for r in requests[:3]]
    step()
    assert engine.slots.available == 0 and len(engine.scheduler.running) == 3
    assert engine.abort(ids[1])
    assert engine.slots.available == 1
    later = engine.submit(requests[3])  # takes the freed slot
    step()
    assert engine.slots.available == 0
    while engine.in_flight:
        step()
    assert done[ids[1]].reason == "abort"
    for rid, i in ((ids[0], 0), (ids[2], 2), (later, 3)):
        assert done[rid].generation.tokens == runs[i][0]
    assert engine.counters().state_held == 0 and engine.counters().held == 0
    assert engine.counters().state_kept == 3  # the three that finished; the aborted one kept nothing


def test_pool_sizes_count_the_slot_bytes(hybrid_checkpoint, monkeypatch):
    """With kv_fraction, the slots' float32 bytes come out of the budget first and the KV blocks fill the rest."""
    path = hybrid_checkpoint("granitemoehybrid")
    handle = ModelHandle.load(path)
    ex = open_executor("cpu")
    one = Driver(handle, ex, DriverOptions(capacity=CAPACITY))._trace(
        StepShape(1, 1, 8, paging=Paging(1, 8, 1, CAPACITY // 8, state_slots=1)))
    per_slot = sum(4 * int(np.prod(s.shape)) for s in one.state.values() if s.recurrent)
    per_block = sum(4 * int(np.prod(s.shape)) for s in one.state.values() if not s.recurrent)
    assert per_slot > 0 and per_block > 0
    free = 4 * per_slot + 37 * per_block
    monkeypatch.setattr(ex, "memory", lambda: {"total": free, "free": free})
    options = DriverOptions(capacity=CAPACITY, prefill_chunk=CHUNK, block_size=8, max_running=4, kv_fraction=1.0)
    engine = Driver(handle, ex, options).serve(Layout.PAGED)
    assert (engine.pool.blocks, engine.slots.slots) == (37, 4)
    small = dataclasses.replace(options, max_running=8, state_slots=8, kv_fraction=0.5)  # 8 slots do not fit
    engine = Driver(handle, ex, small).serve(Layout.PAGED)
    slots = (free // 2) // (per_slot + per_block)
    assert engine.slots.slots == slots < 8
    assert engine.pool.blocks == min((free // 2 - slots * per_slot) // per_block, 8 * CAPACITY // 8)


def test_a_dense_model_beside_keeps_its_prefix_cache(hybrid_checkpoint, tiny_checkpoint):
    """A llama engine and a hybrid engine stepped in turn: the llama requests share a prefix and find it in the
    prefix cache; both give their solo tokens."""
    hybrid = hybrid_checkpoint("lfm2")
    runs = _solo(hybrid, "lfm2")
    llama = tiny_checkpoint("llama", torch.float32)
    ex = open_executor("cpu")
    handle = ModelHandle.load(llama)
    shared = [(5 * j + 2) % 200 + 3 for j in range(24)]
    dense = [GenerateRequest(shared + [10 + i, 20 + i], max_new=NEW, ignore_eos=True) for i in range(4)]
    solo = Driver(handle, ex, DriverOptions(capacity=CAPACITY, prefill_chunk=CHUNK)).serve()
    expected = []
    for r in dense:
        solo.reset()
        expected.append(solo.generate(r).tokens)
    engine = Driver(handle, ex, DriverOptions(capacity=CAPACITY, prefill_chunk=CHUNK, block_size=8, kv_blocks=64,
                                              step_tokens=40, max_running=8)).serve(Layout.PAGED)
    beside = _engine(hybrid)
    first = engine.submit(dense[0])
    hybrid_ids = [beside.submit(r) for r in _requests()]
    dense_done: dict[int, list[int]] = {}
    hybrid_done: dict[int, list[int]] = {}
    later: list[int] = []
    while engine.in_flight or beside.in_flight or not later:
        for event in engine.step():
            if isinstance(event, FinishedEvent):
                dense_done[event.request_id] = event.generation.tokens
        if first in dense_done and not later:  # the shared prefix is cached: the rest find it
            later = [engine.submit(r) for r in dense[1:]]
        for event in beside.step():
            if isinstance(event, FinishedEvent):
                hybrid_done[event.request_id] = event.generation.tokens
    assert [dense_done[i] for i in [first, *later]] == expected
    assert engine.counters().cache.hits >= 3 * (len(shared) // 8)
    assert [hybrid_done[i] for i in hybrid_ids] == [tokens for tokens, _ in runs]


def _turn(engine: ServingDriver, prompt: list[int]) -> tuple[list[int], object]:
    gen = engine.generate(GenerateRequest(prompt, max_new=NEW, ignore_eos=True))
    return gen.tokens, gen.timings


@pytest.mark.parametrize("arch", ARCHS)
def test_a_next_turn_continues_from_the_kept_state(hybrid_checkpoint, arch):
    """A conversation's next turn (the first prompt, the reply, then new tokens longer than a prefill chunk)
    prefills only its new tokens, from the state the first turn left, and gives the tokens and logits of a fresh
    engine's run of the whole prompt."""
    path = hybrid_checkpoint(arch)
    engine = _engine(path)
    first = _prompt(0, 23)
    reply, _ = _turn(engine, first)
    assert engine.counters().state_kept == 1 and engine.counters().state_held == 0
    turn = first + reply + _prompt(5, 19)
    tokens, timings = _turn(engine, turn)
    assert timings.reused_tokens == len(first) + len(reply) - 1  # the reply's last token was picked, never run
    assert timings.prefill_tokens == len(turn) - timings.reused_tokens
    fresh = _engine(path)
    expected, fresh_timings = _turn(fresh, turn)
    assert fresh_timings.reused_tokens == 0
    assert tokens == expected
    seen, want = np.stack(engine.logits[1]), np.stack(fresh.logits[0])
    assert np.abs(seen - want).max() / np.abs(want).max() <= LOGIT_BOUND
    assert engine.scheduler.kept.reused == 1 and engine.counters().state_kept == 1  # the second turn's, now


def test_only_an_exact_extension_under_the_same_salt_continues(hybrid_checkpoint):
    path = hybrid_checkpoint("lfm2")
    engine = _engine(path)
    first = _prompt(0, 23)
    reply, _ = _turn(engine, first)
    held = first + reply[:-1]
    changed = held[:10] + [held[10] + 1] + held[11:] + [9, 9]  # one token inside differs
    assert _turn(engine, changed)[1].reused_tokens == 0
    assert _turn(engine, held)[1].reused_tokens == 0  # nothing left to run: its logits need the last token run
    assert _turn(engine, first + reply + [9, 9])[1].reused_tokens == len(held)
    salted = engine.generate_batch([GenerateRequest(first + reply + [9, 9, 9], max_new=NEW, ignore_eos=True)],
                                   cache_salt="another tenant")[0]
    assert salted.timings.reused_tokens == 0

def test_kept_states_give_way_and_a_dropped_turn_is_recomputed(hybrid_checkpoint):
    """With two slots, the states of finished requests are given back to the next requests; a next turn whose
    state was given back prefills its whole prompt and gives the same tokens."""
    path = hybrid_checkpoint("mamba2")
    engine = _engine(path, state_slots=2)
    first = _prompt(0, 23)
    reply, _ = _turn(engine, first)
    turn = first + reply + _prompt(5, 19)
    engine.generate_batch(_requests()[:3])  # three more requests: the first turn's state gives way
    assert engine.counters().state_kept == 2 and engine.counters().preemptions == 0
    tokens, timings = _turn(engine, turn)
    assert timings.reused_tokens == 0
    assert tokens == _turn(_engine(path), turn)[0]
