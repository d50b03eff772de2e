"""GGUF checkpoints end to end: the real SmolLM2 Q4_1 file against transformers running the same file, and
tiny GGUF files written by the tests with llama.cpp's tensor names."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import transformers

from helpers import smollm, tiny
from helpers.gguf_edit import finish_gguf
from helpers.memory import forward_pass_memory
from poot_core import Driver, DriverOptions, ModelHandle, Reason, Unsupported, open_executor


@pytest.fixture(scope="module")
def handle():
    return ModelHandle.load(smollm.gguf_path())


@pytest.fixture(scope="module")
def reference():
    """transformers on the same file: its own GGUF loader's float32 weights, as saved once into .cache/models
    (smollm.safetensors_copy; the family tests share the copy, so the file is dequantized once per clone)."""
    return transformers.AutoModelForCausalLM.from_pretrained(smollm.safetensors_copy(torch.float32),
                                                             dtype=torch.float32).eval()


def test_config_and_tokenizer_come_from_the_file(handle):
    config = handle.config()
    assert config.family == "llama" and config.source_format == "gguf"
    assert handle.text().has_chat_template()
    weights = handle.store()
    assert weights.get("model.layers.0.self_attn.q_proj.weight").kind == "gguf.Q4_1"


@pytest.mark.slow
def test_logits_match_transformers_on_the_same_file(handle, reference):
    ids = handle.text().encode(" ".join(smollm.PROMPTS))
    driver = Driver(handle, open_executor("cpu"), DriverOptions(capacity=64, prefill_chunk=16))
    ours = driver.logits(ids)
    with torch.no_grad():
        ref = reference(torch.tensor([ids])).logits[0]
    assert tiny.rel_error(ours, ref) <= 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("prompt", smollm.PROMPTS)
def test_greedy_32_tokens_match_transformers(handle, reference, prompt):
    ids = handle.text().encode(prompt)
    ours, theirs = smollm.greedy_tokens(handle, reference, ids)
    assert ours == theirs


def test_resident_memory_stays_near_file_size():
    """Loading maps the file; nothing is widened. Run in a fresh process so other tests' memory is not counted.

    Resident memory is split in two: the pages of the GGUF file's own mapping (at most the file) and anonymous
    memory (copies the loader or executor made). Library code paged in on the first compute is file-backed but
    not the model's, so it is left out; it differs between machines by tens of MB.
    """
    cost = forward_pass_memory(smollm.gguf_path(), "hello")
    copied, mapped = cost["anonymous"], cost["mapped"]
    size = smollm.gguf_path().stat().st_size
    assert 0 < mapped <= size + os.sysconf('SC_PAGE_SIZE'), (mapped, size)  # the last page is whole
    # Widening even the token embedding alone to bf16 (57 MB) breaks this bound; the model is 135M parameters.
    assert copied <= 0.5 * size, (copied, size)


def test_unknown_block_type_is_refused_before_compute(tmp_path):
    import gguf

    path = tmp_path / "iq.gguf"
    w = gguf.GGUFWriter(path, "llama")
    # 4 rows of one IQ2_XXS block (256 weights in 66 bytes) each
    w.add_tensor("blk.0.attn_q.weight", np.zeros((4, 66), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS)
    finish_gguf(w)
    from poot_core.checkpoint.gguf_file import GGUFFile

    with pytest.raises(Unsupported) as err:
        GGUFFile.open(path).tensor("blk.0.attn_q.weight")
    assert err.value.reason is Reason.QUANTIZATION
    assert "IQ2_XXS" in str(err.value) and "blk.0.attn_q.weight" in str(err.value)

