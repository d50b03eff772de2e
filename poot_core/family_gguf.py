"""What families share to read GGUF files written by llama.cpp's converter: metadata keys read with typed
errors (and every key nobody read refused by name), and the table of llama.cpp tensor names each family
extends with its own.

A GGUF file says how to compute the model partly by keys (`llama.rope.scaling.type`) and partly by the
tensors present (`rope_freqs`, biases, `attn_k_b`). poot never ignores either: a key or tensor a family does
not understand is an `Unsupported` naming it, not a silently different model.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from poot_core.errors import CheckpointError, Reason, Unsupported

_REQUIRED: Any = object()


class GGUFKeys:
    """The `{prefix}.*` keys of a GGUF file's metadata (prefix: llama.cpp's architecture name), read by one
    family. Keys read (or declared harmless with `understood`) are remembered, so `refuse_unread` can name
    the first key of that prefix the family did not look at."""

    def __init__(self, metadata: Mapping[str, Any], path: Path | str, prefix: str, family: str) -> None:
        self.metadata = metadata
        self.path = path
        self.prefix = prefix
        self.family = family
        self._read: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.prefix}.{name}"

    def has(self, name: str) -> bool:
        return self.key(name) in self.metadata

    def raw(self, name: str, default: Any = _REQUIRED) -> Any:
        """The value as stored (an array stays a list)."""
        key = self.key(name)
        self._read.add(key)
        value = self.metadata.get(key)
        if value is None:
            if default is _REQUIRED:
                raise CheckpointError(self.path, f"missing metadata {key}")
            return default
        return value

    def __call__(self, name: str, default: Any = _REQUIRED) -> Any:
        """One value. llama.cpp may store a per-layer array for some keys (head counts, lengths); one whose
        entries all agree is that value, one whose layers differ is refused (the families have one value)."""
        value = self.raw(name, default)
        if isinstance(value, list):
            if not value or any(v != value[0] for v in value):
                raise Unsupported(Reason.SHAPE, f"per-layer {self.key(name)} = {value}",
                                  f"the {self.family} family has one value for every layer")
            return value[0]
        return value

    def understood(self, *names: str) -> None:
        """Keys that do not change what poot computes (context length, fine-tuning flags)."""
        self._read.update(self.key(n) for n in names)

    def refuse_unread(self) -> None:
        head = f"{self.prefix}."
        for key in self.metadata:
            if key.startswith(head) and key not in self._read:
                raise Unsupported(Reason.OPERATION, f"GGUF metadata {key} = {self.metadata[key]!r}",
                                  f"{self.path}: the {self.family} family does not read this key, and "
                                  "ignoring it could compute a different model")


# llama.cpp's per-block tensor names -> the Hugging Face names the families trace ("blk.N." becomes
# "model.layers.N."); the names every decoder shares. Families extend this table with their own.
LLAMA_CPP_BLOCK_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
LLAMA_CPP_TOP_NAMES: dict[str, str] = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                                       "output": "lm_head"}
# Tensors a family reads into its config, not as weights.
LLAMA_CPP_CONFIG_TENSORS = frozenset({"rope_freqs.weight"})
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)\.(weight|bias)$")


def split_gguf_name(name: str) -> tuple[int | None, str, str]:
    """"blk.3.attn_q.weight" -> (3, "attn_q", "weight"); "output.weight" -> (None, "output", "weight")."""
    match = _BLOCK.match(name)
    if match:
        return int(match.group(1)), match.group(2), match.group(3)
    stem, _, kind = name.rpartition(".")
    return None, stem, kind


@dataclass(frozen=True)
class GGUFNames:
    """A family's table of llama.cpp tensor names. `map` gives the traced name, None for tensors the config
    reads, and refuses a name the table does not know. Block entries may hold `{placeholders}` that the
    family fills per config (`map(name, moe="block_sparse_moe")`)."""

    block: Mapping[str, str] = field(default_factory=lambda: dict(LLAMA_CPP_BLOCK_NAMES))
    top: Mapping[str, str] = field(default_factory=lambda: dict(LLAMA_CPP_TOP_NAMES))
    config_tensors: frozenset[str] = LLAMA_CPP_CONFIG_TENSORS

    def extended(self, block: Mapping[str, str] | None = None, top: Mapping[str, str] | None = None,
                 config_tensors: Iterable[str] = ()) -> GGUFNames:
        return replace(self, block={**self.block, **(block or {})}, top={**self.top, **(top or {})},
                       config_tensors=self.config_tensors | frozenset(config_tensors))

    def map(self, name: str, family: str, **fill: str) -> str | None:
        if name in self.config_tensors:
            return None
        layer, part, kind = split_gguf_name(name)
        table = self.top if layer is None else self.block
        mapped = table.get(part)
        if mapped is None:
            raise unknown_tensor(name, family)
        mapped = mapped.format(**fill) if fill else mapped
        return f"{mapped}.{kind}" if layer is None else f"model.layers.{layer}.{mapped}.{kind}"


def unknown_tensor(name: str, family: str) -> Unsupported:
    return Unsupported(Reason.OPERATION, f"GGUF tensor {name}",
                       f"the {family} family does not know this llama.cpp tensor; a model that needs it "
                       "would compute differently without it")


__all__ = ["GGUFKeys", "GGUFNames", "LLAMA_CPP_BLOCK_NAMES", "LLAMA_CPP_TOP_NAMES", "split_gguf_name",
           "unknown_tensor"]
