"""Text services of a loaded model: encode, decode, streaming detokenization, chat prompts."""

from __future__ import annotations

from typing import Any

from poot_core.errors import RequestError, TemplateError
from poot_core.text.incremental import StreamDecoder, WindowDecoder
from poot_core.text.vocab import Vocabulary

__all__ = ["StreamDecoder", "TextServices"]


class TextServices:
    def __init__(self, vocab: Vocabulary) -> None:
        self.vocab = vocab
        self.tokenizer = vocab.tokenizer
        self._size = self.tokenizer.get_vocab_size(with_added_tokens=True)  # asked once: decode runs per token
        # shared by every stream of this model
        self._windows = WindowDecoder.of(self.tokenizer, self._size)

    # --- plain text -----------------------------------------------------------------------------------
    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of `text`, with BOS/EOS added the way the model's tokenizer adds them."""
        if not isinstance(text, str):
            raise RequestError(f"encode expects a str, got {type(text).__name__}")
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return self._with_specials(ids) if add_special else ids

    def _with_specials(self, ids: list[int]) -> list[int]:
        v = self.vocab
        if v.add_bos and v.bos_id is not None and (not ids or ids[0] != v.bos_id):
            ids = [v.bos_id, *ids]
        if v.add_eos and v.eos_id is not None:
            ids = [*ids, v.eos_id]
        return ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        ids = [int(i) for i in ids]
        size = self._size
        if ids and not 0 <= min(ids) <= max(ids) < size:
            bad = [i for i in ids if not 0 <= i < size]
            raise RequestError(f"token ids outside the vocabulary of {size}: {bad[:5]}")
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

    def stream(self, context: list[int] | None = None) -> StreamDecoder:
        return StreamDecoder(self._windows, context)

    def vocab_size(self) -> int:
        return self._size

    # --- chat -----------------------------------------------------------------------------------------
    def has_chat_template(self) -> bool:
        return bool(self.vocab.chat_template)

    def render_chat_value(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                          *, template: str | None = None, add_generation_prompt: bool = True) -> Any:
        """Render an OpenAI-style messages array through the model's chat template (or `template`).
        Returns a RenderedChat: .text, .stops (turn-end markers), .segments."""
        from poot_core.text.chat import compile_template

        _refuse_images(messages)
        source = template or self.vocab.chat_template
        if not source:
            raise TemplateError("this model ships no chat template; pass one (--chat-template-file)")
        v = self.vocab
        rendered = compile_template(source).render(messages, tools, add_generation_prompt=add_generation_prompt,
                                                   bos_token=v.bos_token, eos_token=v.eos_token)
        return rendered

    def encode_chat(self, rendered: Any) -> list[int]:
        """The rendered prompt as ids: control tokens the template wrote become their ids, the same spelling
        inside a message stays plain text. BOS is added when the tokenizer adds it and the template did not."""
        from poot_core.text.chat_tokens import encode_segments

        for text in rendered.unplaced:
            spelled = [t for t in self.vocab.control_tokens if t and t in text]
            if spelled:
                raise TemplateError(f"a message spells the control token {spelled[0]!r} and the template changed "
                                    "that message, so poot cannot keep the token as plain text")
        ids = encode_segments(self.tokenizer, rendered.segments, self.vocab.control_tokens)
        v = self.vocab
        if v.add_bos and v.bos_id is not None and (not ids or ids[0] != v.bos_id):
            ids = [v.bos_id, *ids]
        return ids


IMAGE_KEYS = ("image", "url", "path")  # an image part with one of these carries an image, not a placeholder


def _refuse_images(messages: Any) -> None:
    """An image in a message is a typed refusal before any work: the text path renders text only (vision
    models take their images through their family's runtime, which passes bare {"type": "image"} placeholders)."""
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url" or (kind == "image" and any(k in part for k in IMAGE_KEYS)):
                raise RequestError("a chat message holds an image, and this model reads text only")
