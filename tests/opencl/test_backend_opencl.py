"""The OpenCL executor end to end against the CPU executor (the reference every backend is held to), on any
OpenCL device (CI: pocl, a CPU device, installed by plugins/backend_opencl/setup_pocl.sh and used because the
tests name the backend; automatic selection skips CPU devices).

Every dense and MoE family (DeepSeek's latent attention included) in float32 (logits within 1e-3 over prefill
chunks and one-token steps, greedy tokens equal), bfloat16 and float16 weights, a tiny GGUF in each block type, a
MoE GGUF with stacked experts, the real SmolLM2 GGUF, device greedy picks, and typed refusals at prepare time.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from poot_backend_opencl.kernels.runtime import is_cpu_device, opencl_devices
from poot_backend_opencl.plugin import hardware_probe

from helpers import gguf_models, smollm
from helpers import moe as moe_helpers
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

pytestmark = pytest.mark.skipif(not opencl_devices(), reason="no OpenCL device on this machine (pocl-opencl-icd)")

PROMPT = [int(i) for i in np.random.default_rng(7).integers(3, 250, 20)]
DENSE = ("llama", "qwen2", "qwen3", "mistral", "gemma3")
MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")
GGUF = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "IQ4_XS", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


@pytest.fixture(scope="module")
def opencl():
    return open_executor("opencl")


def rel(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def check_parity(handle, opencl, prompt=PROMPT, bound=1e-3, capacity=48, new=6) -> None:
    """Logits of the prompt in chunks of 8, then one token a step (the decode program, splits of keys past the
    position), and greedy tokens after the prompt, against the CPU executor."""
    cpu = open_executor("cpu")
    for chunk in (8, 1):
        options = DriverOptions(capacity=capacity, prefill_chunk=chunk)
        ours, ref = Driver(handle, opencl, options).logits(prompt), Driver(handle, cpu, options).logits(prompt)
        assert rel(ours, ref) <= bound, chunk
    request = GenerateRequest(prompt[:12], max_new=new, ignore_eos=True)
    options = DriverOptions(capacity=capacity, prefill_chunk=8)
    assert Driver(handle, opencl, options).generate(request).tokens == \
        Driver(handle, cpu, options).generate(request).tokens


def test_registered_below_vulkan_and_auto_skips_cpu_devices():
    spec = next(s for s in installed_backends() if s.name == "opencl")
    assert spec.aliases == ("cl",) and spec.priority == 10 and spec.distribution == "poot-backend-opencl"
    vulkan = next((s for s in installed_backends() if s.name == "vulkan"), None)
    assert vulkan is None or vulkan.priority > spec.priority
    assert open_executor("cl").name == "opencl"
    assert hardware_probe() == any(not is_cpu_device(d) for d in opencl_devices())
    if not hardware_probe():
        assert spec.probe() and open_executor("auto").name != "opencl"


@pytest.mark.parametrize("arch", DENSE)
def test_dense_families_match_cpu(tiny_checkpoint, opencl, arch):
    check_parity(ModelHandle.load(tiny_checkpoint(arch, torch.float32)), opencl)


def test_a_decode_step_fuses_its_one_token_neighbours(tiny_checkpoint, opencl):
    """A llama decode step: per layer the residual add and rms_norm, q/k/v, both ropes with the k/v cache
    writes, the two attention kernels, o, gate/up with their activation and down (nine launches), plus the
    embedding, the last norm, the head and the argmax; no separate rope, cache write, activation or copy. The
    step enqueues through the library call (kernels/enqueue.py); the parity tests above run through it."""
    handle = ModelHandle.load(tiny_checkpoint("llama", torch.float32))
    program = Driver(handle, opencl, DriverOptions(capacity=48)).program(StepShape(1, 1, 48))
    names = [launch.kernel.function_name for launch in program.step.launches]
    layers = sum(node.op == "attention" for node in program.graph.nodes)
    assert names.count("rope_qkv") == names.count("gemv_gated") == layers
    assert not {"rope", "kv_write", "gated", "copy", "add"} & set(names)
    assert layers > 1 and len(names) == 9 * layers + 4
    assert program.step.enqueue.direct  # the loader's own clEnqueueNDRangeKernel, found where pyopencl's is


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_weights_match_cpu(tiny_checkpoint, opencl, dtype):
    """16-bit weights as stored (bf16 bit patterns, f16 through vload_half), multiplied as float32 products of
    their exact values, as the CPU executor does."""
    handle = ModelHandle.load(tiny_checkpoint("qwen3", dtype))
    weights = opencl.upload(handle.store())
    assert {w.fmt for w in weights.matrices.values()} == {"bf16" if dtype == torch.bfloat16 else "f16"}
    check_parity(handle, opencl)


@pytest.mark.parametrize("arch", MOE)
def test_moe_families_match_cpu(moe_checkpoint, opencl, arch):
    check_parity(ModelHandle.load(moe_checkpoint(arch)), opencl)


def test_moe_gguf_with_stacked_experts_matches_cpu(moe_checkpoint, opencl, tmp_path):
    """llama.cpp's layout: each layer's experts in three [experts, rows, cols] tensors, uploaded as one buffer
    each, an expert a row range of it."""
    path = moe_helpers.write_gguf(moe_checkpoint("qwen3_moe"), tmp_path, "qwen3_moe")
    handle = ModelHandle.load(path)
    assert opencl.upload(handle.store()).stacks
    check_parity(handle, opencl)


@pytest.mark.parametrize("type_name", GGUF)
def test_gguf_block_types_match_cpu(opencl, tmp_path, type_name):
    path, _ = gguf_models.build(tmp_path, type_name)
    handle = ModelHandle.load(path)
    kinds = {w.fmt for w in opencl.upload(handle.store()).matrices.values()}
    assert type_name in kinds
    check_parity(handle, opencl, gguf_models.PROMPT[:16], new=4)


def test_smollm2_gguf_matches_cpu(opencl):
    """The real SmolLM2-135M (Q4_1 blocks, Q8_0 embeddings)."""
    handle = ModelHandle.load(smollm.gguf_path())
    ids = handle.text().encode(smollm.PROMPTS[0])
    options = DriverOptions(capacity=32, prefill_chunk=16)
    ours = Driver(handle, opencl, options).logits(ids)
    ref = Driver(handle, open_executor("cpu"), options).logits(ids)
    assert rel(ours, ref) <= 1e-3
    request = GenerateRequest(ids, max_new=4, ignore_eos=True)
    assert Driver(handle, opencl, options).generate(request).tokens == \
        Driver(handle, open_executor("cpu"), options).generate(request).tokens


def test_greedy_picks_on_the_device_match_numpy(tiny_checkpoint, opencl):
    handle = ModelHandle.load(tiny_checkpoint("llama", torch.float32))
    graph = trace(handle, StepShape(1, 5, 32, all_logits=True))
    program = opencl.prepare(graph, opencl.upload(handle.store()))
    state = opencl.allocate_state(graph)
    inputs = {"tokens": np.array([PROMPT[:5]]), "positions": np.arange(5)[None]}
    (logits,) = program.run(state, inputs)
    host = opencl.to_numpy(logits)
    np.testing.assert_array_equal(opencl.greedy_rows(logits), np.argmax(host.reshape(5, -1), axis=1))
    assert opencl.greedy_token(logits) == int(np.argmax(host.reshape(5, -1)[-1]))


# -- refusals at prepare time ---------------------------------------------------------------------------


def test_refuses_rows_above_one_and_missing_ops_by_name(tiny_checkpoint, opencl):
    check_rows_and_op_refused(opencl, tiny_checkpoint("llama", torch.float32), "group_attention")


def test_latent_attention_with_bf16_kv_b_matches_cpu(moe_checkpoint, opencl):
    """A bf16 kv_b: the absorbed products' inputs and results rounded to bf16 as the CPU executor multiplies
    them (without that rounding the logits differ by about 6e-3)."""
    handle = ModelHandle.load(moe_checkpoint("deepseek_v3", torch.bfloat16))
    weights = opencl.upload(handle.store())
    assert {w.fmt for n, w in weights.matrices.items() if "kv_b" in n} == {"bf16"}
    check_parity(handle, opencl)


def test_latent_attention_with_packed_kv_b_matches_cpu(moe_checkpoint, opencl, tmp_path):
    """A GGUF DeepSeek V2 whose kv_b is Q8_0 blocks: the expanded form (the cached latent through kv_b each
    step, as the CPU executor does for a packed kv_b)."""
    handle = ModelHandle.load(moe_helpers.write_gguf(moe_checkpoint("deepseek_v2"), tmp_path, "deepseek_v2"))
    weights = opencl.upload(handle.store())
    assert {w.fmt for n, w in weights.matrices.items() if "kv_b" in n} == {"Q8_0"}
    check_parity(handle, opencl)


def test_latent_attention_decode_step_runs_its_kernels(moe_checkpoint, opencl):
    handle = ModelHandle.load(moe_checkpoint("deepseek_v2"))
    program = Driver(handle, opencl, DriverOptions(capacity=48)).program(StepShape(1, 1, 48))
    names = [launch.kernel.function_name for launch in program.step.launches]
    layers = sum(node.op == "mla_attention" for node in program.graph.nodes)
    assert layers > 1 and all(names.count(k) == layers for k in ("mla_cache", "mla_query", "mla_out"))


def test_refuses_heads_larger_than_the_device_holds(tiny_checkpoint, opencl, monkeypatch):
    """The attention kernel keeps a query head in local memory: a device with too little of it refuses the
    step at prepare time, naming the head size and the limit."""
    import dataclasses

    handle = ModelHandle.load(tiny_checkpoint("llama", torch.float32))
    weights = opencl.upload(handle.store())
    runtime = opencl.runtime
    monkeypatch.setattr(runtime, "limits", dataclasses.replace(runtime.limits, group=16, local_bytes=128))
    with pytest.raises(Unsupported) as err:
        opencl.prepare(trace(handle, StepShape(1, 1, 32)), weights)
    assert err.value.reason is Reason.SHAPE and "head size 16" in str(err.value) and "local memory" in str(err.value)


def test_refuses_unsupported_quantization_naming_the_tensor(opencl):
    check_gptq_upload_refused(opencl)


# -- the command line ------------------------------------------------------------------------------------


def test_poot_plugins_lists_the_opencl_devices(capsys):
    from poot_core.cli.main import main

    assert main(["plugins"]) == 0
    text = capsys.readouterr().out
    for device in opencl_devices():
        assert f"device {device.platform.name.strip()} / {device.name.strip()}" in text



@pytest.mark.parametrize("arch", ["lfm2", "mamba2", "qwen3next"])
def test_hybrid_families_are_refused_by_the_op_they_need(hybrid_checkpoint, opencl, arch):
    from helpers.refusals import assert_backend_refuses_by_name

    assert_backend_refuses_by_name(opencl, hybrid_checkpoint(arch))
