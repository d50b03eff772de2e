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

A decoder that ends in a clean-up of spaces (llama.cpp's GGUF BPE and WordPiece tokenizers: Replace " ." -> "."
and the like after the tokens are joined) changes text across tokens: " '" then "s" gives "'s", so a shown
space can be taken back. There the window decodes without the clean-up (the raw text, prefix-stable as above)
and `SpaceCleanup` shows the raw text cleaned up to the last point no later text can change, holding the rest
until the next piece (or flush) decides it. The clean-up starts afresh at the first generated character: the
prompt's text is not the stream's to change.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from tokenizers import decoders

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


JOINS = {"ByteLevel", "Fuse"}  # decoders that make one text of all the tokens: a Replace after them sees it whole


def split_cleanup(decoder: Any) -> tuple[Any, list[tuple[str, str]]]:
    """(the decoder without its clean-up, the clean-up's (old, new) string replacements in order): the clean-up
    is the Replace steps that end a Sequence after its last joining step. ([] and the decoder when none.)"""
    if decoder is None:
        return decoder, []
    state = json.loads(decoder.__getstate__())
    chain = state.get("decoders", []) if state.get("type") == "Sequence" else []
    joins = [i for i, step in enumerate(chain) if step.get("type") in JOINS]
    tail = chain[joins[-1] + 1 :] if joins else []
    pairs = [(step.get("pattern", {}).get("String"), step.get("content")) for step in tail]
    if not tail or any(s.get("type") != "Replace" or not isinstance(o, str) or not isinstance(n, str)
                       for s, (o, n) in zip(tail, pairs, strict=True)):
        return decoder, []
    head = decoders.Sequence([])
    head.__setstate__(json.dumps({"type": "Sequence", "decoders": chain[: joins[-1] + 1]}).encode())
    return head, pairs  # type: ignore[return-value]


class SpaceCleanup:
    """A decoder's trailing string replacements, applied to a stream's raw text as it grows.

    split(raw) cuts raw text where the clean-up of the whole text is the clean-up of the part before the cut
    followed by that of the rest, whatever comes later: a cut is such a point when, at every replacement step
    (applied in order to the part before it), that part does not end in a proper prefix of the step's pattern
    (no match of the step can then reach across the cut). Sound for any string patterns; cuts are tried at the
    end, then before each of the last characters (a held tail is a few characters: patterns are short).
    """

    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        self._steps = [(old, new, tuple(old[:k] for k in range(1, len(old)))) for old, new in pairs if old]
        self._any = re.compile("|".join(re.escape(old) for old, _, _ in self._steps))
        self._heads = tuple({h for _, _, heads in self._steps for h in heads})

    def apply(self, text: str) -> str:
        for old, new, _ in self._steps:
            text = text.replace(old, new)
        return text

    def _before(self, text: str) -> str | None:
        """The clean-up of `text` when the end of `text` is a cut (see the class note), else None."""
        for old, new, heads in self._steps:
            if text.endswith(heads):
                return None
            text = text.replace(old, new)
        return text

    def split(self, raw: str) -> tuple[str, str]:
        """(the cleaned text of raw up to the last cut, the raw text after it, held)."""
        if not raw.endswith(self._heads) and self._any.search(raw) is None:
            return raw, ""  # no step changes raw, and no step's pattern can start at its end
        for n in range(len(raw), -1, -1):  # the held tail is short: a cut comes within a few characters
            shown = self._before(raw[:n])
            if shown is not None:
                return shown, raw[n:]
        return "", raw  # not reached: n == 0 is a cut


class WindowDecoder:
    """Decodes the short id windows of every stream of one tokenizer; the decode of a single id is kept."""

    def __init__(self, decode: Callable[..., str], size: int, byte_level: bool = False,
                 cleanup: SpaceCleanup | None = None) -> None:
        self._decode = decode  # tokenizers.Tokenizer.decode, or raw_decode(its decoder without the clean-up)
        self.size = size
        self.byte_level = byte_level  # byte_level_only(the decoder decode uses)
        self.cleanup = cleanup  # the clean-up decode leaves out, applied by the streams
        self._single: dict[int, str] = {}  # id -> its decode alone (at most the vocabulary's size)

    @classmethod
    def of(cls, tokenizer: Any, size: int) -> WindowDecoder:
        """The window decoder of a tokenizers.Tokenizer: with its clean-up of spaces split off, when it has one."""
        head, pairs = split_cleanup(tokenizer.decoder)
        if not pairs:
            return cls(tokenizer.decode, size, byte_level_only(tokenizer.decoder))
        tokens: dict[int, str] = {}

        def raw_decode(ids: list[int], skip_special_tokens: bool = False) -> str:
            # Tokenizer.decode (no tokens skipped) is the decoder over the ids' tokens, added ones included
            names = [tokens.get(i) or tokens.setdefault(i, tokenizer.id_to_token(i)) for i in ids]
            return head.decode(names)

        return cls(raw_decode, size, byte_level_only(head), SpaceCleanup(pairs))

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
        self._held = ""  # raw text the clean-up may still change (decoders with a clean-up only)

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
            if window.cleanup is not None:
                shown, self._held = window.cleanup.split(self._held + added)
                return shown
            return added
        return ""

    def release(self) -> str:
        """At an end of sequence: the text held only for the clean-up of spaces (whole characters), cleaned up as
        the full decode has it; an incomplete character still waiting stays hidden, as before."""
        cleanup = self._window.cleanup
        if cleanup is None or not self._held:
            return ""
        text, self._held = cleanup.apply(self._held), ""
        return text

    def flush(self) -> str:
        """What is still held back at the end of generation (an incomplete character stays visible)."""
        before = self._text_before()
        now = self._window.decode(self._ids[self._prefix :])
        del self._ids[:]
        self._prefix = self._read = 0
        self._before = None
        tail = now[len(before) :]
        cleanup = self._window.cleanup
        if cleanup is not None:
            tail, self._held = cleanup.apply(self._held + tail), ""
        return tail
