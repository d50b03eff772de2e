"""`poot`: one command with subcommands (generate, perplexity, embed, serve, caption, plugins, manifest).

Each subcommand lives in its own module exposing `add_parser(subparsers)` and `run(args) -> int`.
Errors poot raises on purpose print as one line on stderr with exit 1; anything else is one line too, with
the traceback only under -v or POOT_TRACEBACK=1. Ctrl-C exits 130 without a traceback (interrupt.py); a
broken pipe on stdout exits quietly.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

from poot_core.cli.args import Parser, version
from poot_core.cli.interrupt import exit_130, on_interrupt
from poot_core.errors import PootError

COMMANDS = ("generate", "perplexity", "embed", "serve", "caption", "plugins", "manifest")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="poot", description="Run LLM checkpoints on the CPU or a GPU.")
    parser.add_argument("--version", action="version", version=f"poot {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"poot_core.cli.{name}")
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        with on_interrupt(exit_130):
            parser = build_parser()
            args = parser.parse_args(argv)
            return _run(args)
    except KeyboardInterrupt:
        return 130


def _run(args: argparse.Namespace) -> int:
    prog = f"poot {args.command}"
    try:
        return int(args.run(args) or 0)
    except PootError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away (e.g. `poot generate ... | head`): exit quietly, without a traceback.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        raise
    except MemoryError:
        print(f"{prog}: out of memory (a smaller -c needs less)", file=sys.stderr)
        return 1
    except Exception as exc:  # a bug, not the user's doing: one line unless asked for the traceback
        if getattr(args, "verbose", False) or os.environ.get("POOT_TRACEBACK"):
            traceback.print_exc()
        print(f"{prog}: internal error: {type(exc).__name__}: {exc} (POOT_TRACEBACK=1 shows where)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
