"""Streaming detokenization: generated ids -> text pieces as they come, never splitting a UTF-8 character.

The serving engine pushes every generated token through one of these on its step's path, so each push must
cost little. A stream keeps a short window of recent ids between two offsets (vLLM's prefix and read offsets):
it decodes the window with and without the newest ids and emits only what they added; text that ends in an
incomplete byte sequence (the replacement character) waits for the next id. Decoding with a few ids of
context keeps tokenizers that drop a leading space at the start of a decode honest.

What makes a push cheap without changing a character of the text: a decode is a pure function of its ids, so
the decode of the window without the newest ids is kept from the push that made it, and the decode of one id
(the window after every piece that came out whole, the common case) is remembered per tokenizer. A push is
then one tokenizer decode of two ids where it used to be two decodes through the checked wrapper. A byte-level
decoder (GPT-2's, alone) decodes the bytes of all its tokens at once, replacing invalid UTF-8 by U+FFFD: after a
window whose text holds no U+FFFD (its bytes are whole characters), the decode of the window and the new ids is
that text followed by the decode of the new ids alone, so there a push decodes only the new id (remembered).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from poot_core.errors import RequestError

CONTEXT = 4  # prompt ids kept before the first generated one


def byte_level_only(decoder: Any) -> bool:
    """Whether a tokenizers decoder is ByteLevel alone (or a Sequence of just it): its decode of ids is the
    lossy UTF-8 decode of their bytes joined, so text of whole characters stays a prefix whatever follows."""
    if decoder is None:
        return False
    state = json.loads(decoder.__getstate__())
    while state.get("type") == "Sequence" and len(state.get("decoders", [])) == 1:
        state = state["decoders"][0]
    return state.get("type") == "ByteLevel"


class WindowDecoder:
    """Decodes the short id windows of every stream of one tokenizer; the decode of a single id is kept."""

    def __init__(self, decode: Callable[..., str], size: int, byte_level: bool = False) -> None:
        self._decode = decode  # tokenizers.Tokenizer.decode
        self.size = size
        self.byte_level = byte_level  # byte_level_only(the tokenizer's decoder)
        self._single: dict[int, str] = {}  # id -> its decode alone (at most the vocabulary's size)

    def check(self, ids: list[int]) -> None:
        """The error TextServices.decode gives for ids outside the vocabulary."""
        bad = [i for i in ids if not 0 <= i < self.size]
        if bad:
            raise RequestError(f"token ids outside the vocabulary of {self.size}: {bad[:5]}")

    def decode(self, window: list[int]) -> str:
        """The text of ids already checked against the vocabulary."""
        if len(window) == 1:
            token = window[0]
            text = self._single.get(token)
            if text is None:
                text = self._single[token] = self._decode(window, skip_special_tokens=False)
            return text
        return self._decode(window, skip_special_tokens=False)


class StreamDecoder:
    """One generation's pieces: push(id) gives the text that id made safe to show, flush() the held-back tail."""

    def __init__(self, window: WindowDecoder, context: list[int] | None = None) -> None:
        self._window = window
        self._ids = [int(i) for i in (context or [])[-CONTEXT:]]
        self._prefix = 0
        self._read = len(self._ids)
        self._before: str | None = None  # decode of ids[prefix:read], kept until the offsets move
        self._context_checked = False  # context ids are checked at the first decode, as a decode of them would

    def _text_before(self) -> str:
        if self._before is None:
            if not self._context_checked:
                self._window.check(self._ids[self._prefix : self._read])
                self._context_checked = True
            self._before = self._window.decode(self._ids[self._prefix : self._read])
        return self._before

    def push(self, token_id: int) -> str:
        token_id = int(token_id)
        ids = self._ids
        ids.append(token_id)
        before = self._text_before()
        window = self._window
        if not 0 <= token_id < window.size:
            window.check([token_id])
        if window.byte_level and "\ufffd" not in before:
            added = window.decode(ids[self._read :])  # now == before + added (module note)
        else:
            added = window.decode(ids[self._prefix :])[len(before) :]
        if added and not added.endswith("\ufffd"):
            # ids before the new prefix are never read again
            del ids[: self._read]
            self._prefix, self._read = 0, len(ids)
            self._before = None
            return added
        return ""

    def flush(self) -> str:
        """What is still held back at the end of generation (an incomplete character stays visible)."""
        before = self._text_before()
        now = self._window.decode(self._ids[self._prefix :])
        del self._ids[:]
        self._prefix = self._read = 0
        self._before = None
        return now[len(before) :]
