"""Where things are, independent of which test folder asks."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
TESTS = ROOT / "tests"
TESTDATA = ROOT / ".cache" / "testdata"  # scripts/fetch_test_data.py fills it
