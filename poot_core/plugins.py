"""Plugin discovery: families and backends found through entry points at run time.

A distribution declares an entry point in the group `poot.families` or `poot.backends` that names a module
(or object) implementing the hooks below. Discovery never lets one broken plugin break the others: a plugin
that fails to import is recorded with its error and shown by `poot plugins`.

POOT_DISABLE_PLUGIN_AUTOLOAD=1 turns autoloading off; POOT_PLUGINS="name,name" (entry point names, or
distribution names) then lists the only plugins to load.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy

PROJECT = "poot"
FAMILY_GROUP = "poot.families"
BACKEND_GROUP = "poot.backends"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class PootHooks:
    """The hooks a plugin may implement. A family plugin implements `poot_register_families`, a backend
    plugin `poot_register_backends`; one module may do both."""

    @hookspec
    def poot_register_families(self) -> list[Any]:  # type: ignore[empty-body]
        """Return Family objects (see poot_core.family.Family)."""

    @hookspec
    def poot_register_backends(self) -> list[Any]:  # type: ignore[empty-body]
        """Return BackendSpec objects (see poot_core.executor.BackendSpec)."""

    @hookspec
    def poot_backend_devices(self) -> list[str]:  # type: ignore[empty-body]
        """Optional: one line per device the plugin's backend finds (platform, device, limits), shown by
        `poot plugins`; called only there, so discovery stays free of device drivers."""


def lazy_executor(module: str, name: str) -> Callable[[], Any]:
    """A BackendSpec's `open` that imports `module` and builds its executor class `name` only when the backend
    is opened, so that discovering a backend plugin imports none of its kernels."""

    def open_executor() -> Any:
        return getattr(importlib.import_module(module), name)()

    return open_executor


def quiet_probe(check: Callable[[], Any]) -> Callable[[], bool]:
    """`check` made a BackendSpec probe: its answer as a bool, and False when it raises (a missing package, a
    broken install or a failing driver all mean the device is absent; a probe never raises)."""

    @functools.wraps(check)
    def probe() -> bool:
        try:
            return bool(check())
        except Exception:
            return False

    return probe


@dataclass
class PluginRecord:
    """One discovered entry point: where it came from, and what it registered or why it failed."""

    group: str
    name: str
    distribution: str
    version: str
    error: str | None = None
    families: list[Any] = field(default_factory=list)
    backends: list[Any] = field(default_factory=list)
    devices: Callable[[], list[str]] = field(default=lambda: [], repr=False)  # poot_backend_devices, on demand


@dataclass
class Discovery:
    records: list[PluginRecord]

    def families(self) -> list[tuple[PluginRecord, Any]]:
        return [(r, f) for r in self.records for f in r.families]

    def backends(self) -> list[tuple[PluginRecord, Any]]:
        return [(r, b) for r in self.records for b in r.backends]


def _enabled_filter() -> Callable[[str, str], bool]:
    if os.environ.get("POOT_DISABLE_PLUGIN_AUTOLOAD", "") in ("", "0"):
        return lambda name, dist: True
    wanted = {w.strip() for w in os.environ.get("POOT_PLUGINS", "").split(",") if w.strip()}
    return lambda name, dist: name in wanted or dist in wanted


def _entry_points(group: str) -> list[metadata.EntryPoint]:
    return sorted(metadata.entry_points(group=group), key=lambda ep: ep.name)


def discover(extra: list[tuple[str, object]] | None = None) -> Discovery:
    """Load every enabled entry point of both groups. `extra` adds (name, plugin object) pairs in-process,
    for tests and embedding applications."""
    enabled = _enabled_filter()
    records: list[PluginRecord] = []
    for group in (FAMILY_GROUP, BACKEND_GROUP):
        for ep in _entry_points(group):
            dist = ep.dist.metadata["Name"] if ep.dist is not None else "?"
            version = ep.dist.version if ep.dist is not None else "?"
            if not enabled(ep.name, dist):
                continue
            record = PluginRecord(group, ep.name, dist, version)
            records.append(record)
            try:
                _collect(record, ep.load())
            except Exception as exc:  # a broken plugin must not break the others
                record.error = f"{type(exc).__name__}: {exc}"
    for name, plugin in extra or []:
        record = PluginRecord("in-process", name, "in-process", "-")
        records.append(record)
        _collect(record, plugin)
    return Discovery(records)


def _collect(record: PluginRecord, plugin: object) -> None:
    """Ask one plugin what it registers. A manager per plugin keeps each registration attributed to it."""
    manager = pluggy.PluginManager(PROJECT)
    manager.add_hookspecs(PootHooks)
    manager.register(plugin)
    record.families = [f for batch in manager.hook.poot_register_families() for f in batch]
    record.backends = [b for batch in manager.hook.poot_register_backends() for b in batch]
    record.devices = lambda: [line for batch in manager.hook.poot_backend_devices() for line in batch]
