"""`poot serve`'s logprobs, penalties and tool calls through the official openai client.

Log-probabilities are checked against torch.log_softmax of the logits the offline engine computes on the same
prompt (same file and window), penalties against a float64 numpy reimplementation of OpenAI's formula on the
offline engine's recorded logits, and tool calls are read back by the openai client from a reply constrained to
a call and validated against the tool's schema."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import openai
import pytest
import torch

from helpers import smollm
from helpers.server import MODEL_NAME, offline
from poot_core import GenerateRequest, Sampler
from poot_core.driver.constraints import tool_call_format, tool_call_start, tool_calls_from_reply
from poot_core.server.generation import Tools, chat_plan
from poot_core.server.schemas import ChatCompletionRequest
from poot_core.server.tools import ToolStream

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
NEW = 8
TOP = 5
BOUND = 1e-4  # the server's and the offline engine's float32 logits of the same steps
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(serve):
    return serve("--max-running", "4")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=120)


def _offline(engine, request: GenerateRequest):
    return offline(engine, request)


def _chat_ids(engine, messages):
    text = engine.driver.handle.text()
    rendered = text.render_chat_value(messages)
    return text.encode_chat(rendered), rendered.stops


def _decoded(engine, token: int) -> str:
    return engine.driver.handle.text().decode([token])


@pytest.fixture(scope="module")
def chat_reference(reference):
    ids, stops = _chat_ids(reference, CHAT)
    generation, logits = _offline(reference, GenerateRequest(ids, NEW, Sampler.greedy(), list(stops)))
    return generation, torch.log_softmax(torch.from_numpy(logits), dim=-1)


def _check_chat_entries(reference, entries, generation, logp):
    assert [e.token for e in entries] == [_decoded(reference, t) for t in generation.tokens]
    for i, (entry, token) in enumerate(zip(entries, generation.tokens, strict=True)):
        assert abs(entry.logprob - logp[i, token].item()) < BOUND
        assert entry.bytes == list(entry.token.encode("utf-8"))
        values, ids = torch.topk(logp[i], TOP)
        assert [t.token for t in entry.top_logprobs] == [_decoded(reference, t) for t in ids.tolist()]
        np.testing.assert_allclose([t.logprob for t in entry.top_logprobs], values.numpy(), atol=BOUND)


def test_chat_logprobs_equal_log_softmax_of_the_model(client, reference, chat_reference):
    generation, logp = chat_reference
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=NEW, temperature=0,
                                       logprobs=True, top_logprobs=TOP)
    assert r.choices[0].message.content == generation.text
    _check_chat_entries(reference, r.choices[0].logprobs.content, generation, logp)


def test_chat_logprobs_stream(client, reference, chat_reference):
    generation, logp = chat_reference
    stream = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=NEW, temperature=0,
                                            logprobs=True, top_logprobs=TOP, stream=True)
    entries, text = [], ""
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.logprobs is not None:
                entries.extend(choice.logprobs.content)
    assert text == generation.text
    _check_chat_entries(reference, entries, generation, logp)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs(client, reference, stream):
    prompt = smollm.PROMPTS[0]
    ids = reference.driver.handle.text().encode(prompt)
    generation, logits = _offline(reference, GenerateRequest(ids, NEW, Sampler.greedy()))
    logp = torch.log_softmax(torch.from_numpy(logits), dim=-1)
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=NEW, temperature=0, logprobs=3,
                                  stream=stream)
    tokens, values, tops, offsets, text = [], [], [], [], ""
    for chunk in (r if stream else [r]):
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                values += choice.logprobs.token_logprobs
                tops += choice.logprobs.top_logprobs
                offsets += choice.logprobs.text_offset
    assert text == generation.text
    assert tokens == [_decoded(reference, t) for t in generation.tokens]
    np.testing.assert_allclose(values, [logp[i, t].item() for i, t in enumerate(generation.tokens)], atol=BOUND)
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    for i, top in enumerate(tops):
        best = torch.topk(logp[i], 3).indices.tolist()
        assert set(top) == {_decoded(reference, t) for t in best} | {tokens[i]}


def test_logprob_and_penalty_limits(client):
    for field, value in (("top_logprobs", 21), ("presence_penalty", 2.5), ("frequency_penalty", -2.1)):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2, logprobs=True,
                                           **{field: value})
        assert e.value.body["param"] == field
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, logprobs=21)
    assert e.value.body["param"] == "logprobs"


def _penalised(logits, history, prompt_len, presence, frequency, repetition):
    x = np.array(logits, dtype=np.float64)
    for t in set(history):  # transformers' repetition penalty: every token of prompt and output
        x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    generated = history[prompt_len:]
    for t in set(generated):  # OpenAI: the generated tokens only
        x[t] -= frequency * generated.count(t) + presence
    return x


def test_penalties_follow_the_openai_formula(client, reference):
    prompt, new = smollm.PROMPTS[2], 24
    presence, frequency, repetition = 0.6, 1.2, 1.1
    ids = reference.driver.handle.text().encode(prompt)
    sampler = Sampler(temperature=0.0, presence_penalty=presence, frequency_penalty=frequency,
                      repeat_penalty=repetition, repeat_last_n=-1)
    generation, logits = _offline(reference, GenerateRequest(ids, new, sampler))
    history = list(ids)
    for row, token in zip(logits, generation.tokens, strict=True):
        assert token == int(np.argmax(_penalised(row, history, len(ids), presence, frequency, repetition)))
        history.append(token)
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=new, temperature=0,
                                  presence_penalty=presence, frequency_penalty=frequency,
                                  extra_body={"repetition_penalty": repetition})
    assert r.choices[0].text == generation.text
    plain = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=new, temperature=0)
    assert plain.choices[0].text != generation.text  # the penalties changed the reply


def test_named_tool_choice_gives_a_tool_call(client):
    kwargs = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 40, "temperature": 0, "tools": [WEATHER, TIME],
              "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    r = client.chat.completions.create(**kwargs)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].type == "function" and calls[0].id
    assert calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
    assert r.choices[0].finish_reason == "stop"  # OpenAI's and vLLM's reason for a named function
    # streamed: the arguments arrive in fragments as they are generated (vLLM), the first delta names the call
    fragments, first, reason = [], None, None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                assert call.index == 0
                first = first or call
                fragments.append(call.function.arguments or "")
            reason = choice.finish_reason or reason
    assert first.id and first.type == "function" and first.function.name == "get_weather"
    assert len(fragments) > 1 and "".join(fragments) == calls[0].function.arguments and reason == "stop"


def _add_deltas(found: list, deltas) -> None:
    """Streamed tool-call deltas into (name, arguments) per call: a call's first delta has its id, type and
    name, the next ones only fragments of its arguments."""
    for call in deltas:
        if call.index == len(found):
            assert call.id and call.type == "function" and call.function.name
            found.append((call.function.name, call.function.arguments or ""))
        else:
            assert call.index == len(found) - 1 and not call.function.name
            name, arguments = found[-1]
            found[-1] = (name, arguments + (call.function.arguments or ""))


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice(client, stream):
    kwargs = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 60, "temperature": 0, "tools": [WEATHER, TIME],
              "tool_choice": "required", "parallel_tool_calls": False}
    if not stream:
        r = client.chat.completions.create(**kwargs)
        calls, reason = r.choices[0].message.tool_calls, r.choices[0].finish_reason
        found = [(c.function.name, c.function.arguments) for c in calls]
    else:
        found, reason, chunks_with_calls = [], None, 0
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for choice in chunk.choices:
                if choice.delta.tool_calls:
                    chunks_with_calls += 1
                    _add_deltas(found, choice.delta.tool_calls)
                reason = choice.finish_reason or reason
        assert chunks_with_calls > 1  # the arguments arrive in fragments (vLLM)
    assert reason == "tool_calls" and len(found) == 1
    name, arguments = found[0]
    schema = {"get_weather": WEATHER, "get_time": TIME}[name]["function"]["parameters"]
    jsonschema.validate(json.loads(arguments), schema)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_a_bare_json_call_from_the_reply(client, stream):
    """SmolLM2's template has no tool-call tag, so "auto" reads a reply that is one JSON object naming a tool
    (the reply is steered there by response_format, the parse is the server's)."""
    call = {"type": "object", "properties": {"name": {"const": "get_weather"},
                                             "arguments": WEATHER["function"]["parameters"]},
            "required": ["name", "arguments"], "additionalProperties": False}
    kwargs = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 60, "temperature": 0, "tools": [WEATHER],
              "response_format": {"type": "json_schema", "json_schema": {"name": "call", "schema": call}}}
    if stream:
        content, found, reason = "", [], None
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                _add_deltas(found, choice.delta.tool_calls or [])
                reason = choice.finish_reason or reason
    else:
        r = client.chat.completions.create(**kwargs)
        content, reason = r.choices[0].message.content or "", r.choices[0].finish_reason
        found = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
    assert content == "" and reason == "tool_calls" and len(found) == 1 and found[0][0] == "get_weather"
    jsonschema.validate(json.loads(found[0][1]), WEATHER["function"]["parameters"])


def test_auto_with_a_plain_reply_streams_its_content(client):
    plain = client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=NEW, temperature=0)
    text = plain.choices[0].message.content
    assert text and not text.lstrip().startswith("{")
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, max_tokens=NEW, temperature=0, tools=[WEATHER], stream=True) if c.choices)
    assert streamed == text


def test_tool_choice_errors(client):
    for choice in ({"type": "function", "function": {"name": "nope"}}, "sometimes"):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=2, tools=[WEATHER],
                                           tool_choice=choice)
        assert e.value.body["param"] == "tool_choice"


def test_tool_choice_none_passes_no_tools(reference):
    text = reference.driver.handle.text()
    body = ChatCompletionRequest(messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=4)
    plan = chat_plan(text, body, 512)
    assert plan.tools is None and plan.constraint is None
    forced = chat_plan(text, ChatCompletionRequest(messages=ASK, tools=[WEATHER], tool_choice="required"), 512)
    assert forced.tools is not None and forced.constraint is not None
    auto = chat_plan(text, ChatCompletionRequest(messages=ASK, tools=[WEATHER]), 512)
    assert auto.tools is not None and auto.constraint is None


# --- free replies (tool_choice "auto"): the chat templates' formats ------------------------------------------
HERMES = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_hermes_and_json_replies_are_read():
    assert tool_call_format("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert tool_call_format("{{ messages }}") == "json"
    content, calls = tool_calls_from_reply(HERMES, [WEATHER], "hermes")
    assert content == "Let me check.\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris"})]
    two = HERMES + '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
    assert [c["function"]["name"] for c in tool_calls_from_reply(two, [WEATHER, TIME], "hermes")[1]] == \
        ["get_weather", "get_time"]
    assert tool_calls_from_reply("no call here", [WEATHER], "hermes") == ("no call here", [])
    broken = "<tool_call>{not json</tool_call>"
    assert tool_calls_from_reply(broken, [WEATHER], "hermes") == (broken, [])
    content, calls = tool_calls_from_reply('{"name": "get_weather", "parameters": {"city": "Oslo"}}', [WEATHER],
                                           "json")
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    other = '{"name": "unknown", "parameters": {}}'
    assert tool_calls_from_reply(other, [WEATHER], "json") == (other, [])


def test_a_streamed_hermes_reply_shows_content_until_the_call():
    assert tool_call_start("Let me <tool", "hermes") == len("Let me ")
    assert tool_call_start("  {", "json") == 0 and tool_call_start("Hi {", "json") == 4
    stream = ToolStream(Tools([WEATHER], None, "hermes"))
    pushed = [stream.push(HERMES[i : i + 3]) for i in range(0, len(HERMES), 3)]
    assert "".join(content for content, _ in pushed) == "Let me check.\n"
    rest, last = stream.end()
    deltas = [d for _, calls in pushed for d in calls] + last
    assert rest == "" and len(deltas) > 2 and all(d["index"] == 0 for d in deltas)  # arguments in fragments
    assert deltas[0]["function"]["name"] == "get_weather" and deltas[0]["id"]
    assert json.loads("".join(d["function"]["arguments"] for d in deltas)) == {"city": "Paris"}
    plain = ToolStream(Tools([WEATHER], None, "hermes"))
    shown = "".join(plain.push(p)[0] for p in ["a <", "b", " c"])
    assert shown + plain.end()[0] == "a <b c" and plain.end()[1] == []
