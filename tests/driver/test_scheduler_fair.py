"""Fair admission between tenants of one priority (scheduler.py): a tenant that floods the queue does not hold
back another tenant's requests; they are admitted in turn (round robin over the tenants, fewest running first),
higher priority before all, first come first served within a tenant and without tenants. The order is read
from the scheduler and from the serving engine on SmolLM2 as each step admits, never from timings."""

from __future__ import annotations

import pytest

from helpers import smollm
from poot_core import Driver, DriverOptions, GenerateRequest, Layout, ModelHandle, open_executor
from poot_core.driver.engine import FinishedEvent
from poot_core.driver.kv_pool import KVPool
from poot_core.driver.scheduler import Limits, Scheduler, Sequence


def _admission_order(seqs: list[Sequence], max_running: int) -> list[int]:
    """Ids in the order the scheduler admits them when every admitted sequence finishes at once (its slot is
    free for the next step)."""
    scheduler = Scheduler(KVPool(64, 16), Limits(step_tokens=1024, max_running=max_running, prefill_chunk=64))
    for seq in seqs:
        scheduler.add(seq)
    order: list[int] = []
    while scheduler.waiting:
        batch = scheduler.schedule()
        assert batch, "nothing admitted with free slots"
        order += [s.id for s, _ in batch]
        for seq, _ in batch:
            scheduler.remove(seq)
    return order


def _flood(tenant_b: str | None = "b") -> list[Sequence]:
    """Tenant a submits 6 requests (ids 0-5), then tenant b submits 2 (ids 6, 7)."""
    seqs = [Sequence(i, [1, 2, 3], tenant="a", arrival=i) for i in range(6)]
    return seqs + [Sequence(6 + i, [1, 2, 3], tenant=tenant_b, arrival=6 + i) for i in range(2)]


def test_one_slot_alternates_between_tenants():
    # round robin: a's first, b's first, a's second, b's second, then the rest of a's in their order
    assert _admission_order(_flood(), max_running=1) == [0, 6, 1, 7, 2, 3, 4, 5]


def test_several_slots_are_shared():
    # two slots a step: each step admits one request of each tenant while both wait
    assert _admission_order(_flood(), max_running=2) == [0, 6, 1, 7, 2, 3, 4, 5]


def test_one_tenant_is_first_come_first_served():
    seqs = _flood(tenant_b="a")
    assert _admission_order(seqs, max_running=1) == list(range(8))
    plain = [Sequence(i, [1, 2], arrival=i) for i in range(5)]  # no tenants at all
    assert _admission_order(plain, max_running=2) == list(range(5))


def test_higher_priority_goes_first_then_fairness():
    seqs = _flood() + [Sequence(8, [1, 2], tenant="b", priority=1, arrival=8)]
    assert _admission_order(seqs, max_running=1) == [8, 0, 6, 1, 7, 2, 3, 4, 5]


def test_the_tenant_with_fewer_running_goes_first():
    """A tenant whose requests already hold the slots waits while another tenant has fewer running."""
    scheduler = Scheduler(KVPool(64, 16), Limits(step_tokens=1024, max_running=4, prefill_chunk=64))
    for i in range(3):
        scheduler.add(Sequence(i, [1] * 40, tenant="a", arrival=i))
    first = [s.id for s, _ in scheduler.schedule()]
    assert first == [0, 1, 2]  # only a waits: it takes three slots
    for i in range(3, 6):
        scheduler.add(Sequence(i, [1] * 40, tenant="a", arrival=i))
    scheduler.add(Sequence(6, [1] * 40, tenant="b", arrival=6))
    admitted = [s.id for s, n in scheduler.schedule() if s.id >= 3]
    assert admitted == [6]  # the last slot goes to b, not to a's older request 3


@pytest.fixture(scope="module")
def engine():
    handle = ModelHandle.load(smollm.gguf_path())
    options = DriverOptions(capacity=64, prefill_chunk=32, block_size=16, step_tokens=64, max_running=2)
    return Driver(handle, open_executor("cpu"), options).serve(Layout.PAGED)


def test_engine_admits_tenants_in_turn(engine):
    """Tenant a floods the engine with 6 requests before tenant b's 2: with two running slots, b's are admitted
    among a's first ones, and every request still finishes."""
    ids = {}
    for i in range(6):
        ids[engine.submit(GenerateRequest([1, 100 + i, 200], max_new=2, ignore_eos=True), tenant="a")] = f"a{i}"
    for i in range(2):
        ids[engine.submit(GenerateRequest([1, 300 + i, 200], max_new=2, ignore_eos=True), tenant="b")] = f"b{i}"
    admitted: list[str] = []
    finished = set()
    while len(finished) < len(ids):
        for event in engine.step():
            if isinstance(event, FinishedEvent):
                assert event.reason == "length"
                finished.add(event.request_id)
        for seq in engine.scheduler.running:
            if ids[seq.id] not in admitted:
                admitted.append(ids[seq.id])
    assert admitted == ["a0", "b0", "a1", "b1", "a2", "a3", "a4", "a5"]
