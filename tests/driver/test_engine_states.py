"""A hypothesis state machine drives the serving driver with random submits, steps and aborts against a simple
model of what must hold: every request submitted finishes exactly once (its tokens, or "abort" when aborted
before it finished), no step exceeds the token budget or the running limit, the blocks held are exactly the
blocks the running sequences list, and when everything is done the pool is whole again; the same with an executor
that feeds steps from the device (helpers.fed_cpu), so that greedy steps run ahead (driver/ahead.py), and no
placeholder token is left between steps."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from helpers.fed_cpu import FedCpu
from poot_core import Driver, DriverOptions, GenerateRequest, Layout, ModelHandle, Sampler, open_executor
from poot_core.driver.engine import FinishedEvent, ServingDriver, TokenEvent

STEP_TOKENS, MAX_RUNNING, BLOCKS, BLOCK = 12, 4, 14, 4

_handle: list[ModelHandle] = []


@pytest.fixture(scope="module", autouse=True)
def handle(tiny_checkpoint):
    _handle.append(ModelHandle.load(tiny_checkpoint("llama", torch.float32)))
    yield
    _handle.clear()


class EngineMachine(RuleBasedStateMachine):
    @initialize(prefix_cache=st.booleans(), fed=st.booleans())
    def start(self, prefix_cache: bool, fed: bool) -> None:
        options = DriverOptions(capacity=48, prefill_chunk=5, block_size=BLOCK, kv_blocks=BLOCKS,
                                step_tokens=STEP_TOKENS, max_running=MAX_RUNNING, prefix_cache=prefix_cache)
        executor = FedCpu() if fed else open_executor("cpu")
        self.engine: ServingDriver = Driver(_handle[0], executor, options).serve(Layout.PAGED)
        self.in_flight: dict[int, int] = {}  # id -> max_new
        self.aborted: set[int] = set()
        self.finished: dict[int, FinishedEvent] = {}
        self.tokens: dict[int, list[int]] = {}
        schedule = self.engine.scheduler.schedule
        self.batches: list[list] = []

        def recorded():
            batch = schedule()
            self.batches.append([(seq.id, n) for seq, n in batch])
            return batch

        self.engine.scheduler.schedule = recorded

    @rule(length=st.integers(1, 30), max_new=st.integers(0, 12), shared=st.booleans(), seed=st.integers(0, 3),
          priority=st.integers(0, 1))
    def submit(self, length: int, max_new: int, shared: bool, seed: int, priority: int) -> None:
        prompt = [(3 * j + (0 if shared else seed * 17)) % 250 + 2 for j in range(length)]
        sampler = Sampler(temperature=0.7, seed=seed) if seed % 2 else Sampler.greedy()
        rid = self.engine.submit(GenerateRequest(prompt, max_new=max_new, sampler=sampler, ignore_eos=True),
                                 priority=priority)
        assert rid not in self.in_flight and rid not in self.finished
        self.in_flight[rid] = max_new

    @rule()
    def step(self) -> None:
        self._take(self.engine.step())

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.in_flight)))
        if self.engine.abort(rid):
            self.aborted.add(rid)

    def _take(self, events) -> None:
        for event in events:
            if isinstance(event, TokenEvent):
                assert event.request_id in self.in_flight
                if event.token >= 0:
                    self.tokens.setdefault(event.request_id, []).append(event.token)
                continue
            rid = event.request_id
            assert rid in self.in_flight and rid not in self.finished, "lost or duplicated"
            max_new = self.in_flight.pop(rid)
            self.finished[rid] = event
            if rid in self.aborted:
                assert event.reason == "abort"
            else:
                assert event.reason == "length" and len(event.generation.tokens) == max_new
            assert event.generation.tokens[: len(self.tokens.get(rid, []))] == self.tokens.get(rid, [])

    @invariant()
    def budgets_and_blocks(self) -> None:
        if not hasattr(self, "engine"):
            return
        for batch in self.batches:
            assert sum(n for _, n in batch) <= STEP_TOKENS and len(batch) <= MAX_RUNNING
            assert len({rid for rid, _ in batch}) == len(batch)
        self.batches.clear()
        scheduler, pool = self.engine.scheduler, self.engine.pool
        assert len(scheduler.running) <= MAX_RUNNING
        held: dict[int, int] = {}
        for seq in scheduler.running:
            for block in seq.blocks:
                held[block] = held.get(block, 0) + 1
        assert all(not seq.blocks for seq in scheduler.waiting)
        assert all(seq.unknown < 0 for seq in scheduler.running + scheduler.waiting), "a placeholder left"

        assert {b: r for b, r in enumerate(pool.refs) if r} == held
        assert pool.held == len(held)

    def teardown(self) -> None:
        if not hasattr(self, "engine"):
            return
        for _ in range(2000):
            if not self.in_flight:
                break
            self._take(self.engine.step())
        assert not self.in_flight, "requests never finished"
        assert self.engine.pool.held == 0 and self.engine.pool.available == BLOCKS


EngineMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=30, deadline=None,
                                           suppress_health_check=list(HealthCheck))
test_engine_state_machine = EngineMachine.TestCase
