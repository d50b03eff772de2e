"""A Hugging Face checkpoint's tokenizer files -> Vocabulary.

tokenizer.json is the tokenizer itself; tokenizer_config.json (and chat_template.jinja, when present) give
the special tokens and the chat template. Whether BOS/EOS are added is read off the tokenizer's own
post-processor, so poot adds exactly what transformers would.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers

from poot_core.checkpoint.integrity import FileAccess
from poot_core.errors import CheckpointError
from poot_core.family import ModelConfig
from poot_core.text.vocab import Vocabulary


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _special_affixes(tok: tokenizers.Tokenizer) -> tuple[list[int], list[int]]:
    """The ids the post-processor puts before and after a text (e.g. [bos], [])."""
    plain = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start], full[start + len(plain) :]
    return [], []


def vocabulary_from_hf(root: Path, access: FileAccess, config: ModelConfig) -> Vocabulary:
    path = root / "tokenizer.json"
    if not path.exists():
        raise CheckpointError(root, "tokenizer.json is missing (poot reads the fast tokenizer format)")
    data = access.read_bytes(path)
    try:
        tok = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:  # the tokenizers library raises plain Exceptions for bad JSON
        raise CheckpointError(path, f"not a tokenizers file: {exc}") from exc
    # A tokenizer.json may store fixed padding or truncation (MiniLM pads to 128): encode must give the text's
    # own ids; padding is the caller's business.
    tok.no_padding()
    tok.no_truncation()
    tc: dict[str, Any] = {}
    tc_path = root / "tokenizer_config.json"
    if tc_path.exists():
        try:
            tc = json.loads(access.read_bytes(tc_path))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(tc_path, f"not valid JSON: {exc}") from exc
    template = tc.get("chat_template")
    if isinstance(template, list):  # named templates: the default one is what generation uses
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    jinja_path = root / "chat_template.jinja"
    if jinja_path.exists():
        template = access.read_bytes(jinja_path).decode("utf-8")
    bos_token, eos_token = _token_text(tc.get("bos_token")), _token_text(tc.get("eos_token"))
    bos_id = tok.token_to_id(bos_token) if bos_token else config.bos_id
    eos_id = tok.token_to_id(eos_token) if eos_token else (config.eos_ids[0] if config.eos_ids else None)
    before, after = _special_affixes(tok)
    control = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    stops = tuple(dict.fromkeys([*config.eos_ids, *([eos_id] if eos_id is not None else [])]))
    return Vocabulary(
        tokenizer=tok, bos_id=bos_id if bos_id is not None else (before[0] if before else None),
        eos_id=eos_id, stop_ids=stops, add_bos=bool(before), add_eos=bool(after),
        control_tokens=frozenset(control), chat_template=template, bos_token=bos_token, eos_token=eos_token,
    )
