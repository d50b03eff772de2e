"""Placed drivers (Driver.placed over gloo, spawned ranks) against the one-process driver on the same
checkpoints: logits over a chunked prefill (f32, <= 1e-5 relative) and greedy tokens, for every family kind.

One spawned group runs all the checks of a rank count (starting processes that import torch costs seconds)."""

from __future__ import annotations

from pathlib import Path

import placed_ranks
import torch

from helpers import gguf_models, tiny
from poot_core.distributed import Coordinator

PROMPT = [(5 * i + 11) % 240 + 3 for i in range(20)]  # 3 prefill chunks of 8
NEW = 6
DENSE = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]
MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"]  # experts by features, latent by heads
HYBRID = ["lfm2", "mamba2", "granitemoehybrid", "granite_moe", "bamba", "qwen3next"]  # recurrent layers and attention
SPAWN = {"timeout": 600.0, "collective_timeout": 60.0, "threads": 1}


def one_kv_head(path: Path) -> Path:
    """A tiny llama with 4 query heads and one key/value head: under two ranks that head is replicated."""
    import transformers as tf

    config = tiny.tiny_config("llama")
    config.num_key_value_heads = 1
    torch.manual_seed(1)
    model = tf.LlamaForCausalLM(config)
    tiny._randomize(model, 1)
    model.save_pretrained(path)
    tiny.save_tokenizer(path)
    return path


def check(results: dict, checkpoints: dict[str, Path]) -> list[str]:
    """What differs from the one-process run, per job key."""
    bad = []
    refs = {}
    for key, got in results.items():
        name = key.split(":")[0]
        if isinstance(got, str):
            bad.append(f"{key}: {got}")
            continue
        if name not in refs:
            refs[name] = placed_ranks.single(str(checkpoints[name]), PROMPT, NEW)
        logits, tokens = refs[name]
        err = tiny.rel_error(got[0], torch.from_numpy(logits))
        if not err <= 1e-5 or got[1] != tokens:
            bad.append(f"{key}: logits {err:.2e} of the one-process run; tokens {got[1]} against {tokens}")
    return bad


def test_two_ranks_equal_one_process(tiny_checkpoint, moe_checkpoint, hybrid_checkpoint, tmp_path):
    checkpoints = {arch: tiny_checkpoint(arch) for arch in DENSE}
    checkpoints |= {arch: moe_checkpoint(arch) for arch in MOE}
    checkpoints |= {arch: hybrid_checkpoint(arch) for arch in HYBRID}
    checkpoints["one_kv_head"] = one_kv_head(tmp_path / "kv1")
    for kind in ("Q8_0", "Q4_K"):  # Q4_K's 256-value blocks: the 128-column o_proj slices stay whole (replicated)
        checkpoints[kind] = gguf_models.build(tmp_path / kind, kind)[0]
    jobs = [(f"{name}:{placement}", str(path), placement, PROMPT, NEW)
            for name, path in checkpoints.items() for placement in ("tensor", "pipeline")]
    results = Coordinator.spawn(2, placed_ranks.logits_and_tokens, jobs, **SPAWN)[0]
    assert len(results) == len(jobs)
    assert check(results, checkpoints) == []


def test_three_ranks(tiny_checkpoint):
    checkpoints = {arch: tiny_checkpoint(arch) for arch in ("llama", "gemma3", "qwen3")}
    jobs = [(f"{name}:pipeline", str(path), "pipeline", PROMPT, NEW) for name, path in checkpoints.items()]
    jobs.append(("llama:tensor", str(checkpoints["llama"]), "tensor", PROMPT, NEW))
    results = Coordinator.spawn(3, placed_ranks.logits_and_tokens, jobs, **SPAWN)[0]
    refused = results.pop("llama:tensor")
    # 4 query heads do not split over 3 ranks: a typed refusal that names them, on every rank, before any weight
    assert isinstance(refused, str) and refused.startswith("Unsupported") and "4 attention heads over 3 ranks" \
        in refused, refused
    assert check(results, checkpoints) == []


def test_one_rank_runs_unplaced(tiny_checkpoint):
    """A coordinator of one rank (no process group) runs the placed driver in this process, unchanged."""
    from poot_core.distributed import Coordinator as C

    path = tiny_checkpoint("llama")
    got = placed_ranks.logits_and_tokens(C(0, 1, key="one"), [("llama", str(path), "tensor", PROMPT, NEW)])
    logits, tokens = placed_ranks.single(str(path), PROMPT, NEW)
    assert tiny.rel_error(got["llama"][0], torch.from_numpy(logits)) == 0.0 and got["llama"][1] == tokens
