"""The serving engine (paged KV, several requests sharing steps) on placed drivers of two ranks: each request's
tokens and logits equal those of the same engine on one unplaced driver."""

from __future__ import annotations

import numpy as np
import placed_ranks

from poot_core.distributed import Coordinator

PROMPTS = [[(3 * i + 7 * r) % 240 + 3 for i in range(6 + 5 * r)] for r in range(5)]  # 5 requests, 6-26 tokens
NEW = 5


def test_paged_engine_on_two_ranks(tiny_checkpoint, moe_checkpoint, hybrid_checkpoint):
    checkpoints = {"llama": tiny_checkpoint("llama"), "qwen3": tiny_checkpoint("qwen3"),
                   "mixtral": moe_checkpoint("mixtral"), "lfm2": hybrid_checkpoint("lfm2"),
                   "granite_moe": hybrid_checkpoint("granite_moe")}  # recurrent state slots beside the KV blocks
    jobs = [(f"{name}:{placement}", str(path), placement, PROMPTS, NEW)
            for name, path in checkpoints.items() for placement in ("tensor", "pipeline")]
    placed = Coordinator.spawn(2, placed_ranks.paged_batch, jobs, timeout=600.0, collective_timeout=60.0,
                               threads=1)[0]
    alone = placed_ranks.paged_batch(None, [(name, str(path), None, PROMPTS, NEW)
                                            for name, path in checkpoints.items()])
    bad = []
    for key, runs in placed.items():
        for r, ((tokens, logits), (ref_tokens, ref_logits)) in enumerate(zip(runs, alone[key.split(":")[0]],
                                                                               strict=True)):
            err = float(np.abs(logits - ref_logits).max() / np.abs(ref_logits).max())
            if tokens != ref_tokens or not err <= 1e-5:
                bad.append(f"{key} request {r}: tokens {tokens} against {ref_tokens}, logits {err:.2e}")
    assert len(placed) == len(jobs) and bad == []


def test_images_on_a_placed_engine_are_refused(tmp_path):
    """A vision model's text runs placed (test_placed_families covers the families); a request with image
    features is refused by name before any work, on every rank."""
    from helpers import vision

    path = vision.checkpoint(tmp_path / "smolvlm")
    results = Coordinator.spawn(2, placed_ranks.embeddings_refused, str(path), timeout=600.0,
                                collective_timeout=60.0, threads=1)
    assert all("prompt embeddings on a placed driver" in r for r in results), results


def test_pipeline_steps_run_as_micro_batches(tiny_checkpoint):
    """On a two-stage pipeline with micro_batches=2 a step of more than one sequence runs as two parts (the second
    stage works on the first part while the first stage runs the second), with the tokens of whole steps."""
    path = str(tiny_checkpoint("llama"))
    runs = Coordinator.spawn(2, placed_ranks.micro_batched, path, PROMPTS, NEW, timeout=600.0,
                             collective_timeout=60.0, threads=1)
    for ranks in runs:
        (whole, steps, parted), (micro, micro_steps, micro_parted) = ranks[1], ranks[2]
        assert micro == whole and micro_steps == steps
        assert parted == 0 and micro_parted > 0
    assert runs[0][2][0] == runs[1][2][0]


def test_micro_batches_cut_between_sequences_at_equal_shares():
    from poot_core.driver.engine import micro_batches

    def cut(counts: list[int], parts: int) -> list[list[int]]:
        return [[c for _, c in part] for part in micro_batches([(object(), c) for c in counts], parts)]

    assert cut([1, 1, 1, 1], 2) == [[1, 1], [1, 1]]
    assert cut([10, 1, 1], 2) == [[10], [1, 1]]
    assert cut([1, 1, 10], 2) == [[1, 1], [10]]
    assert cut([3, 3, 3], 3) == [[3], [3], [3]] and cut([5], 4) == [[5]] and cut([2, 2], 4) == [[2], [2]]
    assert cut([4, 1, 1, 1, 1], 2) == [[4], [1, 1, 1, 1]]
