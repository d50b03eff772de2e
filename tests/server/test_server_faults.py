"""Faults `poot serve` must survive, bounded in count and time, on 127.0.0.1: malformed bodies (hypothesis),
a flood past --max-queued, clients that disconnect mid-stream, and SIGTERM under load (requests that finish
within --drain end normally, the rest get an error event; none hangs, and the process exits)."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.server import MODEL_NAME

MAX_RUNNING, MAX_QUEUED = 8, 12
SHORT, LONG = 6, 1000  # tokens: well within the 8 s drain even on a loaded machine; far beyond it
ERROR_KEYS = {"message", "type", "param", "code"}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
COMPLETION = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "temperature": 0}
GUIDED = ["structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"]  # vLLM's
# Fields a mutation may set to anything; max_tokens and n only to values that cannot make a long request.
CHAT_FIELDS = ["model", "messages", "temperature", "top_p", "stop", "seed", "top_k", "min_p", "repetition_penalty",
               "stream_options", "tools", "tool_choice", "response_format", "presence_penalty", "logprobs",
               "ignore_eos", "max_completion_tokens", "logit_bias", *GUIDED]
COMPLETION_FIELDS = ["model", "prompt", "temperature", "top_p", "stop", "seed", "echo", "suffix", "best_of",
                     "logprobs", "min_p", "stream_options", "response_format", *GUIDED]
SMALL_OR_BAD = st.one_of(st.integers(max_value=0), st.integers(min_value=10**6), st.text(max_size=4),
                         st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([1, 2]))
SMALL_BAD_N = st.one_of(st.integers(max_value=0), st.integers(min_value=17), st.text(max_size=4),
                        st.sampled_from([1, 2]))


@pytest.fixture(scope="module")
def server(serve):
    return serve("--max-running", str(MAX_RUNNING), "--max-queued", str(MAX_QUEUED), "--drain", "8", "-c", "1024")


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def _check(r: httpx.Response) -> None:
    """Never a server error; every error is OpenAI's shape; a 200 is a whole answer."""
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert set(r.json()["error"]) == ERROR_KEYS, r.text
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]") or '"error"' in r.text
    else:
        assert "choices" in r.json()


def _mutated(base: dict, fields: list[str]) -> st.SearchStrategy:
    def apply(changes: list) -> dict:
        body = json.loads(json.dumps(base))
        for key, value in changes:
            if key.startswith("-"):
                body.pop(key[1:], None)
            else:
                body[key] = value
        return body

    change = st.one_of(st.tuples(st.sampled_from(fields), json_values),
                       st.tuples(st.sampled_from([f"-{k}" for k in base if k != "max_tokens"]), st.none()),
                       st.tuples(st.just("max_tokens"), SMALL_OR_BAD), st.tuples(st.just("n"), SMALL_BAD_N),
                       st.tuples(st.just("stream"), st.booleans()))
    return st.lists(change, min_size=1, max_size=3).map(apply)


MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "bot", 3]),
                                 "content": json_values}, optional={"name": json_values, "tool_calls": json_values})
FEW = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FEW
@given(body=_mutated(CHAT, CHAT_FIELDS))
def test_mutated_chat_bodies(http, body):
    _check(http.post("/v1/chat/completions", json=body))


@FEW
@given(messages=st.lists(MESSAGE, min_size=0, max_size=3))
def test_random_messages(http, messages):
    _check(http.post("/v1/chat/completions", json={**CHAT, "messages": messages}))


@FEW
@given(body=_mutated(COMPLETION, COMPLETION_FIELDS))
def test_mutated_completion_bodies(http, body):
    _check(http.post("/v1/completions", json=body))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/tokenize",
                             "/detokenize"]),
       raw=st.one_of(st.binary(max_size=40), json_values.map(lambda v: json.dumps(v).encode())))
def test_garbage_is_a_400(http, path, raw):
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    if path == "/v1/embeddings":  # no embedding model here: 404 or 400, in shape
        assert r.status_code in (400, 404)
    else:
        assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == ERROR_KEYS


def _wait_idle(server, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (server.metric("poot:num_requests_running"), server.metric("poot:num_requests_waiting"),
                server.metric("poot:kv_cache_usage_perc")) == (0, 0, 0):
            return
        time.sleep(0.2)
    raise AssertionError(f"not idle: {server.metrics()}")


def test_flood_past_the_queue_gets_429s_and_every_accepted_request_completes(server):
    _wait_idle(server)
    total, limit = 40, MAX_RUNNING + MAX_QUEUED
    body = {"model": MODEL_NAME, "prompt": "Count to ten:", "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    async def flood():
        async with httpx.AsyncClient(base_url=server.url, timeout=300,
                                     limits=httpx.Limits(max_connections=total)) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(total)))

    responses = asyncio.run(flood())
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(ok) + len(refused) == total
    assert len(ok) >= limit and refused  # a request is refused only while `limit` are in flight
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
    for r in ok:
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 8
    _wait_idle(server)


def test_clients_that_disconnect_mid_stream_are_aborted(server):
    _wait_idle(server)
    clients = MAX_RUNNING + MAX_QUEUED
    aborted = server.metric("poot:request_success_total", finished_reason="abort")
    body = {"model": MODEL_NAME, "prompt": "Write a long story about a dragon.", "max_tokens": 400,
            "temperature": 0, "ignore_eos": True, "stream": True}

    async def one(c: httpx.AsyncClient) -> bool:
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    return True  # leaving the block closes the connection mid-stream
        return False

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=300,
                                     limits=httpx.Limits(max_connections=clients)) as c:
            return await asyncio.gather(*(one(c) for _ in range(clients)))

    assert all(asyncio.run(run()))
    _wait_idle(server, timeout=60)
    assert server.metric("poot:request_success_total", finished_reason="abort") - aborted == clients
    assert server.metric("poot:kv_cache_blocks") > 0


@pytest.mark.parametrize("raw", [
    b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',  # a lone surrogate
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": ' + b"[" * 5000 + b"]" * 5000
    + b"}",
])
def test_hostile_json_is_a_400(http, raw):
    r = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == ERROR_KEYS


def _stream(url: str, max_tokens: int, got_first: threading.Event, out: list) -> None:
    body = {"model": MODEL_NAME, "prompt": "Tell me about the sea.", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    events = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    got_first.set()
    except httpx.HTTPError as exc:
        events.append(f"transport error: {exc!r}")
    got_first.set()
    out.append((max_tokens, events))


def test_sigterm_drains_then_exits(server):
    """Last in this module: it stops the module's server."""
    _wait_idle(server)
    results: list = []
    threads, firsts = [], []
    for max_tokens in (SHORT, SHORT, LONG, LONG):
        first = threading.Event()
        t = threading.Thread(target=_stream, args=(server.url, max_tokens, first, results))
        t.start()
        threads.append(t)
        firsts.append(first)
    for first in firsts:
        assert first.wait(120)
    time.sleep(0.2)
    server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a stream hung after SIGTERM"
    assert server.proc.wait(timeout=120) in (0, -signal.SIGTERM)
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/health", timeout=5)
    for max_tokens, events in results:
        if max_tokens == SHORT:  # finished within the drain: a whole answer
            assert events[-1] == "[DONE]", events
            assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        else:  # cut at the end of the drain: an error event, no silent end
            last = json.loads(events[-1])
            assert last["error"]["code"] == "server_stopping", events[-3:]
