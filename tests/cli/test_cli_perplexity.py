"""`poot perplexity`: llama-perplexity's method (chunks of -c tokens, the second half of each scored) on
SmolLM2, against llama-cpp-python's logits for the same GGUF file and transformers' for the bf16 copy,
each computed here the same way from the reference's own tokens."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import smollm
from helpers.gguf_edit import gguf_copy

POOT = [sys.executable, "-m", "poot_core.cli.main", "perplexity"]
CTX, CHUNKS = 128, 3


def poot(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*POOT, *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def text_file() -> Path:
    """English prose that no test data of the model's came from: Python's own licence text."""
    path = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    assert path.stat().st_size > 8000
    return path




def reference(logits_of, tokens: list[int], bos: int | None) -> tuple[float, float]:
    """llama-perplexity's estimate and its error from a reference's float32 logits, in float64."""
    first = CTX // 2
    nll: list[float] = []
    for i in range(CHUNKS):
        chunk = tokens[i * CTX : (i + 1) * CTX]
        if bos is not None:
            chunk = [bos, *chunk[1:]]
        logits = np.asarray(logits_of(chunk), dtype=np.float64)[first : CTX - 1]
        targets = tokens[i * CTX + first + 1 : (i + 1) * CTX]
        top = logits.max(axis=1)
        log_z = top + np.log(np.exp(logits - top[:, None]).sum(axis=1))
        nll += list(log_z - logits[np.arange(len(targets)), targets])
    values = np.array(nll)
    ppl = math.exp(values.mean())
    return ppl, math.sqrt((np.mean(values**2) - values.mean() ** 2) / (len(values) - 1)) * ppl


def _ours(model: Path, text_file: Path) -> dict:
    out = poot("-m", str(model), "-f", str(text_file), "-c", str(CTX), "--chunks", str(CHUNKS), "--json", "-t", "1")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("add_bos", [False, True])
def test_agrees_with_llama_cpp_on_the_same_gguf(text_file, tmp_path, add_bos):
    """Within 1%. With add_bos (the file changed to say so), each chunk starts with BOS in both."""
    llama_cpp = pytest.importorskip("llama_cpp")
    model = smollm.gguf_path()
    if add_bos:
        model = gguf_copy(model, tmp_path / "bos.gguf", **{"tokenizer.ggml.add_bos_token": True})
    llm = llama_cpp.Llama(str(model), n_ctx=CTX, n_batch=CTX, logits_all=True, n_threads=1, verbose=False)
    tokens = llm.tokenize(text_file.read_text(encoding="utf-8").encode(), add_bos=True)
    assert (tokens[0] == llm.token_bos()) == add_bos

    def logits_of(chunk: list[int]) -> np.ndarray:
        llm.reset()
        llm.eval(chunk)
        return np.array(llm.scores[: len(chunk)])

    ppl, error = reference(logits_of, tokens, llm.token_bos() if add_bos else None)
    ours = _ours(model, text_file)
    assert ours["tokens"] == len(tokens) and ours["chunks"] == CHUNKS
    assert ours["scored_tokens"] == CHUNKS * (CTX - CTX // 2 - 1)
    assert ours["ppl"] == pytest.approx(ppl, rel=0.01)
    assert ours["ppl_error"] == pytest.approx(error, rel=0.05)


def test_agrees_with_transformers_on_the_bf16_copy(text_file):
    """Within 0.5%, and the text output has llama-perplexity's form."""
    import transformers as tf

    model = smollm.safetensors_copy(torch.bfloat16)
    tokenizer = tf.AutoTokenizer.from_pretrained(model)
    net = tf.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    tokens = tokenizer(text_file.read_text(encoding="utf-8"))["input_ids"]

    def logits_of(chunk: list[int]) -> np.ndarray:
        with torch.no_grad():
            return net(torch.tensor([chunk])).logits[0].numpy()

    ppl, _ = reference(logits_of, tokens, None)
    out = poot("-m", str(model), "-f", str(text_file), "-c", str(CTX), "--chunks", str(CHUNKS), "-t", "1")
    assert out.returncode == 0, out.stderr
    running, final = out.stdout.strip().splitlines()
    assert re.fullmatch(r"(\[\d\]\d+\.\d{4},){3}", running)
    found = re.fullmatch(r"Final estimate: PPL = (\d+\.\d{4}) \+/- (\d+\.\d{5})", final)
    assert found and float(found.group(1)) == pytest.approx(ppl, rel=0.005)
    assert running.endswith(f"[3]{found.group(1)},")  # the running estimate ends at the final value


def test_refusals(text_file, tmp_path, tiny_checkpoint):
    model = str(tiny_checkpoint("llama", torch.float32))
    short = tmp_path / "short.txt"
    short.write_text("only a few words")
    out = poot("-m", model, "-f", str(short), "-c", "64")
    assert out.returncode == 1 and "needs at least 128" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    out = poot("-m", model, "-f", str(text_file), "--chunks", "0")
    assert out.returncode == 1 and "--chunks must be" in out.stderr
    out = poot("-m", model, "-f", str(tmp_path / "missing.txt"))
    assert out.returncode == 1 and "cannot read the text file" in out.stderr
    out = poot("-m", model, "-f", str(short), "-c", "64", "-t", "1", "-tb", "2")
    assert "-t has no effect here" in out.stderr
