"""`poot generate --backend opencl` (and its alias `cl`): the command line reaches the OpenCL backend and prints
the CPU backend's greedy text for the same SmolLM2 GGUF and prompt."""

from __future__ import annotations

import subprocess
import sys

import pytest
from poot_backend_opencl.kernels.runtime import opencl_devices

from helpers import smollm

pytestmark = pytest.mark.skipif(not opencl_devices(), reason="no OpenCL device on this machine (pocl-opencl-icd)")


def _generate(backend: str) -> subprocess.CompletedProcess:
    args = ["generate", "-m", str(smollm.gguf_path()), "--no-chat-template", "-p", "The capital of France is",
            "-n", "8", "--temp", "0", "--backend", backend]
    return subprocess.run([sys.executable, "-m", "poot_core.cli.main", *args], capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def cpu() -> subprocess.CompletedProcess:
    return _generate("cpu")


@pytest.mark.parametrize("name", ["opencl", "cl"])
def test_generate_on_opencl_prints_the_cpu_text(cpu, name):
    ours = _generate(name)
    assert cpu.returncode == 0, cpu.stderr
    assert ours.returncode == 0, ours.stderr
    assert ours.stdout == cpu.stdout and ours.stdout.strip()
