"""The serving engine (paged KV, several requests sharing steps) on placed drivers of two ranks: each request's
tokens and logits equal those of the same engine on one unplaced driver, image requests included."""

from __future__ import annotations

import dataclasses

import numpy as np
import placed_ranks

from poot_core.distributed import Coordinator

PROMPTS = [[(3 * i + 7 * r) % 240 + 3 for i in range(6 + 5 * r)] for r in range(5)]  # 5 requests, 6-26 tokens
NEW = 5


def _mismatches(placed: dict, alone: dict) -> list[str]:
    """Each placed run ("family:placement") against the unplaced engine's: requests whose tokens differ or whose
    logits are not within 1e-5 relative."""
    bad = []
    for key, runs in placed.items():
        for r, ((tokens, logits), (ref_tokens, ref_logits)) in enumerate(zip(runs, alone[key.split(":")[0]],
                                                                               strict=True)):
            err = float(np.abs(logits - ref_logits).max() / np.abs(ref_logits).max())
            if tokens != ref_tokens or not err <= 1e-5:
                bad.append(f"{key} request {r}: tokens {tokens} against {ref_tokens}, logits {err:.2e}")
    return bad


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
    assert len(placed) == len(jobs) and _mismatches(placed, alone) == []


def test_images_on_a_placed_engine(tmp_path):
    """Requests with image features (prompt embeddings) on a placed serving engine, tensor parallel and pipeline:
    SmolVLM (features spliced in), Qwen2.5-VL (rope by M-RoPE sections, which the tensor-parallel pass splits by
    heads like any rope) and Gemma 3 (an image's tokens attend to each other both ways): each request's tokens
    and logits equal one unplaced engine's, beside a text-only request."""
    from poot_family_vision.runtime import VisionLanguageModel

    from helpers import gemma3_vision, qwen25vl, vision
    from poot_core import ModelHandle, open_executor

    checkpoints = {"smolvlm": vision.checkpoint(tmp_path / "smolvlm"),
                   "qwen2_5_vl": qwen25vl.chat_checkpoint(tmp_path / "qwen2_5_vl")[0],
                   "gemma3": gemma3_vision.chat_checkpoint(tmp_path / "gemma3")[0]}
    requests = {}
    for name, path in checkpoints.items():
        vlm = VisionLanguageModel(ModelHandle.load(path), open_executor("cpu"), capacity=64)
        requests[name] = [vlm.request(vision.prompt_for(vlm, images), images, max_new=NEW, ignore_eos=True)
                          for images in (vision.IMAGES[:1], vision.IMAGES[1:2], [])]
    jobs = [(f"{name}:{placement}", str(path), placement, requests[name], NEW)
            for name, path in checkpoints.items() for placement in ("tensor", "pipeline")]
    placed = Coordinator.spawn(2, placed_ranks.paged_batch, jobs, timeout=600.0, collective_timeout=60.0,
                               threads=1)[0]
    alone = placed_ranks.paged_batch(None, [(name, str(path), None, requests[name], NEW)
                                            for name, path in checkpoints.items()])
    # the comparison can fail: without its image features a prompt's logits differ
    blind = placed_ranks.paged_batch(None, [(name, str(path), None, [dataclasses.replace(r, embeddings=None)
                                                                     for r in requests[name][:1]], NEW)
                                            for name, path in checkpoints.items()])
    for name in checkpoints:
        assert float(np.abs(blind[name][0][1] - alone[name][0][1]).max()) > 1e-3, name
    assert len(placed) == len(jobs) and _mismatches(placed, alone) == []


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
