"""The hybrid families in the serving engine (Layout.PAGED) on the shared Triton executor: recurrent state in a pool
of slots on the device, each sequence's run through the contiguous kernels over its own slot. A batch of mixed
prompt lengths (one across two prefill chunks, one of a single token) against each request alone on the CPU
executor's contiguous Driver: the same greedy tokens, every sampled token's logits within 1e-4.

Without a GPU the executor runs under the Triton interpreter (slow: few, short requests).
"""

from __future__ import annotations

import numpy as np
import pytest
import triton  # noqa: F401 - a test dependency: missing, it must fail, not skip

from helpers.triton_mode import interpreted
from poot_core import Driver, DriverOptions, GenerateRequest, Layout, ModelHandle, open_executor
from poot_kernels_triton.executor import TritonExecutor

# the convolution and scan alone (no KV at all), the convolution and delta rule beside attention: each recurrent op
# in a paged step (the interpreter is slow; the other families are left to tests/driver/test_engine_hybrid.py)
ARCHS = ["mamba2", "qwen3next"]
CHUNK, NEW, BOUND = 6, 3, 1e-4
PROMPTS = [[(7 * i + 5 * j + 3) % 250 + 2 for i in range(n)] for j, n in enumerate([11, 1, 4])]


def _executor() -> TritonExecutor:
    return TritonExecutor.on_interpreter() if interpreted() else TritonExecutor(0)


@pytest.mark.parametrize("arch", ARCHS)
def test_paged_batch_matches_each_request_alone_on_the_cpu(hybrid_checkpoint, arch):
    path = hybrid_checkpoint(arch)
    options = DriverOptions(capacity=32, prefill_chunk=CHUNK, block_size=4, kv_blocks=24, step_tokens=12,
                            max_running=4)
    engine = Driver(ModelHandle.load(path), _executor(), options).serve(Layout.PAGED)
    engine.keep_logits = True
    requests = [GenerateRequest(p, max_new=NEW, ignore_eos=True) for p in PROMPTS]
    generations = engine.generate_batch(requests)
    cpu = Driver(ModelHandle.load(path), open_executor("cpu"), DriverOptions(capacity=32, prefill_chunk=CHUNK))
    for rid, (request, gen) in enumerate(zip(requests, generations, strict=True)):
        cpu.reset()
        assert gen.tokens == cpu.serve().generate(request).tokens, f"request {rid}"
        ref = cpu.logits(request.prompt + gen.tokens[:-1])[len(request.prompt) - 1 :]
        seen = np.stack(engine.logits[rid])
        assert np.abs(seen - ref).max() / np.abs(ref).max() <= BOUND, f"request {rid}"
    counters = engine.counters()  # the finished requests' states are kept for a next turn, not held
    assert counters.state_held == 0 and counters.held == 0 and counters.state_kept == len(requests)
