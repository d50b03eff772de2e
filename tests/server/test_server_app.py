"""The application in this process (no model): /health is 503 until the model is loaded and says why after a
failed load, every route but /health and /metrics answers 503 in OpenAI's shape meanwhile."""

from __future__ import annotations

import threading

from fastapi.testclient import TestClient

from poot_core.server.app import create_app
from poot_core.server.state import ServerState, Settings


def test_health_is_503_until_loaded_and_after_a_failed_load():
    release, failures = threading.Event(), []

    def loader(state):
        release.wait(30)
        raise RuntimeError("no such file")

    state = ServerState(Settings("m"))
    with TestClient(create_app(state, loader, failures.append)) as client:
        r = client.get("/health")
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        r = client.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert client.get("/metrics").status_code == 200
        release.set()
        for _ in range(100):
            if failures:
                break
            threading.Event().wait(0.05)
        assert failures and "no such file" in failures[0]
        r = client.get("/health")
        assert r.status_code == 503 and "no such file" in r.json()["error"]["message"]
