"""`poot manifest PATH > manifest.json`: lengths and SHA-256 of every file of a checkpoint."""

from __future__ import annotations

import argparse

from poot_core.checkpoint.integrity import Manifest


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("manifest", help="write an integrity manifest of a checkpoint to stdout")
    p.add_argument("path", help="a checkpoint directory or a .gguf file")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    print(Manifest.of(args.path).to_json())
    return 0
