"""`poot generate --tp N / --pp N`: the command spawns its ranks and prints rank 0's reply, the same greedy
tokens as one process; flag mistakes and refusals are one line before any rank starts or from rank 0."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from poot_core.cli.main import main

BASE = ["-p", "The capital of France is", "-n", "6", "--no-chat-template", "--json", "-c", "64", "--ignore-eos"]


def reply(capfd, *argv: str) -> dict:
    assert main(["generate", *argv]) == 0
    out = capfd.readouterr().out.strip().splitlines()
    assert len(out) == 1, out  # the other ranks print nothing
    return json.loads(out[0])


def test_tp_and_pp_print_the_one_process_tokens(tiny_checkpoint, capfd):
    model = str(tiny_checkpoint("qwen2"))
    alone = reply(capfd, "-m", model, *BASE)
    assert reply(capfd, "-m", model, *BASE, "--tp", "2")["tokens"] == alone["tokens"]
    assert reply(capfd, "-m", model, *BASE, "--pp", "2", "-ts", "2,1")["tokens"] == alone["tokens"]


def test_a_sampling_run_without_a_seed_samples_alike_on_every_rank(tiny_checkpoint, capfd, monkeypatch):
    """Each rank samples the next token itself: without a seed, the command draws one before the ranks start (here
    1234, drawn through a stand-in), so the ranks feed the model the same tokens and rank 0 prints what one
    process with that seed prints."""
    from poot_core.cli import placed

    model = str(tiny_checkpoint("qwen2"))
    sampled = [*BASE, "--temp", "1.5"]
    alone = reply(capfd, "-m", model, *sampled, "-s", "1234")
    monkeypatch.setattr(placed.np.random, "SeedSequence", lambda: SimpleNamespace(entropy=1234))
    assert reply(capfd, "-m", model, *sampled, "--tp", "2")["tokens"] == alone["tokens"]


@pytest.mark.parametrize(("flags", "words"), [
    (["--tp", "2", "--pp", "2"], "give one"),
    (["--tp", "0"], "--tp must be >= 1"),
    (["-ts", "3,1"], "give --pp N"),
    (["--pp", "2", "-ts", "3,1,1"], "3 shares for 2 ranks"),
    (["--pp", "2", "--lookup"], "speculative decoding"),
])
def test_flag_mistakes_are_refused_before_any_rank(tiny_checkpoint, capfd, flags, words):
    model = str(tiny_checkpoint("qwen2"))
    capfd.readouterr()  # building the checkpoint may print a progress bar; only the command's output counts
    assert main(["generate", "-m", model, *BASE, *flags]) == 1
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err
