"""Prompt log-probabilities from the serving engine's own prefill chunks (poot_core/driver/prompt_logprobs.py):
each prompt token's log-probability, rank and top alternatives equal those of the log-softmax of
`Driver.logits` (one prefill of its own on the contiguous driver) and of transformers' logits, within float32
rounding; a request gives the same values beside others as alone; a prompt found in the prefix cache is
recomputed, so every position still has its step; max_new 0 runs the prompt and finishes with "length"."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.tiny import reference_logits
from poot_core import Driver, DriverOptions, GenerateRequest, Layout, ModelHandle, Sampler, open_executor
from poot_core.driver.engine import FinishedEvent, ServingDriver, TokenEvent
from poot_core.driver.prompt_logprobs import PromptEvent

CAPACITY, CHUNK, TOP = 96, 8, 4
BOUND = 2e-5  # |ours - reference| of a log-probability (float32 logits, log-softmax in float64)


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    path = tiny_checkpoint("llama", torch.float32)
    return path, ModelHandle.load(path)


def _engine(handle, **options) -> ServingDriver:
    base = dict(capacity=CAPACITY, prefill_chunk=CHUNK, block_size=4, step_tokens=24, max_running=8, kv_blocks=200)
    base.update(options)
    return Driver(handle, open_executor("cpu"), DriverOptions(**base)).serve(Layout.PAGED)


def _prompt(i: int, length: int) -> list[int]:
    return [(7 * i + 3 * j + 1) % 250 + 2 for j in range(length)]


def _run(engine: ServingDriver, submits: list[tuple[int, list[int], int, int | None]]) -> dict:
    """submits: (arrival step, prompt, max_new, prompt top or None). Steps to the end; per submit its prompt
    steps (None without), finished event, and the order of its events."""
    ids: dict[int, int] = {}
    steps: dict[int, list] = {}
    done: dict[int, FinishedEvent] = {}
    kinds: dict[int, list[str]] = {}
    step = 0
    while len(done) < len(submits):
        for i, (arrive, prompt, new, top) in enumerate(submits):
            if arrive == step:
                request = GenerateRequest(list(prompt), max_new=new, sampler=Sampler.greedy(), ignore_eos=True)
                ids[engine.submit(request, prompt_logprobs=top)] = i
        for event in engine.step():
            i = ids[event.request_id]
            kinds.setdefault(i, []).append(type(event).__name__)
            if isinstance(event, PromptEvent):
                assert i not in steps, "two prompt events for one request"
                steps[i] = event.steps
            elif isinstance(event, FinishedEvent):
                done[i] = event
            else:
                assert isinstance(event, TokenEvent)
        step += 1
        assert step < 500
    assert engine.counters().held == 0
    return {"steps": steps, "done": done, "kinds": kinds}


def _check_against(steps: list, prompt: list[int], logits: np.ndarray, top: int) -> None:
    """steps against the log-softmax (float64) of reference logits [positions, vocab]."""
    assert len(steps) == len(prompt) and steps[0] is None
    x = logits.astype(np.float64)
    logp = x - (x.max(axis=1, keepdims=True) + np.log(np.exp(x - x.max(axis=1, keepdims=True)).sum(1, keepdims=True)))
    for i in range(1, len(prompt)):
        step, row, token = steps[i], logp[i - 1], prompt[i]
        assert step.logprobs.token == token
        assert abs(step.logprobs.logprob - row[token]) < BOUND, i
        # the rank and the top alternatives, where the reference's ordering is not a float32 tie
        gap = np.sort(np.abs(row - row[token]))[1]
        if gap > 1e-4:
            assert step.rank == 1 + int(np.count_nonzero(row > row[token])), i
        ours = [t for t, _ in step.logprobs.top]
        assert len(ours) == top
        order = np.argsort(-row, kind="stable")[: top + 1]
        if all(row[order[k]] - row[order[k + 1]] > 1e-4 for k in range(top)):
            assert ours == order[:top].tolist(), i
        for t, lp in step.logprobs.top:
            assert abs(lp - row[t]) < BOUND


def test_prompt_steps_equal_driver_logits_and_transformers(llama):
    path, handle = llama
    solo = Driver(handle, open_executor("cpu"), DriverOptions(capacity=CAPACITY, prefill_chunk=CHUNK)).serve()
    prompts = [_prompt(0, 37), _prompt(1, 9), _prompt(2, 2)]
    out = _run(_engine(handle), [(0, p, 3, TOP) for p in prompts])
    for i, prompt in enumerate(prompts):
        _check_against(out["steps"][i], prompt, solo.logits(prompt), TOP)
        _check_against(out["steps"][i], prompt, reference_logits(path, prompt).numpy(), TOP)
        assert out["kinds"][i][0] == "PromptEvent", "the prompt's steps come before its first token"


def test_beside_others_equals_alone_and_tokens_are_unchanged(llama):
    _, handle = llama
    submits = [(i // 2, _prompt(i, 3 + (i * 11) % 40), 2 + i % 5, TOP if i % 3 != 1 else None) for i in range(10)]
    together = _run(_engine(handle), submits)
    for i, (_, prompt, new, top) in enumerate(submits):
        alone = _run(_engine(handle), [(0, prompt, new, top)])
        plain = _run(_engine(handle), [(0, prompt, new, None)])
        assert together["done"][i].generation.tokens == alone["done"][0].generation.tokens
        assert alone["done"][0].generation.tokens == plain["done"][0].generation.tokens
        if top is None:
            assert i not in together["steps"]
            continue
        ours, ref = together["steps"][i], alone["steps"][0]
        assert len(ours) == len(prompt)
        for a, b in zip(ours[1:], ref[1:], strict=True):
            assert a.rank == b.rank and a.logprobs.token == b.logprobs.token
            assert abs(a.logprobs.logprob - b.logprobs.logprob) < BOUND
            assert [t for t, _ in a.logprobs.top] == [t for t, _ in b.logprobs.top]


def test_a_cached_prompt_is_recomputed_with_every_position(llama):
    _, handle = llama
    solo = Driver(handle, open_executor("cpu"), DriverOptions(capacity=CAPACITY, prefill_chunk=CHUNK)).serve()
    engine = _engine(handle, prefix_cache=True)
    prompt = _prompt(5, 30)
    first = _run(engine, [(0, prompt, 2, None)])
    hits = engine.counters().cache.hits
    again = _run(engine, [(0, prompt, 2, None)])  # the cache holds the prompt's blocks: a plain request reuses them
    assert engine.counters().cache.hits > hits and again["done"][0].generation.timings.reused_tokens > 0
    hits = engine.counters().cache.hits
    scored = _run(engine, [(0, prompt, 2, TOP)])
    assert scored["done"][0].generation.timings.reused_tokens == 0  # recomputed: a cached block has no logits
    assert engine.counters().cache.hits == hits
    _check_against(scored["steps"][0], prompt, solo.logits(prompt), TOP)
    assert scored["done"][0].generation.tokens == first["done"][0].generation.tokens


def test_preempted_prompt_scores_each_position_once(llama):
    _, handle = llama
    solo = Driver(handle, open_executor("cpu"), DriverOptions(capacity=CAPACITY, prefill_chunk=CHUNK)).serve()
    engine = _engine(handle, kv_blocks=24, prefix_cache=True)  # 96 positions for six requests: preemption
    submits = [(0, _prompt(i, 30 + i), 12, TOP) for i in range(6)]
    out = _run(engine, submits)
    assert engine.counters().preemptions > 0
    for i, (_, prompt, _, _) in enumerate(submits):
        _check_against(out["steps"][i], prompt, solo.logits(prompt), TOP)


def test_max_new_zero_runs_the_prompt_and_finishes_with_length(llama):
    _, handle = llama
    solo = Driver(handle, open_executor("cpu"), DriverOptions(capacity=CAPACITY, prefill_chunk=CHUNK)).serve()
    prompt = _prompt(3, 20)
    out = _run(_engine(handle), [(0, prompt, 0, 2), (0, [7], 0, 2), (0, [9], 0, None)])
    _check_against(out["steps"][0], prompt, solo.logits(prompt), 2)
    assert out["steps"][1] == [None]
    assert 2 not in out["steps"]
    for i in range(3):
        assert out["done"][i].reason == "length" and out["done"][i].generation.tokens == []
    assert out["kinds"][0] == ["PromptEvent", "FinishedEvent"]
