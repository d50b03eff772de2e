"""`poot serve` as a subprocess on a free 127.0.0.1 port with the packaged SmolLM2 (tests/server), and its
Prometheus samples read back."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from helpers import smollm
from helpers.paths import ROOT

MODEL_NAME = "smollm2"
CTX = 512
START_TIMEOUT = 300  # seconds: imports and the model load on a loaded 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    log: Path

    @property
    def base(self) -> str:
        return f"{self.url}/v1"

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """Prometheus samples by name with labels, e.g. 'poot:num_requests_running{model_name="smollm2"}'."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def metric(self, name: str, **labels: str) -> float:
        """The sum of a metric's samples whose labels include `labels`."""
        total = 0.0
        for key, value in self.metrics().items():
            base, _, rest = key.partition("{")
            if base != name:
                continue
            have = dict(re.findall(r'(\w+)="([^"]*)"', rest))
            if all(have.get(k) == v for k, v in labels.items()):
                total += value
        return total

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        return self.proc.returncode


def start_server(*flags: str, command: tuple[str, ...] = ("-m", "poot_core.cli.main", "serve")) -> Server:
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="poot-serve-", suffix=".log")[1])
    argv = [sys.executable, *command, "-m", str(smollm.gguf_path()), "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", MODEL_NAME, "-c", str(CTX), "-t", "1", "--backend", "cpu", *flags]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT, env=env)
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + START_TIMEOUT
    seen_503 = False
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"poot serve exited with {proc.returncode}:\n{server.stderr()}")
        try:
            r = httpx.get(f"{server.url}/health", timeout=5)
            if r.status_code == 200:
                server.seen_503 = seen_503  # type: ignore[attr-defined]
                return server
            seen_503 = seen_503 or r.status_code == 503
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"poot serve did not become healthy in {START_TIMEOUT} s:\n{server.stderr()}")


def offline(engine, request):
    """The offline serving engine's generation of `request` and the logits (float64 [tokens, vocab]) each of its
    tokens was sampled from: the reference the server's answers are checked against."""
    import numpy as np

    from poot_core.driver.engine import FinishedEvent

    engine.keep_logits = True
    rid = engine.submit(request)
    generation = None
    while generation is None:
        generation = next((e.generation for e in engine.step()
                           if isinstance(e, FinishedEvent) and e.request_id == rid), None)
    return generation, np.stack(engine.logits.pop(rid)).astype(np.float64)
