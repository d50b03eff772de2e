"""The `poot` console command's entry point, outside the poot_core package on purpose: importing poot_core
imports torch, which takes a second or more, and a Ctrl-C in that time must exit 130 without a traceback.
Until poot_core.cli takes over (poot_core/cli/interrupt.py says why), SIGINT ends the process at once."""

from __future__ import annotations

import os
import signal


def main() -> int:
    signal.signal(signal.SIGINT, lambda *_: os._exit(130))
    from poot_core.cli.main import main as run

    return run()


if __name__ == "__main__":
    raise SystemExit(main())
