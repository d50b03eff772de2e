"""The serving driver (Layout.PAGED) against the contiguous driver: each request of a batch, whatever shares its
steps, gives the tokens and text it gives run alone, and its logits within float32 rounding; the same when the
pool is so small that sequences are preempted, and when prompts are found in the prefix cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from poot_core import (
    CapacityError,
    Driver,
    DriverOptions,
    GenerateRequest,
    Layout,
    ModelHandle,
    Sampler,
    Unsupported,
    open_executor,
)
from poot_core.driver.engine import FinishedEvent, ServingDriver, TokenEvent

CAPACITY, CHUNK = 96, 8
LOGIT_BOUND = 1e-4  # float32: max |paged - contiguous| / max |contiguous|


def _sampler(kind: int) -> Sampler:
    """A fresh sampler per run: greedy, seeded draws, a repeat penalty."""
    if kind == 0:
        return Sampler.greedy()
    if kind == 1:
        return Sampler(temperature=0.8, top_k=30, top_p=0.9, min_p=0.02, seed=kind * 7 + 1)
    return Sampler(temperature=0.0, repeat_penalty=1.3)


def _specs(count: int, shared_prefix: int = 0) -> list[dict]:
    """count requests: prompt lengths 2..50, max_new 4..19, three kinds of sampler, arrival steps."""
    base = [(11 * j + 5) % 240 + 3 for j in range(shared_prefix)]
    specs = []
    for i in range(count):
        length = 2 + (i * 13) % 49
        prompt = base + [(7 * i + 3 * j + 1) % 250 + 2 for j in range(length)]
        specs.append(dict(prompt=prompt, max_new=4 + (i * 5) % 16, kind=i % 3, seed=i, arrive=(i * 3) // 4,
                          ignore_eos=i % 4 != 1))
    return specs


def _request(spec: dict, stops: list[str]) -> GenerateRequest:
    sampler = _sampler(spec["kind"])
    if sampler.seed is not None:
        sampler.seed = 100 + spec["seed"]
        sampler.reset()
    return GenerateRequest(list(spec["prompt"]), max_new=spec["max_new"], sampler=sampler, stops=stops,
                           ignore_eos=spec["ignore_eos"])


def _solo_runs(solo: Driver, specs: list[dict]) -> list[tuple[list[str], object]]:
    """Each request alone on the contiguous driver; every third request gets a stop string taken from its own
    unstopped output, so that stops happen."""
    runs = []
    for i, spec in enumerate(specs):
        stops: list[str] = []
        if i % 3 == 2:
            free = solo.generate(_request(spec, []))
            if len(free.text) >= 6:
                stops = [free.text[3:5]]
        runs.append((stops, solo.generate(_request(spec, stops))))
    return runs


def _serve(engine: ServingDriver, specs: list[dict], stops: list[list[str]],
           salts: list[str | None] | None = None) -> dict[int, FinishedEvent]:
    """Submit each request at its arrival step and step until all finish; the finished event per request."""
    ids: dict[int, int] = {}
    finished: dict[int, FinishedEvent] = {}
    pieces: dict[int, list[str]] = {}
    step = 0
    while len(finished) < len(specs):
        for i, spec in enumerate(specs):
            if spec["arrive"] == step:
                ids[engine.submit(_request(spec, stops[i]), cache_salt=None if salts is None else salts[i])] = i
        for event in engine.step():
            if isinstance(event, TokenEvent):
                pieces.setdefault(event.request_id, []).append(event.text)
            else:
                assert ids[event.request_id] not in finished, "a request finished twice"
                finished[ids[event.request_id]] = event
                assert "".join(pieces.get(event.request_id, [])) == event.generation.text
        step += 1
        assert step < 2000
    counters = engine.counters()
    assert counters.held == 0, "blocks still held after every request finished"
    return {ids_i: finished[ids_i] for ids_i in range(len(specs))}


def _check(engine: ServingDriver, solo: Driver, specs: list[dict], runs, finished: dict[int, FinishedEvent],
           ids: list[int]) -> None:
    for i, spec in enumerate(specs):
        gen, ref = finished[i].generation, runs[i][1]
        assert gen.tokens == ref.tokens, f"request {i}"
        assert gen.text == ref.text and gen.stop_reason == ref.stop_reason, f"request {i}"
        seen = engine.logits[ids[i]]
        assert len(seen) == len(gen.tokens)
        if seen:
            ref_logits = solo.logits(spec["prompt"] + gen.tokens[:-1])[len(spec["prompt"]) - 1 :]
            err = np.abs(np.stack(seen) - ref_logits).max() / np.abs(ref_logits).max()
            assert err < LOGIT_BOUND, f"request {i}: {err}"


def _load(path):
    return ModelHandle.load(path)


def _drivers(handle, **serve) -> tuple[Driver, ServingDriver]:
    ex = open_executor("cpu")
    solo = Driver(handle, ex, DriverOptions(capacity=CAPACITY, prefill_chunk=CHUNK)).serve()
    options = DriverOptions(capacity=CAPACITY, prefill_chunk=CHUNK, block_size=4, step_tokens=48, max_running=12)
    for k, v in serve.items():
        setattr(options, k, v)
    engine = Driver(handle, ex, options).serve(Layout.PAGED)
    engine.keep_logits = True
    return solo, engine


def _run_case(handle, count: int = 32, shared_prefix: int = 0, **serve) -> ServingDriver:
    solo, engine = _drivers(handle, **serve)
    specs = _specs(count, shared_prefix)
    runs = _solo_runs(solo, specs)
    finished = _serve(engine, specs, [stops for stops, _ in runs])
    # ids were given in submission order, which is arrival order, then index order
    order = sorted(range(count), key=lambda i: (specs[i]["arrive"], i))
    ids = [0] * count
    for rid, i in enumerate(order):
        ids[i] = rid
    _check(engine, solo, specs, runs, {i: finished[i] for i in range(count)}, ids)
    return engine


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return _load(tiny_checkpoint("llama", torch.float32))


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    from helpers.moe import build

    return _load(build(tmp_path_factory.mktemp("mixtral"), "mixtral", torch.float32))


def test_batch_equals_each_request_alone(llama):
    engine = _run_case(llama, kv_blocks=400, prefix_cache=False)
    assert engine.counters().preemptions == 0
    assert len(engine._programs) <= len(engine._token_buckets) * len(engine._seq_buckets)


def test_moe_with_sliding_window_batch_equals_alone(mixtral):
    _run_case(mixtral, kv_blocks=400)


def test_latent_attention_pages_its_latent(tmp_path_factory):
    from helpers.moe import build

    handle = _load(build(tmp_path_factory.mktemp("deepseek_v2"), "deepseek_v2", torch.float32))
    engine = _run_case(handle, count=8, kv_blocks=24, prefix_cache=False)  # small enough to preempt too
    assert engine.counters().preemptions > 0


def test_tiny_pool_preempts_and_still_gives_the_same_tokens(llama):
    engine = _run_case(llama, kv_blocks=30, prefix_cache=False)
    assert engine.counters().preemptions > 0


def test_prefix_cache_hits_give_the_same_tokens(llama):
    engine = _run_case(llama, count=16, shared_prefix=20, kv_blocks=400)
    cache = engine.counters().cache
    # requests admitted after the first one's prefill find the 5 full blocks of the shared prefix (the
    # earliest arrive before those blocks are computed)
    assert cache.hits >= 10 * 5


def test_salts_never_share_blocks(llama):
    _, engine = _drivers(llama, kv_blocks=200)
    prompt = list(range(3, 40))
    counters = engine.counters().cache

    def run(salt):
        rid = engine.submit(GenerateRequest(prompt, max_new=2, ignore_eos=True), cache_salt=salt)
        while engine.in_flight:
            engine.step()
        return rid

    run("a")
    hits = counters.hits
    run("b")
    assert counters.hits == hits  # another tenant's salt finds nothing
    run("a")
    assert counters.hits == hits + (len(prompt) - 1) // 4
    run(None)
    assert counters.hits == hits + (len(prompt) - 1) // 4


def test_capacity_refused_at_submit(llama):
    _, engine = _drivers(llama, kv_blocks=8)  # 32 positions in all
    with pytest.raises(CapacityError, match="pool"):
        engine.submit(GenerateRequest(list(range(3, 30)), max_new=10))
    with pytest.raises(CapacityError):
        engine.generate_batch([GenerateRequest([3, 4], max_new=2), GenerateRequest(list(range(3, 40)))])
    assert engine.in_flight == 0  # the batch was checked before any of it was queued


def test_generate_and_abort(llama):
    solo, engine = _drivers(llama, kv_blocks=100)
    request = GenerateRequest(list(range(3, 20)), max_new=6, ignore_eos=True)
    seen: list[int] = []
    assert engine.generate(request, lambda t, s: seen.append(t)).tokens == solo.generate(request).tokens
    assert seen and seen[0] >= 0
    rid = engine.submit(GenerateRequest(list(range(3, 30)), max_new=50, ignore_eos=True))
    engine.step()
    assert engine.abort(rid)
    events = engine.step()
    assert [e.reason for e in events if isinstance(e, FinishedEvent)] == ["abort"]
    assert engine.counters().held == 0 and not engine.abort(rid)


def test_backend_without_paged_steps_is_refused_by_name(llama):
    class Contiguous:
        def __init__(self, inner):
            self._inner = inner
            self.name = "vulkan"

        def __getattr__(self, name):
            return getattr(self._inner, name)

        def capabilities(self):
            caps = self._inner.capabilities()
            return type(caps)(caps.ops, caps.weight_kinds)  # contiguous only, the default

    driver = Driver(llama, Contiguous(open_executor("cpu")), DriverOptions(capacity=CAPACITY))
    with pytest.raises(Unsupported, match="vulkan"):
        driver.serve(Layout.PAGED)
