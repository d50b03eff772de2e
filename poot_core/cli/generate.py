"""`poot generate` (being written)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="not built yet")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    raise SystemExit("poot generate is not built yet")
