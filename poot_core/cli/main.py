"""`poot`: one command with subcommands (generate, embed, plugins, manifest).

Each subcommand lives in its own module exposing `add_parser(subparsers)` and `run(args) -> int`.
Errors poot raises on purpose print as one line on stderr with a non-zero exit; a broken pipe on stdout
exits quietly.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from poot_core.errors import PootError

COMMANDS = ("generate", "embed", "plugins", "manifest")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="poot", description="Run LLM checkpoints on the CPU or a GPU.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        module = importlib.import_module(f"poot_core.cli.{name}")
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except PootError as exc:
        print(f"poot {args.command}: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away (e.g. `poot generate ... | head`): exit quietly, without a traceback.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
