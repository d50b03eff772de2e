"""From an OpenAI request body to what the engine runs: prompt ids, the sampler, stops and the token limit.

OpenAI's defaults apply where a field is absent (temperature 1, top-p 1, no top-k, no min-p), not
llama.cpp's: clients expect them. temperature 0 is greedy and gives the offline engine's exact tokens.
presence_penalty and frequency_penalty count the generated tokens (OpenAI), repetition_penalty every token of
prompt and output (transformers, vLLM). logit_bias maps token ids (JSON keys) to a bias added to the logits
before sampling, each value clamped to [-100, 100] and an id outside the vocabulary a 400 (both as vLLM does).
Fields poot cannot honour yet are refused by name instead of being ignored.

Tools: tool_choice "none" renders the prompt without them; a named function or "required" constrains the reply
(tool_call_constraint); "auto" (or absent) leaves the reply free and the server parses it in the format of the
model's chat template or of --tool-call-parser (tool_parsers.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from poot_core.driver.constraints import (
    Constraint,
    from_guided,
    from_response_format,
    guided_fields,
    tool_call_constraint,
)
from poot_core.driver.core import GenerateRequest
from poot_core.driver.embeddings import ImagePrompts
from poot_core.driver.sampling import Sampler
from poot_core.errors import RequestError
from poot_core.server import tool_parsers
from poot_core.server.errors import APIError
from poot_core.server.schemas import (
    GUIDED_FIELDS,
    MAX_STOPS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    Sampling,
)
from poot_core.text.services import TextServices


@dataclass
class Plan:
    """What one prompt of a request runs: `n` choices of the same prompt."""

    prompt: list[int]
    max_new: int  # -1: to the end of the window
    stops: list[str]
    body: Sampling
    constraint: Constraint | None = None  # response_format, vLLM guided fields or a forced call (constraint_of)
    constraint_field: str | None = None  # the request field it came from: the param of its compile error
    logprobs: int | None = None  # top alternatives per token (0: the token's own only); None: no logprobs
    tools: Tools | None = None  # how the reply becomes tool calls (chat with tools)
    logit_bias: dict[int, float] | None = None  # logit_bias_of
    # echo: the text put before the reply (completions: the prompt's; chat: the last message's, the assistant's);
    # prompt_top: the alternatives per prompt token the response needs (echo with logprobs, prompt_logprobs), None
    # when it needs no prompt logprobs (each choice's ticket gets them from the engine)
    echo: str | None = None
    prompt_top: int | None = None
    images: list[Any] = field(default_factory=list)  # a chat's images, in order (their features: on submit)

    def requests(self, n: int) -> list[GenerateRequest]:
        """One engine request per choice; seeded choices get seeds seed, seed+1, ... so they differ."""
        return [GenerateRequest(list(self.prompt), self.max_new, sampler(self.body, i, self.logit_bias),
                                list(self.stops),
                                self.body.ignore_eos, constraint=self.constraint, logprobs=self.logprobs)
                for i in range(n)]


@dataclass
class Tools:
    """A chat request's tools. forced: the reply is constrained to a call (tool_choice names a function or is
    "required"), read by tool_calls_from_text; otherwise it is free and read in `format` (tool_calls_from_reply)."""

    tools: list[dict[str, Any]]
    choice: Any
    format: str
    constraint: Constraint | None = None  # the forced call's

    @property
    def forced(self) -> bool:
        return self.constraint is not None


def refuse(field: str, why: str) -> APIError:
    return APIError(400, f"{field}: {why}", param=field, code="unsupported_parameter")


def sampler(body: Sampling, choice: int = 0, logit_bias: dict[int, float] | None = None) -> Sampler:
    temperature = 1.0 if body.temperature is None else body.temperature
    top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
    seed = None if body.seed is None else (body.seed + choice) % 2**63
    return Sampler(temperature=temperature, top_k=top_k, top_p=1.0 if body.top_p is None else body.top_p,
                   min_p=body.min_p or 0.0, repeat_penalty=body.repetition_penalty or 1.0, repeat_last_n=-1,
                   presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty, seed=seed,
                   logit_bias=logit_bias)


def logit_bias_of(body: Sampling, vocab: int) -> dict[int, float] | None:
    """The request's logit_bias with integer ids and values clamped to [-100, 100] (vLLM); a key that is not a
    token id, or an id outside the vocabulary, is a 400 naming the field."""
    if not body.logit_bias:
        return None
    bias: dict[int, float] = {}
    for key, value in body.logit_bias.items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(400, f"logit_bias: keys must be token ids, got {key!r}", param="logit_bias",
                           code="invalid_logit_bias") from None
        bias[token] = min(100.0, max(-100.0, value))
    bad = sorted(t for t in bias if not 0 <= t < vocab)
    if bad:
        raise APIError(400, f"token_id(s) {bad[:10]} in logit_bias contain out-of-vocab token ids. "
                            f"Vocabulary size: {vocab}", param="logit_bias", code="invalid_logit_bias")
    return bias


def _common_refusals(body: Sampling) -> None:
    if body.stream_options is not None and not body.stream:
        raise refuse("stream_options", "only allowed with stream: true")


def stops_of(body: Sampling) -> list[str]:
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > MAX_STOPS:
        raise refuse("stop", f"at most {MAX_STOPS} stop strings, got {len(stops)}")
    return [s for s in stops if s]


def check_window(prompt: int, max_new: int, window: int, what: str = "messages") -> None:
    """A request that can never fit the window is a 400 naming both numbers (vLLM's wording)."""
    asked = prompt + max(max_new, 0)
    if asked > window or prompt >= window:
        raise APIError(400, f"This model's maximum context length is {window} tokens. However, you requested "
                            f"{asked} tokens ({prompt} in the {what}, {max(max_new, 0)} in the completion). "
                            "Please reduce the length of the messages or completion.",
                       param="max_tokens" if prompt < window else what, code="context_length_exceeded")


def message_dicts(messages: list[ChatMessage], images: bool = False) -> list[dict[str, Any]]:
    """Messages as the template reads them: text parts joined; anything but text refused. images (a model that
    takes them): a message with image_url parts keeps its parts, each image a data: URL (the server reads no
    file and fetches no URL)."""
    out = []
    for i, message in enumerate(messages):
        m = message.model_dump(exclude_none=True)
        content = message.content
        if isinstance(content, list):
            parts = [part.model_dump() if hasattr(part, "model_dump") else dict(part) for part in content]
            kinds = [part.get("type") for part in parts]
            if images and "image_url" in kinds and set(kinds) <= {"text", "image_url"}:
                for part in parts:
                    url = part.get("image_url")
                    url = url.get("url") if isinstance(url, dict) else url
                    if part["type"] == "image_url" and not (isinstance(url, str) and url.startswith("data:")):
                        raise refuse(f"messages.{i}.content", "an image must be a data: URL (base64)")
                m["content"] = parts
            else:
                for kind in kinds:
                    if kind != "text":
                        raise refuse(f"messages.{i}.content", f"content parts of type {kind!r} are not supported; "
                                     "this server takes text" + (" and image_url parts" if images else ""))
                m["content"] = "".join(str(part.get("text", "")) for part in parts)
        out.append(m)
    return out


def chat_plan(text: TextServices, body: ChatCompletionRequest, window: int, parser: str | None = None,
              images: ImagePrompts | None = None) -> Plan:
    """parser: --tool-call-parser (tool_parsers.NAMES), None for the chat template's format; images: the model's
    ImagePrompts (Family.image_prompts) when it takes images."""
    _common_refusals(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise refuse("top_logprobs", "needs logprobs: true")
    tools = _tools(text, body, parser)
    constraint = constraint_of(body, None if tools is None else tools.constraint)
    field = constraint_field(body, constraint is not None and tools is not None and tools.forced)
    if body.max_tokens is not None and body.max_completion_tokens is not None \
            and body.max_tokens != body.max_completion_tokens:
        raise refuse("max_completion_tokens", "differs from max_tokens; give one of them")
    limit = body.max_completion_tokens or body.max_tokens
    if body.prompt_logprobs is not None and body.stream:
        raise refuse("prompt_logprobs", "not available with stream: true")
    messages = message_dicts(body.messages, images is not None)
    pictures: list[Any] = []
    tool_list = None if tools is None else tools.tools
    if images is not None and any(isinstance(m.get("content"), list) for m in messages):
        try:
            rendered, pictures = images.render(text, messages, tool_list)
        except RequestError as err:
            raise refuse("messages", str(err)) from None
    else:
        rendered = text.render_chat_value(messages, tool_list)
    prompt = text.encode_chat(rendered)
    max_new = -1 if limit is None else limit
    check_window(len(prompt), max_new, window)
    stops = stops_of(body)
    if not body.ignore_eos:
        stops += [s for s in rendered.stops if s not in stops]  # the template's end-of-turn markers
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    echo = (messages[-1].get("content") or None) if body.echo and messages[-1]["role"] == "assistant" else None
    return Plan(prompt, max_new, stops, body, constraint, field, logprobs, tools,
                logit_bias_of(body, text.vocab_size()), echo=echo, prompt_top=body.prompt_logprobs, images=pictures)


def constraint_of(body: Sampling, forced: Constraint | None = None) -> Constraint | None:
    """The request's one structured-output constraint: response_format's, vLLM's (structured_outputs or the
    guided_* fields) or a forced tool call's (`forced`). Two of them are a 400 naming both; a malformed one a
    400 naming its field. A schema or grammar that does not compile is refused when the engine takes the request
    (a 400 too, before the response or a stream's first chunk)."""
    try:
        response = from_response_format(body.response_format)
    except RequestError as err:
        raise APIError(400, f"response_format: {err}", param="response_format",
                       code="invalid_response_format") from None
    fields = body.model_dump(include=set(GUIDED_FIELDS), exclude_none=True)
    try:
        given = [name for name, _, _ in guided_fields(fields)]
        guided = from_guided(fields) if len(given) == 1 else None
    except RequestError as err:
        raise APIError(400, str(err), param=next(iter(fields), None), code="invalid_structured_output") from None
    named = [*(["response_format"] if response is not None else []), *given,
             *(["tool_choice"] if forced is not None else [])]
    if len(named) > 1:
        raise APIError(400, f"a request takes one structured output constraint, got {' and '.join(named)}",
                       param=named[1], code="conflicting_constraints")
    return response or guided or forced


def constraint_field(body: Sampling, forced: bool) -> str | None:
    """The field the request's one constraint (constraint_of) came from, as the request spells it: response_format,
    structured_outputs.<kind> or guided_<kind>, or tools (a forced call's schema is the tool's parameters)."""
    if forced:
        return "tools"
    if body.response_format is not None:
        return "response_format"
    try:
        given = guided_fields(body.model_dump(include=set(GUIDED_FIELDS), exclude_none=True))
    except RequestError:
        return None
    return given[0][0] if given else None


def _tools(text: TextServices, body: ChatCompletionRequest, parser: str | None = None) -> Tools | None:
    """The request's tools, or None when there are none or tool_choice is "none"."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none", "auto"):
            raise refuse("tool_choice", "names a tool but the request has no tools")
        return None
    if choice == "none":
        return None
    try:
        constraint = tool_call_constraint(body.tools, choice, body.parallel_tool_calls)
    except RequestError as err:
        raise refuse("tool_choice", str(err)) from None
    return Tools(body.tools, choice, tool_parsers.choose(parser, text.vocab.chat_template), constraint)


def completion_plans(text: TextServices, body: CompletionRequest, window: int) -> list[Plan]:
    _common_refusals(body)
    if body.max_tokens == 0 and not body.echo:
        raise refuse("max_tokens", "must be at least 1 (0 only with echo)")
    if body.suffix:
        raise refuse("suffix", "not supported (no fill-in-the-middle)")
    if body.best_of is not None and body.best_of != body.n:
        raise refuse("best_of", "only best_of equal to n is supported")
    prompt = body.prompt
    texts: list[str | None]
    if isinstance(prompt, str):
        prompts: list[list[int]] = [text.encode(prompt)]
        texts = [prompt]
    elif not prompt:
        raise refuse("prompt", "is empty")
    elif all(isinstance(p, int) for p in prompt):
        prompts, texts = [list(prompt)], [None]  # type: ignore[arg-type]
    elif all(isinstance(p, str) for p in prompt):
        prompts = [text.encode(p) for p in prompt]  # type: ignore[arg-type]
        texts = list(prompt)  # type: ignore[arg-type]
    else:
        prompts = [list(p) for p in prompt]  # type: ignore[union-attr]
        texts = [None] * len(prompts)
    tops = [k for k in (body.logprobs if body.echo else None, body.prompt_logprobs) if k is not None]
    prompt_top = max(tops) if tops else None
    vocab = text.vocab_size()
    constraint = constraint_of(body)
    field = constraint_field(body, False)
    bias = logit_bias_of(body, vocab)
    plans = []
    for i, ids in enumerate(prompts):
        if not ids:
            raise refuse(f"prompt.{i}" if len(prompts) > 1 else "prompt", "has no tokens")
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise refuse("prompt", f"token ids outside the vocabulary of {vocab}: {bad[:5]}")
        max_new = -1 if body.max_tokens is None else body.max_tokens
        check_window(len(ids), max_new, window, "prompt")
        echo = (texts[i] if texts[i] is not None else text.decode(ids)) if body.echo else None
        plans.append(Plan(ids, max_new, stops_of(body), body, constraint, logprobs=body.logprobs, logit_bias=bias,
                          echo=echo, prompt_top=prompt_top, constraint_field=field))
    return plans


def finish_reason(reason: str) -> str:
    """The engine's stop reason in OpenAI's words."""
    return {"eos": "stop", "stop": "stop", "length": "length", "capacity": "length"}.get(reason, reason)
