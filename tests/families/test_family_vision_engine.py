"""Images through the serving engine (Layout.PAGED, what `poot serve` runs): a SmolVLM / Idefics3 request whose
image tokens carry the vision tower's features as prompt embeddings (VisionLanguageModel.request) gives the
tokens and first logits of VisionLanguageModel.generate on the same image, with other requests (text only,
other images, two images in one prompt) sharing its steps, its prompt prefilled in chunks that split an image's
tokens, the prefix cache shared only by requests with the same image, and preemption recomputing the image rows.
Gemma 3's images run whole in one step (their tokens attend to each other both ways), Qwen2.5-VL's rope by its
M-RoPE positions. A text family refuses embeddings at submit; so does any family malformed ones."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from poot_family_vision.runtime import VisionLanguageModel

from helpers import gemma3_vision as g3
from helpers import qwen25vl as q25
from helpers import vision
from poot_core import (
    Driver,
    DriverOptions,
    GenerateRequest,
    Layout,
    ModelHandle,
    PromptEmbeddings,
    RequestError,
    Unsupported,
    open_executor,
)
from poot_core.errors import CapacityError

NEW, BOUND = 4, 1e-4


@pytest.fixture(scope="module", params=["smolvlm", "idefics3", "qwen2_5_vl", "gemma3"])
def checkpoint(request, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen2_5_vl":
        return q25.chat_checkpoint(path)[0]  # its tokenizer holds the image token (the engine streams the text)
    if request.param == "gemma3":
        return g3.chat_checkpoint(path)[0]
    return vision.checkpoint(path, request.param)


def _engine(handle: ModelHandle, **options):
    """A serving driver with small chunks and steps (an image's 4 tokens cross chunk and step boundaries), and
    the runtime on the same executor and weights."""
    opts = DriverOptions(capacity=96, prefill_chunk=3, block_size=4, step_tokens=8, max_running=4)
    if handle.family.embedding_groups(handle.config()):  # Gemma 3: an image (16 tokens here) runs whole in a step
        opts.step_tokens = 20
    for k, v in options.items():
        setattr(opts, k, v)
    driver = Driver(handle, open_executor("cpu"), opts)
    engine = driver.serve(Layout.PAGED)
    engine.keep_logits = True
    return engine, VisionLanguageModel(handle, driver.executor, capacity=96, weights=driver.weights)


def _expected(vlm: VisionLanguageModel, prompt: list[int], images) -> tuple[list[int], np.ndarray]:
    return vlm.generate(prompt, images, max_new=NEW, ignore_eos=True), vlm.logits(prompt, images)[-1]


def _close(first, logits: np.ndarray) -> bool:
    return float(np.abs(np.asarray(first) - logits).max() / np.abs(logits).max()) <= BOUND


def _run(engine, requests: list[GenerateRequest]) -> list:
    ids = [engine.submit(r) for r in requests]
    done = {}
    while len(done) < len(ids):
        for event in engine.step():
            if hasattr(event, "generation"):
                done[event.request_id] = event.generation
    return [(done[i], engine.logits[i][0]) for i in ids]


def test_requests_with_images_equal_the_runtime(checkpoint):
    handle = ModelHandle.load(checkpoint)
    engine, vlm = _engine(handle)
    one, two = vision.IMAGES[:1], vision.IMAGES[1:2]
    cases = [(vision.prompt_for(vlm, imgs), imgs) for imgs in (one, two, vision.IMAGES, [])]
    requests = [vlm.request(p, imgs, max_new=NEW, ignore_eos=True) for p, imgs in cases]
    assert requests[-1].embeddings is None
    for (gen, first), (prompt, imgs) in zip(_run(engine, requests), cases, strict=True):
        tokens, logits = _expected(vlm, prompt, imgs)
        assert gen.tokens == tokens and _close(first, logits)
    # the comparison can fail: the prompt's logits with the image differ from its logits with a blank one
    frames, layouts = vlm.frames(one)
    blank = vlm.logits(cases[0][0], pixels=np.zeros_like(frames), layouts=layouts)[-1]
    assert float(np.abs(_expected(vlm, cases[0][0], one)[1] - blank).max()) > 1e-3


def test_the_prefix_cache_is_shared_only_by_the_same_image(checkpoint):
    handle = ModelHandle.load(checkpoint)
    engine, vlm = _engine(handle)
    one = vision.IMAGES[:1]
    other_image = [vision.IMAGES[0].transpose(0)]  # mirrored: the same size, so the same prompt tokens
    prompt = vision.prompt_for(vlm, one)
    (first, _), = _run(engine, [vlm.request(prompt, one, max_new=NEW, ignore_eos=True)])
    assert first.timings.reused_tokens == 0
    again, other = _run(engine, [vlm.request(prompt, one, max_new=NEW, ignore_eos=True),
                                 vlm.request(prompt, other_image, max_new=NEW, ignore_eos=True)])
    assert again[0].timings.reused_tokens > 0 and again[0].tokens == first.tokens
    assert other[0].timings.reused_tokens == 0  # same tokens, another image: no block of the first is read
    tokens, logits = _expected(vlm, prompt, other_image)
    assert other[0].tokens == tokens and _close(other[1], logits)


def test_a_preempted_request_recomputes_its_image_rows(checkpoint):
    """A pool of blocks for the longest of four prompts and two blocks more: sequences are preempted and
    recomputed from their requests, image rows included."""
    handle = ModelHandle.load(checkpoint)
    _, sizing = _engine(handle)
    cases = [(vision.prompt_for(sizing, imgs), imgs) for imgs in (vision.IMAGES, vision.IMAGES[1:2],
                                                                  vision.IMAGES[:1], vision.IMAGES[::-1])]
    engine, vlm = _engine(handle, kv_blocks=max(len(p) for p, _ in cases) // 4 + 3)
    results = _run(engine, [vlm.request(p, imgs, max_new=NEW, ignore_eos=True) for p, imgs in cases])
    assert engine.counters().preemptions > 0
    for (gen, first), (prompt, imgs) in zip(results, cases, strict=True):
        tokens, logits = _expected(vlm, prompt, imgs)
        assert gen.tokens == tokens and _close(first, logits)


def test_malformed_embeddings_and_other_layouts_are_refused(checkpoint):
    handle = ModelHandle.load(checkpoint)
    engine, vlm = _engine(handle)
    good = vlm.request(vision.prompt_for(vlm, vision.IMAGES[:1]), vision.IMAGES[:1], max_new=NEW)
    e = good.embeddings
    rows, values, positions = e.rows, e.values, e.positions
    bad = {
        "inside the prompt": PromptEmbeddings(rows + 200, values, positions, e.offset),
        "increase": PromptEmbeddings(rows[::-1].copy(), values, positions, e.offset),
        "rows of": PromptEmbeddings(rows, values[:, :-1], positions, e.offset),
        "not finite": PromptEmbeddings(rows, np.full_like(values, np.nan), positions, e.offset),
    }
    if positions is None:  # one position a token: none may be given
        bad["give no positions"] = PromptEmbeddings(rows, values, np.zeros((3, len(good.prompt)), np.int64))
    else:  # M-RoPE: positions by section are needed, of the prompt's length
        bad["in 3 sections"] = PromptEmbeddings(rows, values)
        bad["expected"] = PromptEmbeddings(rows, values, positions[:, :-1], e.offset)
    for message, e in bad.items():
        with pytest.raises(RequestError, match=message):
            engine.submit(GenerateRequest(good.prompt, max_new=NEW, embeddings=e))
    assert engine.in_flight == 0
    with pytest.raises(Unsupported, match="contiguous"):
        Driver(handle, open_executor("cpu"), DriverOptions(capacity=64)).generate(good)


def test_a_text_family_refuses_embeddings(tiny_checkpoint):
    handle = ModelHandle.load(tiny_checkpoint("llama"))
    engine = Driver(handle, open_executor("cpu"), DriverOptions(capacity=64)).serve(Layout.PAGED)
    hidden = handle.config().hidden_size
    request = GenerateRequest([0, 17, 33, 48, 5], max_new=2,
                              embeddings=PromptEmbeddings(np.array([2]), np.zeros((1, hidden), np.float32)))
    with pytest.raises(Unsupported, match="prompt embeddings for llama"):
        engine.submit(request)


def test_an_image_that_cannot_run_in_one_step_is_refused(tmp_path):
    """Gemma 3's image tokens attend to each other both ways, so each image runs whole in one step: an image
    longer than the step budget could never run."""
    path = g3.chat_checkpoint(tmp_path)[0]
    handle = ModelHandle.load(path)
    engine = Driver(handle, open_executor("cpu"), DriverOptions(capacity=96, step_tokens=8)).serve(Layout.PAGED)
    vlm = VisionLanguageModel(handle, engine.driver.executor, capacity=96, weights=engine.driver.weights)
    with pytest.raises(CapacityError, match="must run in one step"):
        engine.submit(vlm.request(vision.prompt_for(vlm, vision.IMAGES[:1]), vision.IMAGES[:1], max_new=2))


def test_an_image_that_needs_a_whole_step_gets_one_while_others_decode(tmp_path):
    """Gemma 3's 16-token image in steps of 16 tokens while three other requests decode: the step after the one
    that found no room for it keeps that room from decode, so its reply starts long before the others end (and
    equals the runtime's)."""
    path = g3.chat_checkpoint(tmp_path)[0]
    handle = ModelHandle.load(path)
    driver = Driver(handle, open_executor("cpu"), DriverOptions(capacity=96, prefill_chunk=4, block_size=4,
                                                               step_tokens=16, max_running=4))
    engine = driver.serve(Layout.PAGED)
    vlm = VisionLanguageModel(handle, driver.executor, capacity=96, weights=driver.weights)
    others = [engine.submit(GenerateRequest([0, 17 + i, 33, 48], max_new=30, ignore_eos=True)) for i in range(3)]
    for _ in range(3):  # their prompts have run: they decode
        engine.step()
    prompt = vision.prompt_for(vlm, vision.IMAGES[:1])
    rid = engine.submit(vlm.request(prompt, vision.IMAGES[:1], max_new=NEW, ignore_eos=True))
    finished: dict[int, object] = {}
    first_token_step, step = None, 0
    while len(finished) < 4:
        step += 1
        for event in engine.step():
            if event.request_id == rid and first_token_step is None and getattr(event, "token", -1) >= 0:
                first_token_step = step
            if hasattr(event, "generation"):
                finished[event.request_id] = event.generation
    assert first_token_step is not None and first_token_step <= 12, first_token_step
    assert finished[rid].tokens == vlm.generate(prompt, vision.IMAGES[:1], max_new=NEW, ignore_eos=True)
    assert all(len(finished[o].tokens) == 30 for o in others)
