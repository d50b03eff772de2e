"""The serving engine (Layout.PAGED) on SmolLM2's GGUF file (Q4_1 products, a Q8_0 head): a request whose
prompt is short (1-4 tokens: prefilled through the decode kernels, alone or batched) gets, in every batched
step, logits bit for bit equal to those it gets decoded alone on the contiguous driver: in steps of up to 12
decode rows (the products' eight-row kernel and its remainder) and in a step that also carries a long
prompt's prefill chunk (more rows than the decode kernel takes: the decode rows keep its arithmetic). The
long prompt's request, prefilled in other chunks than alone, is checked within float32 rounding."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import smollm
from poot_core import Driver, DriverOptions, GenerateRequest, Layout, ModelHandle, Sampler, open_executor
from poot_core.cpu.fusion import ROWWISE_MAX

SHORT, NEW, LONG = 11, 6, 60


@pytest.fixture(scope="module")
def handle():
    return ModelHandle.load(smollm.gguf_path())


def _requests() -> list[GenerateRequest]:
    """SHORT requests of 1-4 prompt tokens, then one of LONG tokens; greedy and seeded samplers."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(SHORT + 1):
        prompt = [int(t) for t in rng.integers(100, 40000, size=LONG if i == SHORT else 1 + i % 4)]
        sampler = Sampler(temperature=0.9, top_k=40, seed=i) if i % 2 else Sampler.greedy()
        out.append(GenerateRequest(prompt, max_new=NEW, sampler=sampler, ignore_eos=True))
    return out


def _alone(handle) -> list[tuple[list[int], list[np.ndarray]]]:
    """Each request on the contiguous driver: its tokens and the logits each was picked from."""
    driver = Driver(handle, open_executor("cpu"), DriverOptions(capacity=128, prefill_chunk=64))
    seen: list[np.ndarray] = []
    pick = driver.next_token

    def recording(logits, sampler, *args, **kwargs):
        seen.append(driver.executor.to_numpy(logits)[0, -1].copy())
        return pick(logits, sampler, *args, **kwargs)

    driver.next_token = recording  # type: ignore[method-assign]
    runs = []
    for request in _requests():
        seen.clear()
        tokens = driver.serve().generate(request).tokens
        assert len(seen) == len(tokens) == NEW
        runs.append((tokens, list(seen)))
    return runs


def test_decode_rows_are_bit_for_bit_the_lone_requests(handle):
    runs = _alone(handle)
    engine = Driver(handle, open_executor("cpu"),
                    DriverOptions(capacity=128, prefill_chunk=64, block_size=16, step_tokens=40,
                                  max_running=SHORT + 1)).serve(Layout.PAGED)
    engine.keep_logits = True
    steps = []  # (decode tokens, all tokens) of each step
    schedule = engine.scheduler.schedule

    def recorded():
        batch = schedule()
        steps.append((sum(1 for _, n in batch if n == 1), sum(n for _, n in batch)))
        return batch

    engine.scheduler.schedule = recorded
    generations = engine.generate_batch(_requests())
    assert max(lone for lone, _ in steps) >= 9, "no step had more decode rows than the four-row kernel takes"
    assert any(lone and total > ROWWISE_MAX for lone, total in steps), "no step carried decode rows and a chunk"
    for i, (gen, (tokens, logits)) in enumerate(zip(generations, runs, strict=True)):
        assert gen.tokens == tokens, f"request {i}"
        got = engine.logits[i]
        for j in range(NEW):
            if i < SHORT:
                assert np.array_equal(got[j].view(np.uint32), logits[j].view(np.uint32)), f"request {i}, token {j}"
            else:
                assert np.abs(got[j] - logits[j]).max() / np.abs(logits[j]).max() < 1e-4, f"token {j}"
