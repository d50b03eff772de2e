"""The ROCm backend, checked as far as a machine without an AMD GPU allows. Nothing here runs on AMD hardware.

- The ROCm executor's graph binding takes the AMD tuning tables (gfx942, gfx90a, gfx1100 tiles) and launches
  with them (its logits against the CPU executor under Triton's interpreter: tests/conformance).
- Every launch that binding makes (float32, bfloat16, GGUF and GPTQ weights; prefill chunks and one-token
  steps) is recorded and compiled ahead of time for gfx942, gfx90a and gfx1100 with triton.compile, in a
  child process (the interpreter, on in this process, turns kernels into functions that cannot compile).
- The probe, automatic selection and `--backend rocm` with torch's answers faked; the refusals.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import triton  # noqa: E402, F401 - a test dependency: missing, it must fail, not skip

import poot_backend_rocm.executor as rocm_executor  # noqa: E402
from helpers.aot import compiled_in_child
from helpers.backends import assert_absent_device_is_refused
from poot_backend_rocm import ARCHITECTURES, arch_info  # noqa: E402
from poot_backend_rocm.executor import RocmExecutor  # noqa: E402
from poot_backend_rocm.plugin import probe  # noqa: E402
from poot_core import (  # noqa: E402
    Driver,
    DriverOptions,
    ModelHandle,
    PackedWeight,
    Reason,
    Unsupported,
    installed_backends,
    open_executor,
)
from poot_kernels_triton import TUNINGS, record_launches  # noqa: E402

PROMPT = [int(i) for i in np.random.default_rng(12).integers(3, 250, 24)]
PREFILL = 20  # over the steps of a few tokens (GRAPH_TOKENS), which attend through the paged decode kernel
TARGETS = {"gfx942": 64, "gfx90a": 64, "gfx1100": 32}  # architecture -> wavefront width
PLENTY = {"total": 1 << 40, "free": 1 << 40}


def interpreted(arch: str) -> RocmExecutor:
    """The ROCm executor for `arch` on the CPU: its tiles, its binding, kernels interpreted, no HIP graphs."""
    ex = RocmExecutor.for_arch(arch, "cpu")
    ex.memory = lambda: PLENTY
    return ex


class Store:
    def __init__(self, weights: dict) -> None:
        self.weights = weights

    def names(self) -> list[str]:
        return list(self.weights)

    def get(self, name: str):
        return self.weights[name]


# -- the binding with AMD tiles -------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_the_binding_takes_the_architectures_hip_tile_table(arch):
    """Its logits against the CPU executor, with these tiles, are in tests/conformance (rocm-<arch>)."""
    ex = interpreted(arch)
    assert ex.tuning is TUNINGS[ARCHITECTURES[arch].tuning] and ex.tuning.backend == "hip"


@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_the_binding_launches_with_the_architectures_tiles(tiny_checkpoint, arch):
    """Not the interpreter's tiles nor the H200's: the recorded launches carry the AMD entry's settings."""
    handle = ModelHandle.load(tiny_checkpoint("llama", torch.float32))
    ex = interpreted(arch)
    driver = Driver(handle, ex, DriverOptions(capacity=64, prefill_chunk=PREFILL))
    tuning = TUNINGS[ARCHITECTURES[arch].tuning]
    with record_launches() as prefill:
        driver._run(PROMPT[:PREFILL], 0, False)
    with record_launches() as decode:
        driver._run(PROMPT[PREFILL : PREFILL + 1], PREFILL, False)
    by_kernel = {}
    for launch in prefill + decode:
        by_kernel.setdefault(launch.kernel.fn.__name__, []).append(launch)
    flash = by_kernel["_prefill_kernel"][0]
    assert (flash.args["BLOCK_M"], flash.args["BLOCK_N"]) == (tuning.prefill.block_m, tuning.prefill.block_n)
    assert (flash.num_warps, flash.num_stages, flash.extra) == (
        tuning.prefill.num_warps,
        tuning.prefill.num_stages,
        tuning.prefill.extra,
    )
    split = by_kernel["_decode_split_kernel"][0]
    assert split.args["BLOCK_N"] == tuning.decode.block_n and split.num_warps == tuning.decode.num_warps
    assert not split.args["UPCAST"]  # the interpreter's float32 upcast is not the hardware path


# -- ahead-of-time compilation for the AMD targets ---------------------------------------------------------


def record_rocm_launches(arch: str, checkpoints: list[str]) -> list:
    """Every launch the ROCm executor makes for `arch`: the tiny checkpoints (dense f32/bf16) and SmolLM2's
    GGUF (quantized embedding and matrices) through Driver steps, plus 4-bit GPTQ matrices at the two
    row counts the binding uses them with."""
    import poot_kernels_triton as ktr

    launches = []
    for path in checkpoints:
        handle = ModelHandle.load(path)
        ex = interpreted(arch)
        driver = Driver(handle, ex, DriverOptions(capacity=64, prefill_chunk=PREFILL))
        with record_launches() as recorded:
            driver._run(PROMPT[:PREFILL], 0, False)
            out = driver._run(PROMPT[PREFILL : PREFILL + 1], PREFILL, False)
            driver._run(PROMPT[PREFILL + 1 :], PREFILL + 1, False)  # a few tokens: the paged decode kernel
            try:
                ex.greedy_token(out)
            except (TypeError, RuntimeError, ValueError):
                pass  # the recorded greedy launch wrote nothing, so reading its id may fail; the launch is kept
        launches += recorded
    gptq = PackedWeight(
        "gptq",
        (256, 512),
        {
            "qweight": torch.zeros(64, 256, dtype=torch.int32),
            "qzeros": torch.zeros(4, 32, dtype=torch.int32),
            "scales": torch.zeros(4, 256, dtype=torch.bfloat16),
            "g_idx": torch.arange(512, dtype=torch.int32) // 128,
        },
        {"bits": 4, "group_size": 128, "sym": True, "desc_act": False},
    )
    with ktr.use_tuning(TUNINGS[ARCHITECTURES[arch].tuning]), record_launches() as recorded:
        for rows in (1, 8):
            ktr.linear(torch.zeros(rows, 512, dtype=torch.bfloat16), gptq)
    return launches + recorded


def compile_rocm(arch: str, checkpoints: list[str]) -> dict:
    """Child-process body: compile each distinct recorded launch for one HIP target."""
    from triton.backends.compiler import GPUTarget

    from poot_kernels_triton.aot import compile_launch, signature_of

    target = GPUTarget("hip", arch, TARGETS[arch])
    seen, compiled, failures = set(), [], []
    for launch in record_rocm_launches(arch, checkpoints):
        signature, constexprs = signature_of(launch)
        name = f"{launch.kernel.fn.__module__.rsplit('.', 1)[-1]}.{launch.kernel.fn.__name__}"
        key = (name, tuple(signature.items()), repr(sorted(constexprs.items())), launch.num_warps, launch.num_stages)
        if key in seen:
            continue
        seen.add(key)
        try:
            kernel = compile_launch(launch, target)
            compiled.append({"kernel": name, "bytes": len(kernel.asm["hsaco"]), "signature": signature})
        except Exception as err:  # report every failure, not just the first
            failures.append({"kernel": name, "signature": signature, "error": f"{type(err).__name__}: {err}"[-2000:]})
    return {"compiled": compiled, "failures": failures}


@pytest.fixture(scope="module")
def aot_checkpoints(tiny_checkpoint) -> list[str]:
    from helpers import smollm

    dense = [tiny_checkpoint(f, d) for f, d in (("llama", torch.float32), ("llama", torch.bfloat16))]
    dense += [tiny_checkpoint(f, torch.bfloat16) for f in ("gemma3", "qwen3")]
    return [str(p) for p in dense] + [str(smollm.gguf_path())]


@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_every_launch_of_the_rocm_binding_compiles_ahead_of_time(arch, aot_checkpoints):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the child imports tests/helpers as we do
    report = compiled_in_child([str(Path(__file__).resolve()), arch, json.dumps(aot_checkpoints)], env)
    built = {c["kernel"] for c in report["compiled"]}
    # what the binding must have used: norms, rope, KV writes, both attentions, dense, GGUF and GPTQ (planes)
    # products, gated activation and the greedy argmax
    for kernel in (
        "norm._add_rms_norm_kernel",
        "rope._write_kv_kernel",
        "attention._prefill_kernel",
        "attention._decode_split_kernel",
        "attention._decode_reduce_kernel",
        "paged._paged_decode_split_kernel",
        "planes._planes_gemv_kernel",
        "planes._planes_gemm_kernel",
        "matmul._gemv_kernel",
        "matmul._gemm_kernel",
        "rope._rope_kernel",
        "sampling._argmax_kernel",
        "activation._gated_kernel",
    ):
        assert kernel in built, f"{kernel} never compiled; built: {sorted(built)}"
    assert "planes._planes_rows_kernel" in built  # the GGUF embedding rows, read from the planes layout
    assert all(c["bytes"] > 0 for c in report["compiled"])
    # float32 activations (the f32 checkpoint, the GGUF embedding's identity product) and bfloat16 ones
    pointer_types = {t for c in report["compiled"] for t in c["signature"].values()}
    assert {"*fp32", "*bf16"} <= pointer_types


# -- the probe, automatic selection, refusals --------------------------------------------------------------


def fake_rocm(monkeypatch, devices: int = 1, arch: str = "gfx942:sramecc+:xnack-", hip: str | None = "6.3.4") -> None:
    """torch as a ROCm build would answer: a hip version, `devices` visible GPUs of architecture `arch`."""
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: devices > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
    monkeypatch.setattr(rocm_executor, "device_arch", lambda device=0: arch)


def specs(*names: str):
    return [s for s in installed_backends() if s.name in names]


def test_registered_with_alias_and_priority():
    spec = next(s for s in installed_backends() if s.name == "rocm")
    assert spec.aliases == ("hip",) and spec.priority == 30 and spec.distribution == "poot-backend-rocm"
    assert spec.probe() == bool(torch.version.hip and torch.cuda.is_available())


def test_probe_follows_torch_and_never_raises(monkeypatch):
    fake_rocm(monkeypatch, devices=1)
    assert probe()
    fake_rocm(monkeypatch, devices=0)
    assert not probe()
    fake_rocm(monkeypatch, devices=1, hip=None)  # a CUDA build with a GPU is not ROCm
    assert not probe()

    def broken() -> int:
        raise RuntimeError("HIP driver failed to initialise")

    fake_rocm(monkeypatch, devices=1)
    monkeypatch.setattr(torch.cuda, "device_count", broken)
    assert probe() is False


def test_auto_picks_rocm_after_cuda_and_before_cpu(monkeypatch):
    fake_rocm(monkeypatch, devices=1)
    ex = open_executor("auto", specs("cuda", "rocm", "cpu"))
    assert ex.name == "rocm" and ex.arch.name == "gfx942" and ex.tuning is TUNINGS["hip.gfx942"]
    assert ex.use_cuda_graphs
    assert open_executor("hip", specs("rocm")).name == "rocm"
    fake_rocm(monkeypatch, devices=1, hip=None)  # the same answers from a CUDA build: CUDA wins
    assert open_executor("auto", specs("cuda", "rocm", "cpu")).name == "cuda"
    fake_rocm(monkeypatch, devices=0)
    assert open_executor("auto", specs("cuda", "rocm", "cpu")).name == "cpu"


def test_each_architecture_gets_its_tuning(monkeypatch):
    for arch, tuning in (("gfx90a:sramecc+:xnack-", "hip.gfx90a"), ("gfx1100", "hip.gfx1100")):
        fake_rocm(monkeypatch, arch=arch)
        ex = open_executor("rocm", specs("rocm"))
        assert ex.tuning is TUNINGS[tuning] and ex.arch.wave_size == TARGETS[arch.split(":")[0]]


def test_an_architecture_triton_does_not_target_is_refused_by_name(monkeypatch):
    fake_rocm(monkeypatch, arch="gfx1030")
    with pytest.raises(Unsupported) as err:
        open_executor("rocm", specs("rocm"))
    assert err.value.reason is Reason.BACKEND and "gfx1030" in err.value.name
    assert open_executor("auto", specs("rocm", "cpu")).name == "cpu"  # auto moves on to the next backend


@pytest.mark.skipif(probe(), reason="checks the refusal on a machine without an AMD GPU")
def test_absent_device_is_refused_by_name():
    assert_absent_device_is_refused("rocm", ("rocm", "hip"), RocmExecutor)


@pytest.mark.skipif(probe(), reason="checks the refusal on a machine without an AMD GPU")
def test_cli_backend_rocm_without_a_device_exits_1_with_one_line(tiny_checkpoint):
    model = str(tiny_checkpoint("llama", torch.float32))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "poot_core.cli.main",
            "generate",
            "-m",
            model,
            "-p",
            "x",
            "-n",
            "1",
            "--backend",
            "rocm",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "rocm" in lines[0] and "not present" in lines[0], out.stderr


# -- what the hardware lacks -------------------------------------------------------------------------------


def fp8_weight() -> PackedWeight:
    return PackedWeight(
        "fp8",
        (64, 64),
        {"weight": torch.zeros(64, 64, dtype=torch.float8_e4m3fn), "scale": torch.ones(1)},
        {"granularity": "tensor"},
    )


@pytest.mark.parametrize("arch", ["gfx90a", "gfx1100"])
def test_fp8_on_an_architecture_without_it_is_refused_naming_it(arch):
    for weight in (fp8_weight(), torch.zeros(64, 64, dtype=torch.float8_e4m3fn)):
        with pytest.raises(Unsupported) as err:
            interpreted(arch).upload(Store({"layer.weight": weight}))
        assert err.value.reason is Reason.QUANTIZATION
        assert arch in err.value.name and "layer.weight" in err.value.name
        assert "no FP8" in str(err.value)


def test_fp8_on_cdna3_is_refused_for_the_missing_kernel_not_the_hardware():
    with pytest.raises(Unsupported) as err:
        interpreted("gfx942").upload(Store({"layer.weight": fp8_weight()}))
    assert err.value.reason is Reason.QUANTIZATION and "gfx942" in err.value.name
    assert "no FP8 matrix product" in str(err.value) and "e4m3fnuz" in str(err.value)


def test_other_layouts_and_sizes_are_refused_as_on_cuda():
    gptq5 = PackedWeight("gptq", (64, 64), {"qweight": torch.zeros(10, 64, dtype=torch.int32)}, {"bits": 5})
    with pytest.raises(Unsupported) as err:
        interpreted("gfx942").upload(Store({"layer.weight": gptq5}))
    assert err.value.reason is Reason.QUANTIZATION and "layer.weight" in err.value.name
    awq = PackedWeight("awq", (64, 64), {"qweight": torch.zeros(64, 8, dtype=torch.int32)}, {"bits": 4})
    with pytest.raises(Unsupported) as err:  # 64 inputs cannot hold one AWQ group of 128
        interpreted("gfx942").upload(Store({"layer.weight": awq}))
    assert err.value.reason is Reason.SHAPE
    ex = interpreted("gfx90a")
    ex.memory = lambda: {"total": 1 << 20, "free": 1 << 20}
    with pytest.raises(Unsupported) as err:
        ex.upload(Store({"big.weight": torch.zeros(1024, 1024, dtype=torch.bfloat16)}))
    assert err.value.reason is Reason.CAPACITY


def test_architecture_table_matches_the_kernels_tuning_lookup():
    from poot_kernels_triton import tuning_for_target

    for name, info in ARCHITECTURES.items():
        assert tuning_for_target("hip", name) is TUNINGS[info.tuning]
    assert arch_info("gfx942:sramecc+:xnack-").name == "gfx942"


if __name__ == "__main__":
    print(json.dumps(compile_rocm(sys.argv[1], json.loads(sys.argv[2]))))
