"""The one error tree of poot.

Every failure a user can cause (a bad file, a missing plugin, an impossible request) is one of these,
with a message that names what was asked, what is missing and what to do. Nothing else should escape
the public API for bad input.
"""

from __future__ import annotations

from enum import StrEnum


class PootError(Exception):
    """Base of every error poot raises on purpose."""


class Reason(StrEnum):
    """Why something is unsupported. Each reason carries the name of the missing thing."""

    REGISTRY = "Registry"  # no installed family serves an architecture
    BACKEND = "Backend"  # a backend is not installed or its device is absent
    OPERATION = "Operation"  # an executor cannot run a graph op
    QUANTIZATION = "Quantization"  # a weight layout / block type nobody can compute
    SHAPE = "Shape"  # a step shape an executor or family cannot run
    CAPACITY = "Capacity"  # does not fit in memory or in the KV window


class Unsupported(PootError):
    """A typed refusal: poot could run this if the named capability existed, but it does not."""

    def __init__(self, reason: Reason | str, name: str, detail: str = "") -> None:
        self.reason = Reason(reason)
        self.name = name
        self.detail = detail
        text = f"unsupported {self.reason.value}: {name}"
        super().__init__(f"{text} ({detail})" if detail else text)


class CheckpointError(PootError):
    """A malformed or truncated checkpoint file; names the file and the byte offset when known."""

    def __init__(self, path: object, message: str, offset: int | None = None) -> None:
        self.path = str(path)
        self.offset = offset
        where = f"{self.path}" + (f" at byte {offset}" if offset is not None else "")
        super().__init__(f"{where}: {message}")


class MissingTensor(CheckpointError, KeyError):
    """A tensor name the file does not hold (also a KeyError, for callers that probe names)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return CheckpointError.__str__(self)


class IntegrityError(PootError):
    """A file does not match the integrity manifest, or is not listed in it."""

    def __init__(self, path: object, message: str) -> None:
        self.path = str(path)
        super().__init__(f"{self.path}: {message}")


class TemplateError(PootError):
    """A chat template that does not compile or fails to render; carries the template's own message."""


class CapacityError(PootError):
    """A request does not fit the memory or the KV window it was given."""


class RequestError(PootError):
    """Bad user input to a request (empty prompt, impossible sampler setting, unknown flag mix)."""


class PluginError(PootError):
    """A plugin is broken or two plugins claim the same thing."""


__all__ = [
    "CapacityError",
    "CheckpointError",
    "IntegrityError",
    "MissingTensor",
    "PluginError",
    "PootError",
    "Reason",
    "RequestError",
    "TemplateError",
    "Unsupported",
]
