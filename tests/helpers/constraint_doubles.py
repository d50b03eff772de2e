"""A test double for one request's llguidance matcher (poot_core.driver.constraints.Matcher holds it): the real
matcher for a few tokens, then a failure, so that a test sees what the engine and the server do when a
constraint stops allowing any token or its library raises mid-generation."""

from __future__ import annotations

from typing import Any

HOWS = ("empty", "mask", "consume")


class DeadEnd:
    """The real matcher for `after` tokens, then it fails as `how` says: "empty" (a mask that allows no token),
    "mask" (computing the mask raises) or "consume" (taking the next token raises). llguidance's batch of masks
    takes only its own matchers, so a batch holding a DeadEnd fails and each matcher's mask is computed alone, as
    after any failure of a batch (constraints.Matcher._settle)."""

    def __init__(self, real: Any, after: int, how: str) -> None:
        if how not in HOWS:
            raise ValueError(f"how must be one of {HOWS}, got {how!r}")
        self._real, self.after, self.how, self.consumed = real, after, how, 0

    def compute_bitmask(self) -> Any:
        bits = self._real.compute_bitmask()
        if self.consumed >= self.after:
            if self.how == "empty":
                return bytes(len(bits))
            if self.how == "mask":
                raise RuntimeError("the mask could not be computed")
        return bits

    def consume_token(self, token: int) -> bool:
        if self.how == "consume" and self.consumed >= self.after:
            raise RuntimeError("the matcher broke")
        self.consumed += 1
        return self._real.consume_token(token)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def fail_after(matcher: Any, after: int, how: str) -> Any:
    """`matcher` (a poot Matcher, or None) with its library matcher replaced by a DeadEnd; returned for chaining."""
    if matcher is not None:
        matcher._m = DeadEnd(matcher._m, after, how)
    return matcher
