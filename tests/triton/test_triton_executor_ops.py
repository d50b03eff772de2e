"""The shared Triton executor's mixture-of-experts, latent-attention and encoder ops, beyond the conformance suite.

Runs the executor's graph binding on the CPU under TRITON_INTERPRET (the same kernels; no CUDA graphs): GGUF Q8_0
stacked experts against the CPU executor, which MoE route a step takes and which experts it runs, the latent
cache's layout, and single activation / encoder-attention nodes. Every MoE family, DeepSeek's latent attention
and the cross encoders against the CPU, interpreted and on a GPU, are in tests/conformance.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton  # noqa: E402, F401 - a test dependency: missing, it must fail, not skip

from helpers import moe as test_family_moe  # noqa: E402
from helpers.graphs import trace  # noqa: E402
from poot_core import (  # noqa: E402
    Driver,
    DriverOptions,
    ModelHandle,
    StepShape,
    open_executor,
)
from poot_kernels_triton.executor import TritonExecutor  # noqa: E402
from poot_kernels_triton.program import Binder, Step  # noqa: E402

PROMPT = [(7 * i + 3) % 250 + 2 for i in range(14)]
interpreter = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path is for machines without a GPU")


def rel(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def interpreted_executor() -> TritonExecutor:
    """The executor's binding on the CPU under TRITON_INTERPRET: same kernels, no CUDA graphs."""
    return TritonExecutor.on_interpreter()


def both_logits(handle: ModelHandle, prompt: list[int], chunk: int) -> tuple[np.ndarray, np.ndarray]:
    opts = DriverOptions(capacity=32, prefill_chunk=chunk)
    ref = Driver(handle, open_executor("cpu"), opts).logits(prompt)
    ours = Driver(handle, interpreted_executor(), opts).logits(prompt)
    return ours, ref


@interpreter
def test_gguf_stacked_q8_experts_match_cpu(moe_checkpoint, tmp_path):
    """Experts stacked [E, F, D] as GGUF Q8_0 blocks (and a Q8_0 kv_b): each expert is a view of the blocks."""
    path = test_family_moe.write_gguf(moe_checkpoint("deepseek_v2"), tmp_path, "deepseek_v2")
    handle = ModelHandle.load(path)
    ours, ref = both_logits(handle, PROMPT[:9], 4)
    assert rel(ours, ref) <= 2e-2  # bf16 activations (packed weights) against the CPU's float32


@interpreter
def test_decode_moe_is_graph_safe_and_prefill_runs_only_chosen_experts(moe_checkpoint, monkeypatch):
    handle = ModelHandle.load(moe_checkpoint("mixtral"))
    ex = interpreted_executor()
    ex.use_cuda_graphs = True
    weights = ex.upload(handle.store())
    decode = ex.prepare(trace(handle, StepShape(1, 1, 32)), weights)
    assert decode.use_graph  # the fused route reads nothing on the host: the step can be a CUDA graph
    graph = trace(handle, StepShape(1, 8, 32))
    assert not ex.prepare(graph, weights).use_graph  # the grouped route reads counts per expert on the host
    import poot_kernels_triton.moe as tmoe

    seen: list[int] = []
    real = tmoe.linear
    experts = next(n.attrs["experts"] for n in graph.nodes if n.op == "moe")

    def counting(x, w, *args, **kwargs):
        if w.shape[0] != experts:  # the router's product is not an expert's
            seen.append(x.shape[0])
        return real(x, w, *args, **kwargs)

    monkeypatch.setattr(tmoe, "linear", counting)
    ex.use_cuda_graphs = False
    Driver(handle, ex, DriverOptions(capacity=32, prefill_chunk=8)).logits(PROMPT[:6])
    moe_layers = sum(n.op == "moe" for n in graph.nodes)
    # one prefill step of 6 tokens, top-2 of 8: gate, up and down of each chosen expert run once over the
    # tokens that chose it, so the rows add up to 6 * 2 per projection and layer, and no expert runs twice
    assert sum(seen) == 3 * 6 * 2 * moe_layers
    assert len(seen) <= 3 * 8 * moe_layers


@interpreter
def test_latent_cache_holds_latent_and_rope_key_only(moe_checkpoint):
    handle = ModelHandle.load(moe_checkpoint("deepseek_v3"))
    graph = trace(handle, StepShape(1, 1, 32))
    ex = interpreted_executor()
    weights = ex.upload(handle.store())
    ex.prepare(graph, weights)
    state = ex.allocate_state(graph)
    widths = {buf.shape[-1] for buf in state.values()}
    assert widths == {32 + 8}  # kv_lora_rank + qk_rope_head_dim
    assert all(buf.shape[1] == 1 for buf in state.values())


@interpreter
@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "relu", "silu"])
def test_activation_matches_cpu(act):
    from poot_core.cpu import ops as cpu_ops

    x = torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(3)) * 3
    graph = type("G", (), {"nodes": [], "outputs": [], "shape": StepShape(1, 1, 8)})()
    from poot_core import Node

    node = Node("activation", ("x",), "y", tuple(x.shape), {"act": act})
    binder = Binder(graph, type("W", (), {"act_dtype": torch.float32})(), lambda *a: None)
    step = Step({"x": x}, {})
    binder.bind(node)(step)
    assert torch.allclose(step.env["y"], cpu_ops.activation(x, act), atol=1e-6)


@interpreter
def test_encoder_attention_with_a_hole_in_the_mask_falls_back(tmp_path):
    """A mask that is not ones-then-padding still matches the CPU's masked attention."""
    from poot_core import Node
    from poot_core.cpu import ops as cpu_ops

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 6, 4, 16, generator=g) for _ in range(3))
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 0, 1, 1, 1, 1]])
    graph = type("G", (), {"nodes": [], "outputs": [], "shape": StepShape(2, 6, 8)})()
    binder = Binder(graph, type("W", (), {"act_dtype": torch.float32})(), lambda *a: None)
    node = Node("encoder_attention", ("q", "k", "v", "m"), "o", (2, 6, 4, 16), {"scale": 0.25})
    step = Step({"q": q, "k": k, "v": v, "m": mask}, {})
    binder.bind(node)(step)
    ref = cpu_ops.encoder_attention(q, k, v, mask, 0.25)
    assert rel(step.env["o"].numpy(), ref.numpy()) <= 1e-5
    # the prefix-shaped row alone goes through the kernel
    step = Step({"q": q[:1], "k": k[:1], "v": v[:1], "m": mask[:1]}, {})
    node1 = Node("encoder_attention", ("q", "k", "v", "m"), "o", (1, 6, 4, 16), {"scale": 0.25})
    binder.bind(node1)(step)
    ref1 = cpu_ops.encoder_attention(q[:1], k[:1], v[:1], mask[:1], 0.25)
    assert rel(step.env["o"][0, :4].numpy(), ref1[0, :4].numpy()) <= 1e-5


@interpreter
def test_a_prefill_is_captured_only_when_its_shape_says_it_is_replayed(tiny_checkpoint):
    """A prefill-sized step with state runs eagerly (the Driver runs most prefills once: a capture would hold
    memory for nothing) unless its shape is marked replayed (a vision runtime's prompt); decode steps always can
    be captured."""
    handle = ModelHandle.load(tiny_checkpoint("llama"))
    ex = interpreted_executor()
    ex.use_cuda_graphs = True
    weights = ex.upload(handle.store())
    assert ex.prepare(trace(handle, StepShape(1, 1, 32)), weights).use_graph
    assert not ex.prepare(trace(handle, StepShape(1, 24, 32)), weights).use_graph
    assert ex.prepare(trace(handle, StepShape(1, 24, 32, replayed=True)), weights).use_graph


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@gpu
def test_a_captured_prefill_replays_only_from_the_starts_it_was_captured_at(tiny_checkpoint):
    """A replayed prefill is captured at its second run from position 0; later runs from 0 replay it with their
    own tokens, and a run from another start (which the capture fixed) runs eagerly: every run's logits equal a
    program that never captures, run through the same sequence of steps on its own state."""
    handle = ModelHandle.load(tiny_checkpoint("llama"))
    shape = StepShape(1, 24, 64, replayed=True)
    graph = trace(handle, shape)
    runs = [(PROMPT[:1] * 24, 0), (PROMPT[:2] * 12, 0), (PROMPT[:3] * 8, 0), (PROMPT[:4] * 6, 0), (PROMPT[:6] * 4, 8)]
    logits = []
    for graphs in (True, False):
        ex = TritonExecutor(0, use_graphs=graphs)
        prog = ex.prepare(graph, ex.upload(handle.store()))
        assert prog.use_graph == graphs
        state = ex.allocate_state(graph)
        out = []
        for tokens, start in runs:
            inputs = {"tokens": np.asarray([tokens]), "positions": np.arange(start, start + 24)[None, :]}
            out.append(ex.to_numpy(prog.run(state, inputs)[0]))
        logits.append(out)
    for ours, ref in zip(*logits, strict=True):
        assert rel(ours, ref) <= 1e-5
    assert rel(logits[0][2], logits[0][3]) > 1e-3  # the replays saw their own tokens


@gpu
@pytest.mark.parametrize("mixed", [False, True])
def test_paged_serving_steps_replay_from_any_start(tiny_checkpoint, monkeypatch, mixed):
    """A paged decode step reads its positions and block tables on the device, so once captured it replays
    whatever its rows hold: in a serving run whose prompts are chunked beside others' decode tokens, each decode
    program (those wider than GRAPH_TOKENS too) runs eagerly only at its first run and its capture (1 + 3 runs)
    and replays after that; mixed steps run eagerly, or replay in the same way with capture_mixed_steps; the tokens
    equal those of an executor that never captures."""
    from poot_core import GenerateRequest, Layout
    from poot_kernels_triton.program import GRAPH_TOKENS, TritonProgram

    runs: dict[int, list[int]] = {}  # id(program) -> [runs, eager runs]
    run, eager = TritonProgram.run, TritonProgram._eager

    def counted_run(self, *args, **kwargs):
        runs.setdefault(id(self), [0, 0])[0] += 1
        return run(self, *args, **kwargs)

    def counted_eager(self, *args, **kwargs):
        runs.setdefault(id(self), [0, 0])[1] += 1
        return eager(self, *args, **kwargs)

    monkeypatch.setattr(TritonProgram, "run", counted_run)
    monkeypatch.setattr(TritonProgram, "_eager", counted_eager)
    handle = ModelHandle.load(tiny_checkpoint("llama"))
    # 40 prompts of 30 tokens, 24 at a time: later prompts are chunked beside the others' decode tokens in steps of
    # the same size, again and again; then 24 short prompts decode together in steps of 24 rows
    batches = [[GenerateRequest((PROMPT * 3)[i % 5: i % 5 + 30], max_new=12, ignore_eos=True) for i in range(40)],
               [GenerateRequest(PROMPT[i % 7: i % 7 + 5], max_new=12, ignore_eos=True) for i in range(24)]]
    tokens = {}
    for graphs in (True, False):
        options = DriverOptions(capacity=96, max_running=24, step_tokens=32, prefill_chunk=16)
        executor = TritonExecutor(0, use_graphs=graphs)
        executor.capture_mixed_steps = mixed
        engine = Driver(handle, executor, options).serve(Layout.PAGED)
        tokens[graphs] = [[g.tokens for g in engine.generate_batch(batch)] for batch in batches]
        if graphs:
            used = [(shape, prog) for shape, prog in engine._programs.items() if runs.get(id(prog), [0])[0] > 4]
            assert {shape.paging.decode for shape, _ in used} == {True, False}
            assert any(shape.paging.decode and shape.tokens > GRAPH_TOKENS for shape, _ in used)
            for shape, prog in used:
                total, eagerly = runs[id(prog)]
                if shape.paging.decode or mixed:
                    assert prog.use_graph and eagerly <= 4, (shape, total, eagerly)
                else:
                    assert not prog.use_graph and eagerly == total, (shape, total, eagerly)
    assert tokens[True] == tokens[False]
