"""Build a `Vocabulary` from GGUF tokenizer metadata, giving the same ids as llama.cpp.

The GGUF file carries the vocabulary as `tokenizer.ggml.*` keys (token texts, scores, token types, BPE
merges, special ids and flags). This module turns them into a Hugging Face `tokenizers.Tokenizer` whose
encode matches llama.cpp's `llama_tokenize` and whose decode matches llama.cpp's detokenizer:

- `llama` (SentencePiece-style BPE over scores, byte fallback, "▁" for spaces, optional space prefix);
- `gpt2` (byte-level BPE with merges) with the pre-tokenizer regexes llama.cpp uses per
  `tokenizer.ggml.pre`;
- `gemma4` (BPE merges over raw UTF-8 with "▁" spaces and <0xXX> byte fallback);
- `bert` (WordPiece, llama.cpp's "▁"-marked form).

Conventions the callers rely on:
- The tokenizer has no post-processor: BOS/EOS are never added by `encode`. Callers prepend `bos_id`
  when `Vocabulary.add_bos` (and append `eos_id` when `add_eos`), as llama.cpp's `add_special` does.
- Control (and unknown) tokens are *special* added tokens, user-defined tokens are plain added tokens.
  `tokenizer.encode_special_tokens = True` makes specials read as text while user-defined tokens are
  still matched whole: that is llama.cpp's `parse_special=false`. The default (False) is
  `parse_special=true`.
- An unknown tokenizer model or pre-tokenizer name is `Unsupported(Reason.REGISTRY, ...)`: like an
  unknown architecture, it names a kind poot has no implementation registered for. Malformed metadata
  (wrong types, ids out of range, missing token list) is a `CheckpointError` naming `source`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from poot_core.errors import CheckpointError, Reason, Unsupported
from poot_core.text.vocab import Vocabulary

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPACE_MARK = "\u2581"  # "▁", SentencePiece's visible space

# Token texts llama.cpp treats as end of generation whatever their stored type (it forces them to control).
END_OF_GENERATION_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",
    "[e~[",
)
# Texts llama.cpp picks the end-of-turn id from when the file names none (first found wins here).
END_OF_TURN_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",
    "<end_of_utterance>",
)

# --- Pre-tokenizer regexes for byte-level BPE, as llama.cpp applies them (each splits every piece the
# previous one left, keeping both the matches and the text between them). Written in the Oniguruma
# dialect that `tokenizers` uses.
_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Letter ranges of DeepSeek's pre-tokenizer, escaped so no editor normalizes them.
_DEEPSEEK_LETTERS = (
    "A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-"
    "\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-"
    "\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d"
    "\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-"
    "\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
    "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d"
    "\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4"
    "\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e"
    "\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"

PRE_TOKENIZER_REGEXES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"),
    "llama3": (LLAMA3,),
    "deepseek-llm": (
        r"[\r\n]",
        r"\s?[" + _DEEPSEEK_LETTERS + "]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        r"\s+\z",
        _CJK_HANGUL,
        r"\p{N}+",
    ),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}"),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"),
    "starcoder": (r"\p{N}", GPT2),
    "gpt2": (GPT2,),
    "qwen2": (QWEN2,),
    "qwen35": (QWEN35,),
    "bloom": (r" ?[^(\s|.,!?…。，、।۔،)]+",),
    "viking": (r" ?[^(\s|.,!?…。，、।۔،)]+", r"\p{N}"),
}

# tokenizer.ggml.pre name -> (regex family above, clean_spaces, ignore_merges, add_bos default).
# clean_spaces is llama.cpp's detokenizer clean-up (" ." -> "." and the like); it is on for BPE unless
# the pre-tokenizer turns it off.
_PRE = tuple[str, bool, bool, bool]
PRE_TOKENIZERS: dict[str, _PRE] = {
    "default": ("default", True, False, False),
    **{
        name: ("llama3", True, True, True)
        for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2")
    },
    "dbrx": ("llama3", True, False, False),
    "smaug-bpe": ("llama3", True, False, False),
    "chatglm-bpe": ("llama3", True, False, False),
    "deepseek-llm": ("deepseek-llm", False, False, False),
    "deepseek-coder": ("deepseek-coder", False, False, False),
    "falcon": ("falcon", True, False, False),
    "mpt": ("gpt2", True, False, False),
    "olmo": ("gpt2", True, False, False),
    "jais": ("gpt2", True, False, False),
    "trillion": ("gpt2", False, False, False),
    "starcoder": ("starcoder", True, False, False),
    "refact": ("starcoder", True, False, False),
    "command-r": ("starcoder", False, False, False),
    "smollm": ("starcoder", False, False, False),
    "codeshell": ("starcoder", True, False, False),
    "exaone": ("starcoder", True, False, False),
    "minerva-7b": ("starcoder", True, False, False),
    **{
        name: ("gpt2", True, False, False)
        for name in (
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v1-en",
            "jina-v2-es",
            "jina-v2-de",
            "jina-v2-code",
            "roberta-bpe",
            "a.x-4.0",
            "mellum",
            "modern-bert",
        )
    },
    **{name: ("qwen2", False, False, False) for name in ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2")},
    "stablelm2": ("qwen2", True, False, False),
    "hunyuan": ("qwen2", False, False, False),
    "qwen35": ("qwen35", False, False, False),
    "poro-chat": ("bloom", False, False, False),
    "bloom": ("bloom", True, False, False),
    "gpt3-finnish": ("bloom", True, False, False),
    "viking": ("viking", False, False, False),
}

# llama.cpp's detokenizer clean-up passes, in order (each is a plain substring replacement).
_CLEAN_SPACES = (
    (" ?", "?"),
    (" !", "!"),
    (" .", "."),
    (" ,", ","),
    (" ' ", "'"),
    (" 's", "'s"),
    (" 'm", "'m"),
    (" 're", "'re"),
    (" 've", "'ve"),
)


class _Metadata:
    """Typed reads of GGUF metadata; a wrong type is a CheckpointError naming the file and the key."""

    def __init__(self, metadata: dict[str, Any], source: str) -> None:
        self.metadata = metadata
        self.source = source

    def bad(self, key: str, message: str) -> CheckpointError:
        return CheckpointError(self.source, f"tokenizer metadata {key}: {message}")

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        value = self.metadata.get(key, default)
        if value is default:
            return value
        if isinstance(value, bool) and kind is int:
            raise self.bad(key, f"expected an integer, found {value!r}")
        if not isinstance(value, kind):
            raise self.bad(key, f"expected {_kind_name(kind)}, found {type(value).__name__}")
        return value

    def array(self, key: str, kind: type | tuple[type, ...], length: int | None) -> list[Any] | None:
        value = self.metadata.get(key)
        if value is None:
            return None
        if not isinstance(value, (list, tuple)):
            raise self.bad(key, f"expected an array, found {type(value).__name__}")
        if length is not None and len(value) < length:
            raise self.bad(key, f"has {len(value)} entries for {length} tokens")
        for item in value:
            if isinstance(item, bool) or not isinstance(item, kind):
                raise self.bad(key, f"expected an array of {_kind_name(kind)}, found {type(item).__name__}")
        return list(value[:length] if length is not None else value)

    def token_id(self, key: str, n_tokens: int, default: int | None) -> int | None:
        """A special id; out of range is ignored (llama.cpp keeps the default then)."""
        if default is not None and not 0 <= default < n_tokens:
            default = None
        value = self.get(key, int)
        if value is None or not 0 <= value < n_tokens:
            return default
        return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def vocabulary_from_gguf(metadata: dict[str, Any], source: str) -> Vocabulary:
    """The tokenizer and special ids described by GGUF `metadata` (plain Python values) of file `source`."""
    meta = _Metadata(metadata, source)
    model = meta.get("tokenizer.ggml.model", str)
    if model is None:
        raise meta.bad("tokenizer.ggml.model", "missing: the file carries no tokenizer")
    tokens = meta.array("tokenizer.ggml.tokens", str, None)
    if not tokens:
        raise meta.bad("tokenizer.ggml.tokens", "missing or empty")
    n = len(tokens)
    if len(set(tokens)) != n:
        raise meta.bad("tokenizer.ggml.tokens", "the same token text appears twice")
    types = meta.array("tokenizer.ggml.token_type", int, n) or [NORMAL] * n
    scores = meta.array("tokenizer.ggml.scores", (float, int), n) or [0.0] * n
    pre_name = meta.get("tokenizer.ggml.pre", str) or "default"
    types = _force_end_of_generation_control(tokens, types)

    # Defaults per model type, as llama.cpp sets them before reading the file's own keys.
    if model == "llama":
        bos_default, eos_default, add_bos = 1, 2, True
        add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", bool, True))
        tokenizer = _spm_tokenizer(tokens, scores, add_space_prefix)
    elif model == "gpt2":
        entry = PRE_TOKENIZERS.get(pre_name)
        if entry is None:
            raise Unsupported(
                Reason.REGISTRY,
                f"GGUF pre-tokenizer {pre_name!r}",
                f"{source}: poot has no pre-tokenizer regexes for it; "
                f"known: {', '.join(sorted(PRE_TOKENIZERS))}",
            )
        family, clean_spaces, ignore_merges, add_bos = entry
        merges = meta.array("tokenizer.ggml.merges", str, None)
        if merges is None:
            raise meta.bad("tokenizer.ggml.merges", "missing: a gpt2 tokenizer needs its merges")
        tokenizer = _bpe_tokenizer(
            tokens, merges, PRE_TOKENIZER_REGEXES[family], clean_spaces, ignore_merges, meta
        )
        bos_default = eos_default = 11
    elif model == "gemma4":
        merges = meta.array("tokenizer.ggml.merges", str, None)
        if merges is None:
            raise meta.bad("tokenizer.ggml.merges", "missing: a gemma4 tokenizer needs its merges")
        tokenizer = _gemma4_tokenizer(tokens, merges, meta)
        bos_default = eos_default = None
        add_bos = True  # llama.cpp forces BOS on for gemma4 whatever the file says
    elif model == "bert":
        tokenizer = _wpm_tokenizer(tokens, meta)
        bos_default, eos_default, add_bos = 101, None, True
    else:
        raise Unsupported(
            Reason.REGISTRY,
            f"GGUF tokenizer model {model!r}",
            f"{source}: poot reads the llama (SentencePiece), gpt2 (byte-level BPE), gemma4 "
            "and bert (WordPiece) models",
        )

    _add_special_tokens(tokenizer, tokens, types, _strip_rules(meta, tokens, types))

    bos_id = meta.token_id("tokenizer.ggml.bos_token_id", n, bos_default)
    eos_id = meta.token_id("tokenizer.ggml.eos_token_id", n, eos_default)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", bool, add_bos)) or model == "gemma4"
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", bool, False))
    stop_ids = _stop_ids(meta, tokens, eos_id)
    template = meta.get("tokenizer.chat_template", str)
    return Vocabulary(
        tokenizer=tokenizer,
        bos_id=bos_id,
        eos_id=eos_id,
        stop_ids=stop_ids,
        add_bos=add_bos and bos_id is not None,
        add_eos=add_eos and eos_id is not None,
        control_tokens=frozenset(t for t, k in zip(tokens, types, strict=True) if k == CONTROL),
        chat_template=template,
        bos_token=None if bos_id is None else tokens[bos_id],
        eos_token=None if eos_id is None else tokens[eos_id],
    )


def _force_end_of_generation_control(tokens: Sequence[str], types: list[int]) -> list[int]:
    """llama.cpp turns end-of-generation-looking tokens into control tokens whatever the file says."""
    wanted = set(END_OF_GENERATION_TEXTS) | {"<|eom_id|>"}
    out = list(types)
    for i, text in enumerate(tokens):
        if text in wanted and out[i] not in (CONTROL, UNUSED):
            out[i] = CONTROL
    return out


def _stop_ids(meta: _Metadata, tokens: Sequence[str], eos_id: int | None) -> tuple[int, ...]:
    n = len(tokens)
    by_text = {t: i for i, t in enumerate(tokens)}
    stops: list[int] = []
    eot_id = meta.token_id("tokenizer.ggml.eot_token_id", n, None)
    if eot_id is None:
        eot_id = next((by_text[t] for t in END_OF_TURN_TEXTS if t in by_text), None)
    eom_id = meta.token_id("tokenizer.ggml.eom_token_id", n, by_text.get("<|eom_id|>"))
    for candidate in (eos_id, eot_id, eom_id, *(by_text.get(t) for t in END_OF_GENERATION_TEXTS)):
        if candidate is not None and candidate not in stops:
            stops.append(candidate)
    return tuple(stops)


def _strip_rules(
    meta: _Metadata, tokens: Sequence[str], types: Sequence[int]
) -> dict[int, tuple[bool, bool]]:
    """Per-token (lstrip, rstrip) that llama.cpp hard-codes by model name, as no GGUF key carries them."""
    name = (meta.get("general.name", str) or "").lower()
    pre = meta.get("tokenizer.ggml.pre", str) or ""
    arch = meta.get("general.architecture", str) or ""
    rules: dict[int, tuple[bool, bool]] = {}
    by_text = {t: i for i, t in enumerate(tokens)}
    if any(k in pre for k in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or "nomic-bert-moe" in arch:
        if "<mask>" in by_text:
            rules[by_text["<mask>"]] = (True, False)
    elif "phi-3" in name or "phi3" in name:
        for i, kind in enumerate(types):
            if kind in (CONTROL, USER_DEFINED, UNKNOWN):
                rules[i] = (False, True)
        if "</s>" in by_text:
            rules[by_text["</s>"]] = (False, True)
        for text in ("<unk>", "<s>", "<|endoftext|>"):
            if text in by_text:
                rules[by_text[text]] = (False, False)
    elif "modern-bert" in name and "[MASK]" in by_text:
        rules[by_text["[MASK]"]] = (True, False)
    return rules


def _add_special_tokens(
    tokenizer: tokenizers.Tokenizer,
    tokens: Sequence[str],
    types: Sequence[int],
    strips: dict[int, tuple[bool, bool]],
) -> None:
    """Control/unknown tokens become special added tokens, user-defined ones plain added tokens.

    They are matched on the raw text before any normalization, as llama.cpp partitions the text on
    them before tokenizing the pieces between.
    """
    added = []
    for i, (text, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind not in (CONTROL, UNKNOWN, USER_DEFINED):
            continue
        lstrip, rstrip = strips.get(i, (False, False))
        added.append(
            AddedToken(text, special=kind != USER_DEFINED, normalized=False, lstrip=lstrip, rstrip=rstrip)
        )
    tokenizer.add_tokens(added)


# --- SentencePiece-style BPE ("llama") --------------------------------------------------------------


def _spm_tokenizer(
    tokens: Sequence[str], scores: Sequence[float], add_space_prefix: bool
) -> tokenizers.Tokenizer:
    """llama.cpp merges the adjacent pair whose joined text is the highest-scored token, leftmost first.

    That is BPE whose merges are every split of every token into two tokens, ranked by the joined
    token's score; characters missing from the vocabulary fall back to <0xXX> byte tokens.
    """
    vocab = {text: i for i, text in enumerate(tokens)}
    candidates: list[tuple[float, int, str, str]] = []
    for i, text in enumerate(tokens):
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in vocab and right in vocab:
                candidates.append((-float(scores[i]), i, left, right))
    candidates.sort()
    merges = [(left, right) for _, _, left, right in candidates]
    has_bytes = all(f"<0x{b:02X}>" in vocab for b in range(256))
    model = models.BPE(vocab=vocab, merges=merges, byte_fallback=has_bytes, fuse_unk=False)
    tokenizer = tokenizers.Tokenizer(model)
    steps = [normalizers.Replace(" ", SPACE_MARK)]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend(SPACE_MARK))
    tokenizer.normalizer = normalizers.Sequence(steps)
    chain = [decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        chain.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(chain)
    return tokenizer


# --- Byte-level BPE ("gpt2") -------------------------------------------------------------------------


def _merge_pairs(tokens: Sequence[str], merges: Sequence[str], meta: _Metadata) -> list[tuple[str, str]]:
    """Merge lines "left right", split at the first space after the first character (as llama.cpp does)."""
    vocab = set(tokens)
    pairs: list[tuple[str, str]] = []
    for index, line in enumerate(merges):
        cut = line.find(" ", 1)
        left, right = (line[:cut], line[cut + 1 :]) if cut > 0 else (line, "")
        if left not in vocab or right not in vocab or left + right not in vocab:
            raise meta.bad(
                "tokenizer.ggml.merges", f"merge {index} {line!r} names a token not in the vocabulary"
            )
        pairs.append((left, right))
    return pairs


def _bpe_tokenizer(
    tokens: Sequence[str],
    merges: Sequence[str],
    regexes: Sequence[str],
    clean_spaces: bool,
    ignore_merges: bool,
    meta: _Metadata,
) -> tokenizers.Tokenizer:
    vocab = {text: i for i, text in enumerate(tokens)}
    pairs = _merge_pairs(tokens, merges, meta)
    model = models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges, fuse_unk=False)
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    chain: list[Any] = [decoders.ByteLevel()]
    if clean_spaces:
        chain += [decoders.Replace(old, new) for old, new in _CLEAN_SPACES]
    tokenizer.decoder = decoders.Sequence(chain)
    return tokenizer


def _gemma4_tokenizer(tokens: Sequence[str], merges: Sequence[str], meta: _Metadata) -> tokenizers.Tokenizer:
    """Gemma 4: BPE merges over raw UTF-8 with spaces spelled "▁", split only between newline runs and
    other text, <0xXX> byte fallback; the detokenizer applies the BPE clean-up of spaces."""
    vocab = {text: i for i, text in enumerate(tokens)}
    pairs = _merge_pairs(tokens, merges, meta)
    has_bytes = all(f"<0x{b:02X}>" in vocab for b in range(256))
    tokenizer = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=pairs, byte_fallback=has_bytes, fuse_unk=False)
    )
    tokenizer.normalizer = normalizers.Replace(" ", SPACE_MARK)
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    chain: list[Any] = [decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    chain += [decoders.Replace(old, new) for old, new in _CLEAN_SPACES]
    tokenizer.decoder = decoders.Sequence(chain)
    return tokenizer


# --- WordPiece ("bert") ------------------------------------------------------------------------------


def _wpm_tokenizer(tokens: Sequence[str], meta: _Metadata) -> tokenizers.Tokenizer:
    """llama.cpp's WordPiece: each word gets a "▁" prefix, then greedy longest match over the vocabulary.

    The GGUF vocabulary already spells word starts with "▁" and continuations bare, so WordPiece with an
    empty continuation prefix over a "▁"-prefixed word is the same search.
    """
    vocab = {text: i for i, text in enumerate(tokens)}
    unk_id = meta.token_id("tokenizer.ggml.unknown_token_id", len(tokens), 100)
    if unk_id is None:
        raise meta.bad("tokenizer.ggml.unknown_token_id", "a bert tokenizer needs an unknown token")
    lowercase = bool(meta.get("tokenizer.ggml.normalizer.lowercase", bool, True))
    strip_accents = bool(meta.get("tokenizer.ggml.normalizer.strip_accents", bool, lowercase))
    model = models.WordPiece(
        vocab=vocab, unk_token=tokens[unk_id], continuing_subword_prefix="", max_input_chars_per_word=1 << 30
    )
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=strip_accents, lowercase=lowercase
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.BertPreTokenizer(),
            pre_tokenizers.Metaspace(replacement=SPACE_MARK, prepend_scheme="always", split=False),
        ]
    )
    chain: list[Any] = [decoders.Replace(SPACE_MARK, " "), decoders.Fuse()]
    chain += [decoders.Replace(old, new) for old, new in _CLEAN_SPACES]
    tokenizer.decoder = decoders.Sequence(chain)
    return tokenizer
