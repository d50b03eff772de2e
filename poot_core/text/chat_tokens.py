"""Tokenizing a rendered chat: the ids of a RenderedChat's segments, with a control token spelled inside a
message read as plain text (a message cannot open a turn).

Rendering (poot_core.text.chat) says which parts of the prompt came from messages; this module turns those
segments into ids without ever changing the shared tokenizer's settings.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

import tokenizers

if TYPE_CHECKING:
    from poot_core.text.chat import Segments


def encode_segments(
    tokenizer: tokenizers.Tokenizer, segments: Segments, control_tokens: Iterable[str] | None = None
) -> list[int]:
    """Ids of a rendered chat: control tokens the template wrote become their ids; a control token spelled inside
    a message is tokenized as plain text. No BOS/EOS is added (no post-processor specials).

    Control tokens are the tokenizer's special added tokens, the other added tokens the template itself wrote in
    this chat, and `control_tokens`. Message text is cut only around a control spelling, never at the border
    between template and message text: ordinary messages tokenize exactly as the whole text does (BPE merges
    across a border, such as a space the template writes before the content, are kept). Each piece after a cut is
    encoded behind a line break that is then removed, so a SentencePiece-style tokenizer does not add the prefix
    space it adds at the start of a string; a cut text thus tokenizes as it would next to a real control token.
    """
    added = tokenizer.get_added_tokens_decoder()
    template_text = "\0".join(piece for piece, from_message in segments if not from_message)
    control = {t.content for t in added.values() if t.special}
    control |= {t.content for t in added.values() if t.content in template_text}
    control |= set(control_tokens or ())
    control = {c for c in control if c and not c.isspace()}
    added_ids = set(added)
    pattern = re.compile("|".join(map(re.escape, sorted(control, key=len, reverse=True)))) if control else None

    # [(text, plain)]: runs of text tokenized normally, and control spellings from messages tokenized as plain.
    pieces: list[tuple[str, bool]] = []
    run: list[str] = []
    for piece, from_message in segments:
        if not from_message or pattern is None:
            run.append(piece)
            continue
        last = 0
        for match in pattern.finditer(piece):
            run.append(piece[last : match.start()])
            pieces.append(("".join(run), False))
            pieces.append((match.group(), True))
            run, last = [], match.end()
        run.append(piece[last:])
    pieces.append(("".join(run), False))

    modes = _modes(tokenizer)
    newline = modes[False].encode("\n", add_special_tokens=False).ids
    ids: list[int] = []
    for i, (piece, plain) in enumerate(pieces):
        if piece:
            ids.extend(_encode_piece(modes, piece, plain, i > 0, newline, added_ids))
    return ids


_MODES: weakref.WeakKeyDictionary[tokenizers.Tokenizer, dict[bool, tokenizers.Tokenizer]] = (
    weakref.WeakKeyDictionary()
)
_MODES_LOCK = threading.Lock()


def _modes(tokenizer: tokenizers.Tokenizer) -> dict[bool, tokenizers.Tokenizer]:
    """Two private copies of a tokenizer: {False: special tokens match as usual, True: they read as text}.
    Copies, made once per tokenizer, so the shared one is never changed while another thread encodes with it."""
    with _MODES_LOCK:
        modes = _MODES.get(tokenizer)
        if modes is None:
            modes = {}
            for plain in (False, True):
                copy = tokenizers.Tokenizer.from_str(tokenizer.to_str())
                copy.encode_special_tokens = plain
                modes[plain] = copy
            _MODES[tokenizer] = modes
        return modes


def _encode_piece(
    modes: dict[bool, tokenizers.Tokenizer], piece: str, plain: bool, inside: bool, newline: list[int],
    added_ids: set[int]
) -> list[int]:
    tokenizer = modes[plain]
    ids: list[int] | None = None
    if inside and newline:
        behind = tokenizer.encode("\n" + piece, add_special_tokens=False).ids
        if behind[: len(newline)] == newline:
            ids = behind[len(newline) :]
    if ids is None:
        ids = tokenizer.encode(piece, add_special_tokens=False).ids
    if plain and len(piece) > 1 and any(i in added_ids for i in ids):
        # encode_special_tokens only unmatches *special* added tokens; a non-special one (say "<think>") still
        # matches, so cut the spelling until no added token can form.
        return _encode_piece(modes, piece[:1], True, inside, newline, added_ids) + _encode_piece(
            modes, piece[1:], True, True, newline, added_ids
        )
    return ids
