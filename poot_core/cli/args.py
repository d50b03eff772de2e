"""The argument parser every `poot` command uses: argparse as llama-cli users need it.

- No abbreviations and no clusters of short flags: `-ngl 99` is never `-n gl`, `-cnv` never `-c nv`. A
  flag the command does not have is refused by name before argparse reads it, with what poot offers
  instead when it is one of llama-cli's (see llama_flags.py).
- `--help` shows every default.
- Usage errors are one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import Any, NoReturn

from poot_core.cli.llama_flags import unknown_flag_message

NUMBER = re.compile(r"-\d+(\.\d*)?([eE][-+]?\d+)?|-\.\d+")  # a negative number is a value, not a flag


def version() -> str:
    """poot-core's installed version (read without importing poot_core's heavy modules)."""
    try:
        return metadata.version("poot-core")
    except metadata.PackageNotFoundError:  # a source tree that is not installed
        return "unknown"


class DefaultsFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to every option's help unless the help already says its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.required or "default" in text or action.default is argparse.SUPPRESS:
            return text
        if isinstance(action, argparse._HelpAction | argparse._VersionAction):
            return text
        return f"{text} (default: {_shown(action.default)})"


def _shown(value: Any) -> str:
    if value is None or value == []:
        return "none"
    if value is True or value is False:
        return "on" if value else "off"
    return str(value).replace("%", "%%")


class Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)
        self._has_commands = False

    def add_subparsers(self, **kwargs: Any) -> Any:
        self._has_commands = True
        return super().add_subparsers(**kwargs)

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        if not self._has_commands:  # a command's own flags; the top level only picks the command
            self._refuse_unknown(argv)
        return super().parse_known_args(argv, namespace)

    def _refuse_unknown(self, argv: list[str]) -> None:
        known = self._option_string_actions
        for token in argv:
            if token == "--":
                break
            # argparse reads these as values: "-", negative numbers and anything with a space
            if not token.startswith("-") or token == "-" or " " in token or NUMBER.fullmatch(token):
                continue
            name = token.split("=", 1)[0] if token.startswith("--") else token
            if name not in known:
                self.error(unknown_flag_message(name, self.prog))

    def _get_option_tuples(self, option_string: str) -> list[Any]:
        # argparse would read "-ngl" as -n with the value "gl", and a value like "-nice day" as -n too:
        # only exact option strings are options here.
        return []

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)
