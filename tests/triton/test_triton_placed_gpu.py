"""One rank on the GPU: a Coordinator that joined a one-rank NCCL group runs the CUDA backend's placed driver
unchanged (its logits and greedy tokens are the unplaced driver's), and an NCCL all_reduce recorded inside a
captured CUDA graph sums at each replay. Skipped without a GPU (the two-rank checks run over gloo on the CPU in
tests/distributed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from poot_core import Driver, DriverOptions, GenerateRequest, ModelHandle, open_executor
from poot_core.distributed import Coordinator, Placement
from poot_core.distributed.spawn import free_port

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and dist.is_nccl_available()),
                                reason="needs a CUDA GPU with NCCL")

OPTIONS = {"capacity": 64, "prefill_chunk": 8}
PROMPT = [(5 * i + 11) % 240 + 3 for i in range(20)]


@pytest.fixture
def nccl_rank(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    coordinator = Coordinator.from_env(timeout=60.0, backend="nccl")
    yield coordinator
    coordinator.close()


def test_an_all_reduce_inside_a_captured_graph_sums_at_each_replay(nccl_rank):
    assert nccl_rank.on_gpu and nccl_rank.joined
    x = torch.arange(16, dtype=torch.float32, device="cuda")
    assert torch.equal(nccl_rank.all_reduce(x.clone()), x)  # eager, one rank: the sum is x
    static = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # NCCL's first call sets up its communicator outside the capture
        nccl_rank.all_reduce(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = nccl_rank.all_reduce(static) * 2
    for k in (3.0, -1.5):
        static.copy_(x * k)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, x * k * 2)


def test_a_one_rank_nccl_placed_driver_runs_the_cuda_backend_unchanged(nccl_rank, tiny_checkpoint):
    handle = ModelHandle.load(tiny_checkpoint("llama", torch.float32))
    plain = Driver(handle, open_executor("cuda"), DriverOptions(**OPTIONS))
    for placement in (Placement.TENSOR, Placement.PIPELINE):
        placed = Driver.placed(handle, nccl_rank, placement, open_executor("cuda"), DriverOptions(**OPTIONS))
        np.testing.assert_allclose(placed.logits(PROMPT), plain.logits(PROMPT), rtol=0, atol=1e-4)
        request = GenerateRequest(PROMPT, max_new=8, ignore_eos=True)
        assert placed.generate(request).tokens == plain.generate(request).tokens
