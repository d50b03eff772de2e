"""The house rule that keeps plugins separately installable: a plugin imports poot_core's public API (the
package itself and its public subpackages errors and graph) and its own package, never another plugin; the
CUDA and ROCm backends are the one exception, wrapping the shared Triton kernels package they depend on."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers.paths import ROOT

PLUGINS = ROOT / "plugins"
PUBLIC_CORE = {"poot_core", "poot_core.errors", "poot_core.graph"}
SHARED = {"backend_cuda": {"poot_kernels_triton"}, "backend_rocm": {"poot_kernels_triton"}}


def poot_imports(source: Path) -> set[str]:
    """Every absolute import of a poot package in a module."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return {n for n in names if n.startswith("poot")}


@pytest.mark.parametrize("plugin", sorted(p.name for p in PLUGINS.iterdir() if (p / "pyproject.toml").is_file()))
def test_a_plugin_imports_only_the_public_core_and_itself(plugin: str) -> None:
    packages = [p for p in (PLUGINS / plugin).iterdir() if p.name.startswith("poot_") and (p / "__init__.py").is_file()]
    assert len(packages) == 1, packages
    own = packages[0].name
    allowed = SHARED.get(plugin, set())
    wrong = {}
    for module in packages[0].rglob("*.py"):
        for name in poot_imports(module):
            top = name.split(".")[0]
            if top == own or name in PUBLIC_CORE or top in allowed:
                continue
            wrong.setdefault(str(module.relative_to(PLUGINS)), []).append(name)
    assert not wrong, f"imports outside poot_core's public API: {wrong}"
