"""`poot serve` through the official openai client (sync, async, streaming): greedy answers equal the offline
engine's tokens for the same prompts, usage counts are the engine's token counts, embeddings equal
SentenceEncoder's, tokenize/detokenize equal the model's tokenizer, and the metrics count what was served."""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import numpy as np
import openai
import pytest

from helpers import smollm
from helpers.encoders import DOCS, QUERY, build_cross_encoder, minilm_path
from helpers.server import CTX, MODEL_NAME
from poot_core import GenerateRequest, Sampler

MAX_NEW = 8
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a colour."}],
]
COMPLETION_PROMPTS = [*smollm.PROMPTS, [1, 504, 3458, 282]]
EMBED_TEXTS = ["a small domestic cat", "the stock market fell sharply today", "cat"]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    path = tmp_path_factory.mktemp("cross-bert")
    build_cross_encoder(path, "bert")
    return path


@pytest.fixture(scope="module")
def server(serve, cross_encoder):
    return serve("--embedding-model", str(minilm_path()), "--rerank-model", str(cross_encoder), "--max-running", "8")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=120)


def _chat_request(engine, messages, max_new=MAX_NEW, stops=(), sampler=None):
    text = engine.driver.handle.text()
    rendered = text.render_chat_value(messages)
    ids = text.encode_chat(rendered)
    return GenerateRequest(ids, max_new, sampler or Sampler.greedy(), [*stops, *rendered.stops])


def _completion_request(engine, prompt, max_new=MAX_NEW, stops=()):
    ids = prompt if isinstance(prompt, list) else engine.driver.handle.text().encode(prompt)
    return GenerateRequest(list(ids), max_new, Sampler.greedy(), list(stops))


@pytest.fixture(scope="module")
def expected(reference):
    """The offline engine's answers to every request these tests send, run as one batch (batched = solo); keyed
    by a name; each value is (prompt ids, Generation)."""
    requests = {f"chat{i}": _chat_request(reference, m) for i, m in enumerate(CHATS)}
    requests |= {f"text{i}": _completion_request(reference, p) for i, p in enumerate(COMPLETION_PROMPTS)}
    requests |= {f"short{i}": _completion_request(reference, p, 6) for i, p in enumerate(smollm.PROMPTS[:2])}
    requests["free"] = _completion_request(reference, smollm.PROMPTS[2], 16)
    requests["seeded"] = _chat_request(reference, CHATS[0], 10,
                                       sampler=Sampler(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=7))
    names = list(requests)
    generations = reference.generate_batch([requests[n] for n in names])
    return {n: (requests[n].prompt, g) for n, g in zip(names, generations, strict=True)}


REASON = {"eos": "stop", "stop": "stop", "length": "length"}


def test_models_lists_the_served_name_and_window(client):
    models = client.models.list().data
    assert models[0].id == MODEL_NAME
    assert models[0].model_extra["max_model_len"] == CTX
    assert [m.id for m in models[1:]] == [minilm_path().name, "cross-bert0"]


@pytest.mark.parametrize("which", range(len(CHATS)))
def test_greedy_chat_equals_the_engine(client, expected, which):
    ids, ref = expected[f"chat{which}"]
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHATS[which], max_tokens=MAX_NEW, temperature=0)
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == REASON[ref.stop_reason]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(ref.tokens))
    assert r.usage.total_tokens == len(ids) + len(ref.tokens)


def test_greedy_completions_equal_the_engine(client, expected):
    for i, prompt in enumerate(COMPLETION_PROMPTS):
        ids, ref = expected[f"text{i}"]
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_NEW, temperature=0)
        assert r.choices[0].text == ref.text, prompt
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(ref.tokens))


def test_a_list_of_prompts_and_n_choices(client, expected):
    prompts = smollm.PROMPTS[:2]
    r = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=6, temperature=0, n=2)
    refs = [expected[f"short{i}"] for i in range(2)]
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [refs[0][1].text] * 2 + [refs[1][1].text] * 2
    assert r.usage.prompt_tokens == sum(len(ids) for ids, _ in refs)
    assert r.usage.completion_tokens == 2 * sum(len(g.tokens) for _, g in refs)


def test_async_clients_at_once_equal_the_engine(server, expected):
    """Requests that share the engine's steps answer what each gives alone."""
    async def run():
        async with openai.AsyncOpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=120) as c:
            chats = [c.chat.completions.create(model=MODEL_NAME, messages=m, max_tokens=MAX_NEW, temperature=0)
                     for m in CHATS]
            texts = [c.completions.create(model=MODEL_NAME, prompt=p, max_tokens=MAX_NEW, temperature=0)
                     for p in smollm.PROMPTS]
            return await asyncio.gather(*chats, *texts)

    results = asyncio.run(run())
    want = [expected[f"chat{i}"][1].text for i in range(len(CHATS))]
    want += [expected[f"text{i}"][1].text for i in range(len(smollm.PROMPTS))]
    got = [r.choices[0].message.content for r in results[: len(CHATS)]]
    got += [r.choices[0].text for r in results[len(CHATS) :]]
    assert got == want


def test_streamed_chat_with_usage(client, expected):
    ids, ref = expected["chat0"]
    stream = client.chat.completions.create(model=MODEL_NAME, messages=CHATS[0], max_tokens=MAX_NEW, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [REASON[ref.stop_reason]]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(ids), len(ref.tokens))


def test_streamed_completion_ends_with_done(server, expected):
    _, ref = expected["text0"]
    body = {"model": MODEL_NAME, "prompt": smollm.PROMPTS[0], "max_tokens": MAX_NEW, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{server.base}/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == ref.text
    assert all("usage" not in c for c in chunks)  # no include_usage: no usage chunk


def test_stop_strings_end_the_answer_before_them(client, reference, expected):
    _, free = expected["free"]
    stop = free.text[6:9]
    ref = reference.generate_batch([_completion_request(reference, smollm.PROMPTS[2], 16, [stop])])[0]
    r = client.completions.create(model=MODEL_NAME, prompt=smollm.PROMPTS[2], max_tokens=16, temperature=0,
                                  stop=stop)
    assert ref.stop_reason == "stop" and stop not in ref.text
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_the_engines_draw(client, expected):
    """OpenAI's defaults (top-p 1, no top-k, no min-p) with a seed: the engine's own seeded draw."""
    _, ref = expected["seeded"]
    answers = [client.chat.completions.create(model=MODEL_NAME, messages=CHATS[0], max_tokens=10, temperature=0.9,
                                              seed=7).choices[0].message.content for _ in range(2)]
    assert answers == [ref.text, ref.text]


def test_tokenize_and_detokenize_are_the_models_tokenizer(server, reference):
    text = reference.driver.handle.text()
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL_NAME, "prompt": smollm.PROMPTS[1]}).json()
    assert r["tokens"] == text.encode(smollm.PROMPTS[1]) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == CTX
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == text.decode(r["tokens"])
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": CHATS[1]}).json()
    assert chat["tokens"] == _chat_reference_ids(text, CHATS[1])


def _chat_reference_ids(text, messages):
    return text.encode_chat(text.render_chat_value(messages))


def test_embeddings_equal_the_sentence_encoder(client, server):
    from poot_core import SentenceEncoder

    encoder = SentenceEncoder.load(minilm_path(), "cpu", rows=8)
    expected = encoder.embed(EMBED_TEXTS)
    r = client.embeddings.create(model=minilm_path().name, input=EMBED_TEXTS)
    got = np.array([d.embedding for d in r.data], dtype=np.float32)
    assert np.allclose(got, expected, atol=1e-6, rtol=0)
    tokens = sum(len(e.ids) for e in encoder.tokenizer.encode_batch(EMBED_TEXTS))
    assert r.usage.prompt_tokens == tokens
    raw = httpx.post(f"{server.base}/embeddings", json={"model": minilm_path().name, "input": EMBED_TEXTS[0],
                                                        "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.array_equal(decoded, got[0])


def test_rerank_equals_the_cross_encoder(server, cross_encoder):
    from poot_core import CrossEncoder

    expected = CrossEncoder.load(cross_encoder, "cpu", rows=8).rerank(QUERY, DOCS)
    r = httpx.post(f"{server.base}/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 3}, timeout=60).json()
    assert [x["index"] for x in r["results"]] == [i for i, _ in expected[:3]]
    assert np.allclose([x["relevance_score"] for x in r["results"]], [s for _, s in expected[:3]], atol=1e-5)
    assert r["results"][0]["document"]["text"] == DOCS[expected[0][0]]


def test_errors_in_openai_shape(client, server):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=CHATS[0], max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "gpt-4" in e.value.body["message"]
    long_prompt = " ".join(["word"] * (CTX + 10))
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt=long_prompt, max_tokens=4)
    n = len(httpx.post(f"{server.url}/tokenize", json={"prompt": long_prompt}).json()["tokens"])
    assert f"maximum context length is {CTX} tokens" in e.value.body["message"]
    assert f"{n} in the prompt" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # fits alone, not with max_tokens: both numbers named
        client.chat.completions.create(model=MODEL_NAME, messages=CHATS[0], max_tokens=CTX)
    assert f"{CTX} in the completion" in e.value.body["message"]
    for field, value in (("presence_penalty", 2.5), ("logit_bias", {"99999999": 1.0})):  # both out of range
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL_NAME, messages=CHATS[0], max_tokens=2, **{field: value})
        assert e.value.body["param"] == field
    r = httpx.post(f"{server.base}/chat/completions", content=b"{not json", headers={"content-type":
                                                                                      "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.get(f"{server.base}/no/such/route")
    assert r.status_code == 404 and "error" in r.json()


def test_metrics_count_what_was_served(client, server, expected):
    before = (server.metric("poot:prompt_tokens_total"), server.metric("poot:generation_tokens_total"),
              server.metric("poot:time_to_first_token_seconds_count"),
              server.metric("poot:inter_token_latency_seconds_count"))
    ids, ref = expected["short0"]
    client.completions.create(model=MODEL_NAME, prompt=smollm.PROMPTS[0], max_tokens=6, temperature=0)
    after = (server.metric("poot:prompt_tokens_total"), server.metric("poot:generation_tokens_total"),
             server.metric("poot:time_to_first_token_seconds_count"),
             server.metric("poot:inter_token_latency_seconds_count"))
    assert after[0] - before[0] == len(ids) and after[1] - before[1] == len(ref.tokens)
    m = server.metrics()  # every metric shown once a request was served (a labelled one only then)
    for name in ("poot:num_requests_running", "poot:num_requests_waiting", "poot:kv_cache_usage_perc",
                 "poot:prefix_cache_queries_total", "poot:prefix_cache_hits_total", "poot:prompt_tokens_total",
                 "poot:generation_tokens_total", "poot:time_to_first_token_seconds_bucket",
                 "poot:inter_token_latency_seconds_bucket", "poot:e2e_request_latency_seconds_bucket",
                 "poot:request_queue_time_seconds_bucket"):
        assert any(k.startswith(name) for k in m), name
    pieces = len(ref.tokens) - (ref.stop_reason == "eos")  # an end-of-sequence token is counted, not shown
    assert after[2] - before[2] == 1 and after[3] - before[3] == pieces - 1
    assert server.metric("poot:num_requests_running") == 0
    assert server.metric("poot:kv_cache_usage_perc") == 0.0
    assert server.metric("poot:recurrent_state_slots") == 0.0  # no recurrent layers
    assert server.metric("poot:recurrent_state_usage_perc") == 0.0


def test_metrics_show_recurrent_state_slots_in_use() -> None:
    """The slot gauges of a hybrid model's engine: slots in all and the fraction held."""
    from poot_core.server.bridge import EngineStats
    from poot_core.server.metrics import Metrics

    text = Metrics("m", lambda: EngineStats(running=3, state_slots=4, state_held=3)).render().decode()
    assert 'poot:recurrent_state_slots{model_name="m"} 4.0' in text
    assert 'poot:recurrent_state_usage_perc{model_name="m"} 0.75' in text


def test_response_format_json_schema_gives_a_reply_that_validates(client):
    """OpenAI's response_format with a JSON schema: the reply parses and validates (the constraint is the
    engine's, tests/driver/test_structured.py); a schema that cannot compile is a 400 in the error shape."""
    import jsonschema

    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 12}},
              "required": ["colour"], "additionalProperties": False}
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Name a colour as JSON."}], max_tokens=40,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    json_object = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": 'Reply with the JSON object {"a": 1}.'}],
        max_tokens=150, temperature=0, response_format={"type": "json_object"})
    assert json_object.choices[0].finish_reason == "stop"  # the object was complete before the limit
    assert isinstance(json.loads(json_object.choices[0].message.content), dict)
    for bad in ({"type": "json_schema", "json_schema": {"name": "c", "schema": {"type": "no-such-type"}}},
                {"type": "json_schema"}, {"type": "xml"}):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4, response_format=bad)
        assert err.value.status_code == 400 and err.value.body["message"]
