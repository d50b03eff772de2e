"""Request bodies (pydantic) of the OpenAI endpoints, with vLLM's extra sampling fields.

Unknown fields are ignored, as OpenAI's clients send some (`user`, `store`, `metadata`) that change nothing
here; fields poot has but cannot honour yet are declared and refused by name in generation.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_N = 16  # choices per request
MAX_STOPS = 16
MAX_LOGPROBS = 20  # vLLM's --max-logprobs default
GUIDED_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "guided_whitespace_pattern", "guided_decoding_backend", "structural_tag")

TokenId = Annotated[int, Field(ge=0, lt=2**31)]


def _valid_text(data: Any) -> Any:
    """JSON may spell lone surrogates (\\ud800) that no tokenizer can take: a 400 here."""
    stack = [data]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("a text is not valid Unicode (it holds a lone surrogate)") from None
        elif isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return data


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _text(cls, data: Any) -> Any:
        return _valid_text(data)


class StreamOptions(_Body):
    include_usage: bool = False


class Sampling(_Body):
    """What both generation endpoints share."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, lt=2**31)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1, lt=2**31)  # -1 or 0: off
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    ignore_eos: bool = False
    # structured output: OpenAI's response_format, or vLLM's fields (extra_body), checked in generation.py
    response_format: dict[str, Any] | None = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_whitespace_pattern: Any = None
    guided_decoding_backend: Any = None
    structural_tag: Any = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # tool_calls, name, ... reach the template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | dict[str, Any]] | None = None


class ChatCompletionRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, lt=2**31)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    # vLLM's extras: echo puts the last message's content before the reply when it is the assistant's (the turn
    # the reply continues); prompt_logprobs gives the rendered prompt's log-probabilities (not with stream)
    echo: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class CompletionRequest(Sampling):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: int | None = Field(None, ge=0, lt=2**31)  # 0 only with echo: the prompt scored, nothing generated
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's extra
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)


class EmbeddingRequest(_Body):
    model: str | None = None
    input: str | list[str]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)


class RerankRequest(_Body):
    model: str | None = None
    query: str = Field(min_length=1)
    documents: list[str]
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = True


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]
