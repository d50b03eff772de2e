"""What a checkpoint says about its tokenizer, in one shape whatever the file format.

A Hugging Face directory gives tokenizer.json + tokenizer_config.json; a GGUF file gives tokenizer.ggml.*
metadata. Both become a `Vocabulary`: a `tokenizers.Tokenizer` that maps text to the same ids the model
was trained with, plus the special ids and flags the driver and chat services need.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tokenizers


@dataclass
class Vocabulary:
    tokenizer: tokenizers.Tokenizer
    bos_id: int | None = None
    eos_id: int | None = None
    # Every id that ends generation: EOS, EOT (end of turn), and the generation_config's eos list.
    stop_ids: tuple[int, ...] = ()
    add_bos: bool = False
    add_eos: bool = False
    # Tokens a template writes as control markup (<|im_start|>, <start_of_turn>, ...): spelled inside a
    # message they must be tokenized as plain text.
    control_tokens: frozenset[str] = field(default_factory=frozenset)
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None

    def token_text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokenizer.id_to_token(token_id)
