"""CPU decode speed of a mixtral-shaped model (8 experts, top-2) beside a dense model with the same active
parameter count (its MLP is as wide as the two chosen experts together), both random bf16 checkpoints built
here with transformers. Decode cost should follow active parameters, not total ones.

  python bench/cpu_moe.py [--new 48] [--layers 6] [--hidden 768]

Prints decode tok/s for both, parameter counts, and writes bench/results/cpu_moe.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import common  # noqa: E402
from helpers import tiny  # noqa: E402

EXPERTS, TOP_K = 8, 2


def configs(layers: int, hidden: int) -> dict[str, Any]:
    import transformers as tf

    expert_width = 2 * hidden
    common_args: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 256,
        max_position_embeddings=1024,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    return {
        "mixtral": tf.MixtralConfig(
            **common_args, intermediate_size=expert_width, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K
        ),
        "dense": tf.MistralConfig(**common_args, intermediate_size=TOP_K * expert_width),
    }


def build(path: Path, config: Any) -> dict[str, int]:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_config(config)
    tiny._randomize(model, 0)
    model.to(torch.bfloat16).save_pretrained(path)
    tiny.save_tokenizer(path)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - experts + experts * TOP_K // EXPERTS
    return {"total_params": total, "active_params": active}


def decode_rate(path: Path, new: int) -> float:
    from poot_core import Driver, DriverOptions, GenerateRequest, ModelHandle, open_executor

    driver = Driver(ModelHandle.load(path), open_executor("cpu"), DriverOptions(capacity=256, prefill_chunk=64))
    prompt = [(7 * i + 3) % 250 + 2 for i in range(32)]
    driver.serve().generate(GenerateRequest(prompt, max_new=4, ignore_eos=True))  # warm up
    best = 0.0
    for _ in range(2):
        driver._cached = []  # no prefix reuse between runs
        result = driver.generate(GenerateRequest(prompt, max_new=new, ignore_eos=True))
        best = max(best, result.timings.decode_tok_s)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new", type=int, default=48)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=768)
    args = parser.parse_args()
    results: dict[str, Any] = {
        "threads": torch.get_num_threads(),
        "experts": EXPERTS,
        "top_k": TOP_K,
        "layers": args.layers,
        "hidden": args.hidden,
        "new_tokens": args.new,
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in configs(args.layers, args.hidden).items():
            path = Path(tmp) / name
            info = build(path, config)
            info["decode_tok_s"] = decode_rate(path, args.new)
            results[name] = info
            print(
                f"{name:8s} total {info['total_params'] / 1e6:7.1f} M params, "
                f"active {info['active_params'] / 1e6:7.1f} M,"
                f" decode {info['decode_tok_s']:7.1f} tok/s (bf16, CPU, {results['threads']} threads)"
            )
    ratio = results["mixtral"]["decode_tok_s"] / results["dense"]["decode_tok_s"]
    results["moe_over_dense"] = ratio
    print(
        f"mixtral-shaped / dense of equal active parameters: {ratio:.2f}x "
        f"(total parameters {results['mixtral']['total_params'] / results['dense']['total_params']:.1f}x)"
    )
    print("wrote", common.write("cpu_moe", results))


if __name__ == "__main__":
    main()
