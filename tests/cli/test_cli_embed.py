"""`poot embed`: the cosine matrix and rankings it prints, against sentence-transformers and transformers."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from helpers.encoders import DOCS, QUERY, build_cross_encoder, minilm_path
from poot_core.cli.main import main
from poot_core.executor import _safe_probe, installed_backends

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXTS = ["a small domestic cat", "a young kitten", "the stock market fell sharply today", "cat"]


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["embed", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def st_vectors():
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_path()), device="cpu")
    return lambda texts: model.encode(texts, normalize_embeddings=True, convert_to_numpy=True)


def test_similarity_json_matches_sentence_transformers(capsys, st_vectors):
    rc, out, _ = _run(capsys, "similarity", str(minilm_path()), *TEXTS, "--json", "--backend", "cpu")
    assert rc == 0
    result = json.loads(out)
    assert result["texts"] == TEXTS and result["backend"] == "cpu"
    v = st_vectors(TEXTS)
    assert np.allclose(np.array(result["similarity"]), v @ v.T, atol=1e-4)


def test_similarity_table_prints_every_row(capsys, st_vectors):
    rc, out, _ = _run(capsys, "similarity", str(minilm_path()), *TEXTS[:2])
    assert rc == 0
    lines = out.strip().splitlines()
    assert len(lines) == 3  # header + one row per text
    v = st_vectors(TEXTS[:2])
    assert lines[1].split()[1:3] == [f"{x:.4f}" for x in (v @ v.T)[0]]
    assert lines[2].endswith(TEXTS[1])


def test_rerank_by_cosine(capsys, st_vectors):
    rc, out, _ = _run(capsys, "rerank", str(minilm_path()), "a cat", *TEXTS[1:], "--json")
    assert rc == 0
    result = json.loads(out)
    q, d = st_vectors(["a cat"])[0], st_vectors(TEXTS[1:])
    ref = np.argsort(-(d @ q), kind="stable")
    assert result["scorer"] == "cosine"
    assert [r["index"] for r in result["results"]] == list(ref)
    assert [r["document"] for r in result["results"]] == [TEXTS[1:][i] for i in ref]


def test_rerank_with_a_cross_encoder(tmp_path, capsys):
    model, fast = build_cross_encoder(tmp_path, "bert")
    batch = fast([QUERY] * len(DOCS), DOCS, padding=True, return_tensors="pt")
    with torch.no_grad():
        ref = model(**batch).logits[:, 0].numpy()
    rc, out, _ = _run(capsys, "rerank", str(tmp_path), QUERY, *DOCS, "--json")
    assert rc == 0
    result = json.loads(out)
    assert result["scorer"] == "cross-encoder"
    order = list(np.argsort(-ref, kind="stable"))
    assert [r["index"] for r in result["results"]] == order
    assert np.allclose([r["score"] for r in result["results"]], ref[order], rtol=1e-4, atol=1e-5)
    rc, out, _ = _run(capsys, "rerank", str(tmp_path), QUERY, *DOCS)  # the table
    assert rc == 0 and len(out.strip().splitlines()) == len(DOCS) + 1
    rc, _, err = _run(capsys, "similarity", str(tmp_path), "a", "b")
    assert rc == 1 and "cross-encoder" in err


def test_refusals(tmp_path, capsys):
    rc, _, err = _run(capsys, "similarity", str(tmp_path / "missing"), "a", "--backend", "cpu")
    assert rc == 1 and "no such checkpoint" in err
    with pytest.raises(SystemExit):
        main(["embed", "similarity", str(minilm_path()), "a", "--backend", "tpu"])
    with pytest.raises(SystemExit):
        main(["embed", "rerank", str(minilm_path()), "query only"])
    absent = [s for s in installed_backends() if s.name != "cpu" and not _safe_probe(s)]
    if not absent:
        pytest.skip("every installed backend has its device on this machine")
    # An absent device is refused before the checkpoint is read (the path does not even exist).
    rc, _, err = _run(capsys, "similarity", str(tmp_path / "missing"), "a", "--backend", absent[0].name)
    assert rc == 1 and "Backend" in err


def test_vectors_match_sentence_transformers(capsys, st_vectors):
    v = st_vectors(TEXTS)
    rc, out, err = _run(capsys, "vectors", str(minilm_path()), *TEXTS, "--json", "--backend", "cpu")
    assert rc == 0 and "warning" not in err
    result = json.loads(out)
    assert result["texts"] == TEXTS and np.allclose(np.array(result["vectors"]), v, atol=2e-5)
    rc, out, _ = _run(capsys, "vectors", str(minilm_path()), *TEXTS[:2])  # one line per text
    lines = out.strip().splitlines()
    assert rc == 0 and len(lines) == 2
    for i, line in enumerate(lines):
        label, *values = line.split()
        assert label == f"[{i}]" and np.allclose([float(x) for x in values], v[i], atol=3e-5)


def test_a_decoder_used_as_an_embedder_warns(capsys, tiny_checkpoint):
    model = str(tiny_checkpoint("llama", torch.float32))
    rc, out, err = _run(capsys, "vectors", model, "a cat", "--backend", "cpu")
    assert rc == 0 and len(out.strip().splitlines()) == 1
    assert "warning" in err and "is a decoder (LlamaForCausalLM), not an embedding model" in err
