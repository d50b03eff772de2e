"""Where things are, independent of which test folder asks."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
TESTS = ROOT / "tests"
TESTDATA = ROOT / ".cache" / "testdata"  # scripts/fetch_test_data.py fills it


def fetched(path: Path) -> Path:
    """`path`, part of the test data scripts/fetch_test_data.py fetches. Missing, it is an error, not a skip:
    `make test` fetches it in its set-up, so a run without it has skipped a step and must not pass."""
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run scripts/fetch_test_data.py (make test's set-up does)")
    return path
