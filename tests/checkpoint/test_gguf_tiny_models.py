"""Tiny llama models whose matrices are stored in each GGUF block type, end to end.

For every type the test writes a GGUF file with llama.cpp's names and layout (q/k rows permuted as its
converter does) and a Hugging Face checkpoint holding exactly the dequantized float values (rows put back in
Hugging Face order); poot's logits from the packed file must match transformers' on the float copy. Types the
`gguf` package can quantize are quantized from the model's own weights; for the others the matrices are random
valid blocks.
"""

from __future__ import annotations

import pytest

from helpers import tiny
from helpers.gguf_blocks import QUANTIZABLE, RANDOM_ONLY
from helpers.gguf_models import PROMPT, build
from poot_core import Driver, DriverOptions, ModelHandle, open_executor


@pytest.mark.parametrize("type_name", QUANTIZABLE + RANDOM_ONLY)
def test_every_block_type_matches_the_float_reference(tmp_path, type_name):
    path, reference = build(tmp_path, type_name)
    handle = ModelHandle.load(path)
    kinds = {handle.store().get(n).kind for n in handle.store().names() if "layers" in n and "norm" not in n}
    assert kinds == {f"gguf.{type_name}"}  # computed from the packed blocks, nothing widened at load
    driver = Driver(handle, open_executor("cpu"), DriverOptions(capacity=64, prefill_chunk=8))
    # The same values (dequantization is bit-exact), summed in another order: measured 1e-6 for most types and
    # 2e-4 for Q3_K, whose random blocks give weights up to 12; even two float32 runs of its float copy (poot's
    # and transformers') differ by 8e-5 there. The bound is the real SmolLM2 check's.
    assert tiny.rel_error(driver.logits(PROMPT), tiny.reference_logits(reference, PROMPT)) <= 1e-3
