"""`torchrun` starting the ranks itself (env:// rendezvous, as across hosts): `poot generate --tp 2` in each
rank joins that group and prints rank 0's reply, the one-process tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from poot_core.cli.main import main

ARGS = ["-p", "The capital of France is", "-n", "5", "--no-chat-template", "--json", "-c", "64", "--ignore-eos",
        "-t", "1"]


def test_torchrun_ranks_join_the_group(tiny_checkpoint, capfd):
    model = str(tiny_checkpoint("mistral"))
    assert main(["generate", "-m", model, *ARGS]) == 0
    alone = json.loads(capfd.readouterr().out)
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "poot_core.cli.main",
                          "generate", "-m", model, *ARGS, "--tp", "2", "--rank-timeout", "60"],
                         capture_output=True, text=True, timeout=240, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, run.stdout
    assert json.loads(lines[0])["tokens"] == alone["tokens"]
