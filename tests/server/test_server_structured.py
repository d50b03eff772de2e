"""Structured output through `poot serve` with the official openai client: vLLM's fields as the client sends them
in `extra_body` (structured_outputs {json, regex, choice, grammar, json_object} and the older guided_json,
guided_regex, guided_choice, guided_grammar) on /v1/chat/completions and /v1/completions, and response_format on
/v1/completions. Every reply is checked on its own terms: `jsonschema` for schemas, `re.fullmatch` for regexes,
membership for choices, Python's own expression parser and an independently written regex for grammars. Two
constraints in one request, malformed fields and constraints that do not compile are 400s in OpenAI's error
shape before any token (a stream too). A constraint that fails mid-generation (a matcher double in the server
process, helpers/dead_end_serve.py) ends only its own request: a 500 or an error event, while requests served
beside it give the offline engine's greedy tokens."""

from __future__ import annotations

import ast
import asyncio
import json
import re
from collections.abc import Callable

import jsonschema
import openai
import pytest

from helpers.dead_end_serve import DEAD_END
from helpers.paths import ROOT
from helpers.server import MODEL_NAME
from poot_core import GenerateRequest, Sampler

ERROR_KEYS = {"message", "type", "param", "code"}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "country": {"type": "string", "maxLength": 20}},
          "required": ["city", "country"], "additionalProperties": False}
YEAR = r"(?:19|20)[0-9]{2}"
CHOICES = ["yes", "no", "maybe"]
# llguidance's Lark: a short sum; checked by Python's parser (ast) and by a regex of the same language
LARK = """start: expr
expr: NUM (OP NUM){0,3}
NUM: /[1-9][0-9]{0,2}/
OP: " + " | " - " | " * "
"""
LARK_RE = re.compile(r"[1-9][0-9]{0,2}(?: [-+*] [1-9][0-9]{0,2}){0,3}")
# llama.cpp's GBNF: up to three colours
GBNF = """root ::= colour (", " colour){0,2}
colour ::= "red" | "green" | "blue" | "yellow"
"""
COLOURS_RE = re.compile(r"(?:red|green|blue|yellow)(?:, (?:red|green|blue|yellow)){0,2}")
CITY = [{"role": "user", "content": "Name the capital of France and its country as JSON."}]
ASK = [{"role": "user", "content": "Is the sky blue? Answer yes, no or maybe."}]
SUM = [{"role": "user", "content": "Write a short sum of small numbers."}]
OBJECT = [{"role": "user", "content": 'Reply with the JSON object {"a": 1}.'}]
MOON = "Q: In which year did people first walk on the Moon?\nA: In the year "
WET = "Question: is water wet? Answer with yes, no or maybe.\nAnswer: "
COLOURS = "Three colours of the rainbow: "


@pytest.fixture(scope="module")
def server(serve):
    return serve("--max-running", "4", command=(str(ROOT / "tests" / "helpers" / "dead_end_serve.py"),))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=120)


def _arithmetic(text: str) -> None:
    assert LARK_RE.fullmatch(text), text
    tree = ast.parse(text, mode="eval")
    assert all(isinstance(n, ast.Expression | ast.BinOp | ast.Constant | ast.operator) for n in ast.walk(tree))


def _schema(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


def _choice(text: str) -> None:
    assert text in CHOICES, text


def _object(text: str) -> None:
    assert isinstance(json.loads(text), dict), text


def _full(language: re.Pattern) -> Callable[[str], None]:
    def check(text: str) -> None:
        assert language.fullmatch(text), text

    return check


CHAT_CASES = [
    ({"guided_json": SCHEMA}, CITY, _schema),
    ({"structured_outputs": {"json": SCHEMA}}, CITY, _schema),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, CITY, _schema),  # vLLM takes a schema as a string too
    ({"guided_choice": CHOICES}, ASK, _choice),
    ({"structured_outputs": {"choice": CHOICES}}, ASK, _choice),
    ({"guided_regex": YEAR}, [{"role": "user", "content": "In which year did people first walk on the Moon?"}],
     _full(re.compile(YEAR))),
    ({"structured_outputs": {"grammar": LARK}}, SUM, _arithmetic),
    ({"guided_grammar": GBNF}, [{"role": "user", "content": "Name some colours."}],
     _full(COLOURS_RE)),
    ({"structured_outputs": {"json_object": True}}, OBJECT, _object),
]
COMPLETION_CASES = [
    ({"guided_regex": YEAR}, MOON, _full(re.compile(YEAR))),
    ({"structured_outputs": {"regex": YEAR}}, MOON, _full(re.compile(YEAR))),
    ({"structured_outputs": {"choice": CHOICES}}, WET, _choice),
    ({"guided_choice": CHOICES}, WET, _choice),
    ({"guided_grammar": GBNF}, COLOURS, _full(COLOURS_RE)),
    ({"structured_outputs": {"grammar": LARK}}, "2 + 3 = 5. A longer sum: ", _arithmetic),
    ({"guided_json": SCHEMA}, 'The capital of France as JSON: ', _schema),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}},
     'The capital of France as JSON: ', _schema),
]


@pytest.mark.parametrize("index", range(len(CHAT_CASES)))
def test_chat_guided_fields(client, index):
    fields, messages, check = CHAT_CASES[index]
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=150, temperature=0,
                                           extra_body=fields)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice  # every constraint here completes before the limit
    check(choice.message.content)


@pytest.mark.parametrize("index", range(len(COMPLETION_CASES)))
def test_completion_guided_fields_and_response_format(client, index):
    fields, prompt, check = COMPLETION_CASES[index]
    reply = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=80, temperature=0,
                                      extra_body=fields)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice
    check(choice.text)


def test_sampled_choices_and_streams(client):
    """Sampled replies (n=4, seeded) are each one of the choices; a stream's pieces add up to a reply that
    matches, and to the whole reply of the same greedy request."""
    sampled = client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=10, temperature=1.0, seed=3,
                                             n=4, extra_body={"guided_choice": CHOICES})
    assert len(sampled.choices) == 4
    for choice in sampled.choices:
        _choice(choice.message.content)
    for fields, prompt, language in (({"guided_regex": YEAR}, MOON, re.compile(YEAR)),
                                     ({"structured_outputs": {"grammar": GBNF}}, COLOURS, COLOURS_RE)):
        whole = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=40, temperature=0,
                                          extra_body=fields).choices[0].text
        pieces = [c.choices[0].text for c in client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=40, temperature=0, stream=True, extra_body=fields)]
        assert "".join(pieces) == whole and language.fullmatch(whole), (pieces, whole)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=10, temperature=0,
                                            stream=True, extra_body={"structured_outputs": {"choice": CHOICES}})
    chunks = list(stream)
    _choice("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    assert chunks[-1].choices[0].finish_reason == "stop"


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}
# (endpoint, extra fields, words the message must hold)
REFUSED = [
    ("chat", {"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, ["response_format", "guided_json"]),
    ("chat", {"structured_outputs": {"regex": "a+"}, "guided_json": SCHEMA},
     ["structured_outputs.regex", "guided_json"]),
    ("chat", {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
              "guided_regex": "a+"}, ["guided_regex", "tool_choice"]),
    ("completions", {"guided_regex": "a+", "guided_choice": ["a"]}, ["guided_regex", "guided_choice"]),
    ("completions", {"structured_outputs": {"regex": "a+", "choice": ["a"]}},
     ["structured_outputs.regex", "structured_outputs.choice"]),
    ("completions", {"response_format": {"type": "json_object"}, "structured_outputs": {"json": SCHEMA}},
     ["response_format", "structured_outputs.json"]),
    ("chat", {"guided_regex": 5}, ["guided_regex", "string"]),
    ("completions", {"guided_choice": []}, ["guided_choice", "choice"]),
    ("chat", {"structured_outputs": {"structural_tag": "{}"}}, ["structural_tag", "not supported"]),
    ("completions", {"guided_whitespace_pattern": " *"}, ["guided_whitespace_pattern", "not supported"]),
    ("completions", {"response_format": {"type": "xml"}}, ["response_format"]),
    # these pass the server's checks and fail to compile in the engine: still a 400 before any token
    ("chat", {"guided_regex": "[a-"}, ["regex", "does not compile"]),
    ("completions", {"guided_json": {"type": "wat"}}, ["JSON schema", "does not compile"]),
    ("chat", {"guided_grammar": "root ::= missing-rule"}, ["grammar", "does not compile"]),
    ("completions", {"structured_outputs": {"grammar": "start: ( 'a'"}}, ["grammar", "does not compile"]),
    ("completions", {"structured_outputs": {"regex": r"[^\x00-\U0010FFFF]"}}, ["regex", "admits no reply"]),
]


@pytest.mark.parametrize("stream", [False, True])
def test_two_constraints_or_a_bad_one_are_a_400_before_any_token(client, server, stream):
    before = server.metric("poot:generation_tokens_total")
    for endpoint, fields, words in REFUSED:
        with pytest.raises(openai.BadRequestError) as err:
            if endpoint == "chat":
                client.chat.completions.create(model=MODEL_NAME, messages=CITY, max_tokens=4, temperature=0,
                                               stream=stream, extra_body=fields)
            else:
                client.completions.create(model=MODEL_NAME, prompt=MOON, max_tokens=4, temperature=0,
                                          stream=stream, extra_body=fields)
        body = err.value.body
        assert err.value.status_code == 400 and set(body) == ERROR_KEYS, body
        assert body["type"] == "invalid_request_error", body
        assert all(w in body["message"] for w in words), (fields, body)
    assert server.metric("poot:generation_tokens_total") == before  # nothing was generated


def _greedy_chat(engine, messages, new):
    text = engine.driver.handle.text()
    rendered = text.render_chat_value(messages)
    return GenerateRequest(text.encode_chat(rendered), new, Sampler.greedy(), list(rendered.stops))


def test_a_failing_constraint_ends_only_its_own_request(server, reference):
    """Four requests at once: a chat and a completion without constraints, and two (whole and streamed) whose
    constraint's matcher stops allowing any token after a few (the double in helpers/dead_end_serve.py). The two
    failing ones get a 500 and an error event in OpenAI's shape; the others give the offline engine's tokens."""
    new = 16
    expected = reference.generate_batch([
        _greedy_chat(reference, CITY, new),
        GenerateRequest(reference.driver.handle.text().encode(MOON), new, Sampler.greedy())])

    async def run():
        client = openai.AsyncOpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=120)

        async def failing_whole():
            with pytest.raises(openai.InternalServerError) as err:
                await client.chat.completions.create(model=MODEL_NAME, messages=CITY, max_tokens=40, temperature=0,
                                                     extra_body={"guided_regex": DEAD_END})
            return err.value

        async def failing_stream():
            texts = []
            with pytest.raises(openai.APIError) as err:
                async for chunk in await client.completions.create(
                        model=MODEL_NAME, prompt=MOON, max_tokens=40, temperature=0, stream=True,
                        extra_body={"guided_regex": DEAD_END}):
                    texts.append(chunk.choices[0].text)
            return err.value, "".join(texts)

        results = await asyncio.gather(
            client.chat.completions.create(model=MODEL_NAME, messages=CITY, max_tokens=new, temperature=0),
            failing_whole(), failing_stream(),
            client.completions.create(model=MODEL_NAME, prompt=MOON, max_tokens=new, temperature=0))
        await client.close()
        return results

    chat, whole_error, (stream_error, streamed), completion = asyncio.run(run())
    assert whole_error.status_code == 500
    for error in (whole_error, stream_error):
        body = error.body
        assert set(body) == ERROR_KEYS and body["code"] == "generation_error", body
        assert "allows no next token" in body["message"], body
    assert re.fullmatch("[a-z]*", streamed), streamed  # what came before the failure followed the regex
    assert chat.choices[0].message.content == expected[0].text
    assert chat.usage.completion_tokens == len(expected[0].tokens)
    assert completion.choices[0].text == expected[1].text
    assert completion.usage.completion_tokens == len(expected[1].tokens)
    assert server.metric("poot:num_requests_running") == 0
