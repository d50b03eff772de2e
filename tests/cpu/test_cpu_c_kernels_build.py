"""The build of the CPU C kernels from csrc/: a broken source shows the compiler's error (once) and the
executor falls back to torch; the report command lists every kernel."""

from __future__ import annotations

import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from poot_core.cpu import c_kernels

pytestmark = pytest.mark.skipif(shutil.which(c_kernels.compiler()) is None, reason="no C compiler")


def _broken_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("POOT_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "csrc"
    shutil.copytree(c_kernels.SOURCE_DIR, src)
    part = src / "small_ops.c"
    part.write_text(part.read_text() + "\nvoid poot_broken(void) { int x = ; }\n")
    return src


def test_broken_source_raises_the_compiler_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = _broken_copy(tmp_path, monkeypatch)
    with pytest.raises(c_kernels.KernelBuildError) as failure:
        c_kernels.build(src)
    message = str(failure.value)
    assert "small_ops.c" in message and "error" in message
    assert not c_kernels.library_path(src).exists()


def test_broken_source_warns_once_and_gives_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loader = c_kernels.Loader(_broken_copy(tmp_path, monkeypatch))
    with pytest.warns(c_kernels.KernelBuildWarning, match=r"small_ops\.c.*error"):
        assert loader.get() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert loader.get() is None  # tried once: no second build, no second warning


def test_cache_key_follows_the_source_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POOT_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "csrc"
    shutil.copytree(c_kernels.SOURCE_DIR, src)
    before = c_kernels.library_path(src)
    assert before == c_kernels.library_path(c_kernels.SOURCE_DIR)
    (src / "common.h").write_text((src / "common.h").read_text() + "\n/* changed */\n")
    assert c_kernels.library_path(src) != before


def test_report_lists_every_kernel() -> None:
    done = subprocess.run([sys.executable, "-m", "poot_core.cpu.c_kernels"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    for name in c_kernels.SIGNATURES:
        assert f"{name}" in done.stdout
    assert "MISSING" not in done.stdout
    assert str(c_kernels.library_path()) in done.stdout
