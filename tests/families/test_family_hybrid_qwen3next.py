"""Qwen3-Next (Gated DeltaNet beside gated attention, sparse MoE with a shared expert) against transformers' float32
forward (its torch paths: flash-linear-attention is not installed) on tiny random checkpoints, from Hugging Face
and from the GGUF file llama.cpp's converter writes, and the CPU's gated delta rule against its recurrence in
float64."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as tf
from transformers.models.qwen3_next import modeling_qwen3_next as hf_qwen3next

from helpers import hybrid, tiny
from helpers.paths import TESTDATA, fetched
from poot_core import (
    CheckpointError,
    DraftPolicy,
    Driver,
    DriverOptions,
    GenerateRequest,
    Layout,
    ModelHandle,
    PackedWeight,
    StepShape,
    Unsupported,
    open_executor,
)
from poot_core.graph import passes

# Longer than the delta rule's chunk (64) and than the prefill chunk (80) the driver below uses, a multiple of
# neither, so a prefill step holds a full chunk and a partial one and the state crosses steps mid-chunk.
PROMPT = [(7 * i + 3) % 250 + 2 for i in range(150)]
CHUNK = 80
CONVERTER = TESTDATA / "llama.cpp" / "convert"


def driver(path: Path, chunk: int = CHUNK) -> Driver:
    return Driver(ModelHandle.load(path), open_executor("cpu"), DriverOptions(capacity=256, prefill_chunk=chunk))


@pytest.mark.parametrize("arch,dtype,bound", [("qwen3next", torch.float32, 1e-4), ("qwen3next", torch.bfloat16, 2e-2),
                                              ("qwen3next_mix", torch.float32, 1e-4)], ids=["f32", "bf16", "mix-f32"])
def test_logits_match_transformers(hybrid_checkpoint, arch, dtype, bound):
    path = hybrid_checkpoint(arch, dtype)
    ours = driver(path).logits(PROMPT)
    ref = tiny.reference_logits(path, PROMPT)
    assert ours.shape == tuple(ref.shape)
    assert tiny.rel_error(ours, ref) <= bound


@pytest.mark.parametrize("arch", ["qwen3next", "qwen3next_mix"])
def test_greedy_tokens_match_transformers(hybrid_checkpoint, arch):
    """transformers' generate: its chunked rule over the prompt, then its recurrent step per token."""
    path = hybrid_checkpoint(arch)
    prompt = PROMPT[:100]
    result = driver(path).serve().generate(GenerateRequest(prompt, max_new=12, ignore_eos=True))
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    assert result.tokens == out[0, len(prompt):].tolist()


def test_decode_after_chunked_prefill_equals_one_long_prefill(hybrid_checkpoint):
    path = hybrid_checkpoint("qwen3next")
    d = driver(path)
    last = d.prefill_cache(PROMPT)
    tokens, steps = [], []
    for _ in range(8):
        logits = d.executor.to_numpy(last)[0, -1]
        steps.append(logits)
        tokens.append(int(np.argmax(logits)))
        last = d.step(tokens[-1], len(PROMPT) + len(tokens) - 1)
    whole = driver(path, chunk=256).logits(PROMPT + tokens)  # one prefill step
    expected = whole[len(PROMPT) - 1 : len(PROMPT) + 7]
    assert np.abs(np.stack(steps) - expected).max() <= 1e-5 * np.abs(expected).max()


def test_conversation_continues_from_the_state(hybrid_checkpoint):
    path = hybrid_checkpoint("qwen3next")
    d = driver(path).serve()
    first = d.generate(GenerateRequest(PROMPT[:70], max_new=6, ignore_eos=True))
    follow = PROMPT[:70] + first.tokens[:-1] + PROMPT[70:90]
    second = d.generate(GenerateRequest(follow, max_new=6, ignore_eos=True))
    assert second.timings.reused_tokens == 70 + 5
    fresh = driver(path).serve().generate(GenerateRequest(follow, max_new=6, ignore_eos=True))
    assert second.tokens == fresh.tokens


def test_state_of_each_layer_and_refusals(hybrid_checkpoint):
    path = hybrid_checkpoint("qwen3next")
    graph = driver(path).program(StepShape(1, 1, 256)).graph
    kinds = {name: (spec.kind, spec.shape) for name, spec in graph.state.items()}
    # layers 0 and 2: the convolution over q, k, v (2 x 2 x 16 + 4 x 8 channels) and the delta state [Hv, Dk, Dv]
    for layer in (0, 2):
        assert kinds[f"conv{layer}"] == ("conv", (1, 96, 3)) and kinds[f"delta{layer}"] == ("delta", (1, 4, 16, 8))
    assert kinds["k1"][0] == "k" and "delta1" not in kinds and graph.recurrent()
    assert "gated_delta" in passes.HYBRID_OPS and "gated_delta" in graph.ops()
    options = DriverOptions(capacity=256, prefill_chunk=CHUNK, draft=DraftPolicy.PromptLookup())
    for layout in (Layout.CONTIGUOUS, Layout.PAGED):  # the paged layout runs it, but speculation stays refused
        with pytest.raises(Unsupported, match="roll back"):
            Driver(ModelHandle.load(path), open_executor("cpu"), options).serve(layout)


def test_vulkan_refuses_the_delta_rule_by_name_and_triton_binds_it(hybrid_checkpoint):
    d = driver(hybrid_checkpoint("qwen3next"))
    graph = d.program(StepShape(1, 1, 256)).graph
    assert "gated_delta" in hybrid.assert_vulkan_refuses_and_triton_prepares(graph, d.handle)


def test_qkv_and_z_are_transformers_split_of_in_proj_qkvz(hybrid_checkpoint, tmp_path):
    """The step's in_proj_qkv and in_proj_z hold the rows transformers' fix_query_key_value_ordering picks from
    in_proj_qkvz; a checkpoint whose in_proj_qkvz has another width than the config's is refused by name."""
    path = hybrid_checkpoint("qwen3next")
    store = ModelHandle.load(path).store()
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    mixer = model.model.layers[2].linear_attn
    eye = torch.eye(mixer.hidden_size)[None]  # [1, D, D]: each "token" reads one column of the weights
    with torch.no_grad():
        q, k, v, z, _, _ = mixer.fix_query_key_value_ordering(mixer.in_proj_qkvz(eye), mixer.in_proj_ba(eye))
    flat = [x.reshape(mixer.hidden_size, -1).T for x in (q, k, v, z)]
    pre = "model.layers.2.linear_attn."
    assert torch.equal(store.get(pre + "in_proj_qkv.weight"), torch.cat(flat[:3]))
    assert torch.equal(store.get(pre + "in_proj_z.weight"), flat[3])
    wrong = tmp_path / "wrong"
    shutil.copytree(path, wrong)
    config = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**config, "linear_value_head_dim": 4}))
    with pytest.raises(CheckpointError, match="in_proj_qkvz"):
        ModelHandle.load(wrong)


@pytest.fixture(scope="module")
def converted(hybrid_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """outtype -> the GGUF file llama.cpp's own convert_hf_to_gguf.py writes for the tiny checkpoint with an MTP
    block (as the hub's checkpoints have; the converter writes it as block 4 and nextn_predict_layers 1)."""
    from helpers.hybrid import with_mtp_block

    fetched(CONVERTER / "convert_hf_to_gguf.py")
    root = tmp_path_factory.mktemp("gguf")
    source = with_mtp_block(hybrid_checkpoint("qwen3next"), root / "with_mtp")
    made = {kind: root / f"qwen3next-{kind}.gguf" for kind in ("f32", "q8_0")}
    jobs = [{"src": str(source), "outtype": kind, "out": str(out)} for kind, out in made.items()]
    (root / "jobs.json").write_text(json.dumps(jobs))
    run = subprocess.run([sys.executable, str(Path(tiny.__file__).with_name("llama_cpp_convert.py")), str(CONVERTER),
                          str(root / "jobs.json")], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return made


def test_file_from_llama_cpp_converter_matches_transformers(converted, hybrid_checkpoint):
    """The f32 file (qwen3next: attn_qkv/attn_gate, ssm_a = -exp(A_log), norms stored as 1 + w, stacked
    experts, the MTP block not read): logits of a chunked prefill against transformers on the original
    checkpoint, and greedy tokens against transformers' generate."""
    handle = ModelHandle.load(converted["f32"])
    config = handle.config()
    assert config.source_format == "gguf" and config.architecture == "qwen3next"
    assert config.raw["qwen3next.block_count"] == 5 and config.raw["qwen3next.nextn_predict_layers"] == 1
    assert config.params.layer_types == ["linear_attention", "full_attention"] * 2 and config.params.rotary_dim == 8
    d = Driver(handle, open_executor("cpu"), DriverOptions(capacity=256, prefill_chunk=CHUNK))
    ref = tiny.reference_logits(hybrid_checkpoint("qwen3next"), PROMPT)
    assert tiny.rel_error(d.logits(PROMPT), ref) <= 1e-4
    prompt = PROMPT[:100]
    ours = d.serve().generate(GenerateRequest(prompt, max_new=8, ignore_eos=True)).tokens
    model = tf.AutoModelForCausalLM.from_pretrained(hybrid_checkpoint("qwen3next"), dtype=torch.float32)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    assert ours == out[0, len(prompt):].tolist()


def test_quantized_file_computes_its_dequantized_weights(converted, tmp_path):
    """The converter's Q8_0 file (attn_qkv, attn_gate, ssm_ba, attention and stacked experts in Q8_0, the shared
    expert's down in F16) gives the logits of the same file with every tensor dequantized by the gguf package
    (whose float path is held to transformers above). Against transformers itself a tiny random model's logits
    move too far under 8-bit weights for a bound to say anything."""
    from helpers.hybrid import dequantized_copy

    store = ModelHandle.load(converted["q8_0"]).store()
    for name in ("linear_attn.in_proj_qkv", "linear_attn.in_proj_ba", "mlp.experts.gate_exps"):
        assert isinstance(store.get(f"model.layers.0.{name}.weight"), PackedWeight), name
    plain = dequantized_copy(converted["q8_0"], tmp_path / "dequantized.gguf")
    logits = {}
    for name, path in (("q8_0", converted["q8_0"]), ("plain", plain)):
        logits[name] = driver(path).logits(PROMPT)
    assert np.abs(logits["q8_0"] - logits["plain"]).max() <= 1e-5 * np.abs(logits["plain"]).max()


def delta_reference(q, k, v, a, b, a_log, dt_bias, state, eps=1e-6):
    """The gated delta rule token by token in float64, as Tracer.gated_delta writes it."""
    q, k, v, a, b, a_log, dt_bias = (x.double() for x in (q, k, v, a, b, a_log, dt_bias))
    spread = v.shape[2] // k.shape[2]
    q, k = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps) for x in (q, k))
    q = q * q.shape[-1] ** -0.5
    S, ys = state.double().clone(), []
    for t in range(v.shape[1]):
        g = -torch.exp(a_log) * torch.nn.functional.softplus(a[:, t] + dt_bias)  # [R, Hv]
        beta = torch.sigmoid(b[:, t])
        kt, qt = k[:, t].repeat_interleave(spread, 1), q[:, t].repeat_interleave(spread, 1)  # [R, Hv, Dk]
        S = S * torch.exp(g)[..., None, None]
        delta = beta[..., None] * (v[:, t] - torch.einsum("rhkv,rhk->rhv", S, kt))
        S = S + kt[..., None] * delta[..., None, :]
        ys.append(torch.einsum("rhkv,rhk->rhv", S, qt))
    return torch.stack(ys, dim=1), S


def test_delta_rule_chunks_and_steps_against_the_float64_recurrence():
    """The CPU's chunked rule (prefill) and its one-token step (decode), from a carried state, over a length no
    chunk divides, with two value heads per key head."""
    from poot_core.cpu.recurrent import gated_delta

    g = torch.Generator().manual_seed(5)
    R, T, Hk, Hv, Dk, Dv = 2, 23, 2, 4, 6, 5
    q, k = torch.randn(R, T, Hk, Dk, generator=g), torch.randn(R, T, Hk, Dk, generator=g)
    v, a, b = torch.randn(R, T, Hv, Dv, generator=g), torch.randn(R, T, Hv, generator=g), torch.randn(R, T, Hv,
                                                                                                      generator=g)
    a_log, dt_bias = torch.randn(Hv, generator=g) * 0.5, torch.randn(Hv, generator=g) * 0.5
    start = torch.randn(R, Hv, Dk, Dv, generator=g)
    expected, final = delta_reference(q, k, v, a, b, a_log, dt_bias, start)
    state = start.clone()
    got = [gated_delta(q[:, :17], k[:, :17], v[:, :17], a[:, :17], b[:, :17], a_log, dt_bias, state, 5, 1e-6)]
    got += [gated_delta(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], a[:, t:t + 1], b[:, t:t + 1], a_log, dt_bias,
                        state, 5, 1e-6) for t in range(17, T)]
    out = torch.cat(got, dim=1)
    assert (out.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert (state.double() - final).abs().max() <= 1e-5 * final.abs().max()


def test_gated_norm_norm_first_matches_transformers():
    from poot_core.cpu.recurrent import gated_rms_norm

    g = torch.Generator().manual_seed(6)
    x, z = torch.randn(3, 7, 4, 8, generator=g), torch.randn(3, 7, 4, 8, generator=g)
    norm = hf_qwen3next.Qwen3NextRMSNormGated(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(8, generator=g))
        expected = norm(x, z)
    got = gated_rms_norm(x, z, norm.weight.detach(), 1e-6, 8, norm_first=True)
    assert (got - expected).abs().max() <= 1e-6 * expected.abs().max()
