"""The Triton executor's constraint masks (sampling.apply_bitmask, TritonExecutor.mask_logits): the kernel masks
exactly what the host path masks, and the serving engine on the Triton executor gives the same tokens with the
masks on the device as with the host path, constrained rows beside unconstrained ones. Runs in Triton's
interpreter without a GPU, compiled on one with a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton  # noqa: F401 - a test dependency: missing, it must fail, not skip

from helpers import tiny
from helpers.triton_mode import interpreted
from poot_core import Constraint, Driver, DriverOptions, GenerateRequest, Layout, ModelHandle, Sampler
from poot_core.driver import token_masks
from poot_kernels_triton.executor import TritonExecutor
from poot_kernels_triton.sampling import apply_bitmask

DEVICE = torch.device("cpu" if interpreted() else "cuda")


def _executor() -> TritonExecutor:
    return TritonExecutor.on_interpreter() if interpreted() else TritonExecutor(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitmask_kernel_equals_the_host_mask(dtype):
    rng = np.random.default_rng(2)
    rows, vocab = 4, 700  # not a multiple of 32 nor of the kernel's block
    bitmask = rng.integers(-(2**31), 2**31, size=(3, token_masks.words(vocab)), dtype=np.int64).astype(np.int32)
    slots = np.array([3, 0, 1])
    logits = torch.from_numpy(rng.standard_normal((rows, vocab)).astype(np.float32)).to(dtype)
    ref = logits.float().numpy().copy()
    ref[slots] = np.where(token_masks.unpack(bitmask, vocab), ref[slots], -np.inf)
    out = logits.to(DEVICE)
    apply_bitmask(out, torch.from_numpy(bitmask).to(DEVICE), torch.from_numpy(slots).to(DEVICE))
    assert np.array_equal(out.float().cpu().numpy(), ref)


def test_triton_engine_device_masks_give_the_host_paths_tokens(tmp_path_factory):
    handle = ModelHandle.load(tiny.build(tmp_path_factory.mktemp("llama"), "llama", layers=1))
    ex = _executor()
    prompts = [handle.text().encode(t) for t in ("Numbers: 0 1 2", "The capital of", "def add(a, b):")]

    def requests():
        return [GenerateRequest(prompts[0], 8, Sampler.greedy(), constraint=Constraint.regex(r"[a-z]{2}[0-9]")),
                GenerateRequest(prompts[1], 4, Sampler.greedy(), ignore_eos=True),
                GenerateRequest(prompts[2], 8, Sampler(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=4),
                                constraint=Constraint.choice(["yes", "no"]))]

    def run(on_device: bool) -> list:
        engine = Driver(handle, ex, DriverOptions(capacity=64, prefill_chunk=16, block_size=4, step_tokens=16,
                                                  max_running=4, kv_blocks=40)).serve(Layout.PAGED)
        if not on_device:
            engine.driver.masks.device = None
        assert (engine.driver.masks.device is not None) == on_device
        return [(g.tokens, g.text, g.stop_reason) for g in engine.generate_batch(requests())]

    on_device = run(True)
    assert on_device == run(False)
    assert on_device[0][2] == "eos" and on_device[2][1] in ("yes", "no")
