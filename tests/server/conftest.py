"""Fixtures of the server tests: one `poot serve` subprocess per module (helpers/server.py), and the reference the
answers are compared with (the offline engine in this process, on the same file and window)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from helpers import smollm
from helpers.server import CTX, Server, start_server


@pytest.fixture(scope="module")
def serve() -> Iterator:
    """serve(*flags) -> a started Server, stopped at the end of the module."""
    started: list[Server] = []

    def make(*flags: str, **kwargs) -> Server:
        server = start_server(*flags, **kwargs)
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def reference():
    """The offline engine on the same file and window: the answers a greedy request must give."""
    from poot_core import Driver, DriverOptions, Layout, ModelHandle, open_executor

    handle = ModelHandle.load(smollm.gguf_path())
    options = DriverOptions(capacity=CTX, prefill_chunk=256, step_tokens=256, max_running=8)  # the server's
    driver = Driver(handle, open_executor("cpu"), options)
    return driver.serve(Layout.PAGED)
