"""Stop strings over a stream of text pieces: no partial stop string ever leaks into the output.

Text that could still become the start of a stop string is held back until the next piece decides it.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str] | tuple[str, ...]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""

    def push(self, piece: str) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop string was reached)."""
        text = self._held + piece
        hits = [(text.find(s), s) for s in self.stops if s in text]
        if hits:
            at = min(i for i, _ in hits)
            self._held = ""
            return text[:at], True
        keep = 0
        for s in self.stops:  # the longest tail of `text` that begins some stop string
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if s.startswith(text[-n:]):
                    keep = max(keep, n)
                    break
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
