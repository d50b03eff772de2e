"""The Vulkan MoE path that reads only the chosen experts (routing writes the chosen ids and weights; the
gate/up and down products gather those experts' rows from per-layer stacks), against the CPU executor's moe op
on fresh random inputs and on the MoE family's tiny checkpoints; unchosen experts poisoned with NaN after upload
leave the output finite and equal. On any Vulkan adapter (CI: lavapipe)."""

from __future__ import annotations

try:  # triton bundles its own LLVM: imported after lavapipe has loaded Mesa's LLVM, it crashes the process
    import triton  # noqa: F401
except ImportError:
    pass

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from helpers.gguf_blocks import quantized_blocks, random_blocks
from helpers.graphs import trace
from poot_backend_vulkan.kernels import moe as moe_kernels
from poot_backend_vulkan.kernels.linear import linear
from poot_backend_vulkan.kernels.runtime import Runtime, vulkan_adapters
from poot_backend_vulkan.kernels.weights import upload_stack, upload_weight
from poot_core import Driver, DriverOptions, ModelHandle, StepShape, open_executor
from poot_core.cpu import moe as cpu_moe

pytestmark = pytest.mark.skipif(not vulkan_adapters(), reason="no Vulkan adapter on this machine (mesa-vulkan-drivers)")
PROMPT = [5, 77, 190]  # 3 tokens x top 2 of 8 experts: at least two experts of each layer stay unchosen


@pytest.fixture(scope="module")
def vulkan():
    return open_executor("vulkan")


def _weight(fmt: str, rows: int, cols: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(stored data as upload_weight takes it, the f32 values it stands for: gguf's dequantization)."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.2
    if fmt == "f32":
        return w, w
    if fmt == "bf16":
        data = (w.view(np.uint32) >> 16).astype(np.uint16)
        return data, (data.astype(np.uint32) << 16).view(np.float32)
    data = quantized_blocks(fmt, rows, cols, seed) if fmt == "Q8_0" else random_blocks(fmt, rows, cols, seed)
    return data, quants.dequantize(data, GGMLQuantizationType[fmt]).astype(np.float32)


@pytest.mark.parametrize(("fmt", "width", "inter", "tokens", "norm"),
                         [("f32", 64, 32, 1, True), ("bf16", 64, 32, 3, False), ("Q8_0", 64, 64, 2, True),
                          ("Q4_K", 256, 256, 1, False)])
def test_gathered_experts_match_the_cpu_moe_op(fmt: str, width: int, inter: int, tokens: int, norm: bool) -> None:
    """route + gate_up + down on random inputs against poot_core.cpu.moe.moe on the dequantized weights, with the
    stacks cut into chunks of whole experts (a lowered binding limit), so several dispatches share the slots."""
    count, top_k, act = 8, 2, "silu" if norm else "gelu_tanh"
    gate_up_data, down_data, experts = [], [], []
    for e in range(count):
        g, g_ref = _weight(fmt, inter, width, 10 * e)
        u, u_ref = _weight(fmt, inter, width, 10 * e + 1)
        d, d_ref = _weight(fmt, width, inter, 10 * e + 2)
        gate_up_data.append([g, u])
        down_data.append([d])
        experts.append(tuple(torch.from_numpy(w) for w in (g_ref, u_ref, d_ref)))
    full = Runtime()
    per_expert_bytes = (g.size * g.itemsize) * 2
    rt = Runtime(adapter=full.adapter, max_binding_bytes=3 * per_expert_bytes)  # 3 experts a chunk: 3 dispatches
    gate_up = upload_stack(rt, gate_up_data, fmt, width)
    down = upload_stack(rt, down_data, fmt, inter)
    assert gate_up is not None and down is not None and len(gate_up.weight.chunks) == 3
    rng = np.random.default_rng(1)
    x = rng.standard_normal((tokens, width)).astype(np.float32)
    router = rng.standard_normal((count, width)).astype(np.float32)
    attrs = {"scoring": "softmax", "groups": 1, "topk_groups": 1, "group_score": "max", "top_k": top_k,
             "norm_topk": norm, "routed_scale": 1.5, "act": act}
    want = cpu_moe.moe(torch.from_numpy(x), torch.from_numpy(router), None, None, None, experts, attrs).numpy()

    dx, out = rt.upload(x), rt.empty((tokens, width))
    logits, weights = rt.empty((tokens, count)), rt.empty((tokens, count))
    ids, chosen, h = rt.empty((tokens, top_k), "u32"), rt.empty((tokens, top_k)), rt.empty((tokens * top_k, inter))
    batch = rt.batch()
    linear(batch, dx, upload_weight(rt, router, "f32", router.shape), logits)
    moe_kernels.route(batch, logits, weights, top_k, norm, 1.5, ids, chosen)
    moe_kernels.gate_up(batch, dx, gate_up, ids, h, act)
    moe_kernels.down(batch, h, down, ids, chosen, out)
    batch.submit()
    want_ids, want_w = cpu_moe.route(torch.from_numpy(x), torch.from_numpy(router), None, attrs)
    assert np.array_equal(rt.read(ids), want_ids.numpy())
    np.testing.assert_allclose(rt.read(chosen), want_w.numpy(), rtol=1e-5, atol=1e-6)
    got = rt.read(out)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.parametrize(("arch", "dtype"), [("mixtral", torch.float32), ("mixtral", torch.bfloat16),
                                             ("qwen2_moe", torch.float32), ("qwen3_moe", torch.float32)])
def test_decode_steps_gather_experts_and_match_cpu(moe_checkpoint, vulkan, arch: str, dtype: torch.dtype) -> None:
    """Every step one token (the decode program, which takes the gathered path), logits against the CPU."""
    handle = ModelHandle.load(moe_checkpoint(arch, dtype))
    prompt = [int(i) for i in np.random.default_rng(3).integers(3, 250, 6)]
    opts = DriverOptions(capacity=32, prefill_chunk=1)
    ours_driver = Driver(handle, vulkan, opts)
    assert ours_driver.weights.stacked  # the experts were stacked at upload
    ours = ours_driver.logits(prompt)
    ref = Driver(handle, open_executor("cpu"), opts).logits(prompt)
    assert np.abs(ours - ref).max() <= 1e-3 * np.abs(ref).max()
    program = vulkan.prepare(trace(handle, StepShape(1, 1, 32)), ours_driver.weights)
    moe_layers = sum(n.op == "moe" for n in program.graph.nodes)
    # per moe layer: router product, routing, gate/up, down (+ the shared expert's gate and sum): not one per expert
    assert program.step.dispatch_count < len(program.graph.nodes) + 3 * moe_layers


def _chosen_by_cpu(handle, monkeypatch) -> tuple[np.ndarray, list[set[int]]]:
    """The CPU logits of PROMPT, and the experts its routing chooses, per moe layer in graph order (one step)."""
    calls: list[torch.Tensor] = []
    route = cpu_moe.route

    def recording(*args):
        ids, weights = route(*args)
        calls.append(ids)
        return ids, weights

    monkeypatch.setattr(cpu_moe, "route", recording)
    ref = Driver(handle, open_executor("cpu"), DriverOptions(capacity=32, prefill_chunk=16)).logits(PROMPT)
    monkeypatch.setattr(cpu_moe, "route", route)
    return ref, [set(ids.reshape(-1).tolist()) for ids in calls]


def _poison(runtime: Runtime, driver: Driver, graph, layer_experts: list[set[int]]) -> None:
    """Overwrite the named experts' rows (gate, up and down) in the uploaded stacks with NaN."""
    nan = np.full(1, np.nan, dtype=np.float32).view(np.uint32)
    nodes = [n for n in graph.nodes if n.op == "moe"]
    for node, experts in zip(nodes, layer_experts, strict=True):
        for e in experts:
            for j in (0, 2):  # the gate/up stack and the down stack
                stack, index, _ = driver.weights.stacked[node.inputs[5 + 3 * e + j].name]
                row_bytes = stack.weight.fmt.row_bytes(stack.weight.cols)
                chunk, lo, _ = next(c for c in stack.chunk_experts() if c[1] <= index < c[2])
                offset = (index - lo) * stack.per_expert * row_bytes
                words = np.repeat(nan, stack.per_expert * row_bytes // 4)
                runtime.device.queue.write_buffer(chunk.buffer, offset, words)


def test_unchosen_experts_are_never_read(moe_checkpoint, vulkan, monkeypatch) -> None:
    """NaN in every expert the routing does not choose changes nothing; NaN in one chosen expert reaches the
    logits (so the poison would show a read)."""
    handle = ModelHandle.load(moe_checkpoint("mixtral"))
    ref, chosen = _chosen_by_cpu(handle, monkeypatch)
    graph = trace(handle, StepShape(1, 1, 32))
    count = next(n for n in graph.nodes if n.op == "moe").attrs["experts"]
    assert len(chosen) == sum(n.op == "moe" for n in graph.nodes)
    unchosen = [set(range(count)) - c for c in chosen]
    assert all(unchosen)
    opts = DriverOptions(capacity=32, prefill_chunk=1)
    driver = Driver(handle, vulkan, opts)
    _poison(vulkan.runtime, driver, graph, unchosen)
    ours = driver.logits(PROMPT)
    assert np.isfinite(ours).all()
    assert np.abs(ours - ref).max() <= 1e-3 * np.abs(ref).max()
    control = Driver(handle, vulkan, opts)
    _poison(vulkan.runtime, control, graph, [{min(chosen[0])}] + [set()] * (len(chosen) - 1))
    assert not np.isfinite(control.logits(PROMPT)).all()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral_gguf"])
def test_gguf_stacked_experts_match_cpu(moe_checkpoint, vulkan, tmp_path, arch: str) -> None:
    """GGUF's stacked [E, out, in] Q8_0 experts (helpers.moe.write_gguf): uploaded as stacks, gathered at decode
    (one token a step) and run expert by expert in a prefill chunk, both against the CPU."""
    from helpers.moe import write_gguf

    handle = ModelHandle.load(write_gguf(moe_checkpoint(arch), tmp_path, arch))
    prompt = [int(i) for i in np.random.default_rng(5).integers(3, 250, 8)]
    ref = Driver(handle, open_executor("cpu"), DriverOptions(capacity=32, prefill_chunk=16)).logits(prompt)
    driver = Driver(handle, vulkan, DriverOptions(capacity=32, prefill_chunk=1))
    assert driver.weights.expert_tensors and not driver.weights.stacked
    for options in (DriverOptions(capacity=32, prefill_chunk=1), DriverOptions(capacity=32, prefill_chunk=8)):
        ours = Driver(handle, vulkan, options).logits(prompt)
        assert np.abs(ours - ref).max() <= 1e-3 * np.abs(ref).max()
