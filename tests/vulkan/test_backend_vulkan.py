"""The Vulkan executor end to end against the CPU executor (the reference every backend is held to), on any
Vulkan adapter (CI: Mesa's lavapipe, installed by plugins/backend_vulkan/setup_lavapipe.sh).

Here is what the conformance suite (tests/conformance: the dense and MoE families in f32 and bf16, greedy tokens,
output lifetime, positions outside the cache) does not cover: split-K decode, YaRN rope, a tiny GGUF with Q8_0,
Q4_0, Q4_1, Q4_K and Q6_K weights and the real SmolLM2 GGUF, fused dispatches, and typed refusals at prepare time
for what the kernels cannot run.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

try:  # triton bundles its own LLVM: imported after lavapipe has loaded Mesa's LLVM, it crashes the process
    import triton  # noqa: F401
except ImportError:
    pass

from helpers import smollm
from helpers.gguf_edit import finish_gguf
from helpers.graphs import trace
from helpers.refusals import check_gptq_upload_refused, check_rows_and_op_refused
from poot_core import (
    Driver,
    DriverOptions,
    GenerateRequest,
    ModelHandle,
    Reason,
    StepShape,
    Unsupported,
    installed_backends,
    open_executor,
)

PROMPT = [int(i) for i in np.random.default_rng(7).integers(3, 250, 40)]


def _has_vulkan() -> bool:
    try:
        from poot_backend_vulkan.plugin import probe
    except ImportError:
        return False
    return probe()


pytestmark = pytest.mark.skipif(not _has_vulkan(), reason="no Vulkan adapter on this machine (mesa-vulkan-drivers)")


@pytest.fixture(scope="module")
def vulkan():
    return open_executor("vulkan")


def rel(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def both_logits(handle, vulkan, prompt=PROMPT, **options) -> tuple[np.ndarray, np.ndarray]:
    opts = {"capacity": 64, "prefill_chunk": 16, **options}
    ref = Driver(handle, open_executor("cpu"), DriverOptions(**opts)).logits(prompt)
    ours = Driver(handle, vulkan, DriverOptions(**opts)).logits(prompt)
    return ours, ref


def test_registered_with_alias_and_priority():
    spec = next(s for s in installed_backends() if s.name == "vulkan")
    assert spec.aliases == ("wgpu",) and spec.priority == 20 and spec.distribution == "poot-backend-vulkan"
    assert open_executor("wgpu").name == "vulkan"


def test_decode_steps_with_split_keys_match_cpu(tiny_checkpoint, vulkan, monkeypatch):
    """One token per step (the decode program), with keys cut into splits of 16 positions so that the
    split-K path, its merge and splits past the position all run; mistral's window of 8 on top."""
    from poot_backend_vulkan import program

    monkeypatch.setattr(program, "DECODE_SPLIT", 16)
    handle = ModelHandle.load(tiny_checkpoint("mistral", torch.float32))
    ours, ref = both_logits(handle, vulkan, PROMPT[:36], prefill_chunk=1)
    assert rel(ours, ref) <= 1e-3


def test_decode_steps_with_every_product_split_match_cpu(tiny_checkpoint, vulkan, monkeypatch):
    """Every one-token product cut in two along K (the tiny shapes alone never are): gate/up summed and gated
    by the combine pass, as the head; q/k/v left as partial sums that rope_kv adds up, o and down as partial
    sums that the next residual add + rms_norm adds up."""
    from poot_backend_vulkan.kernels import linear

    monkeypatch.setattr(linear, "split_count", lambda groups, words, min_span=256: 2 if words >= 2 else 1)
    handle = ModelHandle.load(tiny_checkpoint("llama", torch.float32))
    graph = trace(handle, StepShape(1, 1, 64))
    kinds = [str(d.pipeline.label) for d, _ in vulkan.prepare(graph, vulkan.upload(handle.store())).step._records]
    layers = handle.config().params.layers
    combines = {k: kinds.count(k) for k in kinds if k.startswith("gemv_combine")}  # q/k/v, o and down have none
    assert combines == {"gemv_combine:gated_silu": layers, "gemv_combine": 1}  # gate/up and the head
    ours, ref = both_logits(handle, vulkan, PROMPT[:20], prefill_chunk=1)
    assert rel(ours, ref) <= 1e-3


def test_yarn_rope_matches_cpu(tiny_checkpoint, vulkan, tmp_path):
    """YaRN's frequencies and its attention factor (cos and sin scaled by 1.14 here) come from poot_core's rope,
    as on the CPU: the prompt runs past the original context of 16, where the scaled frequencies matter."""
    import json
    import shutil

    path = shutil.copytree(tiny_checkpoint("llama", torch.float32), tmp_path / "yarn")
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                 "rope_theta": 10000.0}
    (path / "config.json").write_text(json.dumps(config))
    handle = ModelHandle.load(path)
    ours, ref = both_logits(handle, vulkan)
    assert rel(ours, ref) <= 1e-3
    plain = Driver(ModelHandle.load(tiny_checkpoint("llama", torch.float32)), open_executor("cpu"),
                   DriverOptions(capacity=64, prefill_chunk=16)).logits(PROMPT)
    assert rel(plain, ref) > 1e-2  # the scaling really changes the logits


# -- refusals at prepare time ---------------------------------------------------------------------------


def test_refuses_rows_above_one_and_unknown_ops(tiny_checkpoint, vulkan):
    check_rows_and_op_refused(vulkan, tiny_checkpoint("llama", torch.float32), "mla_attention")


def test_moe_with_sigmoid_routing_is_refused_by_name(moe_checkpoint, vulkan):
    """DeepSeek V3's routing (sigmoid scores, expert groups, a correction bias) has no Vulkan shader yet."""
    handle = ModelHandle.load(moe_checkpoint("mixtral"))
    graph = trace(handle, StepShape(1, 1, 64))
    at = next(i for i, n in enumerate(graph.nodes) if n.op == "moe")
    node = graph.nodes[at]
    graph.nodes[at] = type(node)(node.op, node.inputs, node.output, node.shape, {**node.attrs, "scoring": "sigmoid"})
    with pytest.raises(Unsupported) as err:
        vulkan.prepare(graph, vulkan.upload(handle.store()))
    assert err.value.reason is Reason.OPERATION and "moe routing sigmoid" in str(err.value)


def test_refuses_erf_gelu_by_name(tiny_checkpoint, vulkan):
    handle = ModelHandle.load(tiny_checkpoint("llama", torch.float32))
    graph = trace(handle, StepShape(1, 1, 64))
    for node in graph.nodes:
        if node.op == "gated":
            node.attrs["act"] = "gelu"
    with pytest.raises(Unsupported) as err:
        vulkan.prepare(graph, vulkan.upload(handle.store()))
    assert err.value.reason is Reason.OPERATION and "gelu" in str(err.value)


def test_refuses_unsupported_quantization_naming_the_tensor(vulkan):
    check_gptq_upload_refused(vulkan)


# -- GGUF -------------------------------------------------------------------------------------------------


def _kquant_blocks(qtype, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks with small f16 scales (gguf's Python side cannot quantize K-quants)."""
    from gguf import quants

    block_values, block_bytes = quants.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // block_values, block_bytes), dtype=np.uint8)
    for at in {"Q4_K": (0, 2), "Q6_K": (208,)}[qtype.name]:
        scales = rng.uniform(1e-4, 1e-3, blocks.shape[:2]).astype(np.float16)
        blocks[:, :, at : at + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


def write_tiny_gguf(path, layers: int = 2, hidden: int = 256, ffn: int = 256) -> None:
    """A random 2-layer llama GGUF with SmolLM2's tokenizer metadata and llama.cpp's tensor names."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    reader = gguf.GGUFReader(smollm.gguf_path())
    tokens = reader.fields["tokenizer.ggml.tokens"]
    vocab = len(tokens.data)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(hidden // 4)
    writer.add_vocab_size(vocab)
    for field in reader.fields.values():
        if field.name.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    rng = np.random.default_rng(0)

    def matrix(name: str, rows: int, cols: int, qtype) -> None:
        if qtype in (Q.Q4_K, Q.Q6_K):
            writer.add_tensor(name, _kquant_blocks(qtype, rows, cols, rng), raw_dtype=qtype)
            return
        w = (rng.standard_normal((rows, cols)) * (0.5 / cols**0.5)).astype(np.float32)
        writer.add_tensor(name, quants.quantize(w, qtype), raw_dtype=qtype)

    def norm(name: str, size: int) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32))

    matrix("token_embd.weight", vocab, hidden, Q.Q8_0)
    norm("output_norm.weight", hidden)
    for i in range(layers):
        attention_type = Q.Q4_0 if i == 0 else Q.Q4_1
        norm(f"blk.{i}.attn_norm.weight", hidden)
        matrix(f"blk.{i}.attn_q.weight", hidden, hidden, attention_type)
        matrix(f"blk.{i}.attn_k.weight", hidden // 2, hidden, attention_type)
        matrix(f"blk.{i}.attn_v.weight", hidden // 2, hidden, attention_type)
        matrix(f"blk.{i}.attn_output.weight", hidden, hidden, attention_type)
        norm(f"blk.{i}.ffn_norm.weight", hidden)
        matrix(f"blk.{i}.ffn_gate.weight", ffn, hidden, Q.Q4_K)
        matrix(f"blk.{i}.ffn_up.weight", ffn, hidden, Q.Q8_0)
        matrix(f"blk.{i}.ffn_down.weight", hidden, ffn, Q.Q6_K)
    finish_gguf(writer)


def test_tiny_gguf_blocks_match_cpu(tmp_path, vulkan):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    handle = ModelHandle.load(path)
    kinds = {getattr(handle.store().get(n), "kind", "dense") for n in handle.store().names()}
    assert {"gguf.Q8_0", "gguf.Q4_0", "gguf.Q4_1", "gguf.Q4_K", "gguf.Q6_K"} <= kinds
    assert handle.config().params.rope_style == "interleaved"
    ours, ref = both_logits(handle, vulkan, PROMPT[:24])
    assert rel(ours, ref) <= 1e-3
    request = GenerateRequest(PROMPT[:12], max_new=6, ignore_eos=True)
    want = Driver(handle, open_executor("cpu"), DriverOptions(capacity=64, prefill_chunk=16)).generate(request)
    got = Driver(handle, vulkan, DriverOptions(capacity=64, prefill_chunk=16)).generate(request)
    assert got.tokens == want.tokens


@pytest.mark.slow
def test_smollm2_gguf_matches_cpu(vulkan):
    """The real SmolLM2-135M (Q4_1 blocks, Q8_0 embeddings) through the shaders."""
    handle = ModelHandle.load(smollm.gguf_path())
    ids = handle.text().encode(smollm.PROMPTS[0])
    ours, ref = both_logits(handle, vulkan, ids, capacity=32)
    assert rel(ours, ref) <= 1e-3


# -- fusion ---------------------------------------------------------------------------------------------


def test_one_token_step_reads_each_concatenation_in_one_dispatch(tiny_checkpoint, vulkan):
    """q/k/v and gate/up are uploaded as one matrix each (the parts are row ranges sharing its buffer); a
    one-token step runs each group as one dispatch, gate/up with its activation applied: 4 fewer a layer than
    with the parts run alone (q/k/v 3 -> 1, gate, up and the activation 3 -> 1). (That the fused step computes
    the same logits is test_decode_steps_with_split_keys_match_cpu.)"""
    import dataclasses

    handle = ModelHandle.load(tiny_checkpoint("llama", torch.float32))
    weights = vulkan.upload(handle.store())
    layers = handle.config().params.layers
    assert len(weights.concatenated) == 2 * layers
    for names, whole in weights.concatenated.items():
        assert sum(weights.matrices[n].rows for n in names) == whole.rows
        assert all(weights.matrices[n].chunks[0].buffer is whole.chunks[0].buffer for n in names)
    graph = trace(handle, StepShape(1, 1, 64))
    fused = vulkan.prepare(graph, weights).step.dispatch_count
    alone = vulkan.prepare(graph, dataclasses.replace(weights, concatenated={})).step.dispatch_count
    assert alone - fused == 4 * layers


def test_ropes_and_cache_writes_of_an_attention_are_one_dispatch(tiny_checkpoint, vulkan):
    """The q and k ropes that only their attention reads (passes.rope_attention_triples) and the writes of the
    new keys and values run as one rope_kv dispatch a layer, in prefill and decode steps; a one-token step's
    last position is a view (no copy). (Their logits: the CPU comparisons of this file.)"""
    import collections

    handle = ModelHandle.load(tiny_checkpoint("llama", torch.float32))
    weights = vulkan.upload(handle.store())
    layers = handle.config().params.layers
    for tokens in (1, 4):
        step = vulkan.prepare(trace(handle, StepShape(1, tokens, 64)), weights).step
        kinds = collections.Counter(str(d.pipeline.label) for d, _ in step._records)
        assert kinds["rope_kv"] == layers and kinds["rope"] == 0, kinds
        assert kinds["copy"] == (0 if tokens == 1 else 1), kinds  # the last position of a prefill


def test_refuses_head_dims_not_a_multiple_of_four(vulkan):
    from poot_backend_vulkan.kernels.attention import attention_decode

    rt = vulkan.runtime
    q, cache = rt.empty((1, 2, 6)), rt.empty((8, 1, 6))
    with pytest.raises(Unsupported) as err:
        attention_decode(rt.batch(), q, cache, cache, rt.empty((1, 2, 6)), position=0, scale=1.0)
    assert err.value.reason is Reason.SHAPE and "multiple of 4" in str(err.value)


def test_paged_layout_is_refused_by_name(tiny_checkpoint, vulkan):
    """Layout.PAGED: the serving driver refuses a backend without the paged layout, and a paged step prepared
    directly is refused at prepare time, before any kernel runs."""
    from poot_core import Layout
    from poot_core.graph.ir import Paging

    handle = ModelHandle.load(tiny_checkpoint("llama", torch.float32))
    assert "paged" not in vulkan.capabilities().layouts
    with pytest.raises(Unsupported) as err:
        Driver(handle, vulkan, DriverOptions(capacity=64)).serve(Layout.PAGED)
    assert err.value.reason is Reason.SHAPE and "Layout.PAGED" in str(err.value)
    graph = trace(handle, StepShape(1, 4, 64, paging=Paging(blocks=8, block_size=16, seqs=4, max_blocks=4)))
    with pytest.raises(Unsupported) as err:
        vulkan.prepare(graph, vulkan.upload(handle.store()))
    assert err.value.reason is Reason.SHAPE and "paged KV" in str(err.value)


@pytest.mark.parametrize("arch", ["lfm2", "mamba2", "qwen3next"])
def test_hybrid_families_are_refused_by_the_op_they_need(hybrid_checkpoint, vulkan, arch):
    from helpers.refusals import assert_backend_refuses_by_name

    assert_backend_refuses_by_name(vulkan, hybrid_checkpoint(arch))
