"""`poot serve --tp/--pp` (poot_core/server/ranks.py): rank 0 serves and tells the other ranks what it did to its
engine before each step. In process: a second engine following rank 0's messages runs the same steps and samples
the same tokens, unseeded requests and aborts included. End to end: the server over two gloo ranks (tensor and
pipeline) answers as one process does, and stops cleanly on SIGTERM."""

from __future__ import annotations

import pickle
import queue
import threading

import httpx
import pytest

from helpers.server import Server, start_server
from poot_core import Driver, DriverOptions, GenerateRequest, Layout, ModelHandle, Sampler, open_executor
from poot_core.driver.engine import FinishedEvent
from poot_core.server.ranks import Lead, follow

PROMPTS = [[5, 6, 7, 8], [9, 3, 4], [11, 12, 13, 14, 15, 16], [2, 3]]


class _Pipe:
    """Two ranks' broadcasts from rank 0, through a queue (each object pickled, as over the wire)."""

    def __init__(self) -> None:
        self.q: queue.Queue = queue.Queue()

    def rank(self, r: int) -> object:
        pipe = self

        class Rank:
            rank = r

            def broadcast_object(self, obj: object, src: int) -> object:
                if r == src:
                    pipe.q.put(pickle.dumps(obj))
                    return obj
                return pickle.loads(pipe.q.get(timeout=60))

        return Rank()


def _engine(path) -> object:
    options = DriverOptions(capacity=64, max_running=4, step_tokens=8, prefill_chunk=4)
    return Driver(ModelHandle.load(path), open_executor("cpu"), options).serve(Layout.PAGED)


def _finished(events: list, into: dict) -> None:
    for e in events:
        if isinstance(e, FinishedEvent):
            into[e.request_id] = (e.reason, e.generation.tokens)


def test_a_following_engine_runs_the_same_steps_and_samples_the_same_tokens(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    lead_engine, follower = _engine(path), _engine(path)
    pipe = _Pipe()
    lead = Lead(pipe.rank(0))
    seen: dict = {}
    follower_step = follower.step

    def recorded_step() -> list:
        events = follower_step()
        _finished(events, seen)
        return events

    follower.step = recorded_step
    thread = threading.Thread(target=follow, args=(follower, pipe.rank(1)))
    thread.start()
    samplers = [Sampler(temperature=1.0), Sampler(temperature=0.8, seed=3), Sampler.greedy(), Sampler(temperature=1.2)]
    requests = [GenerateRequest(p, max_new=12, sampler=s, ignore_eos=True) for p, s in zip(PROMPTS, samplers,
                                                                                          strict=True)]
    unseeded = lead.seeded(requests[0])
    assert unseeded.sampler.seed is not None and lead.seeded(requests[2]) is requests[2]
    ours: dict = {}
    for request in requests[:3]:  # the last one arrives later
        request = lead.seeded(request)
        lead.submitted(lead_engine.submit(request), request, {})
    steps = 0
    while lead_engine.in_flight or steps < 3:
        if steps == 2:
            request = lead.seeded(requests[3])
            lead.submitted(lead_engine.submit(request, priority=1), request, {"priority": 1})
        if steps == 4:
            lead_engine.abort(1)
            lead.aborted(1)
        lead.step()
        _finished(lead_engine.step(), ours)
        steps += 1
    lead.stop()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert seen == ours and len(ours) == 4
    assert ours[1][0] == "abort" and {ours[i][0] for i in (0, 2, 3)} == {"length"}


# --- end to end: the server over two ranks ----------------------------------------------------------------------

BODIES = [{"prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0, "logprobs": 2},
          {"prompt": [9, 3, 4], "max_tokens": 8, "temperature": 1.0, "seed": 7},
          {"prompt": "hello", "max_tokens": 6, "temperature": 1.0}]  # no seed: rank 0 draws one


def _serve(path, *flags: str) -> Server:
    """poot serve of the tiny checkpoint (helpers.server, whose own -m, name and window these flags replace)."""
    return start_server("-m", str(path), "--served-model-name", "tiny", "-c", "128", *flags)


def _answers(url: str) -> list[dict]:
    """The bodies sent at once (they share the engine's steps)."""
    out: list = [None] * len(BODIES)

    def send(i: int) -> None:
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", **BODIES[i]}, timeout=300)
        out[i] = (r.status_code, r.json())

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(BODIES))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.fixture(scope="module")
def one_process(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    server = _serve(path)
    try:
        yield path, _answers(server.url)
    finally:
        server.stop()


@pytest.mark.parametrize("flags", [("--tp", "2"), ("--pp", "2")])
def test_the_server_over_two_ranks_answers_as_one_process_does(one_process, flags):
    path, alone = one_process
    server = _serve(path, *flags)
    try:
        placed = _answers(server.url)
    finally:
        code = server.stop(timeout=120)
    assert [status for status, _ in placed] == [200, 200, 200], placed
    for (_, ours), (_, ref) in zip(placed[:2], alone[:2], strict=True):
        assert ours["choices"][0]["text"] == ref["choices"][0]["text"]
    ours_lp = placed[0][1]["choices"][0]["logprobs"]["token_logprobs"]
    ref_lp = alone[0][1]["choices"][0]["logprobs"]["token_logprobs"]
    assert max(abs(a - b) for a, b in zip(ours_lp, ref_lp, strict=True)) < 1e-4
    assert placed[2][1]["usage"]["completion_tokens"] == 6
    assert code == 0  # SIGTERM went to rank 0, which drained and told the other rank to stop


@pytest.mark.parametrize("arch,flags", [("qwen2_5_vl", ("--tp", "2")), ("qwen2_5_vl", ("--pp", "2")),
                                        ("idefics3", ("--tp", "2")), ("gemma3", ("--tp", "2"))])
def test_the_server_over_two_ranks_answers_chats_with_images(tmp_path_factory, arch, flags):
    """A vision-language checkpoint served over two ranks (Qwen2.5-VL ropes by M-RoPE sections, which the
    tensor-parallel split follows by heads; Gemma 3's image tokens attend both ways): rank 0 runs the vision tower
    on weights of its own (the ranks' shares hold only the text model's) and the other rank gets the features with
    the request; a chat with an image is answered as VisionLanguageModel.chat answers it."""
    import base64
    import io

    from poot_family_vision.runtime import VisionLanguageModel

    from helpers import gemma3_vision, qwen25vl, vision

    build = {"idefics3": vision.chat_checkpoint, "qwen2_5_vl": qwen25vl.chat_checkpoint,
             "gemma3": gemma3_vision.chat_checkpoint}
    path = build[arch](tmp_path_factory.mktemp(f"{arch}-placed"))[0]
    buf = io.BytesIO()
    vision.IMAGES[0].save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What is this?"}]}]
    server = start_server("-m", str(path), "--served-model-name", "tiny", *flags)
    try:
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=300,
                       json={"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0})
    finally:
        code = server.stop(timeout=120)
    assert r.status_code == 200, r.text
    vlm = VisionLanguageModel.load(path)
    ids, _ = vlm.chat(messages, max_new=6)
    assert r.json()["choices"][0]["message"]["content"] == vlm.handle.text().decode(ids, skip_special=False)
    assert code == 0
