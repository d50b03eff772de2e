"""/v1/embeddings over a SentenceEncoder (`--embedding-model DIR`) and /v1/rerank over a CrossEncoder, or an
embedding model's cosine (`--rerank-model DIR`), each in a thread of its own.

An encoder is prepared for `rows` texts per call; a longer input list is encoded `rows` at a time. Calls run
one at a time on the encoder's single worker thread, so the event loop and the generation engine never wait
for an encoder.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from poot_core.server.errors import APIError
from poot_core.server.schemas import EmbeddingRequest, RerankRequest
from poot_core.server.state import ServerState

router = APIRouter()
MAX_INPUTS = 2048
T = TypeVar("T")


class EncoderWorker:
    """One encoder (SentenceEncoder or CrossEncoder) and the one thread that runs it."""

    def __init__(self, encoder: Any, name: str) -> None:
        self.encoder, self.name = encoder, name
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="poot-encoder")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def tokens(self, texts: list[str] | list[tuple[str, str]]) -> int:
        return sum(len(e.ids) for e in self.encoder.tokenizer.encode_batch(texts))

    def embed(self, texts: list[str]) -> tuple[np.ndarray, int]:
        rows = self.encoder.rows
        vectors = [self.encoder.embed(texts[i : i + rows]) for i in range(0, len(texts), rows)]
        return np.concatenate(vectors, axis=0), self.tokens(texts)

    def rerank(self, query: str, docs: list[str]) -> tuple[list[tuple[int, float]], int]:
        rows = self.encoder.rows
        scored: list[tuple[int, float]] = []
        for start in range(0, len(docs), rows):
            scored += [(start + i, s) for i, s in self.encoder.rerank(query, docs[start : start + rows])]
        scored.sort(key=lambda pair: (-pair[1], pair[0]))
        if hasattr(self.encoder, "logits"):  # a cross-encoder reads each (query, document) pair
            return scored, self.tokens([(query, d) for d in docs])
        return scored, self.tokens([query, *docs])

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _texts(value: str | list[str], field: str) -> list[str]:
    texts = [value] if isinstance(value, str) else list(value)
    if not texts:
        raise APIError(400, f"{field}: is empty", param=field)
    if len(texts) > MAX_INPUTS:
        raise APIError(400, f"{field}: at most {MAX_INPUTS} texts per request, got {len(texts)}", param=field)
    if any(not t for t in texts):
        raise APIError(400, f"{field}: texts must not be empty", param=field)
    return texts


def _worker(state: ServerState, which: str, model: str | None) -> EncoderWorker:
    worker: EncoderWorker | None = getattr(state.need(), which)
    if worker is None:
        flag = "--embedding-model" if which == "encoder" else "--rerank-model"
        raise APIError(404, f"this server has no {'embedding' if which == 'encoder' else 'rerank'} model (start "
                            f"it with {flag} DIR)", param="model", code="model_not_found")
    if model is not None and model != worker.name:
        raise APIError(404, f"The model `{model}` does not exist. This server serves `{worker.name}` here.",
                       param="model", code="model_not_found")
    return worker


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> JSONResponse:
    worker = _worker(request.app.state.server, "encoder", body.model)
    if body.dimensions is not None:
        raise APIError(400, "dimensions: not supported (the model's own width is returned)", param="dimensions",
                       code="unsupported_parameter")
    vectors, tokens = await worker.run(worker.embed, _texts(body.input, "input"))
    data = []
    for i, v in enumerate(vectors):
        value: Any = (base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode()
                      if body.encoding_format == "base64" else [float(x) for x in v])
        data.append({"object": "embedding", "index": i, "embedding": value})
    return JSONResponse({"object": "list", "data": data, "model": worker.name,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


@router.post("/v1/rerank")
@router.post("/rerank")
async def rerank(body: RerankRequest, request: Request) -> JSONResponse:
    """vLLM's (Jina's, Cohere's) rerank shape: results best first, each with its index and relevance_score."""
    worker = _worker(request.app.state.server, "reranker", body.model)
    docs = _texts(body.documents, "documents")
    scored, tokens = await worker.run(worker.rerank, body.query, docs)
    top = scored[: body.top_n] if body.top_n is not None else scored
    results = [{"index": i, "relevance_score": s, **({"document": {"text": docs[i]}} if body.return_documents
                                                      else {})} for i, s in top]
    return JSONResponse({"id": f"rerank-{id(body):x}", "model": worker.name, "results": results,
                         "usage": {"total_tokens": tokens}})
