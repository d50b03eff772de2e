"""Structured output: decode speed with a JSON-schema constraint beside the same requests without one, in the same
run, rounds interleaved; plus the one-time costs (the tokenizer's trie, once per vocabulary; compiling the
schema with its first mask) and the constraint's own work per token (mask, applying it, advancing), replayed
over the constrained reply.

  python bench/structured.py [--new 64] [--repeats 3] [--threads 1]
      the CPU: SmolLM2-135M-Instruct (the packaged GGUF Q4_1), batch 1. Target: <= 10% slower per token.
  python bench/structured.py --backend cuda [--new 128] [--batch 64] [--layers 32] [--vocab FILE]
      the GPU: a Llama-3-8B-shaped model with random bf16 weights (bench/gpu_serve.py builds it) and Llama 3's
      tokenizer (llama.cpp's ggml-vocab-llama-bpe.gguf, which scripts/fetch_test_data.py fetches into
      .cache/testdata), at batch 1 (the Driver) and batch 64 (the serving engine, every row constrained, beside
      64 unconstrained rows). Target: <= 5% slower per token at batch 64.
  python bench/structured.py --backend cuda --small
      the GPU path on the CPU executor with a small model of the same vocabulary (checks the script).

The schema asks for a list of at least 64 people, so no reply completes within the new tokens: every request,
constrained or not, generates exactly --new tokens (end-of-sequence ignored), and the per-token times compare
like with like. The random model writes whatever the mask leaves it (still JSON, by the mask). Writes
bench/results/structured.json (CPU) or structured_cuda.json (--out NAME: NAME.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import common  # noqa: E402
from poot_core import Constraint, Driver, DriverOptions, GenerateRequest, Layout, ModelHandle  # noqa: E402
from poot_core.driver import constraints  # noqa: E402

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9.]+$"},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 1, "maxItems": 5},
    "address": {"type": "object", "properties": {"street": {"type": "string", "maxLength": 40},
                                                 "city": {"type": "string", "maxLength": 30},
                                                 "country": {"enum": ["France", "Germany", "Italy", "Spain"]}},
                "required": ["city", "country"]}},
    "required": ["name", "age", "hobbies", "address"]}
SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "items": PERSON, "minItems": 64}},
          "required": ["people"], "additionalProperties": False}
PROMPT = "Invent people who live in Europe and describe them as JSON: name, age, email, hobbies and address."
VOCAB = common.RESULTS.parent.parent / ".cache/testdata/llama.cpp/vocab/ggml-vocab-llama-bpe.gguf"
log = common.log


def one_time_costs(driver: Driver, constraint: Constraint) -> dict[str, float]:
    """The tokenizer's trie (built once per vocabulary) and the schema's compile with its first mask (median of 5)."""
    text, vocab, eos = driver.handle.text(), driver.config.vocab_size, driver._eos_ids()
    t0 = time.perf_counter()
    constraints.tokenizer_info(text.vocab.tokenizer, vocab, eos)
    trie = time.perf_counter() - t0
    compiles = []
    for _ in range(5):
        t0 = time.perf_counter()
        constraints.compile_constraint(constraint, text.vocab.tokenizer, vocab, eos)  # the first mask is in it
        compiles.append(time.perf_counter() - t0)
    return {"tokenizer_trie_seconds": trie, "schema_compile_seconds_median": statistics.median(compiles)}


def replay_cost(driver: Driver, constraint: Constraint, reply: list[int], device: str) -> dict[str, float]:
    """The constraint's own work per token over `reply`, alone (not overlapped with a step), in three parts: the
    mask computed, applied to one row of logits where the Driver applies it (the executor's device,
    synchronized), the token taken. Medians in microseconds, and the mean of their sum."""
    text, vocab = driver.handle.text(), driver.config.vocab_size
    matcher = constraints.compile_constraint(constraint, text.vocab.tokenizer, vocab, driver._eos_ids(),
                                             allow_eos=False)
    logits = torch.randn(1, 1, vocab, device=device, dtype=torch.float32 if device == "cpu" else torch.bfloat16)
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    parts: dict[str, list[float]] = {"mask": [], "apply": [], "advance": []}
    for token in reply:
        sync()
        t0 = time.perf_counter()
        mask = matcher.row_mask()
        t1 = time.perf_counter()
        driver.masks.apply(logits, [0], mask[None])
        sync()
        t2 = time.perf_counter()
        matcher.advance(token)
        t3 = time.perf_counter()
        for name, seconds in zip(parts, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            parts[name].append(seconds)
    out = {f"constraint_{name}_us_median": 1e6 * statistics.median(v) for name, v in parts.items()}
    out["constraint_us_per_token_mean"] = 1e6 * sum(statistics.fmean(v) for v in parts.values())
    return out


def driver_round(driver: Driver, ids: list[int], new: int, constraint: Constraint | None) -> dict[str, Any]:
    driver.reset()
    r = driver.generate(GenerateRequest(ids, max_new=new, ignore_eos=True, constraint=constraint))
    return {"decode_tok_s": r.timings.decode_tok_s, "ms_per_token": 1e3 / r.timings.decode_tok_s,
            "tokens": len(r.tokens), "stop_reason": r.stop_reason, "text": r.text, "ids": r.tokens}


def engine_round(engine: Any, prompts: list[list[int]], new: int, constraint: Constraint | None,
                 sync: Any) -> dict[str, Any]:
    """All requests at once through generate_batch: wall time, and the mean time per decode token of a request
    (its decode seconds over its decode tokens)."""
    requests = [GenerateRequest(list(p), max_new=new, ignore_eos=True, constraint=constraint) for p in prompts]
    stats0 = dataclasses.replace(constraints.STATS)  # a copy
    steps0, ahead0 = engine.steps, engine.ahead.steps
    sync()
    t0 = time.perf_counter()
    gens = engine.generate_batch(requests)
    sync()
    wall = time.perf_counter() - t0
    tpot = statistics.fmean(g.timings.decode_seconds / g.timings.decode_tokens for g in gens)
    steps = engine.steps - steps0
    stats = constraints.STATS.since(stats0)
    return {"seconds": wall, "output_tok_s": sum(len(g.tokens) for g in gens) / wall, "ms_per_token": 1e3 * tpot,
            "decode_tok_s": len(gens) / tpot, "tokens": [len(g.tokens) for g in gens],
            "stop_reasons": sorted({g.stop_reason for g in gens}), "text": gens[0].text,
            "steps": steps, "steps_ahead": engine.ahead.steps - ahead0,
            # per step: the mask thread's filling, and the engine's wait for it (the part not hidden by the step)
            "mask_fill_ms_per_step": 1e3 * stats.fill_seconds / steps,
            "mask_wait_ms_per_step": 1e3 * stats.wait_seconds / steps, "masks": stats.masks}


def interleaved(run: Any, repeats: int) -> dict[str, dict[str, Any]]:
    """run(constraint or None) for both, `repeats` rounds alternating after one warm-up round each; the best
    (fewest ms per token) of each kept."""
    constraint = Constraint.json_schema(SCHEMA)
    cases = (("plain", None), ("json_schema", constraint))
    for _, c in cases:
        run(c)  # warm-up: programs prepared (and CUDA graphs captured)
    best: dict[str, dict[str, Any]] = {}
    for i in range(repeats):
        for name, c in cases:
            r = run(c)
            log(f"  round {i + 1} {name}: {r['ms_per_token']:.2f} ms/token")
            if name not in best or r["ms_per_token"] < best[name]["ms_per_token"]:
                best[name] = r
    best["slower_per_token"] = best["json_schema"]["ms_per_token"] / best["plain"]["ms_per_token"] - 1.0
    return best


def check(rows: dict[str, Any], new: int) -> None:
    """Every request generated exactly `new` tokens (so the per-token times compare like with like)."""
    for name in ("plain", "json_schema"):
        counts = rows[name]["tokens"]
        counts = counts if isinstance(counts, list) else [counts]
        if set(counts) != {new}:
            raise SystemExit(f"{name}: the requests generated {sorted(set(counts))} tokens, not {new}")


def show(label: str, rows: dict[str, Any], target: float | None) -> None:
    plain, schema = rows["plain"], rows["json_schema"]
    verdict = "" if target is None else (" (target <= {:.0f}%: {})".format(
        100 * target, "met" if rows["slower_per_token"] <= target else "MISSED"))
    log(f"{label}: plain {plain['ms_per_token']:.2f} ms/token ({plain['decode_tok_s']:.1f} tok/s), JSON schema "
        f"{schema['ms_per_token']:.2f} ms/token ({schema['decode_tok_s']:.1f} tok/s): "
        f"{100 * rows['slower_per_token']:+.1f}% per token{verdict}")


def strip(rows: dict[str, Any]) -> dict[str, Any]:
    return {k: ({kk: vv for kk, vv in v.items() if kk != "ids"} if isinstance(v, dict) else v) for k, v in rows.items()}


def cpu_main(args: argparse.Namespace) -> dict[str, Any]:
    from helpers import smollm
    from poot_core import open_executor

    handle = ModelHandle.load(smollm.gguf_path())
    driver = Driver(handle, open_executor("cpu"), DriverOptions(capacity=512, prefill_chunk=128)).serve()
    text = handle.text()
    ids = text.encode_chat(text.render_chat_value([{"role": "user", "content": PROMPT}]))
    result: dict[str, Any] = {"model": "SmolLM2-135M-Instruct Q4_1 (GGUF)", "backend": "cpu", "new_tokens": args.new,
                              **one_time_costs(driver, Constraint.json_schema(SCHEMA))}
    rows = interleaved(lambda c: driver_round(driver, ids, args.new, c), args.repeats)
    check(rows, args.new)
    result["batch1"] = strip(rows)
    result.update(replay_cost(driver, Constraint.json_schema(SCHEMA), rows["json_schema"]["ids"], "cpu"))
    show("batch 1 (Driver)", rows, 0.10)
    return result


def cuda_main(args: argparse.Namespace) -> dict[str, Any]:
    import gpu_decode
    import gpu_serve

    from poot_core.checkpoint.gguf_file import GGUFFile
    from poot_core.text.gguf_vocab import vocabulary_from_gguf
    from poot_core.text.services import TextServices

    vocab_file = Path(args.vocab)
    if not vocab_file.exists():
        raise SystemExit(f"{vocab_file} is missing: Llama 3's tokenizer (llama.cpp's ggml-vocab-llama-bpe.gguf; "
                         "scripts/fetch_test_data.py fetches it) is needed for the masks of its vocabulary; "
                         "copy it there or pass --vocab")
    text = TextServices(vocabulary_from_gguf(dict(GGUFFile.open(vocab_file).metadata), vocab_file.name))
    hf = {**gpu_decode.HF_LLAMA3_8B, "num_hidden_layers": args.layers}
    if args.small:  # the same vocabulary, a model small enough for the CPU
        hf.update(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=2)
        args.batch, args.new, args.repeats = min(args.batch, 8), min(args.new, 16), 1
    device = "cpu" if args.small else "cuda"
    base = gpu_serve.random_handle(hf, device=device)
    handle = ModelHandle(base.path, base.family, base.config(), text, base.store(), [])
    if args.small:
        from poot_core import open_executor

        ex = open_executor("cpu")
        sync: Any = lambda: None  # noqa: E731
    else:
        from poot_backend_cuda.executor import CudaExecutor

        ex, sync = CudaExecutor(), torch.cuda.synchronize
    prompts = [text.encode(f"{PROMPT} Person {i + 1} of {args.batch}:") for i in range(args.batch)]
    longest = max(len(p) for p in prompts)
    result: dict[str, Any] = {"model": f"Llama-3-8B shape, random bf16, {hf['num_hidden_layers']} layers",
                              "tokenizer": vocab_file.name, "backend": "cpu (--small)" if args.small else "cuda",
                              "new_tokens": args.new, "prompt_tokens": longest, "small": args.small}
    if not args.small:
        result["device"] = torch.cuda.get_device_name()
    driver = Driver(handle, ex, DriverOptions(capacity=longest + args.new + 16)).serve()
    result.update(one_time_costs(driver, Constraint.json_schema(SCHEMA)))
    rows = interleaved(lambda c: driver_round(driver, prompts[0], args.new, c), args.repeats)
    check(rows, args.new)
    result["batch1"] = strip(rows)
    result.update(replay_cost(driver, Constraint.json_schema(SCHEMA), rows["json_schema"]["ids"], device))
    show("batch 1 (Driver)", rows, None)
    engine = Driver(handle, ex, gpu_serve.engine_options(args.batch, longest, args.new, None)).serve(Layout.PAGED)
    rows = interleaved(lambda c: engine_round(engine, prompts, args.new, c, sync), args.repeats)
    check(rows, args.new)
    result[f"batch{args.batch}"] = strip(rows)
    show(f"batch {args.batch} (engine, every row constrained vs none)", rows, 0.05)
    for name in ("plain", "json_schema"):
        r = rows[name]
        log(f"  {name}: {r['steps']} steps, {r['steps_ahead']} ahead; masks {r['mask_fill_ms_per_step']:.2f} ms a "
            f"step on {constraints.mask_threads()} threads, waited for {r['mask_wait_ms_per_step']:.2f} ms a step")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--new", type=int, default=None, help="new tokens per request (cpu 64, cuda 128)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of both cases; the best of each kept")
    ap.add_argument("--threads", type=int, default=None, help="torch's CPU threads")
    ap.add_argument("--batch", type=int, default=64, help="cuda: the engine's requests")
    ap.add_argument("--layers", type=int, default=32, help="cuda: decoder layers of the Llama-3-8B shape")
    ap.add_argument("--vocab", default=str(VOCAB), help="cuda: llama.cpp's ggml-vocab-llama-bpe.gguf")
    ap.add_argument("--small", action="store_true", help="cuda: the path on the CPU with a small model")
    ap.add_argument("--mask-threads", type=int, default=None,
                    help="llguidance's threads for a batch of masks (a diagnostic; default: mask_threads())")
    ap.add_argument("--out", default=None, help="the JSON written: bench/results/OUT.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.mask_threads:
        constraints.mask_threads = lambda: args.mask_threads  # read when the executor is first made
    args.new = args.new or (64 if args.backend == "cpu" else 128)
    try:
        import llguidance  # noqa: F401 - poot-core's dependency for structured output
    except ImportError:
        raise SystemExit("llguidance is not installed: pip install 'llguidance>=1.9.1,<2' (a wheel, no "
                         "dependencies)") from None
    result = cpu_main(args) if args.backend == "cpu" else cuda_main(args)
    load = os.getloadavg()
    result["load_average"] = load
    result["mask_threads"] = constraints.mask_threads()
    if args.mask_threads:
        result["mask_threads_flag"] = args.mask_threads
    log(f"one-time: tokenizer trie {1e3 * result['tokenizer_trie_seconds']:.0f} ms (once per vocabulary), schema "
        f"compile + first mask {1e3 * result['schema_compile_seconds_median']:.1f} ms (median of 5)")
    log(f"constraint per token, alone: {result['constraint_us_per_token_mean']:.0f} us mean; medians: mask "
        f"{result['constraint_mask_us_median']:.0f} us (computed while the step runs), applying it "
        f"{result['constraint_apply_us_median']:.0f} us, taking the token {result['constraint_advance_us_median']:.0f}"
        f" us; load average {load[0]:.1f}")
    log(f"reply: {result['batch1']['json_schema']['text'][:300]}")
    name = args.out or ("structured" if args.backend == "cpu" else "structured_cuda")
    log(f"wrote {common.write(name, result)}")


if __name__ == "__main__":
    main()
