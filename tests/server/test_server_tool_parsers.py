"""The tool-call parsers of `poot serve` (vLLM's hermes, mistral, llama3_json, pythonic): well-formed replies are
read into OpenAI tool_calls (arguments checked with json.loads against the calls written), streams give the same
calls with their arguments in fragments, and hypothesis-made malformed replies are plain content, never an
exception (whole or streamed)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from poot_core import RequestError
from poot_core.driver.constraints import tool_call_constraint
from poot_core.server import tool_parsers
from poot_core.server.generation import Tools
from poot_core.server.tools import ToolStream

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TOOLS = [WEATHER, TIME]
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "CET", "nested": {"a": [1, "}"]}})]


def _mistral_old(calls) -> str:
    return "Sure. [TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls])


def _mistral_new(calls) -> str:
    return "Sure. " + "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls)


def _llama3(calls) -> str:
    return "<|python_tag|>" + "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)


def _pythonic(calls) -> str:
    return "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")" for n, a in calls) + "]"


def _hermes(calls) -> str:
    return "Sure. " + "".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>"
                              for n, a in calls)


WRITERS = {"hermes": _hermes, "mistral": _mistral_old, "llama3_json": _llama3, "pythonic": _pythonic}
CONTENT = {"hermes": "Sure. ", "mistral": "Sure. ", "llama3_json": None, "pythonic": None}


def _read(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def _stream(fmt: str, text: str, size: int, choice=None) -> tuple[str, list[tuple[str, str]], int]:
    """(content shown, (name, arguments) per call, deltas) of `text` pushed `size` characters at a time."""
    stream = ToolStream(Tools(TOOLS, choice, fmt, tool_call_constraint(TOOLS, choice)))
    shown, found, deltas = "", [], 0
    pieces = [stream.push(text[i : i + size]) for i in range(0, len(text), size)]
    for content, calls in [*pieces, stream.end()]:
        shown += content
        for d in calls:
            deltas += 1
            if d["index"] == len(found):
                found.append((d["function"]["name"], d["function"]["arguments"]))
            else:
                assert d["index"] == len(found) - 1 and "name" not in d["function"]
                found[-1] = (found[-1][0], found[-1][1] + d["function"]["arguments"])
    return shown, found, deltas


@pytest.mark.parametrize("fmt", list(WRITERS))
def test_each_format_reads_its_calls(fmt):
    text = WRITERS[fmt](CALLS)
    content, calls = tool_parsers.parse(fmt, text, TOOLS)
    assert content == CONTENT[fmt] and _read(calls) == CALLS
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    shown, found, deltas = _stream(fmt, text, 3)
    assert shown == (CONTENT[fmt] or "")
    assert [(n, json.loads(a)) for n, a in found] == CALLS
    if fmt != "pythonic":  # pythonic calls are read whole
        assert deltas > 2 * len(CALLS)


def test_the_newer_mistral_format_and_one_call():
    content, calls = tool_parsers.parse("mistral", _mistral_new(CALLS), TOOLS)
    assert content == "Sure. " and _read(calls) == CALLS
    _, found, deltas = _stream("mistral", _mistral_new(CALLS), 4)
    assert [(n, json.loads(a)) for n, a in found] == CALLS and deltas > 4
    one = '[TOOL_CALLS]{"name": "get_time", "arguments": {"zone": "UTC"}}'
    assert _read(tool_parsers.parse("mistral", one, TOOLS)[1]) == [("get_time", {"zone": "UTC"})]


def test_plain_replies_and_near_misses_are_content():
    for fmt, text in [("mistral", "no calls"), ("mistral", "[TOOL_CALLS] not json"),
                      ("llama3_json", '{"name": "unknown_tool", "parameters": {}}'),
                      ("pythonic", "[get_time(zone=os.environ)]"), ("pythonic", "[get_time('positional')]"),
                      ("pythonic", "[get_time(zone={1, 2})]"), ("pythonic", "[1, 2]"), ("pythonic", "plain words"),
                      ("hermes", "<tool_call>{broken</tool_call>")]:
        assert tool_parsers.parse(fmt, text, TOOLS) == (text, []), (fmt, text)
        shown, found, _ = _stream(fmt, text, 2)
        assert shown == text and found == [], (fmt, text)


def test_text_after_complete_calls_is_dropped_whole_and_streamed():
    for fmt, text in [("llama3_json", '{"name": "get_time", "parameters": {"zone": "UTC"}} and more'),
                      ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}] and more')]:
        assert _read(tool_parsers.parse(fmt, text, TOOLS)[1]) == [("get_time", {"zone": "UTC"})]
        _, found, _ = _stream(fmt, text, 3)
        assert [(n, json.loads(a)) for n, a in found] == [("get_time", {"zone": "UTC"})]


def test_a_forced_required_array_streams_in_fragments():
    text = json.dumps([{"name": n, "parameters": a} for n, a in CALLS])
    shown, found, deltas = _stream("llama3_json", text, 5, choice="required")
    assert shown == "" and [(n, json.loads(a)) for n, a in found] == CALLS and deltas > 4


def test_choose_by_name_or_template():
    assert tool_parsers.choose(None, "{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert tool_parsers.choose(None, "[AVAILABLE_TOOLS] ... [TOOL_CALLS]") == "mistral"
    assert tool_parsers.choose(None, "{{ messages }}") == "llama3_json"
    assert tool_parsers.choose("pythonic", "<tool_call>") == "pythonic"
    with pytest.raises(RequestError):
        tool_parsers.choose("nope", None)


# --- fuzz: malformed model output is content, never an exception -----------------------------------------------
PIECES = ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_tag|>", "<tool_call>", "</tool_call>", "<|python_start|>",
          "<|python_end|>", '{"name": "get_time"', '"arguments": ', '"parameters": ', "get_weather(", "city=", ")",
          "{", "}", "[", "]", '"', "\\", ",", ";", ":", " ", "\n", "1", "1e999", "NaN", "'x'", "**k", "None", "é"]
REPLIES = st.lists(st.sampled_from(PIECES) | st.text(max_size=4), max_size=30).map("".join)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fmt=st.sampled_from(tool_parsers.NAMES), text=REPLIES, size=st.integers(1, 7))
@example(fmt="pythonic", text="[TOOL_CALLS]]", size=1)  # found by this test in CI: not Python, a SyntaxError
def test_malformed_replies_never_raise(fmt, text, size):
    content, calls = tool_parsers.parse(fmt, text, TOOLS)
    if not calls:
        assert content == text
    for call in calls:
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
    shown, found, _ = _stream(fmt, text, size)
    if not found:
        assert shown == text  # nothing read as a call: all of it was shown as content
