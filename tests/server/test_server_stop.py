"""SIGTERM under load: the server stops taking connections, requests that finish within --drain end normally,
the rest get an error event; none hangs, and the process exits."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from helpers.server import MODEL_NAME

SHORT, LONG = 24, 1000  # within the 5 s drain on this machine; far beyond it


def _stream(url: str, max_tokens: int, got_first: threading.Event, out: list) -> None:
    body = {"model": MODEL_NAME, "prompt": "Tell me about the sea.", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    events = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    got_first.set()
    except httpx.HTTPError as exc:
        events.append(f"transport error: {exc!r}")
    got_first.set()
    out.append((max_tokens, events))


def test_sigterm_drains_then_exits(serve):
    server = serve("--drain", "5", "--max-running", "4", "-c", "1024")
    results: list = []
    threads, firsts = [], []
    for max_tokens in (SHORT, SHORT, LONG, LONG):
        first = threading.Event()
        t = threading.Thread(target=_stream, args=(server.url, max_tokens, first, results))
        t.start()
        threads.append(t)
        firsts.append(first)
    for first in firsts:
        assert first.wait(120)
    time.sleep(0.2)
    server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a stream hung after SIGTERM"
    assert server.proc.wait(timeout=120) in (0, -signal.SIGTERM)
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/health", timeout=5)
    for max_tokens, events in results:
        if max_tokens == SHORT:  # finished within the drain: a whole answer
            assert events[-1] == "[DONE]", events
            assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        else:  # cut at the end of the drain: an error event, no silent end
            last = json.loads(events[-1])
            assert last["error"]["code"] == "server_stopping", events[-3:]
