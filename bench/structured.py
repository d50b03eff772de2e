"""Structured output on the CPU: decode tok/s of SmolLM2-135M-Instruct (the packaged GGUF Q4_1) at batch 1 with a
JSON-schema constraint beside the same request without one, in the same run, rounds interleaved; plus the
one-time costs (the tokenizer's trie, built once per vocabulary; compiling the schema) and the per-token cost of
the constraint itself (mask, applying it to the logits, advancing), replayed over the constrained reply.

  python bench/structured.py [--new 64] [--repeats 3] [--threads 1]

Writes bench/results/structured.json. Target: <= 10% slower per token with the constraint.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import common  # noqa: E402
from helpers import smollm  # noqa: E402
from poot_core import Constraint, Driver, DriverOptions, GenerateRequest, ModelHandle, open_executor  # noqa: E402
from poot_core.driver import constraints  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9.]+$"},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 1, "maxItems": 5},
    "address": {"type": "object", "properties": {"street": {"type": "string", "maxLength": 40},
                                                 "city": {"type": "string", "maxLength": 30},
                                                 "country": {"enum": ["France", "Germany", "Italy", "Spain"]}},
                "required": ["city", "country"]}},
    "required": ["name", "age", "hobbies", "address"]}
PROMPT = "Invent a person who lives in Europe and describe them as JSON: name, age, email, hobbies and address."


def _rate(driver: Driver, ids: list[int], new: int, constraint: Constraint | None) -> dict[str, Any]:
    driver.reset()
    r = driver.generate(GenerateRequest(ids, max_new=new, ignore_eos=constraint is None, constraint=constraint))
    return {"decode_tok_s": r.timings.decode_tok_s, "tokens": len(r.tokens), "stop_reason": r.stop_reason,
            "text": r.text, "ids": r.tokens}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, default=64, help="most new tokens per run")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of both requests; the best of each kept")
    ap.add_argument("--threads", type=int, default=None, help="torch's CPU threads")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    handle = ModelHandle.load(smollm.gguf_path())
    driver = Driver(handle, open_executor("cpu"), DriverOptions(capacity=512, prefill_chunk=128)).serve()
    text = handle.text()
    ids = text.encode_chat(text.render_chat_value([{"role": "user", "content": PROMPT}]))
    vocab, eos = handle.config().vocab_size, driver._eos_ids()

    t0 = time.perf_counter()
    constraints.tokenizer_info(text.vocab.tokenizer, vocab, eos)
    trie_s = time.perf_counter() - t0
    constraint = Constraint.json_schema(SCHEMA)
    compiles = []
    for _ in range(5):
        t0 = time.perf_counter()
        constraints.compile_constraint(constraint, text.vocab.tokenizer, vocab, eos).allowed()  # first mask too
        compiles.append(time.perf_counter() - t0)

    _rate(driver, ids, 8, None)  # warm-up: programs prepared
    best: dict[str, dict[str, Any]] = {}
    for _ in range(args.repeats):
        for name, c in (("plain", None), ("json_schema", constraint)):
            r = _rate(driver, ids, args.new, c)
            if name not in best or r["decode_tok_s"] > best[name]["decode_tok_s"]:
                best[name] = r

    # the constraint's own cost per token, replayed over the constrained reply
    reply = best["json_schema"]["ids"]
    matcher = constraints.compile_constraint(constraint, text.vocab.tokenizer, vocab, eos)
    logits = np.random.default_rng(0).standard_normal(vocab).astype(np.float32)
    per_token = []
    for token in reply:
        t0 = time.perf_counter()
        matcher.apply(logits)
        matcher.advance(token)
        per_token.append(time.perf_counter() - t0)

    plain, constrained = best["plain"], best["json_schema"]
    slower = 1.0 - constrained["decode_tok_s"] / plain["decode_tok_s"]
    load = os.getloadavg()
    result = {"model": "SmolLM2-135M-Instruct Q4_1 (GGUF)", "batch": 1, "new_tokens": args.new,
              "load_average": load, "plain_decode_tok_s": plain["decode_tok_s"],
              "constrained_decode_tok_s": constrained["decode_tok_s"], "slower_per_token": slower,
              "constrained_tokens": constrained["tokens"], "constrained_stop_reason": constrained["stop_reason"],
              "constrained_text": constrained["text"], "tokenizer_trie_seconds": trie_s,
              "schema_compile_seconds_median": statistics.median(compiles),
              "constraint_us_per_token_median": 1e6 * statistics.median(per_token),
              "constraint_us_per_token_mean": 1e6 * statistics.fmean(per_token),
              "constraint_us_per_token_max": 1e6 * max(per_token),
              "constraint_share_of_plain_step": statistics.fmean(per_token) * plain["decode_tok_s"]}
    print(f"decode tok/s: plain {plain['decode_tok_s']:.1f}, JSON schema {constrained['decode_tok_s']:.1f} "
          f"({100 * slower:+.1f}% slower; {constrained['tokens']} tokens, {constrained['stop_reason']})")
    print(f"one-time: tokenizer trie {1e3 * trie_s:.0f} ms (once per vocabulary), schema compile + first mask "
          f"{1e3 * statistics.median(compiles):.1f} ms (median of 5)")
    print(f"constraint per token: {result['constraint_us_per_token_median']:.0f} us median, "
          f"{result['constraint_us_per_token_mean']:.0f} us mean, {result['constraint_us_per_token_max']:.0f} us max "
          f"({100 * result['constraint_share_of_plain_step']:.1f}% of a plain step, before overlap with it); "
          f"load average {load[0]:.1f}")
    print(f"reply: {constrained['text']}")
    print(f"wrote {common.write('structured', result)}")


if __name__ == "__main__":
    main()
