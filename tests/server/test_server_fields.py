"""`poot serve`'s logit_bias (chat and completions), echo and prompt log-probabilities (completions and chat), an
explicit --tool-call-parser (mistral), and the field named by a constraint's compile error, through the official
openai client.

logit_bias is checked against a float64 numpy formula (logits + bias, then argmax) on the logits the offline
engine recorded for each token, and the reply against the offline engine's under the same bias; prompt
log-probabilities against torch.log_softmax of the offline Driver's logits on the prompt."""

from __future__ import annotations

import json

import httpx
import numpy as np
import openai
import pytest
import torch

from helpers.server import MODEL_NAME, offline
from poot_core import GenerateRequest, Sampler

NEW = 8
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server(serve):
    return serve("--max-running", "4", "--tool-call-parser", "mistral")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=120)


def _text(engine):
    return engine.driver.handle.text()


def _biased(engine, ids: list[int], stops: list[str], bias: dict[int, float]):
    """The offline engine's greedy reply under `bias`, each token checked against numpy's argmax of its recorded
    logits plus the bias; and the plain greedy reply (the bias must change it, else nothing is tested)."""
    plain, _ = offline(engine, GenerateRequest(ids, NEW, Sampler.greedy(), list(stops)))
    generation, logits = offline(engine, GenerateRequest(ids, NEW, Sampler(temperature=0.0, logit_bias=bias),
                                                         list(stops)))
    shifted = logits.copy()
    for token, value in bias.items():
        shifted[:, token] += value
    assert generation.tokens == [int(t) for t in np.argmax(shifted, axis=1)]
    assert generation.tokens != plain.tokens
    return generation


def _bias_against(engine, ids: list[int], stops: list[str]) -> dict[int, float]:
    plain, _ = offline(engine, GenerateRequest(ids, NEW, Sampler.greedy(), list(stops)))
    return {plain.tokens[0]: -100.0, plain.tokens[1]: -4.0, 1000: 2.0}


def test_completion_logit_bias_follows_the_formula(client, reference):
    ids = _text(reference).encode(PROMPT)
    bias = _bias_against(reference, ids, [])
    want = _biased(reference, ids, [], bias)
    got = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=NEW, temperature=0,
                                    logit_bias={str(k): v for k, v in bias.items()})
    assert got.choices[0].text == want.text
    assert got.usage.completion_tokens == len(want.tokens)


def test_chat_logit_bias_follows_the_formula(client, reference):
    text = _text(reference)
    rendered = text.render_chat_value(CHAT)
    ids, stops = text.encode_chat(rendered), list(rendered.stops)
    bias = _bias_against(reference, ids, stops)
    want = _biased(reference, ids, stops, bias)
    got = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=NEW, temperature=0,
                                         logit_bias={str(k): v for k, v in bias.items()})
    assert got.choices[0].message.content == want.text
    streamed = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=NEW, temperature=0,
                                              logit_bias={str(k): v for k, v in bias.items()}, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want.text


def test_a_bias_over_100_is_clamped(client, reference):
    """vLLM clamps values to [-100, 100]: +500 on one token acts as +100 (here: that token every time)."""
    token = _text(reference).encode(" blue")[-1]
    got = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0,
                                    logit_bias={str(token): 500})
    want, _ = offline(reference, GenerateRequest(_text(reference).encode(PROMPT), 3,
                                                 Sampler(temperature=0.0, logit_bias={token: 100.0})))
    assert got.choices[0].text == want.text


def test_bad_logit_bias_is_a_400_naming_it(client, server, reference):
    vocab = _text(reference).vocab_size()
    for bias, words in (({str(vocab): 1.0}, ["out-of-vocab", str(vocab)]), ({"-3": 1.0}, ["out-of-vocab"]),
                        ({"abc": 1.0}, ["token ids"])):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, logit_bias=bias)
        assert e.value.body["param"] == "logit_bias", e.value.body
        assert all(w in e.value.body["message"] for w in words), e.value.body
    r = httpx.post(f"{server.base}/chat/completions", json={"messages": CHAT, "max_tokens": 2,
                                                            "logit_bias": {"1": "lots"}})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("logit_bias")


# --- echo and prompt log-probabilities (completions) --------------------------------------------------------
TOP = 3
BOUND = 1e-4  # float32 logits of the same prompt, in the server and here


@pytest.fixture(scope="module")
def prompt_logp(reference):
    """The prompt's ids and torch.log_softmax of the offline Driver's logits on it (row i predicts token i+1)."""
    ids = _text(reference).encode(PROMPT)
    logits = torch.from_numpy(reference.driver.logits(ids)).double()
    return ids, torch.log_softmax(logits, dim=-1)


def test_echo_puts_the_prompt_before_the_reply(client, reference):
    ids = _text(reference).encode(PROMPT)
    want, _ = offline(reference, GenerateRequest(ids, NEW, Sampler.greedy()))
    got = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=NEW, temperature=0, echo=True)
    assert got.choices[0].text == PROMPT + want.text
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == len(want.tokens)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=NEW, temperature=0, echo=True)
    assert by_ids.choices[0].text == _text(reference).decode(ids) + want.text


def _check_prompt_part(reference, logprobs, ids, logp):
    n = len(ids)
    decoded = [_text(reference).decode([t]) for t in ids]
    assert logprobs.tokens[:n] == decoded
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # nothing predicts it
    for i in range(1, n):
        assert abs(logprobs.token_logprobs[i] - logp[i - 1, ids[i]].item()) < BOUND
        values, best = torch.topk(logp[i - 1], TOP)
        top = logprobs.top_logprobs[i]
        for t, v in zip(best.tolist(), values.tolist(), strict=True):
            assert abs(top[_text(reference).decode([t])] - v) < BOUND
    offsets = np.cumsum([0] + [len(t) for t in logprobs.tokens[:-1]])
    assert logprobs.text_offset == offsets.tolist()


def test_echo_with_logprobs_gives_the_prompt_tokens_first(client, reference, prompt_logp):
    ids, logp = prompt_logp
    got = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                    logprobs=TOP)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + got.usage.completion_tokens
    _check_prompt_part(reference, lp, ids, logp)
    assert "".join(lp.tokens) == got.choices[0].text
    streamed = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0,
                                              echo=True, logprobs=TOP, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == got.choices[0].text
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens
    assert streamed[0].choices[0].text == PROMPT  # the first chunk is the echoed prompt


def test_echo_with_no_new_tokens_scores_the_prompt(client, reference, prompt_logp):
    ids, logp = prompt_logp
    got = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True, logprobs=TOP)
    assert got.choices[0].text == PROMPT and got.usage.completion_tokens == 0
    assert len(got.choices[0].logprobs.tokens) == len(ids)
    _check_prompt_part(reference, got.choices[0].logprobs, ids, logp)
    with pytest.raises(openai.BadRequestError) as e:  # 0 new tokens only make sense with echo
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"


def _check_prompt_logprobs(reference, field, ids, logp, top):
    """vLLM's prompt_logprobs field against the log-softmax of the offline Driver's logits."""
    assert len(field) == len(ids) and field[0] is None
    for i in range(1, len(ids)):
        entry = field[i]
        own = entry[str(ids[i])]
        assert abs(own["logprob"] - logp[i - 1, ids[i]].item()) < BOUND
        assert own["rank"] == 1 + int((logp[i - 1] > logp[i - 1, ids[i]]).sum())
        assert own["decoded_token"] == _text(reference).decode([ids[i]])
        values, best = torch.topk(logp[i - 1], top)
        for rank, (t, v) in enumerate(zip(best.tolist(), values.tolist(), strict=True), 1):
            assert abs(entry[str(t)]["logprob"] - v) < BOUND
            assert entry[str(t)]["rank"] == rank or t == ids[i]


def test_prompt_logprobs_follow_log_softmax(client, reference, prompt_logp):
    ids, logp = prompt_logp
    got = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0,
                                    extra_body={"prompt_logprobs": 2})
    _check_prompt_logprobs(reference, got.choices[0].model_extra["prompt_logprobs"], ids, logp, 2)
    assert not got.choices[0].text.startswith(PROMPT)  # prompt_logprobs alone does not echo
    both = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0, n=2,
                                     extra_body={"prompt_logprobs": 2})  # each choice scores its own prefill
    for choice in both.choices:
        _check_prompt_logprobs(reference, choice.model_extra["prompt_logprobs"], ids, logp, 2)


# --- echo and prompt log-probabilities (chat: vLLM's extras) -------------------------------------------------
TURN = "The colour I name is"
CONTINUED = [*CHAT, {"role": "assistant", "content": TURN}]


def test_chat_echo_puts_the_assistant_turn_before_the_reply(client):
    def reply(messages, **extra):
        return client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=NEW, temperature=0,
                                              extra_body=extra or None).choices[0].message.content

    plain = reply(CONTINUED)
    assert reply(CONTINUED, echo=True) == TURN + plain
    assert reply(CHAT, echo=True) == reply(CHAT)  # the last message is the user's: nothing to echo
    streamed = list(client.chat.completions.create(model=MODEL_NAME, messages=CONTINUED, max_tokens=NEW,
                                                   temperature=0, stream=True, extra_body={"echo": True}))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == TURN + plain


def test_chat_prompt_logprobs_follow_log_softmax(client, reference):
    text = _text(reference)
    ids = text.encode_chat(text.render_chat_value(CHAT))
    logp = torch.log_softmax(torch.from_numpy(reference.driver.logits(ids)).double(), dim=-1)
    got = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2, temperature=0,
                                         extra_body={"prompt_logprobs": 3})
    assert got.usage.prompt_tokens == len(ids)
    _check_prompt_logprobs(reference, got.model_extra["prompt_logprobs"], ids, logp, 3)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2, stream=True,
                                       extra_body={"prompt_logprobs": 3})
    assert e.value.body["param"] == "prompt_logprobs"


# --- --tool-call-parser mistral ------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# SmolLM2 knows no Mistral format: a regex steers its reply into one, the server's mistral parser reads it
MISTRAL_CALL = r'\[TOOL_CALLS\]\[\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome|Oslo)"\}\}\]'


@pytest.mark.parametrize("stream", [False, True])
def test_the_mistral_parser_reads_calls_of_a_free_reply(client, stream):
    kwargs = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 60, "temperature": 0, "tools": [WEATHER],
              "extra_body": {"structured_outputs": {"regex": MISTRAL_CALL}}}
    if not stream:
        r = client.chat.completions.create(**kwargs)
        choice = r.choices[0]
        found = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        content, reason = choice.message.content, choice.finish_reason
    else:
        found, content, reason, chunks = [], "", None, 0
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for call in choice.delta.tool_calls or []:
                    chunks += 1
                    if call.index == len(found):
                        assert call.id and call.function.name
                        found.append((call.function.name, call.function.arguments or ""))
                    else:
                        found[-1] = (found[-1][0], found[-1][1] + (call.function.arguments or ""))
                reason = choice.finish_reason or reason
        assert chunks > 1  # the arguments in fragments
    assert reason == "tool_calls" and not content
    assert len(found) == 1 and found[0][0] == "get_weather"
    assert json.loads(found[0][1])["city"] in ("Paris", "Rome", "Oslo")


# --- a constraint that does not compile: the 400 names its field -----------------------------------------------
BAD_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}
NOT_COMPILING = [  # these pass the server's checks and fail to compile in the engine
    ("chat", {"guided_regex": "[a-"}, "guided_regex"),
    ("completions", {"guided_json": {"type": "wat"}}, "guided_json"),
    ("completions", {"structured_outputs": {"grammar": "start: ( 'a'"}}, "structured_outputs.grammar"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
     "response_format"),
    ("chat", {"tools": [BAD_TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools"),
]


@pytest.mark.parametrize("stream", [False, True])
def test_a_compile_error_names_its_field(client, stream):
    for endpoint, fields, param in NOT_COMPILING:
        with pytest.raises(openai.BadRequestError) as err:
            if endpoint == "chat":
                client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=4, stream=stream,
                                               extra_body=fields)
            else:
                client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, stream=stream,
                                          extra_body=fields)
        body = err.value.body
        assert body["param"] == param, (fields, body)
        assert "does not compile" in body["message"] or "admits no reply" in body["message"], body
