"""Speculative decoding: with every draft policy the greedy output is the plain output token for token (every
family, prompts that repeat and prompts that do not, stops, end of sequence, callbacks and max_new inside an
accepted run, the CPU executor and the Triton executor under its interpreter); sampled tokens keep the
target's distribution (chi-square over seeded draws); bad policies are refused before any tensor is read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import spec_models, spec_sampling, tiny
from helpers.spec_models import DENSE, MOE, PLAIN, PROBES, REPEATING
from poot_core import (
    DraftPolicy,
    Driver,
    DriverOptions,
    GenerateRequest,
    Generation,
    GenerationControl,
    ModelHandle,
    RequestError,
    Sampler,
    open_executor,
)

OPTIONS = dict(capacity=160, prefill_chunk=16)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """checkpoint(arch, seed) -> a tiny float32 checkpoint of any family; seeds give other weights, one vocabulary."""
    return spec_models.checkpoint_maker(tmp_path_factory)


def _policies(handle: ModelHandle, other: ModelHandle) -> dict[str, object]:
    return {
        "lookup": DraftPolicy.PromptLookup(),
        "lookup-k3-bigram": DraftPolicy.PromptLookup(max_ngram=2, min_ngram=2, k=3),
        "self-draft": DraftPolicy.DraftModel(handle, k=4),  # proposes the target's own tokens: all kept
        "other-draft": DraftPolicy.DraftModel(other, k=3),  # other weights: mostly rejected
    }


def _generate(handle, draft, request, executor=None, on_token=None):
    options = DriverOptions(**OPTIONS, draft=draft)
    return Driver(handle, executor or open_executor("cpu"), options).generate(request, on_token)


@pytest.mark.parametrize("arch", DENSE + MOE)
def test_greedy_output_is_the_plain_output_with_every_policy(checkpoint, arch):
    handle = ModelHandle.load(checkpoint(arch))
    other = ModelHandle.load(checkpoint(arch, seed=1))
    ex = open_executor("cpu")
    proposed = accepted = 0
    for prompt in (handle.text().encode(REPEATING), PLAIN):
        request = GenerateRequest(prompt, max_new=40)
        plain = _generate(handle, DraftPolicy.OFF, request, ex)
        for name, draft in _policies(handle, other).items():
            spec = _generate(handle, draft, request, ex)
            assert (spec.tokens, spec.text, spec.stop_reason) == (plain.tokens, plain.text, plain.stop_reason), name
            t = spec.timings
            assert t.proposed >= t.accepted and t.verify_steps > 0, name
            if name == "self-draft":
                assert t.acceptance_rate == 1.0
            proposed, accepted = proposed + t.proposed, accepted + t.accepted
    assert 0 < accepted < proposed  # runs were kept and proposals rejected (and rolled back) on the way


def _first_fresh(items: list, ok: list[bool]) -> int | None:
    """An index 1..4 whose item did not come earlier (and ok there): under a self-draft of k=4 the first verify
    step yields indices 1..5 (four kept proposals, then the target's own token), so a stop there falls inside
    the run."""
    return next((i for i in range(1, 5) if items[i] not in items[:i] and ok[i]), None)


def _with_eos(path: Path, dest: Path, eos: int) -> Path:
    shutil.copytree(path, dest)
    (dest / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, eos]}))
    return dest


def _probe(handle: ModelHandle, ex, sampler: Sampler) -> tuple[list[int], Generation, list[str], int, int]:
    """The first probe prompt whose plain output has, early on, a fresh token (no stop id up to it) and a
    fresh streamed piece (not in the text before it): where an end of sequence and a stop string will go."""
    stop_ids = set(handle.text().vocab.stop_ids) | set(handle.config().eos_ids)
    for text in PROBES:
        prompt = handle.text().encode(text)
        pieces: list[str] = []
        request = GenerateRequest(prompt, max_new=12, sampler=sampler, ignore_eos=True)
        first = _generate(handle, DraftPolicy.OFF, request, ex, lambda t, p, seen=pieces: seen.append(p))
        toks, texts = first.tokens, ["".join(pieces[:i]) for i in range(len(pieces))]
        at_eos = _first_fresh(toks, [not stop_ids & set(toks[: i + 1]) for i in range(len(toks))])
        at_stop = _first_fresh(pieces, [bool(p) and p not in texts[i] + p[:-1] for i, p in enumerate(pieces)])
        if at_eos is not None and at_stop is not None:
            return prompt, first, pieces, at_eos, at_stop
    raise AssertionError(f"no probe prompt gives {handle.family.name} a fresh token and piece early on")


@pytest.mark.parametrize("arch", DENSE + MOE)
def test_stops_eos_max_new_and_callbacks_inside_an_accepted_run(checkpoint, arch, tmp_path):
    path = checkpoint(arch)
    handle = ModelHandle.load(path)
    ex = open_executor("cpu")
    # Temperature 0 with a strong repeat penalty: deterministic picks that do not settle on one token.
    sampler = Sampler(temperature=0.0, repeat_penalty=3.0)
    prompt, first, pieces, at_eos, at_stop = _probe(handle, ex, sampler)
    eos_handle = ModelHandle.load(_with_eos(path, tmp_path / "eos", first.tokens[at_eos]))
    cases = {  # name: (handle, request, break after this many tokens, where it must end)
        "eos": (eos_handle, GenerateRequest(prompt, max_new=12, sampler=sampler), None, at_eos),
        "stop": (handle, GenerateRequest(prompt, max_new=12, sampler=sampler, stops=[pieces[at_stop]],
                                         ignore_eos=True), None, at_stop),
        "length": (handle, GenerateRequest(prompt, max_new=6, sampler=sampler, ignore_eos=True), None, 5),
        "callback": (handle, GenerateRequest(prompt, max_new=12, sampler=sampler, ignore_eos=True), 3, 2),
    }
    for name, (h, request, break_after, end) in cases.items():
        def run(draft, h=h, request=request, break_after=break_after):
            seen: list[tuple[int, str]] = []

            def on_token(token: int, piece: str) -> GenerationControl:
                seen.append((token, piece))
                done = break_after is not None and len(seen) == break_after
                return GenerationControl.BREAK if done else GenerationControl.CONTINUE

            return _generate(h, draft, request, ex, on_token), seen

        plain, plain_seen = run(DraftPolicy.OFF)
        spec, spec_seen = run(DraftPolicy.DraftModel(h, k=4, min_k=4))  # always 4
        assert plain.stop_reason == name and len(plain.tokens) == end + 1, name
        assert (spec.tokens, spec.text, spec.stop_reason) == (plain.tokens, plain.text, plain.stop_reason), name
        assert spec_seen == plain_seen, name  # the same callbacks, piece by piece
        # It ended in the first verify step: inside its run of kept proposals, or (length) at its end, the
        # proposal cut to what the limit leaves.
        assert spec.timings.verify_steps == 1, name
        assert spec.timings.accepted >= end if name != "length" else spec.timings.proposed == end - 1, name


def test_rejected_positions_are_rolled_back_for_the_next_request(checkpoint):
    """After speculative requests with rejections, a follow-up that reuses the cached prefix decodes what a
    fresh driver decodes: the cache bookkeeping holds only tokens whose K/V is in place."""
    handle = ModelHandle.load(checkpoint("mistral"))
    other = ModelHandle.load(checkpoint("mistral", seed=1))
    ex = open_executor("cpu")
    driver = Driver(handle, ex, DriverOptions(**OPTIONS, draft=DraftPolicy.DraftModel(other, k=4)))
    prompt = handle.text().encode(REPEATING)
    first = driver.generate(GenerateRequest(prompt, max_new=30, ignore_eos=True))
    assert first.timings.proposed > first.timings.accepted  # some proposals were rejected
    follow = prompt + first.tokens[:-1] + PLAIN[:5]
    again = driver.generate(GenerateRequest(follow, max_new=20, ignore_eos=True))
    assert again.timings.reused_tokens == len(prompt) + len(first.tokens) - 1
    fresh = _generate(handle, DraftPolicy.OFF, GenerateRequest(follow, max_new=20, ignore_eos=True), ex)
    assert again.tokens == fresh.tokens
    np.testing.assert_array_equal(driver.logits(follow), Driver(handle, ex, DriverOptions(**OPTIONS)).logits(follow))


@pytest.mark.interpreter
def test_triton_executor_under_the_interpreter(tmp_path_factory):
    pytest.importorskip("triton")
    from poot_kernels_triton.executor import TritonExecutor

    # one decoder layer: the interpreter's cost is per kernel launch, and one layer has every op of a step
    handle = ModelHandle.load(tiny.build(tmp_path_factory.mktemp("qwen2-1"), "qwen2", layers=1))
    ex = TritonExecutor.on_interpreter()  # slow: a short prompt, a few tokens
    request = GenerateRequest(handle.text().encode("a + b\na + b\na + b\na +"), max_new=8)
    plain = _generate(handle, DraftPolicy.OFF, request, ex)
    assert plain.tokens == _generate(handle, DraftPolicy.OFF, request).tokens  # the CPU executor agrees
    # Prompt lookup, and a draft model on another executor (the CPU) than the target's.
    for draft in (DraftPolicy.PromptLookup(k=3), DraftPolicy.DraftModel(handle, k=3, executor=open_executor("cpu"))):
        spec = _generate(handle, draft, request, ex)
        assert spec.tokens == plain.tokens and spec.timings.accepted > 0


def test_a_draft_of_another_vocabulary_is_refused_before_tensors_are_read(checkpoint, tmp_path, monkeypatch):
    target = ModelHandle.load(checkpoint("llama"))
    other_tokens = tmp_path / "other-tokens"
    shutil.copytree(checkpoint("llama"), other_tokens)
    tiny.save_tokenizer(other_tokens, vocab_size=320)  # same config, a tokenizer with merges
    other_size = tmp_path / "other-size"
    shutil.copytree(checkpoint("llama"), other_size)
    config = json.loads((other_size / "config.json").read_text())
    (other_size / "config.json").write_text(json.dumps({**config, "vocab_size": 300}))

    def no_reads(self, name):
        raise AssertionError(f"tensor {name} read before the refusal")

    monkeypatch.setattr(type(target.store()), "get", no_reads)
    for path in (other_tokens, other_size):
        draft = DraftPolicy.DraftModel(ModelHandle.load(path), k=4)
        with pytest.raises(RequestError, match="tokenizer"):
            Driver(target, open_executor("cpu"), DriverOptions(**OPTIONS, draft=draft))
    with pytest.raises(RequestError):
        DraftPolicy.PromptLookup(max_ngram=1, min_ngram=2)
    with pytest.raises(RequestError):
        DraftPolicy.DraftModel(target, k=0)


# --- sampling: the rejection rule keeps the target's distribution ------------------------------------------
def _perturbed(path: Path, dest: Path, noise: float) -> Path:
    """A copy of a checkpoint with noise added to every weight: a draft whose distribution overlaps the
    target's without equalling it (random weights of another seed share almost no likely token with it)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(path, dest)
    g = torch.Generator().manual_seed(3)
    tensors = load_file(dest / "model.safetensors")
    tensors = {k: v + noise * v.std() * torch.randn(v.shape, generator=g) if v.numel() > 1 else v
               for k, v in tensors.items()}
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


@pytest.mark.parametrize("policy", ["lookup", "draft"])
def test_sampling_keeps_the_target_distribution(checkpoint, policy, tmp_path):
    handle = ModelHandle.load(checkpoint("llama"))
    other = ModelHandle.load(_perturbed(checkpoint("llama"), tmp_path / "noisy", 0.3))
    ex = open_executor("cpu")
    options = DriverOptions(capacity=48, prefill_chunk=32)
    seed_prompt = handle.text().encode("The capital of")
    # The prompt ends with the model's own greedy continuation, so that prompt lookup finds likely proposals.
    prompt = seed_prompt + Driver(handle, ex, options).generate(GenerateRequest(seed_prompt, max_new=10)).tokens
    draft = (DraftPolicy.PromptLookup(max_ngram=2, k=3) if policy == "lookup"
             else DraftPolicy.DraftModel(other, k=3))
    spec = Driver(handle, ex, DriverOptions(capacity=48, prefill_chunk=32, draft=draft))
    n, draws = 4, 2000
    counts: dict[tuple[int, ...], int] = {}
    proposed = accepted = 0
    for seed in range(draws):
        g = spec.generate(GenerateRequest(prompt, max_new=n, sampler=spec_sampling.sampler(seed), ignore_eos=True))
        counts[tuple(g.tokens)] = counts.get(tuple(g.tokens), 0) + 1
        proposed, accepted = proposed + g.timings.proposed, accepted + g.timings.accepted
    assert proposed > draws // 2 and 0 < accepted < proposed  # the rule both kept and rejected proposals
    joint = spec_sampling.exact_joint(Driver(handle, ex, options), prompt, n)
    assert set(counts) <= set(joint), "a draw outside the target's support"
    assert spec_sampling.chi_square_p(counts, joint, draws) > 1e-3
    if policy == "draft":
        # The same test tells the draft model's own distribution apart from the target's: it can fail.
        drafting = Driver(other, ex, options)
        q_counts: dict[tuple[int, ...], int] = {}
        for seed in range(draws // 4):
            request = GenerateRequest(prompt, max_new=n, sampler=spec_sampling.sampler(seed), ignore_eos=True)
            g = drafting.generate(request)
            q_counts[tuple(g.tokens)] = q_counts.get(tuple(g.tokens), 0) + 1
        assert spec_sampling.chi_square_p(q_counts, joint, draws // 4) < 1e-6


# --- the proposers and the length choice ---------------------------------------------------------------------
def _latest_match(history: list[int], max_n: int, min_n: int, k: int) -> list[int]:
    """Brute force: the longest n whose last n tokens occurred before; the latest such occurrence."""
    for n in range(min(max_n, len(history) - 1), min_n - 1, -1):
        tail = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start : start + n] == tail:
                follow = history[start + n :]
                return [follow[j % len(follow)] for j in range(k)]
    return []


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    from poot_core.driver.speculation import LookupProposer

    rng = np.random.default_rng(0)
    for trial in range(300):
        history = [int(t) for t in rng.integers(0, 6, size=int(rng.integers(2, 40)))]
        policy = DraftPolicy.PromptLookup(max_ngram=int(rng.integers(1, 4)), min_ngram=1, k=int(rng.integers(1, 9)))
        proposer = LookupProposer(policy)
        proposer.begin(history[:1])
        for end in range(2, len(history) + 1):  # grown token by token, as during decoding
            got = proposer.propose(history[:end], policy.k, Sampler.greedy()).tokens
            assert got == _latest_match(history[:end], policy.max_ngram, policy.min_ngram, policy.k), (trial, end)


def test_the_proposal_length_follows_measured_cost_and_acceptance():
    from poot_core.driver.speculation import LookupProposer, Speculation

    spec = Speculation(LookupProposer(DraftPolicy.PromptLookup()), k=8, min_k=1)
    assert spec.length() == 1  # nothing measured: it starts short
    spec.steps, spec.per_proposed = {1: 1.0, 2: 1.1}, 0.0
    assert spec.length() == 3  # and grows to steps twice as wide as the widest measured
    # Widths up to 4 cost a little more than decode, wider ones about 3 decode steps.
    spec.steps = {1: 1.0, 2: 1.2, 3: 1.25, 4: 1.3} | {w: 3.0 for w in range(5, 10)}
    spec.kept_tokens, spec.rejected = {0: 9.0}, {0: 1.0}  # 90% kept
    assert spec.length() == 3
    spec.per_proposed = 1.0  # a draft model as slow as the target: not worth it even when all is kept
    spec.kept_tokens, spec.rejected = {0: 10.0}, {0: 0.0}
    assert spec.length() == 0
    spec.per_proposed = 0.0
    spec.kept_tokens, spec.rejected = {0: 0.1}, {0: 9.9}  # 1% kept: plain decode steps
    assert spec.length() == 0
    fixed = Speculation(LookupProposer(DraftPolicy.PromptLookup()), k=4, min_k=4)
    assert fixed.length() == 4  # min_k = k: always k


def test_prompt_lookup_lengths_follow_how_often_each_match_length_was_kept():
    """Acceptance is estimated per grade (the n-gram length matched): where 3-gram matches were kept and 1-gram
    ones rejected, a 3-gram match gets the longest proposal and a 1-gram match none, in the driver's own loop."""
    from poot_core.driver.speculation import LookupProposer, Speculation

    proposer = LookupProposer(DraftPolicy.PromptLookup())
    history = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    assert proposer.grade(history) == 3 and proposer.grade([*history, 3]) == 0 and proposer.grade([*history, 1]) == 1
    spec = Speculation(proposer, k=15, min_k=1)
    spec.steps, spec.per_proposed = {w: 1.0 + 0.07 * (w - 1) for w in range(1, 17)}, 0.0  # the CPU's verify steps
    spec.kept_tokens, spec.rejected = {3: 9.5, 1: 0.2}, {3: 0.5, 1: 9.8}
    assert (spec.length(3), spec.length(1)) == (15, 0)
    assert 0 < spec.length(2) < 15  # not seen yet: the prior a = 0.75
    proposal = spec.propose(history, 100, Sampler.greedy())
    assert proposal is not None and proposal.tokens == [8, 9, 1, 2, 5, 6, 7] * 2 + [8]
    spec.kept(15, 2)  # counted against 3-gram matches only
    assert spec.acceptance(3) == pytest.approx((0.9 * 9.5 + 2) / (0.9 * 9.5 + 2 + 0.9 * 0.5 + 1))
    assert spec.acceptance(1) == pytest.approx(0.02)
    assert spec.propose([*history, 1], 100, Sampler.greedy()) is None  # a 1-gram match: a plain decode step
    # Whatever the estimate, the lengths are those of a few verify widths (2, 3, 4, 6, 8, 12, 16): few programs.
    lengths = set()
    for kept in np.linspace(0.5, 40.0, 60):
        spec.kept_tokens[2] = kept
        lengths.add(spec.length(2))
    assert lengths <= {0, 1, 2, 3, 5, 7, 11, 15} and len(lengths) >= 4
