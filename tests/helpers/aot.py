"""The ahead-of-time compile checks of the Triton tests: a child process (the parent imported the kernels under
TRITON_INTERPRET, which cannot compile them) compiles the recorded launches and prints its report as JSON on
its last line: {"compiled": [...], "failures": [...], ...}."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


def compiled_in_child(argv: list[str], env: dict[str, str]) -> dict[str, Any]:
    """The report of `python *argv` run with `env`, once the child exited 0 and no compile failed."""
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["failures"] == [], json.dumps(report["failures"], indent=1)
    return report
