"""`poot serve` of a vision-language checkpoint (a tiny SmolVLM-style Idefics3 with SmolVLM's chat template, a
tiny Qwen2.5-VL and a tiny Gemma 3 with theirs)
through the official openai client: a chat whose messages hold images as data: URLs is answered with the tokens
VisionLanguageModel.chat gives for the same messages, streamed or not, beside text-only chats sharing its steps;
a file path or a web URL as an image is a 400 (the server reads no file and fetches nothing), and so is an
image part the model's template does not place."""

from __future__ import annotations

import asyncio
import base64
import io

import httpx
import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from poot_family_vision.runtime import VisionLanguageModel

from helpers import gemma3_vision as g3
from helpers import qwen25vl as q25
from helpers import vision
from helpers.server import MODEL_NAME

MAX_NEW = 6


def _url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _chat(images, question: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": _url(i)}} for i in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


@pytest.fixture(scope="module", params=["idefics3", "qwen2_5_vl", "gemma3"])
def checkpoint(request, tmp_path_factory):
    build = {"idefics3": vision.chat_checkpoint, "qwen2_5_vl": q25.chat_checkpoint, "gemma3": g3.chat_checkpoint}
    return build[request.param](tmp_path_factory.mktemp(f"{request.param}-chat"))[0]


@pytest.fixture(scope="module")
def server(serve, checkpoint):
    return serve("-m", str(checkpoint), "--max-running", "4")


def test_chats_with_images_equal_the_runtime(server, checkpoint):
    chats = [_chat(vision.IMAGES[:1], "What is this?"), _chat(vision.IMAGES, "Compare them."),
             _chat(vision.IMAGES[1:], "What is this?"), [{"role": "user", "content": "Just text."}]]
    client = openai.AsyncOpenAI(base_url=server.base, api_key="none")

    async def ask(messages, stream: bool) -> str:
        if not stream:
            r = await client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=MAX_NEW,
                                                     temperature=0)
            return r.choices[0].message.content
        pieces = []
        async for chunk in await client.chat.completions.create(model=MODEL_NAME, messages=messages, stream=True,
                                                                max_tokens=MAX_NEW, temperature=0):
            pieces.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
        return "".join(pieces)

    async def main():
        return await asyncio.gather(*(ask(m, i % 2 == 1) for i, m in enumerate(chats)))

    replies = asyncio.run(main())
    vlm = VisionLanguageModel.load(checkpoint)
    for messages, reply in zip(chats, replies, strict=True):
        ids, _ = vlm.chat(messages, max_new=MAX_NEW)
        # the server's text keeps special tokens, as the engine streams them
        assert reply == vlm.handle.text().decode(ids, skip_special=False), (ids, reply)
    # the first token's log-probability is the runtime's for this image, and not for the other one (the two
    # single-image chats differ only in their image; their greedy tokens may agree)
    r = openai.OpenAI(base_url=server.base, api_key="none").chat.completions.create(
        model=MODEL_NAME, messages=chats[0], max_tokens=1, temperature=0, logprobs=True)
    served = r.choices[0].logprobs.content[0].logprob
    first = vlm.chat(chats[0], max_new=1)[0][0]

    def logprob(messages) -> float:
        tokens, images = vlm.chat_prompt(messages)
        logits = vlm.logits(tokens, images)[-1].astype(np.float64)
        return float(logits[first] - logits.max() - np.log(np.exp(logits - logits.max()).sum()))

    assert abs(served - logprob(chats[0])) <= 1e-4
    assert abs(served - logprob(chats[2])) > 1e-3


def test_images_that_are_not_data_urls_are_refused(server, tmp_path):
    file = tmp_path / "a.png"
    vision.IMAGES[0].save(file)
    client = openai.OpenAI(base_url=server.base, api_key="none")
    for url in (str(file), "https://example.com/a.png"):
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                 {"type": "text", "text": "hi"}]}]
        with pytest.raises(openai.BadRequestError, match="data: URL"):
            client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2)
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    with pytest.raises(openai.BadRequestError, match="image"):
        client.chat.completions.create(model=MODEL_NAME, messages=bad, max_tokens=2)


_URLS = st.one_of(st.sampled_from(["data:image/png;base64,", "data:image/png;base64,AAAA", "data:,x",
                                   "data:image/png,abc", "data:image/png;base64,iVBORw0KGgo=", "file:///etc/passwd",
                                   "/etc/passwd", ""]),
                  st.text(max_size=20).map(lambda t: "data:image/png;base64," + t), st.text(max_size=12))
_PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("image_url"),
                           "image_url": st.one_of(st.fixed_dictionaries({"url": _URLS}), _URLS, st.none(),
                                                  st.integers())}),
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image", "input_image", "video_url", 3])},
                          optional={"text": st.text(max_size=8), "image": _URLS}),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(_PART, min_size=0, max_size=3))
def test_random_image_parts_never_break_the_server(server, parts):
    """Malformed and odd content parts: a 4xx in OpenAI's error shape or a whole answer, never a 5xx; the
    server stays up."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": parts}], "max_tokens": 2,
            "temperature": 0}
    r = httpx.post(f"{server.base}/chat/completions", json=body, timeout=120)
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    else:
        assert "choices" in r.json()
