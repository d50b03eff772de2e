"""Registry: architecture name -> Family, built from the installed family plugins."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from poot_core.errors import PluginError, Reason, Unsupported
from poot_core.family import Family
from poot_core.plugins import Discovery, discover


class Registry:
    def __init__(self, families: Iterable[tuple[str, Family]] = ()) -> None:
        """`families` holds (distribution name, family) pairs. Two distributions claiming one
        architecture is a PluginError naming both, never a silent override."""
        self._by_arch: dict[str, tuple[str, Family]] = {}
        self._families: list[tuple[str, Family]] = []
        for dist, family in families:
            self.add(family, dist)

    def add(self, family: Family, distribution: str = "in-process") -> None:
        for arch in family.architectures:
            owner = self._by_arch.get(arch)
            if owner is not None and owner[1] is not family:
                raise PluginError(
                    f"architecture {arch!r} is claimed by two families: {owner[1].name} ({owner[0]}) and "
                    f"{family.name} ({distribution}); uninstall one, or load plugins explicitly with "
                    "POOT_DISABLE_PLUGIN_AUTOLOAD=1 POOT_PLUGINS=..."
                )
        for arch in family.architectures:
            self._by_arch[arch] = (distribution, family)
        self._families.append((distribution, family))

    @classmethod
    def builtin(cls, discovery: Discovery | None = None) -> Registry:
        """Every family of every installed (and enabled) family plugin."""
        found = discovery or discover()
        return cls((record.distribution, family) for record, family in found.families())

    def families(self) -> list[Family]:
        return [f for _, f in self._families]

    def resolve(self, *names: Any) -> Family:
        """The family serving the first of `names` that any family claims."""
        for name in names:
            if isinstance(name, str) and name in self._by_arch:
                return self._by_arch[name][1]
        asked = next((n for n in names if n), "<none>")
        installed = ", ".join(f.name for f in self.families()) or "none"
        raise Unsupported(
            Reason.REGISTRY,
            str(asked),
            f"no installed family serves it; installed families: {installed}. {install_hint(names)}",
        )


def install_hint(names: Iterable[Any]) -> str:
    """How to install a family for `names`, the way this poot was installed: from a source checkout, the
    plugin folder(s) of the checkout whose source names the first of `names` any of them names (else all
    its family plugins)."""
    plugins = Path(__file__).resolve().parent.parent / "plugins"
    folders = [f.parent for f in sorted(plugins.glob("family_*/pyproject.toml"))]
    if not folders:
        return "Install the poot family plugin that serves this architecture (`poot plugins` lists those installed)"
    sources = {folder: " ".join(src.read_text(encoding="utf-8", errors="replace") for src in folder.rglob("*.py"))
               for folder in folders}
    serving: list[Path] = []
    for name in names:
        if isinstance(name, str) and name and not serving:
            serving = [folder for folder in folders if f'"{name}"' in sources[folder]]
    return "Install it from this checkout: " + " or ".join(f"pip install {folder}" for folder in serving or folders)
