"""Streaming detokenization over decoders with llama.cpp's clean-up of spaces (" 's" -> "'s", " ." -> ".",
" ' " -> "'"): a later token changes text before it, so the stream holds what the clean-up may still change.

The reference is the tokenizer's own decode of all the ids (the clean-up llama.cpp's detokenizer applies, built
by poot_core.text.gguf_vocab from llama.cpp's vocab files): the pieces joined equal it, every text shown is a
prefix of it, a stop string is found where it first occurs in it, and the Driver's Generation.text equals it.
"""

from __future__ import annotations

import functools
import random
from typing import Any

import pytest
import torch

from helpers.paths import TESTDATA, fetched
from poot_core import Driver, DriverOptions, GenerateRequest, Layout, ModelHandle, Sampler, open_executor
from poot_core.checkpoint.gguf_file import GGUFFile
from poot_core.driver.engine import FinishedEvent
from poot_core.driver.stops import StopMatcher
from poot_core.text.gguf_vocab import vocabulary_from_gguf
from poot_core.text.services import TextServices

VOCAB_DIR = fetched(TESTDATA / "llama.cpp" / "vocab")
# a byte-level BPE (GPT-2), Llama 3's byte-level BPE and a WordPiece (BERT): the joining steps the clean-up follows
KINDS = ["gpt-2", "llama-bpe", "bert-bge"]
EXAMPLES = ["It 's", "say ' hi", "don 't", "a , b .", "I 'm sure you 're right , it 've been .", "why ?", "no !",
            "x  ' re", "a ' ?", "tail ' ", "end  ", "it ' s"]


@functools.cache
def _services(kind: str) -> TextServices:
    path = VOCAB_DIR / f"ggml-vocab-{kind}.gguf"
    return TextServices(vocabulary_from_gguf(dict(GGUFFile.open(path).metadata), path.name))


def _pieces(services: TextServices, ids: list[int], context: list[int] | None = None) -> list[str]:
    stream = services.stream(context)
    return [stream.push(i) for i in ids] + [stream.flush()]


def _one_by_one(services: TextServices, ids: list[int]) -> str:
    return "".join(services.decode([i]) for i in ids)


@pytest.mark.parametrize("kind", KINDS)
def test_examples_stream_as_the_full_decode(kind: str) -> None:
    services = _services(kind)
    changed = 0
    for text in EXAMPLES:
        ids = services.encode(text, add_special=False)
        final = services.decode(ids)
        pieces = _pieces(services, ids)
        assert "".join(pieces) == final, (kind, text, pieces)
        for k in range(len(pieces)):
            assert final.startswith("".join(pieces[:k])), (kind, text, pieces)
        changed += final != _one_by_one(services, ids)  # the clean-up reached across tokens
    assert changed >= 6, kind  # the examples exercise the clean-up (the old windowed decode lost text there)


@pytest.mark.parametrize("kind", KINDS)
def test_random_ids_of_clean_up_characters(kind: str) -> None:
    """Runs of the tokens the patterns are made of, after a context: every order of them."""
    services = _services(kind)
    tok = services.tokenizer
    pool = sorted({i for piece in (" ", "'", "s", "m", "re", "ve", ".", ",", "?", "!", " '", " .", "a", " a", " s")
                   for i in tok.encode(piece, add_special_tokens=False).ids})
    rng = random.Random(5)
    for _ in range(300):
        ids = [rng.choice(pool) for _ in range(rng.randrange(1, 14))]
        context = [rng.choice(pool) for _ in range(rng.randrange(0, 3))]
        final = services.decode(ids)
        pieces = _pieces(services, ids, context)
        assert "".join(pieces) == final, (kind, context, ids, pieces)
        for k in range(len(pieces)):
            assert final.startswith("".join(pieces[:k])), (kind, ids, pieces)


@pytest.mark.parametrize("kind", ["gpt-2", "bert-bge"])
def test_a_stop_string_over_held_text_is_found_where_the_full_text_has_it(kind: str) -> None:
    services = _services(kind)
    for text, stop in [("It 's over , done .", "'s"), ("say ' hi ' now", "'hi"), ("a , b . c", "b."),
                       ("one , two , three", ", t"), ("why ? no", "y?"), ("It 's", "t's"), ("x ' re y", "'re")]:
        ids = services.encode(text, add_special=False)
        full = services.decode(ids)
        at = full.find(stop)
        assert at >= 0, (text, full)
        stream, matcher = services.stream(), StopMatcher([stop])
        shown, hit = "", False
        for i in ids:
            emit, hit = matcher.push(stream.push(i))
            shown += emit
            if hit:
                break
        if not hit:  # the stop string lies in the text held to the end: the driver's flush finds it
            emit, hit = matcher.push(stream.flush())
            shown += emit
        assert hit and shown == full[:at], (kind, text, stop, shown)


def test_driver_text_equals_the_decode_of_its_tokens(tiny_checkpoint) -> None:
    """A tiny model read through GPT-2's GGUF vocabulary (its ids below 256 are single bytes), sampling pushed
    towards the clean-up's characters: Generation.text and the streamed pieces equal the decode of the tokens."""
    services = _services("gpt-2")
    tiny = ModelHandle.load(tiny_checkpoint("llama", torch.float32))
    handle = ModelHandle(tiny.path, tiny.family, tiny.config(), services, tiny.store(), tiny.files_read)
    driver = Driver(handle, open_executor("cpu"), DriverOptions(capacity=96, prefill_chunk=8)).serve()
    bias = {i: 40.0 for i in (services.tokenizer.token_to_id(t) for t in ["Ġ", "'", "s", ".", ",", "a", "?"])}
    prompt = [services.tokenizer.token_to_id(t) for t in ["I", "t"]]
    assert all(i < 256 for i in [*bias, *prompt])
    changed = 0
    for seed in range(4):
        pieces: list[str] = []
        sampler = Sampler(temperature=1.0, seed=seed, logit_bias=bias)
        result = driver.generate(GenerateRequest(prompt, max_new=32, sampler=sampler, ignore_eos=True),
                                 lambda t, p, pieces=pieces: pieces.append(p))
        final = services.decode(result.tokens)
        assert result.text == "".join(pieces) == final, (result.tokens, pieces)
        changed += final != _one_by_one(services, result.tokens)
    assert changed == 4


def _gpt2_driver_and_engine(tiny_checkpoint) -> tuple[TextServices, Driver, Any, int]:
    """A tiny llama read through GPT-2's GGUF vocabulary: its services, a Driver, a serving engine, its eos id."""
    services = _services("gpt-2")
    tiny = ModelHandle.load(tiny_checkpoint("llama", torch.float32))
    handle = ModelHandle(tiny.path, tiny.family, tiny.config(), services, tiny.store(), tiny.files_read)
    options = DriverOptions(capacity=96, prefill_chunk=8)
    driver = Driver(handle, open_executor("cpu"), options).serve()
    engine = Driver(handle, open_executor("cpu"), options).serve(Layout.PAGED)
    return services, driver, engine, tiny.config().eos_ids[0]


def test_driver_text_at_end_of_sequence_keeps_the_held_text(tiny_checkpoint) -> None:
    """Replies that end in text the clean-up could still have changed (" '", a space) before the model's
    end-of-sequence id (the tiny config's, a byte of GPT-2's vocabulary): the text is the decode of the rest."""
    services, driver, engine, eos = _gpt2_driver_and_engine(tiny_checkpoint)
    bias = {services.tokenizer.token_to_id("Ġ"): 40.0, services.tokenizer.token_to_id("'"): 40.0, eos: 39.0}
    held_at_end = 0
    for seed in range(8):
        sampler = Sampler(temperature=1.0, seed=seed, logit_bias=bias)
        result = driver.generate(GenerateRequest([services.tokenizer.token_to_id("I")], max_new=24, sampler=sampler))
        if result.stop_reason != "eos":
            continue
        final = services.decode(result.tokens[:-1])
        assert result.text == final, (result.tokens, result.text)
        held_at_end += final.endswith((" ", " '"))
        engine.submit(GenerateRequest([services.tokenizer.token_to_id("I")], max_new=24, sampler=sampler))
        done = [e for _ in range(60) for e in engine.step() if isinstance(e, FinishedEvent)]
        assert len(done) == 1
        if done[0].reason == "eos":  # the engine's sampling draws its own numbers: its own tokens, decoded
            tokens = done[0].generation.tokens
            assert done[0].generation.text == services.decode(tokens[:-1]), tokens
            held_at_end += services.decode(tokens[:-1]).endswith((" ", " '"))
    assert held_at_end >= 4


def test_a_stop_strings_start_held_at_end_of_sequence_is_part_of_the_reply(tiny_checkpoint) -> None:
    """A reply that ends in the start of a stop string ("'" of "'#") and then the model's end-of-sequence id: the
    stop string never completed, so the held "'" is text of the reply (the decode of every token but the last),
    in the Driver and in the serving engine."""
    services, driver, engine, eos = _gpt2_driver_and_engine(tiny_checkpoint)
    bias = {services.tokenizer.token_to_id("a"): 40.0, services.tokenizer.token_to_id("'"): 40.0, eos: 40.0}
    prompt = [services.tokenizer.token_to_id("I")]
    ends_held = 0
    for seed in range(8):
        sampler = Sampler(temperature=1.0, seed=seed, logit_bias=bias)
        request = GenerateRequest(prompt, max_new=24, sampler=sampler, stops=["'#"])
        result = driver.generate(request)
        engine.submit(request)
        done = [e for _ in range(60) for e in engine.step() if isinstance(e, FinishedEvent)]
        assert len(done) == 1
        for reason, tokens, text in ((result.stop_reason, result.tokens, result.text),
                                     (done[0].reason, done[0].generation.tokens, done[0].generation.text)):
            if reason == "eos":
                assert text == services.decode(tokens[:-1]), tokens
                ends_held += text.endswith("'")
    assert ends_held >= 2
