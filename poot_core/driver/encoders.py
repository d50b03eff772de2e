"""Sentence embeddings and reranking on the driver's encode step.

SentenceEncoder and CrossEncoder load a checkpoint onto an executor, tokenize, run the encode step and do
the host side in numpy: pooling over the real tokens only, L2 normalization, classifier heads and ranking.
The encode shapes for `rows` texts and every length up to the longest a text can tokenize to are prepared
at load (lengths and row counts in buckets: a text is padded up to the next bucket and masked out), so a
call never compiles anything and a call with more than `rows` texts is a typed refusal.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

import numpy as np
import tokenizers

from poot_core.checkpoint.handle import LoadOptions, ModelHandle, WeightStore
from poot_core.checkpoint.integrity import FileAccess
from poot_core.driver.core import Driver, DriverOptions
from poot_core.errors import CheckpointError, Reason, RequestError, Unsupported
from poot_core.executor import BackendChoice, Executor, open_executor
from poot_core.registry import Registry

POOLING_MODES = ("cls", "mean", "lasttoken")
LENGTH_STEP, COARSE_FROM, COARSE_STEP = 16, 256, 256
BUFFER_SUFFIXES = (".position_ids", "embeddings.token_type_ids")


def _buckets(limit: int) -> list[int]:
    """Powers of two below `limit`, then `limit` itself."""
    sizes, n = [], 1
    while n < limit:
        sizes.append(n)
        n *= 2
    return [*sizes, limit]


def _length_buckets(limit: int) -> list[int]:
    """Multiples of 16 up to 256, then of 256, then `limit`: short texts (the common case) pad by less than
    16 tokens, long ones by less than 256, and a long-context model still prepares few shapes."""
    fine = list(range(LENGTH_STEP, min(limit, COARSE_FROM) + 1, LENGTH_STEP))
    coarse = list(range(COARSE_FROM + COARSE_STEP, limit + 1, COARSE_STEP))
    return sorted({*(b for b in fine + coarse if b < limit), limit})


def _open(executor: Executor | BackendChoice | str | None) -> Executor:
    if executor is None or isinstance(executor, BackendChoice | str):
        return open_executor(executor or BackendChoice.AUTO)
    return executor


def _read_json(access: FileAccess, path: Path) -> dict[str, Any] | list[Any] | None:
    if not path.is_file():
        return None
    try:
        return json.loads(access.read_bytes(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(path, f"not valid JSON: {exc}") from exc


def _without_buffers(handle: ModelHandle) -> ModelHandle:
    """The handle without the index buffers transformers saves beside BERT's weights
    (embeddings.position_ids, token_type_ids): no graph reads them and backends need not upload them."""
    store = handle.store()
    keep = [n for n in store.names() if not n.endswith(BUFFER_SUFFIXES)]
    if len(keep) == len(store.names()):
        return handle
    shapes = store.shapes()
    filtered = WeightStore({n: (lambda n=n: store.get(n)) for n in keep}, {n: shapes[n] for n in keep})
    return ModelHandle(handle.path, handle.family, handle.config(), handle.text(), filtered, handle.files_read)


def _texts(texts: Sequence[str], what: str) -> list[str]:
    if isinstance(texts, str):
        raise RequestError(f"{what} must be a list of strings, not one string")
    items = list(texts)
    bad = [type(t).__name__ for t in items if not isinstance(t, str)]
    if bad:
        raise RequestError(f"{what} must be strings, got {bad[0]}")
    return items


class _EncoderBase:
    """What both encoders share: the handle, the driver with its prepared shapes, and the tokenizer."""

    def __init__(self, handle: ModelHandle, executor: Executor, rows: int, max_length: int) -> None:
        if rows < 1:
            raise RequestError(f"rows must be at least 1, got {rows}")
        self.handle = handle
        self.config = handle.config()
        self.rows = rows
        self.max_length = max(1, min(max_length, self.config.max_positions))
        self.driver = Driver(_without_buffers(handle), executor, DriverOptions(capacity=self.config.max_positions))
        # A copy of the checkpoint's tokenizer without its stored padding, truncating as transformers would.
        source = handle.text().tokenizer
        self.tokenizer = tokenizers.Tokenizer.from_str(source.to_str())
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(self.max_length, strategy="longest_first")
        for r in _buckets(rows):
            for t in _length_buckets(self.max_length):
                self.driver.prepare_encode(r, t)

    @classmethod
    def load(
        cls,
        path: str | Path,
        executor: Executor | BackendChoice | str | None = None,
        rows: int = 8,
        *,
        registry: Registry | None = None,
        options: LoadOptions | None = None,
        max_length: int | None = None,
    ) -> Self:
        """Load a checkpoint directory; `executor` is an open executor or a backend choice (None: auto).
        Texts are truncated to `max_length` tokens (default: see from_handle)."""
        options = options or LoadOptions()
        handle = ModelHandle.load(path, registry, options)
        return cls.from_handle(handle, executor, rows, options, max_length=max_length)

    @classmethod
    def from_handle(
        cls,
        handle: ModelHandle,
        executor: Executor | BackendChoice | str | None = None,
        rows: int = 8,
        options: LoadOptions | None = None,
        *,
        max_length: int | None = None,
    ) -> Self:
        """The encoder over a checkpoint already opened; `options`' manifest covers the files it reads beyond
        the handle's. `max_length` defaults as `_read` says."""
        extra, limit = cls._read(handle, options or LoadOptions())
        return cls(handle, _open(executor), rows, *extra, max_length or limit)

    @classmethod
    def _read(cls, handle: ModelHandle, options: LoadOptions) -> tuple[tuple[Any, ...], int]:
        """What this encoder reads beside the handle: its constructor's arguments between rows and max_length,
        and the default max_length (here: none, and the model's positions)."""
        return (), handle.config().max_positions

    @property
    def executor_name(self) -> str:
        return self.driver.executor.name

    def _check_count(self, n: int) -> None:
        if n > self.rows:
            raise Unsupported(
                Reason.SHAPE,
                f"{n} texts in one call",
                f"this encoder was loaded for at most {self.rows} texts per call; load it with "
                f"rows >= {n} or send fewer texts",
            )

    def _query_and_docs(self, query: str, docs: Sequence[str]) -> list[str]:
        """The documents of a (query, docs) call as a list, after checking their types and count."""
        if not isinstance(query, str):
            raise RequestError(f"the query must be a string, got {type(query).__name__}")
        items = _texts(docs, "docs")
        self._check_count(len(items))
        return items

    def _run(self, encodings: list[tokenizers.Encoding]) -> list[np.ndarray]:
        """Final hidden states [tokens, D] of each encoded text, padding excluded."""
        self._check_count(len(encodings))
        ids = [list(e.ids) for e in encodings]
        if any(not i for i in ids):
            raise RequestError("a text tokenized to no tokens")
        return self.driver.encode(ids, [list(e.type_ids) for e in encodings])


class SentenceEncoder(_EncoderBase):
    """Embeddings from a sentence-transformers checkpoint (or a plain encoder, mean-pooled)."""

    def __init__(self, handle: ModelHandle, executor: Executor, rows: int, pooling: str, max_length: int) -> None:
        super().__init__(handle, executor, rows, max_length)
        self.pooling = pooling

    @classmethod
    def _read(cls, handle: ModelHandle, options: LoadOptions) -> tuple[tuple[Any, ...], int]:
        """The pooling mode, from modules.json and the pooling module's config.json read the way
        sentence-transformers reads them; the default max_length is sentence_bert_config.json's max_seq_length,
        else the model's positions."""
        root = Path(handle.path)
        access = FileAccess(root, options.manifest())
        pooling = _pooling(root, access)
        st = _read_json(access, root / "sentence_bert_config.json")
        limit = handle.config().max_positions
        if isinstance(st, dict) and st.get("max_seq_length"):
            limit = int(st["max_seq_length"])
        return (pooling,), limit

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """float32 [len(texts), D], each row L2-normalized. At most `rows` texts per call."""
        items = _texts(texts, "texts")
        if not items:
            return np.zeros((0, self.config.hidden_size), dtype=np.float32)
        self._check_count(len(items))
        states = self._run(self.tokenizer.encode_batch(items))
        pooled = np.stack([self._pool(h) for h in states])
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)
        return (pooled / np.maximum(norms, 1e-12)).astype(np.float32)

    def _pool(self, h: np.ndarray) -> np.ndarray:
        if self.pooling == "cls":
            return h[0]
        if self.pooling == "lasttoken":
            return h[-1]
        return h.astype(np.float64).mean(axis=0)

    def similarity(self, texts: Sequence[str]) -> np.ndarray:
        """The cosine matrix [N, N] of the texts' embeddings."""
        v = self.embed(texts)
        return v @ v.T

    def rerank(self, query: str, docs: Sequence[str]) -> list[tuple[int, float]]:
        """(index into docs, cosine with the query), best first; ties keep the documents' order."""
        items = self._query_and_docs(query, docs)
        if not items:
            return []
        q = self.embed([query])[0]
        scores = self.embed(items) @ q
        order = sorted(range(len(items)), key=lambda i: -float(scores[i]))
        return [(i, float(scores[i])) for i in order]


def _pooling(root: Path, access: FileAccess) -> str:
    """The pooling mode sentence-transformers would use: from modules.json's Pooling module, else mean."""
    modules = _read_json(access, root / "modules.json")
    if modules is None:
        return "mean"
    if not isinstance(modules, list):
        raise CheckpointError(root / "modules.json", "expected a list of modules")
    pooling = "mean"
    for module in modules:
        kind = str(module.get("type", "")) if isinstance(module, dict) else ""
        short = kind.rsplit(".", 1)[-1]
        if short in ("Transformer", "Normalize"):
            continue  # the encoder itself; normalization is always applied
        if short != "Pooling":
            raise Unsupported(
                Reason.OPERATION,
                f"sentence-transformers module {kind or module!r}",
                "poot applies only Transformer, Pooling and Normalize modules",
            )
        cfg = _read_json(access, root / str(module.get("path", "")) / "config.json") or {}
        if not isinstance(cfg, dict):
            raise CheckpointError(root / str(module.get("path", "")), "pooling config is not an object")
        chosen = [
            m
            for m in (
                "cls_token",
                "mean_tokens",
                "lasttoken",
                "max_tokens",
                "mean_sqrt_len_tokens",
                "weightedmean_tokens",
            )
            if cfg.get(f"pooling_mode_{m}")
        ]
        if len(chosen) != 1 or chosen[0] not in ("cls_token", "mean_tokens", "lasttoken"):
            raise Unsupported(
                Reason.OPERATION,
                f"pooling {'+'.join(chosen) or 'none'}",
                "poot pools by exactly one of CLS token, mean of tokens, last token",
            )
        pooling = {"cls_token": "cls", "mean_tokens": "mean", "lasttoken": "lasttoken"}[chosen[0]]
    return pooling


class CrossEncoder(_EncoderBase):
    """Relevance scores from a sequence-classification checkpoint (a reranker)."""

    def __init__(self, handle: ModelHandle, executor: Executor, rows: int, max_length: int) -> None:
        family = handle.family
        steps_of = getattr(family, "classifier_steps", None)
        store = handle.store()
        steps = steps_of(handle.config(), set(store.names())) if steps_of else []
        if not steps:
            raise Unsupported(
                Reason.OPERATION,
                f"sequence classification head of {handle.config().architecture}",
                f"the checkpoint or family {family.name} has no classifier head poot can read",
            )
        # The head is small: float32 copies on the host, applied to the first token's hidden state.
        self._head = [(_f32(store.get(w)), None if b is None else _f32(store.get(b)), act) for w, b, act in steps]
        super().__init__(handle, executor, rows, max_length)

    @staticmethod
    def serves(handle: ModelHandle) -> bool:
        """Whether the checkpoint is a sequence-classification model (a reranker), by its architecture."""
        return handle.config().architecture.endswith("ForSequenceClassification")

    def logits(self, query: str, docs: Sequence[str]) -> np.ndarray:
        """float32 [len(docs), labels]: the head's output for each (query, doc) pair, paired as the
        tokenizer pairs them."""
        items = self._query_and_docs(query, docs)
        if not items:
            return np.zeros((0, self._head[-1][0].shape[0]), dtype=np.float32)
        states = self._run(self.tokenizer.encode_batch([(query, d) for d in items]))
        x = np.stack([h[0] for h in states]).astype(np.float32)
        for w, b, act in self._head:
            x = x @ w.T
            if b is not None:
                x = x + b
            if act == "tanh":
                x = np.tanh(x)
        return x.astype(np.float32)

    def rerank(self, query: str, docs: Sequence[str]) -> list[tuple[int, float]]:
        """(index into docs, score), highest score first; the score is the head's single logit."""
        scores = self.logits(query, docs)
        if scores.shape[1] != 1:
            raise Unsupported(
                Reason.SHAPE,
                f"a classifier head with {scores.shape[1]} labels",
                "rerank needs a single relevance score per pair; use logits()",
            )
        order = sorted(range(len(scores)), key=lambda i: -float(scores[i, 0]))
        return [(i, float(scores[i, 0])) for i in order]


def _f32(w: Any) -> np.ndarray:
    import torch

    if not isinstance(w, torch.Tensor):
        raise Unsupported(Reason.QUANTIZATION, "packed classifier head", "the head must be stored dense")
    return w.detach().float().numpy()


__all__ = ["CrossEncoder", "SentenceEncoder"]
