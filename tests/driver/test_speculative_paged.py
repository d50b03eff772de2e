"""Speculative decoding in the serving engine (Layout.PAGED): each sequence of a batch speculates on its own, and
its greedy tokens are the contiguous driver's plain tokens (every family whose tiny checkpoint speculates in the
contiguous tests, prompt lookup and draft models); end of sequence, stops, limits and callbacks inside a kept
run; rejected positions leave the blocks' bookkeeping (blocks past the kept run go back, a prefix-cache follow-up
is still exact); counters; no speculation above draft_max_batch; MTP is refused in the paged layout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import moe, spec_models, spec_sampling
from helpers.spec_models import DENSE, MOE, PLAIN, PROBES, REPEATING
from poot_core import (
    DraftPolicy,
    Driver,
    DriverOptions,
    GenerateRequest,
    GenerationControl,
    Layout,
    ModelHandle,
    Sampler,
    Unsupported,
    open_executor,
)
from poot_core.driver.engine import FinishedEvent

OPTIONS = dict(capacity=160, prefill_chunk=16, block_size=8, kv_blocks=96, max_running=8)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """checkpoint(arch, seed) -> a tiny float32 checkpoint of any family; seeds give other weights, one vocabulary."""
    return spec_models.checkpoint_maker(tmp_path_factory)


def _engine(handle, draft, ex, **extra):
    return Driver(handle, ex, DriverOptions(**{**OPTIONS, **extra}, draft=draft)).serve(Layout.PAGED)


def _prompts(handle) -> list[list[int]]:
    text = handle.text()
    return [text.encode(REPEATING), PLAIN, text.encode(PROBES[1]), text.encode(REPEATING)[:9] + PLAIN[:6]]


@pytest.mark.parametrize("arch", DENSE + MOE)
def test_each_sequence_speculates_and_keeps_the_plain_tokens(checkpoint, arch):
    handle = ModelHandle.load(checkpoint(arch))
    other = ModelHandle.load(checkpoint(arch, seed=1))
    ex = open_executor("cpu")
    requests = [GenerateRequest(p, max_new=30, ignore_eos=True) for p in _prompts(handle)]
    solo = Driver(handle, ex, DriverOptions(capacity=OPTIONS["capacity"], prefill_chunk=16))
    plain = [solo.generate(r) for r in requests]
    policies = {"lookup": DraftPolicy.PromptLookup(k=4),
                "self-draft": DraftPolicy.DraftModel(handle, k=3),  # the target's own tokens: all kept
                "other-draft": DraftPolicy.DraftModel(other, k=2)}  # other weights: mostly rejected
    rejected = 0
    for name, draft in policies.items():
        engine = _engine(handle, draft, ex)
        got = engine.generate_batch(requests)
        for g, p in zip(got, plain, strict=True):
            assert (g.tokens, g.text, g.stop_reason) == (p.tokens, p.text, p.stop_reason), name
        c = engine.speculation.counters
        assert c.verify_steps > 0 and c.proposed >= c.accepted, name
        assert sum(g.timings.proposed for g in got) == c.proposed, name
        assert sum(g.timings.accepted for g in got) == c.accepted, name
        if name == "self-draft":
            assert c.acceptance_rate == 1.0
        assert engine.pool.held == 0 and engine.in_flight == 0, name  # every block came back
        rejected += c.proposed - c.accepted
    assert rejected > 0  # rejected positions rolled back on the way


def _with_eos(path: Path, dest: Path, eos: int) -> Path:
    shutil.copytree(path, dest)
    (dest / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, eos]}))
    return dest


def _fresh(items: list, ok: list[bool]) -> int | None:
    """An index 1..3 whose item did not come earlier (and ok there): a self-draft of k=3 kept whole yields
    indices 1..4 from the first verify step, so an end there falls inside the kept run."""
    return next((i for i in range(1, 4) if items[i] not in items[:i] and ok[i]), None)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "deepseek_v3"])
def test_ends_inside_a_kept_run(checkpoint, arch, tmp_path):
    path = checkpoint(arch)
    handle = ModelHandle.load(path)
    ex = open_executor("cpu")
    sampler = Sampler(temperature=0.0, repeat_penalty=3.0)  # deterministic picks that do not settle
    stop_ids = set(handle.text().vocab.stop_ids) | set(handle.config().eos_ids)
    solo = Driver(handle, ex, DriverOptions(capacity=OPTIONS["capacity"], prefill_chunk=16))
    for text in PROBES:  # a prompt whose plain output has a fresh token and a fresh piece early on
        prompt = handle.text().encode(text)
        pieces: list[str] = []
        first = solo.generate(GenerateRequest(prompt, max_new=12, sampler=sampler, ignore_eos=True),
                              lambda t, p, seen=pieces: seen.append(p))
        toks, texts = first.tokens, ["".join(pieces[:i]) for i in range(len(pieces))]
        at_eos = _fresh(toks, [not stop_ids & set(toks[: i + 1]) for i in range(len(toks))])
        at_stop = _fresh(pieces, [bool(p) and p not in texts[i] + p[:-1] for i, p in enumerate(pieces)])
        if at_eos is not None and at_stop is not None:
            break
    else:
        raise AssertionError("no probe prompt has a fresh token and piece early on")
    eos_handle = ModelHandle.load(_with_eos(path, tmp_path / "eos", toks[at_eos]))
    cases = {  # name: (handle, request, break after this many tokens, the index it ends at)
        "eos": (eos_handle, GenerateRequest(prompt, max_new=12, sampler=sampler), None, at_eos),
        "stop": (handle, GenerateRequest(prompt, max_new=12, sampler=sampler, stops=[pieces[at_stop]],
                                         ignore_eos=True), None, at_stop),
        # proposals stop short of the limit (room), so the limit ends a run: 1 + 4 (a run of 3 kept and the
        # target's own token) + 1 (a proposal of 0: the plain step)
        "length": (handle, GenerateRequest(prompt, max_new=6, sampler=sampler, ignore_eos=True), None, 5),
        "callback": (handle, GenerateRequest(prompt, max_new=12, sampler=sampler, ignore_eos=True), 2, 1),
    }
    for name, (h, request, break_after, end) in cases.items():
        def run(engine, h=h, request=request, break_after=break_after):
            seen: list[int] = []

            def on_token(token: int, piece: str) -> GenerationControl:
                seen.append(token)
                done = break_after is not None and len(seen) == break_after
                return GenerationControl.BREAK if done else GenerationControl.CONTINUE

            return engine.generate(request, on_token), seen

        contiguous = Driver(h, ex, DriverOptions(capacity=OPTIONS["capacity"], prefill_chunk=16))
        plain, plain_seen = run(contiguous)
        engine = _engine(h, DraftPolicy.DraftModel(h, k=3, min_k=3), ex)
        spec, spec_seen = run(engine)
        assert plain.stop_reason == name and len(plain.tokens) == end + 1, name
        assert (spec.tokens, spec.text, spec.stop_reason) == (plain.tokens, plain.text, plain.stop_reason), name
        assert spec_seen == plain_seen, name
        c = engine.speculation.counters
        assert c.verify_steps == 1 and c.proposed == 3 and c.accepted == 3, name  # it ended inside (or after) it
        assert engine.pool.held == 0, name


def test_rejected_blocks_go_back_and_a_cached_prefix_stays_exact(checkpoint):
    handle = ModelHandle.load(checkpoint("llama"))
    other = ModelHandle.load(checkpoint("llama", seed=1))
    ex = open_executor("cpu")
    engine = _engine(handle, DraftPolicy.DraftModel(other, k=8, min_k=8), ex, block_size=4)
    prompt = handle.text().encode(REPEATING)
    held: list[tuple[int, int]] = []
    rid = engine.submit(GenerateRequest(prompt, max_new=24, ignore_eos=True))
    done = None
    while done is None:
        for event in engine.step():
            if isinstance(event, FinishedEvent):
                done = event.generation
        seq = next((s for s in engine.scheduler.running if s.id == rid), None)
        if seq is not None and seq.pending == 1:  # between steps: blocks for the kept positions and the next
            held.append((len(seq.blocks), engine.pool.blocks_for(seq.computed + 1)))
    assert held and all(have <= need for have, need in held)  # nothing held past the kept run
    c = engine.speculation.counters
    assert c.proposed - c.accepted >= 8  # drafts were rejected, their positions' blocks went back
    solo = Driver(handle, ex, DriverOptions(capacity=OPTIONS["capacity"], prefill_chunk=16))
    assert done.tokens == solo.generate(GenerateRequest(prompt, max_new=24, ignore_eos=True)).tokens
    # a follow-up that shares the prompt and the kept output finds their full blocks in the prefix cache
    follow = prompt + done.tokens[:12] + PLAIN[:5]
    again = engine.generate(GenerateRequest(follow, max_new=16, ignore_eos=True))
    assert again.timings.reused_tokens > len(prompt)
    assert again.tokens == solo.generate(GenerateRequest(follow, max_new=16, ignore_eos=True)).tokens


def test_a_pool_too_small_for_every_sequence_preempts_and_stays_exact(checkpoint):
    """Drafts take only blocks the pool has to spare; sequences preempted for the plain tokens of others are
    recomputed and still give their plain tokens."""
    handle = ModelHandle.load(checkpoint("llama"))
    ex = open_executor("cpu")
    requests = [GenerateRequest(p, max_new=30, ignore_eos=True) for p in _prompts(handle)]
    solo = Driver(handle, ex, DriverOptions(capacity=OPTIONS["capacity"], prefill_chunk=16))
    plain = [solo.generate(r).tokens for r in requests]
    engine = _engine(handle, DraftPolicy.PromptLookup(k=6), ex, block_size=4, kv_blocks=40, prefix_cache=False)
    assert [g.tokens for g in engine.generate_batch(requests)] == plain
    assert engine.counters().preemptions > 0 and engine.speculation.counters.accepted > 0
    assert engine.pool.held == 0


def test_no_speculation_above_draft_max_batch(checkpoint):
    handle = ModelHandle.load(checkpoint("llama"))
    ex = open_executor("cpu")
    requests = [GenerateRequest(p, max_new=16, ignore_eos=True) for p in _prompts(handle)]
    off = _engine(handle, DraftPolicy.PromptLookup(), ex, draft_max_batch=3)  # 4 requests run at once
    plain = _engine(handle, DraftPolicy.OFF, ex)
    first_steps: list[int] = []
    ids = [off.submit(r) for r in requests]
    while off.in_flight:
        off.step()
        if len(off.scheduler.running) > 3:
            first_steps.append(off.speculation.counters.proposed)
    assert first_steps and set(first_steps) == {0}  # nothing proposed while four ran
    assert ids == list(range(4))
    got = [g.tokens for g in _engine(handle, DraftPolicy.PromptLookup(), ex, draft_max_batch=0)
           .generate_batch(requests)]
    assert got == [g.tokens for g in plain.generate_batch(requests)]


def test_sampled_requests_speculate_and_finish(checkpoint):
    """Seeded sampling under prompt lookup in the engine: the rejection rule's path runs, each request gives
    as many tokens as asked, and the same seeds give the same tokens again."""
    handle = ModelHandle.load(checkpoint("llama"))
    ex = open_executor("cpu")

    def run() -> list[list[int]]:
        requests = [GenerateRequest(p, max_new=20, ignore_eos=True,
                                    sampler=Sampler(temperature=0.7, top_k=20, seed=i))
                    for i, p in enumerate(_prompts(handle))]
        engine = _engine(handle, DraftPolicy.PromptLookup(k=4), ex)
        out = [g.tokens for g in engine.generate_batch(requests)]
        assert engine.speculation.counters.verify_steps > 0
        return out

    first = run()
    assert all(len(t) == 20 for t in first) and run() == first


def test_sampling_in_the_engine_keeps_the_target_distribution(checkpoint):
    """Seeded draws of the next 4 tokens, 8 requests a step under prompt lookup, against the exact joint
    distribution of the plain sampler (chi-square)."""
    handle = ModelHandle.load(checkpoint("llama"))
    ex = open_executor("cpu")
    options = DriverOptions(capacity=48, prefill_chunk=32)
    seed_prompt = handle.text().encode("The capital of")
    # the prompt ends with the model's own greedy continuation, so that prompt lookup finds likely proposals
    prompt = seed_prompt + Driver(handle, ex, options).generate(GenerateRequest(seed_prompt, max_new=10)).tokens
    engine = Driver(handle, ex, DriverOptions(capacity=48, prefill_chunk=32, block_size=8, kv_blocks=64,
                                              max_running=8, draft=DraftPolicy.PromptLookup(max_ngram=2, k=3)))
    engine = engine.serve(Layout.PAGED)
    n, draws = 4, 2000
    counts: dict[tuple[int, ...], int] = {}
    for first in range(0, draws, 8):
        requests = [GenerateRequest(prompt, max_new=n, sampler=spec_sampling.sampler(seed), ignore_eos=True)
                    for seed in range(first, first + 8)]
        for g in engine.generate_batch(requests):
            counts[tuple(g.tokens)] = counts.get(tuple(g.tokens), 0) + 1
    c = engine.speculation.counters
    assert c.proposed > draws // 2 and 0 < c.accepted < c.proposed  # the rule both kept and rejected proposals
    joint = spec_sampling.exact_joint(Driver(handle, ex, options), prompt, n)
    assert set(counts) <= set(joint), "a draw outside the target's support"
    assert spec_sampling.chi_square_p(counts, joint, draws) > 1e-3


def test_mtp_is_refused_in_the_paged_layout(checkpoint, tmp_path):
    path = moe.build(tmp_path / "v3", "deepseek_v3", torch.float32)
    moe.add_nextn_layer(path, tmp_path / "donor")
    driver = Driver(ModelHandle.load(path), open_executor("cpu"), DriverOptions(**OPTIONS, draft=DraftPolicy.Mtp(1)))
    with pytest.raises(Unsupported, match="paged"):
        driver.serve(Layout.PAGED)
