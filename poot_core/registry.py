"""Registry: architecture name -> Family, built from the installed family plugins."""

from __future__ import annotations

from collections.abc import Iterable
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
            f"no installed family serves it; installed families: {installed}. "
            "Install the family plugin that serves this architecture (e.g. pip install poot-family-llama)",
        )
