"""API keys, tenants and their limits (`--api-keys FILE`).

The file has one key per line, `#` starts a comment:

    KEY TENANT [rpm=N] [tpm=N] [running=N] [priority=N]

KEY is the key itself or `sha256:<hex digest of the key>` (so the file need not hold the secret). Only
digests are kept in memory; a presented key is digested and compared with every stored digest in constant
time (hmac.compare_digest, no early exit), so timing tells nothing about which bytes matched. Several keys may
name one tenant; a tenant's limits are the ones on its first line that gives any.

Limits: rpm, requests accepted per minute; tpm, prompt plus generated tokens per minute; running, requests
in flight at once; priority, the engine's scheduling priority (higher first). A request over a limit is a
429 with Retry-After, checked before it reaches the engine, so it costs the other tenants nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from poot_core.errors import RequestError

LIMIT_KEYS = ("rpm", "tpm", "running", "priority")
WINDOW = 60.0


@dataclass(frozen=True)
class Tenant:
    name: str
    rpm: int | None = None
    tpm: int | None = None
    running: int | None = None
    priority: int = 0

    @property
    def salt(self) -> str:
        """The prefix-cache salt of this tenant's requests: tenants never share KV blocks."""
        return f"tenant:{self.name}"


DEFAULT = Tenant("default")


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeyRing:
    def __init__(self, entries: list[tuple[bytes, Tenant]]) -> None:
        if not entries:
            raise RequestError("the API key file names no keys")
        self._entries = entries

    @classmethod
    def load(cls, path: str | Path) -> KeyRing:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise RequestError(f"cannot read the API key file {path}: {exc.strerror}") from exc
        tenants: dict[str, Tenant] = {}
        keys: list[tuple[bytes, str]] = []
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            words = line.split()
            if len(words) < 2:
                raise RequestError(f"{path}:{number}: expected `KEY TENANT [rpm=N] [tpm=N] [running=N] "
                                   "[priority=N]`")
            key, name, options = words[0], words[1], words[2:]
            limits = _limits(options, f"{path}:{number}")
            if name not in tenants or (limits and tenants[name] == Tenant(name)):
                tenants[name] = Tenant(name, **limits)
            keys.append((_stored_digest(key, f"{path}:{number}"), name))
        return cls([(d, tenants[name]) for d, name in keys])

    def tenant(self, presented: str | None) -> Tenant | None:
        """The tenant of a presented key, or None; the time taken does not depend on the key's bytes."""
        probe = digest(presented or "")
        found: Tenant | None = None
        for stored, tenant in self._entries:
            if hmac.compare_digest(stored, probe) and presented:
                found = tenant
        return found

    @property
    def tenants(self) -> list[Tenant]:
        return list({t.name: t for _, t in self._entries}.values())


def _stored_digest(key: str, where: str) -> bytes:
    if key.startswith("sha256:"):
        try:
            value = bytes.fromhex(key.removeprefix("sha256:"))
        except ValueError as exc:
            raise RequestError(f"{where}: sha256: must be followed by 64 hex digits") from exc
        if len(value) != 32:
            raise RequestError(f"{where}: sha256: must be followed by 64 hex digits")
        return value
    return digest(key)


def _limits(options: list[str], where: str) -> dict[str, int]:
    limits: dict[str, int] = {}
    for option in options:
        name, _, value = option.partition("=")
        if name not in LIMIT_KEYS or not value:
            raise RequestError(f"{where}: unknown option {option!r}; options: " +
                               ", ".join(f"{k}=N" for k in LIMIT_KEYS))
        try:
            number = int(value)
        except ValueError as exc:
            raise RequestError(f"{where}: {name} must be an integer, got {value!r}") from exc
        if name != "priority" and number < 1:
            raise RequestError(f"{where}: {name} must be at least 1, got {number}")
        limits[name] = number
    return limits


class OverLimit(Exception):
    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = max(1, math.ceil(retry_after))


@dataclass
class _Usage:
    requests: deque[float] = field(default_factory=deque)
    tokens: deque[tuple[float, int]] = field(default_factory=deque)
    token_sum: int = 0
    running: int = 0


class Limiter:
    """Per-tenant counters; `admit` either takes a slot for `count` requests or raises OverLimit."""

    def __init__(self, clock=time.monotonic) -> None:
        self._usage: dict[str, _Usage] = {}
        self._lock = threading.Lock()
        self._clock = clock

    def _trim(self, usage: _Usage, now: float) -> None:
        while usage.requests and usage.requests[0] <= now - WINDOW:
            usage.requests.popleft()
        while usage.tokens and usage.tokens[0][0] <= now - WINDOW:
            usage.token_sum -= usage.tokens.popleft()[1]

    def admit(self, tenant: Tenant, count: int) -> None:
        now = self._clock()
        with self._lock:
            usage = self._usage.setdefault(tenant.name, _Usage())
            self._trim(usage, now)
            if tenant.running is not None and usage.running + count > tenant.running:
                raise OverLimit(f"tenant {tenant.name!r} has {usage.running} requests running, its limit is "
                                f"{tenant.running}", 1)
            if tenant.rpm is not None and len(usage.requests) + count > tenant.rpm:
                wait = usage.requests[0] + WINDOW - now if usage.requests else WINDOW
                raise OverLimit(f"tenant {tenant.name!r} is at its limit of {tenant.rpm} requests per minute", wait)
            if tenant.tpm is not None and usage.token_sum >= tenant.tpm:
                wait = usage.tokens[0][0] + WINDOW - now if usage.tokens else WINDOW
                raise OverLimit(f"tenant {tenant.name!r} is at its limit of {tenant.tpm} tokens per minute", wait)
            usage.running += count
            usage.requests.extend([now] * count)

    def count_tokens(self, tenant: Tenant, tokens: int) -> None:
        if tokens <= 0:
            return
        with self._lock:
            usage = self._usage.setdefault(tenant.name, _Usage())
            usage.tokens.append((self._clock(), tokens))
            usage.token_sum += tokens

    def release(self, tenant: Tenant, count: int = 1) -> None:
        with self._lock:
            usage = self._usage.setdefault(tenant.name, _Usage())
            usage.running = max(usage.running - count, 0)

    def running(self, tenant: Tenant) -> int:
        with self._lock:
            usage = self._usage.get(tenant.name)
            return usage.running if usage else 0
