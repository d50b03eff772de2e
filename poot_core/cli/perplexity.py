"""`poot perplexity -m MODEL -f TEXT [-c N] [--chunks K]`: llama-perplexity's method.

The text is tokenized once (BOS first when the tokenizer adds one) and cut into chunks of -c tokens; each
chunk is run from an empty cache (its first token replaced by BOS when the tokenizer adds one) and only the
second half of each chunk is scored: the negative log-likelihood of every token from position c/2 + 1 on,
given everything before it in the chunk. The running estimate is printed after each chunk as
"[i]ppl," and the final value with its error estimate, as llama-perplexity prints them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from poot_core.cli import runtime
from poot_core.errors import RequestError

DEFAULT_CTX = 512  # llama-perplexity's


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("perplexity", help="perplexity of a model on a text file (llama-perplexity's method)",
                       description="Perplexity over chunks of the window, scoring the second half of each chunk.")
    p.add_argument("-m", "--model", required=True, help="a safetensors checkpoint directory or a .gguf file "
                   "(required)")
    p.add_argument("-f", "--file", required=True, help="the text file (required)")
    runtime.add_device_flags(p, DEFAULT_CTX)
    p.add_argument("--chunks", type=int, default=-1, metavar="K", help="score at most K chunks; -1: every whole one")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the running estimate")
    p.set_defaults(run=run)


def _tokens(services, text: str) -> list[int]:
    v = services.vocab
    ids = services.encode(text, add_special=False)
    return [v.bos_id, *ids] if v.add_bos and v.bos_id is not None else ids


def chunk_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log p(target) per row of float32 logits, in float64."""
    x = logits.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    log_z = np.log(np.exp(x).sum(axis=1))
    return log_z - x[np.arange(len(targets)), targets]


def run(args: argparse.Namespace) -> int:
    runtime.check_device_flags(args)
    if args.threads != -1 and args.threads_batch is not None:
        runtime.warn("-t has no effect here: poot perplexity only prefills, with -tb threads")
    if args.chunks == 0 or args.chunks < -1:
        raise RequestError(f"--chunks must be -1 or >= 1, got {args.chunks}")
    model = Path(args.model)
    if not model.exists():
        raise RequestError(f"no such checkpoint: {model}")
    try:
        text = Path(args.file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RequestError(f"cannot read the text file {args.file}: {exc}") from exc

    loaded = runtime.load(args, model, default_ctx=DEFAULT_CTX, logits=True)
    services = loaded.handle.text()
    ctx = loaded.ctx
    tokens = _tokens(services, text)
    if len(tokens) < 2 * ctx:
        raise RequestError(f"{args.file} tokenizes to {len(tokens)} tokens; perplexity with a context of {ctx} "
                           f"needs at least {2 * ctx} (give a smaller -c or a longer text)")
    n_chunks = len(tokens) // ctx if args.chunks < 0 else min(args.chunks, len(tokens) // ctx)
    first = ctx // 2
    bos = services.vocab.bos_id if services.vocab.add_bos else None
    runtime.log(args, f"{len(tokens)} tokens: {n_chunks} chunks of {ctx}, scoring positions {first + 1}..{ctx - 1} "
                      "of each")
    nll = nll2 = 0.0
    count = 0
    running: list[float] = []
    t0 = time.perf_counter()
    for i in range(n_chunks):
        chunk = tokens[i * ctx : (i + 1) * ctx]
        if bos is not None:
            chunk = [bos, *chunk[1:]]
        logits = loaded.driver.logits(chunk)
        values = chunk_nll(logits[first : ctx - 1], np.asarray(tokens[i * ctx + first + 1 : (i + 1) * ctx]))
        nll += float(values.sum())
        nll2 += float((values**2).sum())
        count += len(values)
        running.append(math.exp(nll / count))
        if not args.json:
            print(f"[{i + 1}]{running[-1]:.4f},", end="", flush=True)
        if i == 0:
            runtime.log(args, f"{time.perf_counter() - t0:.2f} s per chunk")
    mean = nll / count
    ppl = math.exp(mean)
    variance = nll2 / count - mean * mean
    error = math.sqrt(variance / (count - 1)) * ppl if variance > 0 and count > 1 else 0.0
    if args.json:
        print(json.dumps({"model": str(model), "file": str(args.file), "backend": loaded.executor.name,
                          "context": ctx, "tokens": len(tokens), "chunks": n_chunks, "scored_tokens": count,
                          "ppl": ppl, "ppl_error": error, "running": running,
                          "seconds": time.perf_counter() - t0}))
    else:
        print()
        print(f"Final estimate: PPL = {ppl:.4f} +/- {error:.5f}")
    sys.stdout.flush()
    return 0
