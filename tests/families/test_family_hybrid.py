"""The hybrid families (LFM2, Mamba2, Granite 4.0-H dense and with experts, Bamba) against transformers' float32
forward on tiny random checkpoints, and the Driver's handling of their recurrent state (convolution windows, SSM
states)."""

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
    StepShape,
    Unsupported,
    open_executor,
)
from poot_core.graph import Paging

ARCHS = ["lfm2", "mamba2", "granitemoehybrid", "granite_moe", "granite_rope", "bamba"]
# Longer than prefill_chunk (16) and than Mamba2's scan chunk (8), not a multiple of either.
PROMPT = [(7 * i + 3) % 250 + 2 for i in range(41)]
CONVERTER = TESTDATA / "llama.cpp" / "convert"
GGUF_ARCHS = ["lfm2", "mamba2", "granitemoehybrid", "granite_moe"]
def driver(path: Path, chunk: int = 16) -> Driver:
    return Driver(ModelHandle.load(path), open_executor("cpu"), DriverOptions(capacity=128, prefill_chunk=chunk))


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)], ids=["f32", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(hybrid_checkpoint, arch, dtype, bound):
    path = hybrid_checkpoint(arch, dtype)
    ours = driver(path).logits(PROMPT)
    ref = tiny.reference_logits(path, PROMPT)
    assert ours.shape == tuple(ref.shape)
    assert tiny.rel_error(ours, ref) <= bound


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers(hybrid_checkpoint, arch):
    path = hybrid_checkpoint(arch)
    result = driver(path).serve().generate(GenerateRequest(PROMPT[:20], max_new=12, ignore_eos=True))
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = model.generate(torch.tensor([PROMPT[:20]]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                         pad_token_id=0, min_new_tokens=12)
    assert result.tokens == out[0, 20:].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_after_chunked_prefill_equals_one_long_prefill(hybrid_checkpoint, arch):
    """Prefill in chunks of 16 then decode step by step: every step's logits are those of one prefill of the
    whole sequence (the state carried across chunks and steps is the state of the sequence)."""
    path = hybrid_checkpoint(arch)
    d = driver(path, chunk=16)
    last = d.prefill_cache(PROMPT)
    tokens, steps = [], []
    for _ in range(8):
        logits = d.executor.to_numpy(last)[0, -1]
        steps.append(logits)
        tokens.append(int(np.argmax(logits)))
        last = d.step(tokens[-1], len(PROMPT) + len(tokens) - 1)
    whole = driver(path, chunk=128).logits(PROMPT + tokens)  # one prefill step
    expected = whole[len(PROMPT) - 1 : len(PROMPT) + 7]
    assert np.abs(np.stack(steps) - expected).max() <= 1e-5 * np.abs(expected).max()


@pytest.mark.parametrize("arch", ARCHS)
def test_conversation_continues_from_the_state_and_restarts_otherwise(hybrid_checkpoint, arch):
    """A request that extends every cached token continues from the stored state; one that does not starts a
    new sequence from zeroed state. Both give the tokens of a fresh driver."""
    path = hybrid_checkpoint(arch)
    d = driver(path).serve()
    first = d.generate(GenerateRequest(PROMPT[:20], max_new=6, ignore_eos=True))
    follow = PROMPT[:20] + first.tokens[:-1] + PROMPT[20:30]  # the last token was never run
    second = d.generate(GenerateRequest(follow, max_new=6, ignore_eos=True))
    assert second.timings.reused_tokens == 20 + 5
    other = PROMPT[:10] + PROMPT[30:40]  # shares 10 tokens, but the state cannot be cut back to them
    third = d.generate(GenerateRequest(other, max_new=6, ignore_eos=True))
    assert third.timings.reused_tokens == 0
    for request, got in ((follow, second), (other, third)):
        fresh = driver(path).serve().generate(GenerateRequest(request, max_new=6, ignore_eos=True))
        assert got.tokens == fresh.tokens



@pytest.mark.parametrize("arch", ["lfm2", "mamba2"])
def test_encode_starts_every_call_from_zeroed_state(hybrid_checkpoint, arch):
    """Driver.encode (the final hidden states) of a row is the same every time and beside another row: no call
    reads the recurrent state an earlier one left."""
    d = driver(hybrid_checkpoint(arch))
    d.prepare_encode(2, 24)
    row, other = PROMPT[:24], PROMPT[24:40]
    once = d.encode([row])[0]
    twice = d.encode([row])[0]
    beside = d.encode([other, row])[1]
    assert np.abs(once).max() > 0
    np.testing.assert_array_equal(once, twice)
    np.testing.assert_allclose(beside, once, rtol=1e-5, atol=1e-5 * np.abs(once).max())

def test_state_kinds_of_each_layer(hybrid_checkpoint):
    lfm2 = driver(hybrid_checkpoint("lfm2")).program(StepShape(1, 1, 128)).graph
    kinds = {name: (spec.kind, spec.shape) for name, spec in lfm2.state.items()}
    assert kinds["conv0"] == ("conv", (1, 64, 2)) and kinds["conv2"] == ("conv", (1, 64, 2))
    assert kinds["k1"][0] == "k" and "conv1" not in kinds and lfm2.recurrent()
    mamba = driver(hybrid_checkpoint("mamba2")).program(StepShape(1, 1, 128)).graph
    kinds = {name: (spec.kind, spec.shape) for name, spec in mamba.state.items()}
    assert kinds == {"conv0": ("conv", (1, 128 + 2 * 2 * 16, 3)), "ssm0": ("ssm", (1, 8, 16, 16)),
                     "conv1": ("conv", (1, 192, 3)), "ssm1": ("ssm", (1, 8, 16, 16))}


@pytest.mark.parametrize("arch", ARCHS)
def test_speculation_is_refused_by_name_in_either_layout(hybrid_checkpoint, arch):
    """The paged layout runs these models, their recurrent state in a pool of slots (tests/driver/
    test_engine_hybrid.py); speculation stays refused: rejected tokens cannot be taken back out of the state."""
    path = hybrid_checkpoint(arch)
    options = DriverOptions(capacity=128, prefill_chunk=16, draft=DraftPolicy.PromptLookup())
    for layout in (Layout.CONTIGUOUS, Layout.PAGED):
        with pytest.raises(Unsupported, match="roll back"):
            Driver(ModelHandle.load(path), open_executor("cpu"), options).serve(layout)
    graph = driver(path)._trace(StepShape(1, 4, 128, paging=Paging(16, 8, 2, 16, state_slots=3)))
    assert {spec.shape[0] for spec in graph.state.values() if spec.recurrent} == {3}  # a pool of 3 slots


@pytest.mark.parametrize("arch", ARCHS)
def test_vulkan_refuses_the_recurrent_ops_by_name_and_triton_binds_them(hybrid_checkpoint, arch):
    d = driver(hybrid_checkpoint(arch))
    hybrid.assert_vulkan_refuses_and_triton_prepares(d.program(StepShape(1, 1, 128)).graph, d.handle)


def test_granite_experts_are_views_of_the_joined_tensors(hybrid_checkpoint, tmp_path):
    """Each expert's gate, up and down are zero-copy views of Hugging Face's input_linear [E, 2F, D] and
    output_linear [E, D, F]; a checkpoint whose experts do not have the config's width is refused by name."""
    path = hybrid_checkpoint("granite_moe")
    store = ModelHandle.load(path).store()
    pre = "model.layers.1.block_sparse_moe."
    joined, down = store.get(pre + "input_linear.weight"), store.get(pre + "output_linear.weight")
    F = joined.shape[1] // 2
    for name, expected in (("gate_proj", joined[3, :F]), ("up_proj", joined[3, F:]), ("down_proj", down[3])):
        view = store.get(f"{pre}experts.3.{name}.weight")
        assert torch.equal(view, expected) and view.data_ptr() == expected.data_ptr()
    wrong = tmp_path / "wrong"
    shutil.copytree(path, wrong)
    config = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**config, "intermediate_size": F // 2}))
    with pytest.raises(CheckpointError, match="input_linear"):
        ModelHandle.load(wrong)


@pytest.fixture(scope="module")
def converted(hybrid_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """arch -> the f32 GGUF file llama.cpp's own convert_hf_to_gguf.py writes for the tiny checkpoint; arch + "-bf16"
    -> the bf16 file it writes for the bfloat16 checkpoint."""
    fetched(CONVERTER / "convert_hf_to_gguf.py")
    root = tmp_path_factory.mktemp("gguf")
    made = {arch: root / f"{arch}.gguf" for arch in GGUF_ARCHS}
    jobs = [{"src": str(hub_layer_names(hybrid_checkpoint(arch), root / arch)), "outtype": "f32", "out": str(out)}
            for arch, out in made.items()]
    for arch in GGUF_ARCHS:
        out = made[f"{arch}-bf16"] = root / f"{arch}-bf16.gguf"
        source = hub_layer_names(hybrid_checkpoint(arch, torch.bfloat16), root / f"{arch}-bf16")
        jobs.append({"src": str(source), "outtype": "bf16", "out": str(out)})
    (root / "jobs.json").write_text(json.dumps(jobs))
    run = subprocess.run([sys.executable, str(Path(tiny.__file__).with_name("llama_cpp_convert.py")), str(CONVERTER),
                          str(root / "jobs.json")], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return made


def hub_layer_names(path: Path, copy: Path) -> Path:
    """Granite's checkpoint with the layer types Granite 4.0-H's config.json on the hub has ("mamba",
    "attention"): the converter looks for those, transformers 5 writes "linear_attention"/"full_attention" (and
    reads both). Other checkpoints as they are."""
    config = json.loads((path / "config.json").read_text())
    if config.get("model_type") != "granitemoehybrid":
        return path
    shutil.copytree(path, copy)
    hub = {"linear_attention": "mamba", "full_attention": "attention"}
    config["layer_types"] = [hub[kind] for kind in config["layer_types"]]
    (copy / "config.json").write_text(json.dumps(config, indent=2))
    return copy


@pytest.mark.parametrize("arch", GGUF_ARCHS)
def test_file_from_llama_cpp_converter_matches_transformers(converted, hybrid_checkpoint, arch):
    """The f32 file: logits of a chunked prefill against transformers on the original hybrid_checkpoint, and greedy
    decode steps against transformers' generate."""
    handle = ModelHandle.load(converted[arch])
    assert handle.config().source_format == "gguf"
    d = Driver(handle, open_executor("cpu"), DriverOptions(capacity=128, prefill_chunk=16))
    ref = tiny.reference_logits(hybrid_checkpoint(arch), PROMPT)
    assert tiny.rel_error(d.logits(PROMPT), ref) <= 1e-4
    ours = d.serve().generate(GenerateRequest(PROMPT[:20], max_new=8, ignore_eos=True)).tokens
    model = tf.AutoModelForCausalLM.from_pretrained(hybrid_checkpoint(arch), dtype=torch.float32)
    out = model.generate(torch.tensor([PROMPT[:20]]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    assert ours == out[0, 20:].tolist()


@pytest.mark.parametrize("arch", GGUF_ARCHS)
def test_bf16_file_from_llama_cpp_converter_matches_transformers(converted, hybrid_checkpoint, arch):
    """The converter's bf16 file of the bfloat16 checkpoint: logits of a chunked prefill within bf16 rounding of
    transformers' on that checkpoint."""
    handle = ModelHandle.load(converted[f"{arch}-bf16"])
    d = Driver(handle, open_executor("cpu"), DriverOptions(capacity=128, prefill_chunk=16))
    ref = tiny.reference_logits(hybrid_checkpoint(arch, torch.bfloat16), PROMPT)
    assert tiny.rel_error(d.logits(PROMPT), ref) <= 2e-2


def test_granitehybrid_file_with_rope_is_refused_by_name(converted, tmp_path):
    """llama.cpp ropes a granitehybrid model when rope.scaling.finetuned is set (Bamba), over the dimension the
    converter writes (the whole head, where transformers ropes half): such a file is refused, not guessed."""
    from helpers.gguf_edit import gguf_copy

    roped = gguf_copy(converted["granite_moe"], tmp_path / "roped.gguf",
                      **{"granitehybrid.rope.scaling.finetuned": True})
    with pytest.raises(Unsupported, match="rope.scaling.finetuned"):
        ModelHandle.load(roped).config()


def test_scan_chunks_and_steps_against_the_float64_recurrence():
    """The CPU's chunked scan (prefill) and its one-token step (decode), from a carried state, against the
    recurrence itself in float64, over a length no chunk divides."""
    from poot_core.cpu.recurrent import ssm_scan

    g = torch.Generator().manual_seed(3)
    R, T, H, P, G, N = 2, 13, 4, 3, 2, 5
    x, dt = torch.randn(R, T, H, P, generator=g), torch.randn(R, T, H, generator=g)
    b, c = torch.randn(R, T, G, N, generator=g), torch.randn(R, T, G, N, generator=g)
    a_log, d, dt_bias = (torch.randn(H, generator=g) * 0.5 for _ in range(3))
    start = torch.randn(R, H, P, N, generator=g)
    # float64 reference: S = exp(dt a) S + dt x b^T, y = S c + d x, per head h of group h // (H / G)
    S, ys = start.double().clone(), []
    step_dt = torch.nn.functional.softplus(dt.double() + dt_bias.double())
    a = -torch.exp(a_log.double())
    group = torch.arange(H) // (H // G)
    for t in range(T):
        bt, ct = b[:, t, group].double(), c[:, t, group].double()  # [R, H, N]
        S = (torch.exp(step_dt[:, t] * a)[..., None, None] * S
             + (step_dt[:, t, :, None] * x[:, t].double())[..., None] * bt[:, :, None, :])
        ys.append(torch.einsum("rhpn,rhn->rhp", S, ct) + d.double()[:, None] * x[:, t].double())
    expected = torch.stack(ys, dim=1)
    state = start.clone()
    got = ssm_scan(x[:, :9], dt[:, :9], a_log, b[:, :9], c[:, :9], d, dt_bias, state, 4, (0.0, float("inf")))
    steps = [ssm_scan(x[:, t:t + 1], dt[:, t:t + 1], a_log, b[:, t:t + 1], c[:, t:t + 1], d, dt_bias, state, 4,
                      (0.0, float("inf"))) for t in range(9, T)]
    got = torch.cat([got, *steps], dim=1)
    assert (got.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert (state.double() - S).abs().max() <= 1e-5 * S.abs().max()


def test_short_conv_chunks_against_numpy():
    from poot_core.cpu.recurrent import short_conv

    rng = np.random.default_rng(4)
    R, T, C, K = 2, 11, 6, 4
    x, w, b = rng.standard_normal((R, T, C)), rng.standard_normal((C, K)), rng.standard_normal(C)
    padded = np.concatenate([np.zeros((R, K - 1, C)), x], axis=1)
    expected = np.stack([(padded[:, t:t + K] * w.T).sum(axis=1) + b for t in range(T)], axis=1)
    window = torch.zeros(R, C, K - 1)
    parts = [short_conv(torch.tensor(x[:, i:j], dtype=torch.float32), torch.tensor(w, dtype=torch.float32),
                        torch.tensor(b, dtype=torch.float32), window, None) for i, j in ((0, 5), (5, 6), (6, 11))]
    got = torch.cat(parts, dim=1).double().numpy()
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()
    assert np.allclose(window.numpy(), x[:, -(K - 1):].transpose(0, 2, 1), atol=1e-6)
