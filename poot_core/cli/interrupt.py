"""Ctrl-C outside a reply: end the process at once with status 130.

Raising KeyboardInterrupt is not safe everywhere: raised inside a native extension's callback (a torch or
tokenizers call, an import that initialises one) it can abort the process with a C++ error instead of
unwinding. So while poot loads and prepares, SIGINT exits without unwinding; a reply being generated
handles Ctrl-C itself (it stops the reply), and the chat's prompt uses Python's KeyboardInterrupt, which
input() handles safely.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any


def exit_130(signum: int = signal.SIGINT, frame: Any = None) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(130)


@contextlib.contextmanager
def on_interrupt(handler: Any) -> Iterator[None]:
    """SIGINT goes to `handler` inside the block (the handler before it is restored after)."""
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
