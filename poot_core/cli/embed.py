"""`poot embed`: sentence embeddings, similarity and reranking on the device --backend names.

    poot embed vectors MODEL "text a" "text b" ...      the texts' embeddings (L2-normalized), one per line
    poot embed similarity MODEL "text a" "text b" ...   the cosine matrix of the texts' embeddings
    poot embed rerank MODEL QUERY DOC [DOC ...]         the documents ordered by relevance to the query

rerank scores with the model's classifier head when the checkpoint is a sequence-classification model (a
cross-encoder), else by the cosine of embeddings. --json prints one JSON object instead of a table. A
decoder (a chat or base model) with no sentence-transformers pooling config of its own gives embeddings it
was not trained to give: that is a warning.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from poot_core.cli.runtime import BACKEND_NAMES, BACKENDS, warn
from poot_core.errors import RequestError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("embed", help="sentence embeddings, similarity and reranking with an encoder model")
    actions = p.add_subparsers(dest="action", required=True)
    vec = actions.add_parser("vectors", help="print the texts' embeddings (L2-normalized), one line per text")
    vec.add_argument("model", help="a checkpoint directory (sentence-transformers or a plain encoder)")
    vec.add_argument("texts", nargs="+", help="the texts")
    sim = actions.add_parser("similarity", help="print the cosine matrix of the texts' embeddings")
    sim.add_argument("model", help="a checkpoint directory (sentence-transformers or a plain encoder)")
    sim.add_argument("texts", nargs="+", help="the texts")
    rr = actions.add_parser("rerank", help="print the documents ordered by relevance to the query")
    rr.add_argument("model", help="an embedding model or a cross-encoder (sequence classification) checkpoint")
    rr.add_argument("query")
    rr.add_argument("docs", nargs="+", help="the documents")
    for q in (vec, sim, rr):
        q.add_argument("--backend", choices=BACKENDS, default="auto", help="the device to run on")
        q.add_argument("--json", action="store_true", help="print one JSON object")
        q.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from poot_core import CrossEncoder, ModelHandle, SentenceEncoder, open_executor

    # The device first: a named backend that is absent is refused before the checkpoint is read.
    executor = open_executor(BACKEND_NAMES.get(args.backend, args.backend))
    handle = ModelHandle.load(args.model)
    config = handle.config()
    if config.kind != "encoder" and not CrossEncoder.serves(handle) and not _has_pooling_config(args.model):
        warn(f"{args.model} is a decoder ({config.architecture}), not an embedding model: it has no "
             "sentence-transformers pooling config, so its embeddings are mean-pooled hidden states it was not "
             "trained to give")
    if args.action == "vectors":
        encoder = SentenceEncoder.from_handle(handle, executor, rows=len(args.texts))
        _print_vectors(args, encoder.embed(args.texts).tolist(), encoder.executor_name)
        return 0
    if args.action == "similarity":
        if CrossEncoder.serves(handle):
            raise RequestError(
                f"{args.model} is a cross-encoder: it scores pairs and gives no embeddings; use `poot embed rerank`"
            )
        encoder = SentenceEncoder.from_handle(handle, executor, rows=len(args.texts))
        matrix = encoder.similarity(args.texts)
        _print_similarity(args, matrix.tolist(), encoder.executor_name)
        return 0
    if CrossEncoder.serves(handle):
        scorer: Any = CrossEncoder.from_handle(handle, executor, rows=len(args.docs))
        kind = "cross-encoder"
    else:
        scorer = SentenceEncoder.from_handle(handle, executor, rows=len(args.docs))
        kind = "cosine"
    ranked = scorer.rerank(args.query, args.docs)
    _print_ranking(args, ranked, kind, scorer.executor_name)
    return 0


def _has_pooling_config(model: str) -> bool:
    return (Path(model) / "modules.json").is_file()


def _print_vectors(args: argparse.Namespace, vectors: list[list[float]], backend: str) -> None:
    if args.json:
        print(json.dumps({"model": args.model, "backend": backend, "texts": args.texts, "vectors": vectors}))
        return
    for i, v in enumerate(vectors):
        print(f"[{i}] " + " ".join(f"{x:.6f}" for x in v))
    sys.stdout.flush()


def _print_similarity(args: argparse.Namespace, matrix: list[list[float]], backend: str) -> None:
    if args.json:
        print(json.dumps({"model": args.model, "backend": backend, "texts": args.texts, "similarity": matrix}))
        return
    width = len(str(len(matrix) - 1))
    header = " " * (width + 3) + " ".join(f"{f'[{j}]':>7}" for j in range(len(matrix)))
    print(header)
    for i, (row, text) in enumerate(zip(matrix, args.texts, strict=True)):
        values = " ".join(f"{v:7.4f}" for v in row)
        print(f"[{i:>{width}}]  {values}  {_short(text)}")
    sys.stdout.flush()


def _print_ranking(args: argparse.Namespace, ranked: list[tuple[int, float]], kind: str, backend: str) -> None:
    if args.json:
        results = [{"index": i, "score": s, "document": args.docs[i]} for i, s in ranked]
        print(
            json.dumps(
                {"model": args.model, "backend": backend, "query": args.query, "scorer": kind, "results": results}
            )
        )
        return
    print(f"rank  {kind:>13}  doc")
    for rank, (i, score) in enumerate(ranked, 1):
        print(f"{rank:>4}  {score:13.4f}  [{i}] {_short(args.docs[i])}")
    sys.stdout.flush()


def _short(text: str, limit: int = 60) -> str:
    one_line = " ".join(text.split())
    return one_line if len(one_line) <= limit else one_line[: limit - 3] + "..."
