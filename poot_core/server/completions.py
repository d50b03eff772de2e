"""/v1/chat/completions and /v1/completions: whole responses and server-sent event streams.

A stream ends with `data: [DONE]`; with stream_options.include_usage the chunk before it carries the usage
and no choices. An error after the stream started (the engine failed, the server is stopping) arrives as a
final event in OpenAI's error shape. A client that goes away aborts its requests at once: for a stream,
Starlette cancels the generator; for a whole response, a watcher reads the connection's disconnect.

Log-probabilities ride on the chunk of their token (logprobs.py); those of tokens that show no text (the
end-of-sequence token) on the finishing chunk. A chat with tools streams its content until a tool call may
begin, then delivers the calls in one delta before the finishing chunk (tools.py).

Completions' echo (vLLM's semantics): the prompt's text comes before the reply (a stream's first chunk of each
choice), and with logprobs the prompt's tokens come first in them, the first one's logprob None; vLLM's
prompt_logprobs rides on the choice (a stream's first chunk). Each choice's ticket gets them from its own prompt's
prefill in the engine, so a stream's first chunk of a choice goes out with the choice's first item.
Chat's echo and prompt_logprobs (vLLM's extras): the last message's content before the reply when it is the
assistant's (a stream: a content chunk after the role chunk); prompt_logprobs on the response, not with stream.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from poot_core.errors import RequestError
from poot_core.server.bridge import Done, Piece, Rejected, Ticket
from poot_core.server.errors import APIError, error_body, from_poot
from poot_core.server.generation import Plan, chat_plan, completion_plans, finish_reason
from poot_core.server.logprobs import CompletionLogprobs, chat_content, joined, prompt_logprobs_field
from poot_core.server.schemas import ChatCompletionRequest, CompletionRequest, Sampling
from poot_core.server.state import ServerState
from poot_core.server.tools import ToolStream, finish, read_calls
from poot_core.text.services import TextServices

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.server


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    state = _state(request)
    loaded = state.serving(body.model)
    plan = chat_plan(loaded.text, body, loaded.window, state.settings.tool_call_parser, loaded.images)
    return await _serve(state, request, body, [plan], chat=True, text=loaded.text)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    state = _state(request)
    loaded = state.serving(body.model)
    plans = completion_plans(loaded.text, body, loaded.window)
    return await _serve(state, request, body, plans, chat=False, text=loaded.text)


async def _serve(state: ServerState, request: Request, body: Sampling, plans: list[Plan], chat: bool,
                 text: TextServices) -> Any:
    requests = [r for plan in plans for r in plan.requests(body.n)]
    tops = [plan.prompt_top for plan in plans for _ in range(body.n)]  # every choice scores its own prefill
    images = [plan.images for plan in plans for _ in range(body.n)]
    try:
        tickets = await state.submit(request.state.tenant, requests, tops, images)
    except APIError as err:
        raise _name_field(err, plans) from None
    prompt_tokens = sum(len(p.prompt) for p in plans)
    meta = _Meta(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time()), state.settings.model,
                 chat, prompt_tokens, text)
    choice_plans = [plan for plan in plans for _ in range(body.n)]
    if body.stream:
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(state, tickets, choice_plans, meta, usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    watcher = asyncio.create_task(_abort_on_disconnect(request, state, tickets))
    try:
        finished = [await _collect(t) for t in tickets]
    finally:
        watcher.cancel()
    choices, completion_tokens = [], 0
    for index, ((reply, done), plan, ticket) in enumerate(zip(finished, choice_plans, tickets, strict=True)):
        reason = finish_reason(done.event.reason)
        generation = done.event.generation
        completion_tokens += len(generation.tokens)
        steps = generation.logprobs
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": reply, "tool_calls": []}
            if plan.tools is not None:
                content, calls = read_calls(plan.tools, reply)
                if calls:
                    message.update(content=content, tool_calls=calls)
                    reason = finish(plan.tools, calls, reason)
            if plan.echo is not None:
                message["content"] = plan.echo + (message["content"] or "")
            logprobs = None if steps is None else {"content": chat_content(text, steps)}
            choices.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason})
        else:
            logprobs = None
            if steps is not None:
                built = CompletionLogprobs(text)
                echoed = [] if plan.echo is None else [built.prompt(plan.prompt, ticket.prompt_steps or [], _top(plan))]
                logprobs = joined(*echoed, built.block(steps))
            choice = {"index": index, "text": (plan.echo or "") + reply, "logprobs": logprobs, "finish_reason": reason}
            choices.append(_with_prompt_logprobs(choice, plan, text, ticket.prompt_steps))
    response = {"id": meta.id, "object": meta.object, "created": meta.created, "model": meta.model,
                "choices": choices, "usage": _usage(prompt_tokens, completion_tokens)}
    if chat and plans[0].prompt_top is not None:  # one prompt: vLLM gives them on the response
        response["prompt_logprobs"] = prompt_logprobs_field(text, tickets[0].prompt_steps or [], plans[0].prompt_top)
    return JSONResponse(response)


class _Meta:
    def __init__(self, id_: str, created: int, model: str, chat: bool, prompt_tokens: int,
                 text: TextServices) -> None:
        self.id, self.created, self.model, self.chat, self.prompt_tokens = id_, created, model, chat, prompt_tokens
        self.text = text
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"
        self._pieces: dict[int, tuple[str, str]] = {}  # choice index -> piece(): the chunk's text before and after

    def piece(self, index: int, text: str) -> str:
        """chunk() of choice `index`'s piece of text with no logprobs, from a template made once per choice: the
        same bytes, without building and serializing the whole body for every token."""
        template = self._pieces.get(index)
        if template is None:
            marker = json.dumps("\x00piece\x00")
            template = self._pieces[index] = tuple(self.chunk([_delta(self, index, "\x00piece\x00", None)])
                                                   .split(marker))
        head, tail = template
        return head + json.dumps(text, ensure_ascii=False) + tail

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        body: dict[str, Any] = {"id": self.id, "object": self.chunk_object, "created": self.created,
                                "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return _event(body)


def _name_field(err: APIError, plans: list[Plan]) -> APIError:
    """A constraint that does not compile is refused when the engine takes the request, as a RequestError that
    knows no field: the 400 names the field the constraint came from."""
    field = plans[0].constraint_field
    if err.status != 400 or err.param is not None or err.code != "RequestError" or field is None:
        return err
    return APIError(400, f"{field}: {err.message}", param=field, code="invalid_structured_output")


def _top(plan: Plan) -> int:
    """The alternatives per token of a completion's logprobs."""
    return plan.logprobs or 0


def _with_prompt_logprobs(choice: dict[str, Any], plan: Plan, text: TextServices,
                          steps: list[Any] | None) -> dict[str, Any]:
    top = getattr(plan.body, "prompt_logprobs", None)
    if top is not None:
        choice["prompt_logprobs"] = prompt_logprobs_field(text, steps or [], top)
    return choice


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def _collect(ticket: Ticket) -> tuple[str, Done]:
    pieces = []
    while True:
        item = await ticket.items.get()
        if isinstance(item, Piece):
            pieces.append(item.text)
        elif isinstance(item, Done):
            if item.event.reason == "error":
                raise APIError(500, f"generation failed: {item.event.error}", code="generation_error")
            return "".join(pieces), item
        elif isinstance(item, Rejected):
            if isinstance(item.error, RequestError):  # the request's own fault (a schema that does not compile)
                raise from_poot(item.error)
            raise APIError(503, str(item.error), code="not_ready")


async def _abort_on_disconnect(request: Request, state: ServerState, tickets: list[Ticket]) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            state.abort(tickets)
            return


class _Choice:
    """What one streamed choice carries between its chunks."""

    def __init__(self, meta: _Meta, plan: Plan) -> None:
        self.tools = ToolStream(plan.tools) if meta.chat and plan.tools is not None else None
        self.logprobs = plan.logprobs is not None
        self.completion = None if meta.chat or not self.logprobs else CompletionLogprobs(meta.text)
        self.streamed = 0  # tokens whose logprobs went out

    def logprob_block(self, meta: _Meta, steps: list[Any]) -> dict[str, Any] | None:
        if not self.logprobs or not steps:
            return None
        self.streamed += len(steps)
        if self.completion is not None:
            return self.completion.block(steps)
        return {"content": chat_content(meta.text, steps)}


async def _stream(state: ServerState, tickets: list[Ticket], plans: list[Plan], meta: _Meta,
                  usage: bool) -> AsyncIterator[str]:
    """Every choice's items, as they come, merged into one event stream. The chunks of every item already
    queued go out in one write (a stream that fell behind catches up in one send, not one a token)."""
    merged: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(index: int, ticket: Ticket) -> None:
        while True:
            item = await ticket.items.get()
            await merged.put((index, item))
            if isinstance(item, Done | Rejected):
                return

    # one choice (the common case) reads its ticket's queue itself; several are merged by one task each
    single = tickets[0].items if len(tickets) == 1 else None
    pumps = [] if single is not None else [asyncio.create_task(pump(i, t)) for i, t in enumerate(tickets)]
    source: asyncio.Queue[Any] = single if single is not None else merged

    async def next_item() -> tuple[int, Any]:
        return (0, await single.get()) if single is not None else await merged.get()

    open_ = len(tickets)
    choices = [_Choice(meta, plan) for plan in plans]
    completion_tokens = 0
    out: list[str] = []  # chunks not yet written
    try:
        if meta.chat:
            out.append(meta.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None} for i in range(len(tickets))]))
            if plans[0].echo is not None:
                out.append(meta.chunk([_delta(meta, i, plans[0].echo, None) for i in range(len(tickets))]))
        started = [meta.chat] * len(tickets)  # whether the choice's first chunk (completions: its prompt's) went
        while open_:
            if out and source.empty():
                yield "".join(out)
                out = []
            index, item = await next_item()
            choice = choices[index]
            if not started[index] and (isinstance(item, Piece) or isinstance(item, Done)
                                       and item.event.reason != "error"):
                started[index] = True
                first = _prompt_chunk(meta, index, plans[index], choice, tickets[index].prompt_steps)
                if first is not None:
                    out.append(first)
            if isinstance(item, Piece):
                piece, calls = (item.text, []) if choice.tools is None else choice.tools.push(item.text)
                logprobs = choice.logprob_block(meta, [] if item.logprobs is None else [item.logprobs])
                if piece and logprobs is None:
                    out.append(meta.piece(index, piece))
                elif piece or (logprobs is not None and not calls):
                    out.append(meta.chunk([_delta(meta, index, piece, None, logprobs)]))
                    logprobs = None
                if calls:
                    out.append(meta.chunk([{"index": index, "delta": {"tool_calls": calls}, "logprobs": logprobs,
                                            "finish_reason": None}]))
            elif isinstance(item, Done):
                open_ -= 1
                if item.event.reason == "error":
                    yield "".join(out) + _event(error_body(f"generation failed: {item.event.error}", "server_error",
                                                           None, "generation_error"))
                    return
                generation = item.event.generation
                completion_tokens += len(generation.tokens)
                reason = finish_reason(item.event.reason)
                if choice.tools is not None:
                    rest, calls = choice.tools.end()
                    if rest:
                        out.append(meta.chunk([_delta(meta, index, rest, None)]))
                    if calls:
                        out.append(meta.chunk([{"index": index, "delta": {"tool_calls": calls}, "logprobs": None,
                                                "finish_reason": None}]))
                    if choice.tools.called:
                        reason = finish(choice.tools.tools, choice.tools.sent, reason)
                left = (generation.logprobs or [])[choice.streamed :]
                out.append(meta.chunk([_delta(meta, index, "", reason, choice.logprob_block(meta, left))]))
            elif isinstance(item, Rejected):
                yield "".join(out) + _event(error_body(str(item.error), "server_error", None, "server_stopping"))
                return
        if usage:
            out.append(meta.chunk([], _usage(meta.prompt_tokens, completion_tokens)))
        yield "".join(out) + "data: [DONE]\n\n"
    finally:  # the client went away (cancelled here) or an error ended the stream: nothing keeps running
        state.abort(tickets)
        for p in pumps:
            p.cancel()


def _prompt_chunk(meta: _Meta, index: int, plan: Plan, choice: _Choice, steps: list[Any] | None) -> str | None:
    """A streamed completion's first chunk when it echoes the prompt or gives prompt_logprobs."""
    if plan.echo is None and getattr(plan.body, "prompt_logprobs", None) is None:
        return None
    logprobs = None
    if plan.echo is not None and choice.completion is not None:
        logprobs = choice.completion.prompt(plan.prompt, steps or [], _top(plan))
    body = {"index": index, "text": plan.echo or "", "logprobs": logprobs, "finish_reason": None}
    return meta.chunk([_with_prompt_logprobs(body, plan, meta.text, steps)])


def _delta(meta: _Meta, index: int, text: str, reason: str | None,
           logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    if meta.chat:
        return {"index": index, "delta": {"content": text} if text or reason is None else {}, "logprobs": logprobs,
                "finish_reason": reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
