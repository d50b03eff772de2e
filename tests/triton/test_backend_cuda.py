"""The CUDA executor against the CPU executor (the reference every backend is held to).

On a machine without a GPU (CI) the executor's graph binding runs on the CPU through Triton's interpreter
(the same kernels, the same fusions; no CUDA graphs), and the refusals are checked. On a machine with a
CUDA device (`make test-gpu` on the lent H200) the tiny llama-family checkpoints run end to end on the GPU,
decode steps replayed from CUDA graphs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton  # noqa: E402, F401 - a test dependency: missing, it must fail, not skip

from poot_backend_cuda.executor import CudaExecutor  # noqa: E402
from poot_backend_cuda.plugin import probe  # noqa: E402
from poot_core import (  # noqa: E402
    Driver,
    DriverOptions,
    GenerateRequest,
    ModelHandle,
    Node,
    PackedWeight,
    Reason,
    StepShape,
    Tracer,
    Unsupported,
    installed_backends,
    open_executor,
)

PROMPT = [int(i) for i in np.random.default_rng(11).integers(3, 250, 24)]
HAS_GPU = probe()
gpu = pytest.mark.skipif(not HAS_GPU, reason="no CUDA device on this machine")


def rel(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def interpreted_executor() -> CudaExecutor:
    """The executor's binding on the CPU under TRITON_INTERPRET: same kernels, no CUDA graphs."""
    return CudaExecutor.on_interpreter()


def both_logits(handle, ours_executor, prompt=PROMPT, **options):
    opts = {"capacity": 48, "prefill_chunk": 8, **options}
    ref = Driver(handle, open_executor("cpu"), DriverOptions(**opts)).logits(prompt)
    ours = Driver(handle, ours_executor, DriverOptions(**opts)).logits(prompt)
    return ours, ref


def _graph(handle, shape: StepShape):
    tracer = Tracer(shape, handle.store().shapes())
    handle.family.trace(handle.config(), tracer, shape)
    return tracer.graph


# -- everywhere -------------------------------------------------------------------------------------------


def test_registered_with_alias_and_priority():
    spec = next(s for s in installed_backends() if s.name == "cuda")
    assert spec.aliases == ("ptx",) and spec.priority == 40 and spec.distribution == "poot-backend-cuda"
    assert spec.probe() == HAS_GPU


@pytest.mark.skipif(HAS_GPU, reason="checks the refusal on a machine without a GPU")
def test_absent_device_is_refused_by_name():
    for name in ("cuda", "ptx"):
        with pytest.raises(Unsupported) as err:
            open_executor(name)
        assert err.value.reason is Reason.BACKEND and err.value.name == "cuda"
    with pytest.raises(Unsupported) as err:
        CudaExecutor()
    assert err.value.reason is Reason.BACKEND


@pytest.mark.skipif(HAS_GPU, reason="the interpreter path is for machines without a GPU")
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_interpreted_binding_matches_cpu(tiny_checkpoint, arch):
    """Prefill chunks and one-token steps through the Triton kernels (interpreted) vs the CPU executor."""
    handle = ModelHandle.load(tiny_checkpoint(arch, torch.float32))
    ours, ref = both_logits(handle, interpreted_executor(), PROMPT[:12], prefill_chunk=5)
    assert ours.shape == ref.shape
    assert rel(ours, ref) <= 1e-3
    ours1, ref1 = both_logits(handle, interpreted_executor(), PROMPT[:6], prefill_chunk=1)
    assert rel(ours1, ref1) <= 1e-3


@pytest.mark.skipif(HAS_GPU, reason="the interpreter path is for machines without a GPU")
def test_qkv_and_gate_up_are_concatenated_into_views(tiny_checkpoint):
    handle = ModelHandle.load(tiny_checkpoint("llama", torch.float32))
    ex = interpreted_executor()
    weights = ex.upload(handle.store())
    ex.prepare(_graph(handle, StepShape(1, 1, 32)), weights)
    q = weights.tensors["model.layers.0.self_attn.q_proj.weight"]
    joined = weights.fused[tuple(f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv")]
    assert q.untyped_storage().data_ptr() == joined.untyped_storage().data_ptr()
    assert any("gate_proj" in names[0] and "up_proj" in names[1] for names in weights.fused)


def test_prepare_refuses_what_the_kernels_cannot_run(tiny_checkpoint):
    handle = ModelHandle.load(tiny_checkpoint("llama", torch.float32))
    ex = interpreted_executor()
    weights = ex.upload(handle.store())
    graph = _graph(handle, StepShape(1, 4, 32))
    node = next(n for n in graph.nodes if n.op == "gated")
    node.attrs["act"] = "gelu"  # erf gelu: no gated kernel for it
    with pytest.raises(Unsupported) as err:
        ex.prepare(graph, weights)
    assert err.value.reason is Reason.OPERATION and err.value.name == "gated:gelu"
    graph = _graph(handle, StepShape(1, 4, 32))
    graph.nodes.append(Node("moe", (), "moe99", (1,)))
    with pytest.raises(Unsupported) as err:
        ex.prepare(graph, weights)
    assert err.value.reason is Reason.OPERATION and err.value.name == "moe"
    graph = _graph(handle, StepShape(1, 4, 32))
    next(n for n in graph.nodes if n.op == "rope").attrs["style"] = "glm"
    with pytest.raises(Unsupported) as err:
        ex.prepare(graph, weights)
    assert err.value.name == "rope:glm"


def test_upload_refuses_layouts_and_sizes_before_copying():
    class Store:
        def __init__(self, weights):
            self.weights = weights

        def names(self):
            return list(self.weights)

        def get(self, name):
            return self.weights[name]

    ex = interpreted_executor()
    gptq5 = PackedWeight("gptq", (64, 64), {"qweight": torch.zeros(10, 64, dtype=torch.int32)}, {"bits": 5})
    with pytest.raises(Unsupported) as err:
        ex.upload(Store({"layer.weight": gptq5}))
    assert err.value.reason is Reason.QUANTIZATION and "layer.weight" in err.value.name
    ex.memory = lambda: {"total": 1 << 20, "free": 1 << 20}
    with pytest.raises(Unsupported) as err:
        ex.upload(Store({"big.weight": torch.zeros(1024, 1024, dtype=torch.bfloat16)}))
    assert err.value.reason is Reason.CAPACITY


def test_kv_cache_that_does_not_fit_is_refused_at_prepare(tiny_checkpoint):
    handle = ModelHandle.load(tiny_checkpoint("llama", torch.float32))
    ex = interpreted_executor()
    weights = ex.upload(handle.store())
    ex.memory = lambda: {"total": 1 << 30, "free": 1 << 30}  # less than the 1 GiB headroom plus any KV
    with pytest.raises(Unsupported) as err:
        ex.prepare(_graph(handle, StepShape(1, 1, 32)), weights)
    assert err.value.reason is Reason.CAPACITY and "KV" in err.value.name


# -- on a GPU ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cuda():
    return open_executor("cuda")


@gpu
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "gemma3"])
def test_gpu_f32_logits_and_greedy_tokens_match_cpu(tiny_checkpoint, cuda, arch):
    handle = ModelHandle.load(tiny_checkpoint(arch, torch.float32))
    ours, ref = both_logits(handle, cuda)
    # float32 matmuls on the GPU go through tf32 tensor cores in the prefill GEMM and attention
    assert rel(ours, ref) <= 1e-2
    request = GenerateRequest(PROMPT[:12], max_new=12, ignore_eos=True)
    want = Driver(handle, open_executor("cpu"), DriverOptions(capacity=48, prefill_chunk=8)).generate(request)
    got = Driver(handle, cuda, DriverOptions(capacity=48, prefill_chunk=8)).generate(request)
    assert got.tokens == want.tokens


@gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "gemma3"])
def test_gpu_bf16_logits_match_cpu(tiny_checkpoint, cuda, arch):
    """bf16 weights as stored, bf16 activations between matmuls, float32 residual stream and logits."""
    handle = ModelHandle.load(tiny_checkpoint(arch, torch.bfloat16))
    ours, ref = both_logits(handle, cuda)
    assert rel(ours, ref) <= 3e-2
    ours1, ref1 = both_logits(handle, cuda, PROMPT[:16], prefill_chunk=1)  # replayed decode steps
    assert rel(ours1, ref1) <= 3e-2


@gpu
def test_gpu_greedy_token_and_outputs_survive_replays(tiny_checkpoint, cuda):
    handle = ModelHandle.load(tiny_checkpoint("llama", torch.bfloat16))
    driver = Driver(handle, cuda, DriverOptions(capacity=48, prefill_chunk=8))
    first = driver._run(PROMPT[:8], 0, False)
    assert cuda.greedy_token(first) == int(np.argmax(cuda.to_numpy(first)[0, -1]))
    one = driver._run(PROMPT[8:9], 8, False)
    copy = cuda.to_numpy(one)
    two = driver._run(PROMPT[9:10], 9, False)
    assert np.array_equal(cuda.to_numpy(one), copy)
    assert cuda.greedy_token(two) == int(np.argmax(cuda.to_numpy(two)[0, -1]))
