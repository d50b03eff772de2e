"""CPU prefill of a small LFM2-shaped hybrid (gated short convolutions beside a few attention layers) beside a
llama of the same width, depth, heads and MLP, and beside transformers' forward of the same LFM2 weights.

Issue 21's CPU target: a 2048-token prefill of the LFM2 shape runs at the llama family's speed or better. Both
models have random float32 weights and run through poot's CPU executor in prompt chunks of the CPU's default
size (RunDefaults: 128 tokens), the recurrent state and KV carried from chunk to chunk as the Driver does;
transformers runs the whole prompt in one forward (its fastest way). The floor is the prompt's matmul FLOPs at
the machine's measured float32 matmul rate. Prints tok/s and writes bench/results/hybrid_prefill_cpu.json.

    python bench/hybrid_prefill_cpu.py                      # 2048 tokens, the default shape
    python bench/hybrid_prefill_cpu.py --tokens 256 --reps 1   # smoke
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hybrid_decode import RandomStore  # noqa: E402  (random weights under transformers' names)

import common  # noqa: E402

# A quarter of LFM2-350M (hidden 1024, 16 layers of which 6 attention): the "tiny LFM2 shape" of the issue.
SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=2048, vocab_size=8192)
LFM2_LAYERS = ["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "full_attention"]


def configs(tokens: int) -> dict[str, Any]:
    import transformers as tf

    common_fields = dict(SHAPE, max_position_embeddings=tokens, bos_token_id=0, eos_token_id=1, pad_token_id=0,
                         tie_word_embeddings=True)
    return {"lfm2": tf.Lfm2Config(**common_fields, block_auto_adjust_ff_dim=False, layer_types=LFM2_LAYERS,
                                  conv_L_cache=3),
            "llama": tf.LlamaConfig(**common_fields)}


def poot_prefill_s(config: Any, arch: str, tokens: int, chunk: int, reps: int) -> float:
    """Best seconds of a `tokens` prefill in `chunk`-token steps through poot's CPU executor."""
    from poot_core import Registry, open_executor

    executor = open_executor("cpu")
    family = Registry.builtin().resolve(arch)
    model_config = family.config_from_hf({**config.to_dict(), "architectures": [arch]})
    weights = executor.upload(RandomStore(config, torch.device("cpu"), torch.float32))
    shapes = {n: tuple(w.shape) for n, w in weights.items()} if isinstance(weights, dict) else \
        {n: tuple(w.shape) for n, w in weights.tensors.items()}
    program, graph = common.step_programs(family, model_config, executor, weights, shapes, tokens)(chunk)
    ids = np.random.default_rng(0).integers(2, SHAPE["vocab_size"], size=tokens)
    best = float("inf")
    for _ in range(reps):
        state = executor.allocate_state(graph)  # a fresh sequence: recurrent state from zeros
        t0 = time.perf_counter()
        for start in range(0, tokens, chunk):
            inputs = {"tokens": ids[None, start:start + chunk].astype(np.int64),
                      "positions": np.arange(start, start + chunk, dtype=np.int64)[None]}
            program.run(state, inputs)
        best = min(best, time.perf_counter() - t0)
    return best


def transformers_prefill_s(config: Any, tokens: int, reps: int) -> float:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_config(config).eval()
    model.load_state_dict(RandomStore(config, torch.device("cpu"), torch.float32).w, strict=False)
    ids = torch.from_numpy(np.random.default_rng(0).integers(2, SHAPE["vocab_size"], size=(1, tokens)))
    best = float("inf")
    with torch.inference_mode():
        for _ in range(reps):
            t0 = time.perf_counter()
            model(ids, use_cache=False, logits_to_keep=1)
            best = min(best, time.perf_counter() - t0)
    return best


def floor_s(tokens: int) -> tuple[float, float]:
    """(seconds, measured GFLOP/s): the linears' 2 * params FLOPs a token at torch's float32 matmul rate."""
    h, f = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    kv = h * SHAPE["num_key_value_heads"] // SHAPE["num_attention_heads"]
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * f  # attention's q, o and k, v (a conv layer's in/out are similar)
    flops = 2 * tokens * SHAPE["num_hidden_layers"] * per_layer
    a, b = torch.randn(512, h), torch.randn(h, f)
    torch.mm(a, b)
    t0 = time.perf_counter()
    for _ in range(20):
        torch.mm(a, b)
    rate = 20 * 2 * 512 * h * f / (time.perf_counter() - t0)
    return flops / rate, rate / 1e9


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=128, help="prompt chunk (the CPU's RunDefaults: 128)")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    cfg = configs(args.tokens)
    floor, gflops = floor_s(args.tokens)
    result: dict[str, Any] = {"shape": SHAPE, "lfm2_layers": LFM2_LAYERS, "tokens": args.tokens,
                              "chunk": args.chunk, "threads": torch.get_num_threads(), "floor_s": floor,
                              "matmul_GFLOPs": gflops}
    result["poot_lfm2_s"] = poot_prefill_s(cfg["lfm2"], "Lfm2ForCausalLM", args.tokens, args.chunk, args.reps)
    result["poot_llama_s"] = poot_prefill_s(cfg["llama"], "LlamaForCausalLM", args.tokens, args.chunk, args.reps)
    result["transformers_lfm2_s"] = transformers_prefill_s(cfg["lfm2"], args.tokens, args.reps)
    n = args.tokens
    common.log(f"{n}-token prefill, {torch.get_num_threads()} threads, floor {n / floor:.0f} tok/s "
               f"({gflops:.0f} GFLOP/s float32 matmul)")
    common.log(f"  poot LFM2          {n / result['poot_lfm2_s']:8.0f} tok/s")
    common.log(f"  poot llama (peer)  {n / result['poot_llama_s']:8.0f} tok/s  "
               f"LFM2/llama {result['poot_llama_s'] / result['poot_lfm2_s']:.2f}x (target >= 1.0x)")
    common.log(f"  transformers LFM2  {n / result['transformers_lfm2_s']:8.0f} tok/s")
    common.write("hybrid_prefill_cpu", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
