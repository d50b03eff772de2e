"""Streaming detokenization (poot_core/text/incremental.py) against two references, for every tokenizer kind
the tests build: llama.cpp's vocab files (sentencepiece with byte fallback, GPT-2 byte-level BPE with and
without the space clean-up, WordPiece), SmolLM2's GGUF tokenizer and the tiny byte-level BPE of tests/helpers.

- the pieces, push by push and the flushed tail, equal the windowed decode the engine used before (two checked
  decodes a token, written out below as the reference), for decoders without a clean-up of spaces;
- the pieces joined up to every token are a prefix of the tokenizer's own full decode of all the ids (after the
  same context) and of the ids up to that token, and with the tail they equal the full decode. Not where the
  ids hold a byte-fallback run that is not valid UTF-8: tokenizers' ByteFallback turns every byte of such a run
  into U+FFFD once its end is seen, while a stream has already shown the bytes that decoded alone (as before,
  and as vLLM's incremental detokenizer); nor where the context ends inside a character (its decode then ends
  in U+FFFD that the ids after it mend). Decoders with llama.cpp's clean-up of spaces (CLEANUP below) hold text
  a later token can change, and their pieces joined equal the decode of the generated ids alone as well (the
  clean-up does not reach back into the prompt's text, so where it would, that is the full decode compared).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable

import pytest

from helpers import smollm
from helpers.paths import TESTDATA, fetched
from helpers.tiny import CORPUS, train_tokenizer
from poot_core.checkpoint.gguf_file import GGUFFile
from poot_core.errors import RequestError
from poot_core.text.gguf_vocab import vocabulary_from_gguf
from poot_core.text.services import TextServices
from poot_core.text.vocab import Vocabulary

VOCAB_DIR = fetched(TESTDATA / "llama.cpp" / "vocab")
# one file of each decoder chain (the large vocabularies of the same kinds take seconds to build each)
GGUF_VOCABS = ["llama-spm", "phi-3", "baichuan", "gpt-2", "mpt", "deepseek-coder", "bert-bge"]
KINDS = [*GGUF_VOCABS, "smollm2", "tiny-bpe"]
# decoders with llama.cpp's clean-up of spaces (" '" + "s" -> "'s"): the pre-tokenizers llama.cpp cleans up for
CLEANUP = {"gpt-2", "mpt", "bert-bge"}
TEXTS = [*smollm.PROMPTS, *CORPUS, "東京🙂 naïve café — ½ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "  two  spaces\n\ttab ", "한국어 текст עברית",
         "emoji 👩‍👩‍👧 flags 🇫🇷 and a lone é"]


@functools.cache
def _services(kind: str) -> TextServices:
    if kind == "tiny-bpe":
        return TextServices(Vocabulary(tokenizer=train_tokenizer()))
    path = smollm.gguf_path() if kind == "smollm2" else VOCAB_DIR / f"ggml-vocab-{kind}.gguf"
    return TextServices(vocabulary_from_gguf(dict(GGUFFile.open(path).metadata), path.name))


def _reference_stream(decode: Callable[[list[int]], str], context: list[int], ids: list[int]) -> list[str]:
    """The windowed decode as the engine ran it before: both windows decoded at every token."""
    window, prefix, read = list(context)[-4:], 0, len(context[-4:])
    pieces = []
    for token in ids:
        window.append(token)
        before, now = decode(window[prefix:read]), decode(window[prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            prefix, read = read, len(window)
            pieces.append(now[len(before) :])
        else:
            pieces.append("")
    before, now = decode(window[prefix:read]), decode(window[prefix:])
    return [*pieces, now[len(before) :]]


def _cases(services: TextServices, seed: int) -> list[tuple[list[int], list[int]]]:
    """(context, generated ids): uniformly random ids, runs of byte-fallback, special and added ids, and the
    ids of real texts (multi-byte characters split across tokens), each after a random context."""
    rng = random.Random(seed)
    size = services.vocab_size()
    tok = services.tokenizer
    vocab = tok.get_vocab(with_added_tokens=True)
    byte_ids = [i for t, i in vocab.items() if t.startswith("<0x") and t.endswith(">")]
    special = [i for i, t in tok.get_added_tokens_decoder().items()] or [0]
    cases = []
    for _ in range(120):
        context = [rng.randrange(size) for _ in range(rng.randrange(0, 7))]
        cases.append((context, [rng.randrange(size) for _ in range(rng.randrange(1, 24))]))
    for _ in range(40):
        pool = (byte_ids or list(range(min(size, 300)))) + special
        cases.append(([rng.randrange(size)], [rng.choice(pool) for _ in range(rng.randrange(1, 16))]))
    for text in TEXTS:
        ids = services.encode(text, add_special=False)
        cut = rng.randrange(len(ids) + 1)
        cases.append((ids[:cut], ids[cut:] or ids))
        cases.append(([], ids))
        mixed = list(ids)
        mixed.insert(rng.randrange(len(mixed) + 1), rng.choice(special))
        cases.append((ids[: rng.randrange(len(ids) + 1)], mixed))
    return cases


@pytest.mark.parametrize("kind", KINDS)
def test_stream_equals_the_windowed_reference_and_the_full_decode(kind: str) -> None:
    services = _services(kind)
    for context, ids in _cases(services, seed=len(kind)):
        stream = services.stream(context)
        pieces = [stream.push(token) for token in ids] + [stream.flush()]
        if kind not in CLEANUP:
            assert pieces == _reference_stream(services.decode, context, ids), (kind, context, ids)
        window = context[-4:]
        head = services.decode(window)
        final = services.decode(window + ids)
        if "\ufffd" in head + final + services.decode(ids):
            continue  # an invalid byte run, or a context cut inside a character: see the module's note
        if kind in CLEANUP:
            assert "".join(pieces) == services.decode(ids), (kind, context, ids)
            if not final.startswith(head):  # the clean-up of the whole text reaches into the context's
                window, head, final = [], "", services.decode(ids)
        assert final.startswith(head) and head + "".join(pieces) == final, (kind, context, ids)
        for k in range(1, len(ids) + 1):
            shown = head + "".join(pieces[:k])
            assert final.startswith(shown), (kind, ids[:k])
            upto = services.decode(window + ids[:k])
            if "\ufffd" not in upto:  # a run cut short decodes as U+FFFD for all its bytes
                assert upto.startswith(shown), (kind, ids[:k])


def test_no_piece_splits_a_character_of_real_text() -> None:
    for kind in KINDS:
        services = _services(kind)
        for text in TEXTS:
            ids = services.encode(text, add_special=False)
            stream = services.stream()
            pieces = [stream.push(i) for i in ids] + [stream.flush()]
            assert "".join(pieces) == services.decode(ids), (kind, text)
            if "\ufffd" not in services.decode(ids):
                assert all("\ufffd" not in p for p in pieces), (kind, text)


def test_ids_outside_the_vocabulary_are_refused_as_a_decode_refuses_them() -> None:
    services = _services("tiny-bpe")
    size = services.vocab_size()
    with pytest.raises(RequestError, match=f"outside the vocabulary of {size}: \\[{size}\\]"):
        services.stream([1, 2]).push(size)
    with pytest.raises(RequestError, match=f"outside the vocabulary of {size}: \\[-1\\]"):
        services.stream([1, -1]).push(3)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        services.decode([1, size])


def test_the_byte_level_shortcut_is_taken_for_byte_level_decoders_only() -> None:
    """The kinds above exercise both paths of a push: a ByteLevel decoder alone (its shortcut; for the clean-up
    kinds, the decoder without its clean-up) and the rest; the clean-up is found on the kinds that have one."""
    byte_level = {kind for kind in KINDS if _services(kind)._windows.byte_level}
    assert byte_level == {"deepseek-coder", "smollm2", "tiny-bpe", "gpt-2", "mpt"}
    assert {kind for kind in KINDS if _services(kind)._windows.cleanup is not None} == CLEANUP
