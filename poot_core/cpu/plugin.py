"""The CPU backend's entry point: registered like every other backend, so core exercises the mechanism."""

from __future__ import annotations

from poot_core.executor import BackendSpec
from poot_core.plugins import hookimpl


def _open():  # noqa: ANN202 - imported lazily so discovery stays cheap
    from poot_core.cpu.executor import CpuExecutor

    return CpuExecutor()


@hookimpl
def poot_register_backends() -> list[BackendSpec]:
    return [BackendSpec("cpu", _open, probe=lambda: True, priority=0,
                        description="torch on the CPU; the reference executor")]
