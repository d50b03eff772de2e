"""`poot plugins`: every discovered family and backend, with its distribution and version; a broken
plugin is shown with its error instead of breaking the listing."""

from __future__ import annotations

import argparse
import json

from poot_core.executor import _safe_probe
from poot_core.plugins import discover


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plugins", help="list installed model families and backends")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=run)


def _devices(record: object) -> list[str]:
    try:
        return list(record.devices())  # type: ignore[attr-defined]
    except Exception as exc:  # a broken device listing must not break the others
        return [f"(listing failed: {type(exc).__name__}: {exc})"]


def run(args: argparse.Namespace) -> int:
    found = discover()
    rows = []
    for record in found.records:
        entry = {"group": record.group, "name": record.name, "distribution": record.distribution,
                 "version": record.version, "error": record.error,
                 "families": [{"name": f.name, "architectures": list(f.architectures)} for f in record.families],
                 "backends": [{"name": b.name, "aliases": list(b.aliases), "priority": b.priority,
                               "device_present": _safe_probe(b)} for b in record.backends]}
        entry["devices"] = _devices(record) if record.backends else []
        rows.append(entry)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for e in rows:
        head = f"{e['group']:<14} {e['name']:<12} {e['distribution']} {e['version']}"
        if e["error"]:
            print(f"{head}  BROKEN: {e['error']}")
            continue
        print(head)
        for f in e["families"]:
            print(f"    family  {f['name']}: {', '.join(f['architectures'])}")
        for b in e["backends"]:
            state = "device present" if b["device_present"] else "device absent"
            aliases = f" (also {', '.join(b['aliases'])})" if b["aliases"] else ""
            print(f"    backend {b['name']}{aliases}: {state}, priority {b['priority']}")
        for line in e["devices"]:
            print(f"        device {line}")
    return 0
