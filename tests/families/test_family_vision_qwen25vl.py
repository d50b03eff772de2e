"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration) against transformers on tiny random checkpoints and
Pillow-made images of three sizes and aspect ratios (one shrunk by max_pixels): pixel values and grids equal
the Qwen2-VL (Pillow) image processor's, the vision tower (window attention in 2 x 2 windows of merged tokens,
one full-attention layer) and the merger match the float32 forward, the whole prompt's logits with M-RoPE match
(f32 1e-4, bf16 2e-2), greedy tokens equal generate's, a text-only prompt matches through the driver, chat
prompts and `poot caption` equal the processor's and generate's, and a corrupt image is a RequestError."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers as tf
from PIL import Image
from poot_family_vision.runtime import VisionLanguageModel

from helpers import qwen25vl as q25
from helpers import tiny, vision
from poot_core import Driver, DriverOptions, ModelHandle, RequestError, open_executor

IMAGE_TOKEN = q25.IMAGE_TOKEN
# wide (2 x 3 merged tokens: windows of 4 and 2), tall (4 x 1), large (shrunk to at most 16 merged tokens)
IMAGES = [*vision.IMAGES, vision.image(300, 180, 4)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen25vl")
    model = q25.build(q25.config(), seed=3)
    model.save_pretrained(path)
    tiny.save_tokenizer(path)
    q25.processor().save_pretrained(path)
    return path, model


def _reference(images) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    out = q25.processor()(images=images, return_tensors="pt")
    return out["pixel_values"].numpy(), [tuple(g) for g in out["image_grid_thw"].tolist()]


def _prompt(grids) -> list[int]:
    ids = [0, 17, 33, 48]
    for t, h, w in grids:
        ids += [q25.VISION_START] + [IMAGE_TOKEN] * (t * h * w // 4) + [q25.VISION_END, 55]
    return ids + [60, 71, 5]


def _reference_logits(model, tokens, pixels, grids) -> torch.Tensor:
    ids = torch.tensor([tokens])
    with torch.no_grad():
        return model(input_ids=ids, pixel_values=torch.from_numpy(pixels).to(model.dtype),
                     image_grid_thw=torch.tensor(grids), mm_token_type_ids=(ids == IMAGE_TOKEN).int(),
                     ).logits[0].float()


def test_pixel_values_equal_the_processor(checkpoint):
    path, _ = checkpoint
    ours, grids = VisionLanguageModel.load(path).frames(IMAGES)
    ref, ref_grids = _reference(IMAGES)
    assert grids == ref_grids == [(1, 4, 6), (1, 8, 2), (1, 6, 10)]
    assert ours.shape == ref.shape == (24 + 16 + 60, 3 * 2 * 14 * 14)
    assert np.array_equal(ours, ref)


def test_vision_tower_and_merger_match(checkpoint):
    path, model = checkpoint
    pixels, grids = _reference(IMAGES)
    hidden, features = VisionLanguageModel.load(path).encode_images(pixels, grids)
    visual = model.model.visual
    with torch.no_grad():
        ref = visual(torch.from_numpy(pixels), grid_thw=torch.tensor(grids))
        assert features.shape == (100 // 4, 64)
        assert tiny.rel_error(hidden[0], ref.last_hidden_state) <= 1e-4
        assert tiny.rel_error(features, ref.pooler_output) <= 1e-4
        # the windows matter: every layer attending over the whole image gives other features
        visual.fullatt_block_indexes = [0, 1]
        try:
            everywhere = visual(torch.from_numpy(pixels), grid_thw=torch.tensor(grids)).pooler_output
        finally:
            visual.fullatt_block_indexes = [1]
    assert tiny.rel_error(features, everywhere) > 1e-2


def test_prompt_logits_match(checkpoint):
    path, model = checkpoint
    vlm = VisionLanguageModel.load(path)
    images = IMAGES[:2]
    pixels, grids = _reference(images)
    tokens = _prompt(grids)
    ours = vlm.logits(tokens, images)
    ref = _reference_logits(model, tokens, pixels, grids)
    assert tiny.rel_error(ours, ref) <= 1e-4
    # the comparison can fail: plain positions (transformers without mm_token_type_ids) give other logits
    with torch.no_grad():
        plain = model(input_ids=torch.tensor([tokens]), pixel_values=torch.from_numpy(pixels),
                      image_grid_thw=torch.tensor(grids)).logits[0]
    assert tiny.rel_error(ours, plain) > 1e-3


def test_greedy_tokens_match(checkpoint):
    path, model = checkpoint
    pixels, grids = _reference(IMAGES[2:])
    tokens = _prompt(grids)
    ours = VisionLanguageModel.load(path).generate(tokens, IMAGES[2:], max_new=8, ignore_eos=True)
    ids = torch.tensor([tokens])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=torch.from_numpy(pixels),
                         image_grid_thw=torch.tensor(grids), mm_token_type_ids=(ids == IMAGE_TOKEN).int(),
                         max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=8)
    assert ours == out[0, len(tokens):].tolist()


def test_one_runtime_serves_requests_of_other_sizes_and_prepares_a_repeat_once(checkpoint, monkeypatch):
    """Requests of other image sizes and prompt lengths, in turn, through one runtime (its KV state and prepared
    programs kept): each gives what a fresh runtime gives it, and a request like an earlier one prepares nothing."""
    path, _ = checkpoint
    runtime = VisionLanguageModel.load(path)
    prepared = []
    prepare = runtime.executor.prepare
    monkeypatch.setattr(runtime.executor, "prepare",
                        lambda graph, weights: prepared.append(graph) or prepare(graph, weights))
    made = []  # programs each request of `runtime` prepared
    for images in ([IMAGES[0]], [IMAGES[1]], [IMAGES[0]]):
        tokens = _prompt(_reference(images)[1])
        fresh = VisionLanguageModel.load(path).generate(tokens, images, max_new=6, ignore_eos=True)
        before = len(prepared)
        assert runtime.generate(tokens, images, max_new=6, ignore_eos=True) == fresh
        made.append(len(prepared) - before)
    # the vision tower, the prefill and the decode step; the second size's tower and prefill; the repeat: none
    assert made == [3, 2, 0], made


def test_text_only_prompt(checkpoint):
    """Without images M-RoPE is the plain rope: the driver's chunked prefill and the runtime's prompt give
    transformers' logits."""
    path, model = checkpoint
    tokens = [0, 17, 33, 48, 60, 71, 5, 9, 12, 40]
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([tokens])).logits[0]
    driver = Driver(ModelHandle.load(path), open_executor("cpu"), DriverOptions(capacity=64, prefill_chunk=4))
    assert tiny.rel_error(driver.logits(tokens), ref) <= 1e-4
    assert tiny.rel_error(VisionLanguageModel.load(path).logits(tokens), ref) <= 1e-4


def test_bf16_checkpoint_logits(tmp_path):
    model = q25.build(q25.config(), seed=4).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    tiny.save_tokenizer(tmp_path)
    q25.processor().save_pretrained(tmp_path)
    vlm = VisionLanguageModel.load(tmp_path)
    assert vlm.weights["model.embed_tokens.weight"].dtype == torch.bfloat16
    images = IMAGES[:2]
    pixels, grids = _reference(images)
    tokens = _prompt(grids)
    ours = vlm.logits(tokens, images)
    wide = type(model).from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert tiny.rel_error(ours, _reference_logits(wide, tokens, pixels, grids)) <= 1e-4
    assert tiny.rel_error(ours, _reference_logits(model, tokens, pixels, grids)) <= 2e-2


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory):
    return q25.chat_checkpoint(tmp_path_factory.mktemp("qwen25vl-chat"))


def _chat_reference(model, full, content: list[dict[str, Any]], images, new: int) -> tuple[Any, list[int]]:
    text = full.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    ref = full(text=[text], images=images, return_tensors="pt")
    out = model.generate(**ref, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0,
                         min_new_tokens=new)
    return ref, out[0, ref["input_ids"].shape[1]:].tolist()


def test_chat_with_images_matches_the_processor(chat_checkpoint, tmp_path):
    path, model, full = chat_checkpoint
    file = tmp_path / "tall.png"
    IMAGES[1].save(file)
    messages = [{"role": "user", "content": [
        {"type": "image", "image": IMAGES[0]}, {"type": "text", "text": "What is in these two pictures?"},
        {"type": "image_url", "image_url": {"url": str(file)}}]}]
    vlm = VisionLanguageModel.load(path)
    tokens, images = vlm.chat_prompt(messages)
    plain = [{"type": "image"}, {"type": "text", "text": "What is in these two pictures?"}, {"type": "image"}]
    ref, expected = _chat_reference(model, full, plain, [IMAGES[0], IMAGES[1]], 6)
    assert tokens == ref["input_ids"][0].tolist()
    assert tokens.count(model.config.image_token_id) == (24 + 16) // 4
    assert np.array_equal(vlm.pixel_values(images), ref["pixel_values"].numpy())
    ids, _ = vlm.chat(messages, max_new=6)
    assert ids == expected


def test_caption_matches_transformers(chat_checkpoint, tmp_path, capsys):
    from poot_core.cli.main import main

    path, model, full = chat_checkpoint
    image = tmp_path / "large.png"
    IMAGES[2].save(image)
    assert main(["caption", "-m", str(path), str(image), "-p", "What is this?", "-n", "5"]) == 0
    reply = capsys.readouterr().out
    ref, ids = _chat_reference(model, full, [{"type": "image"}, {"type": "text", "text": "What is this?"}],
                               [IMAGES[2]], 5)
    expected = full.tokenizer.decode(ids, skip_special_tokens=True)
    assert expected.strip() and reply == expected.strip() + "\n"


def test_corrupt_image_is_a_request_error(checkpoint, tmp_path: Path):
    path, _ = checkpoint
    vlm = VisionLanguageModel.load(path)
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really a png" * 4)
    with pytest.raises(RequestError):
        vlm.generate([0, 5], [bad], max_new=2)
    with pytest.raises(RequestError):
        vlm.frames(["data:image/png;base64,AAAA"])
    # a prompt whose image tokens do not fit the images' grids is refused before any text step
    pixels, grids = _reference(IMAGES[:1])
    with pytest.raises(RequestError):
        vlm.logits(_prompt(grids)[:-6] + [5], IMAGES[:1])


def test_released_config_layout(checkpoint, tmp_path):
    """Released checkpoints keep the text fields at the top of config.json, with rope_scaling of type mrope: the
    same model for poot and for transformers."""
    path, model = checkpoint
    hf = json.loads((path / "config.json").read_text())
    text = hf.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = hf | {k: v for k, v in text.items() if k not in ("model_type", "architectures")} | {
        "rope_theta": rope["rope_theta"], "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    for file in path.iterdir():
        if file.name != "config.json":
            (tmp_path / file.name).symlink_to(file)
    (tmp_path / "config.json").write_text(json.dumps(flat))
    assert VisionLanguageModel.load(tmp_path).params == VisionLanguageModel.load(path).params
    pixels, grids = _reference(IMAGES[:1])
    tokens = _prompt(grids)
    released = tf.Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert tiny.rel_error(VisionLanguageModel.load(tmp_path).logits(tokens, IMAGES[:1]),
                          _reference_logits(released, tokens, pixels, grids)) <= 1e-4


def test_transparent_and_gray_images_as_the_processor_converts_them(checkpoint):
    """RGBA and palette images with transparency are composited onto white, grayscale widened, as transformers'
    convert_to_rgb does: pixel values equal the processor's."""
    path, _ = checkpoint
    rgba = IMAGES[0].convert("RGBA")
    alpha = np.full((rgba.height, rgba.width), 255, np.uint8)
    alpha[:, : rgba.width // 2] = 40  # half the image mostly transparent
    rgba.putalpha(Image.fromarray(alpha))
    palette = IMAGES[1].convert("P")
    palette.info["transparency"] = 0
    images = [rgba, palette, IMAGES[2].convert("L")]
    ours, grids = VisionLanguageModel.load(path).frames(images)
    ref, ref_grids = _reference(images)
    assert grids == ref_grids
    assert np.array_equal(ours, ref)
    # the comparison can fail: dropping the alpha channel gives other pixels
    assert not np.array_equal(VisionLanguageModel.load(path).frames([rgba.convert("RGB")])[0], _reference([rgba])[0])


def test_in_memory_weight_names(checkpoint, tmp_path):
    """A checkpoint saved under transformers 5's module names (model.language_model., model.visual.) reads the
    same: logits match transformers loading that copy."""
    from safetensors.torch import load_file, save_file

    path, _ = checkpoint
    renames = (("model.", "model.language_model."), ("visual.", "model.visual."))
    tensors = {}
    for name, value in load_file(path / "model.safetensors").items():
        new = next((to + name[len(old):] for old, to in renames if name.startswith(old)), name)
        tensors[new] = value
    assert "model.visual.patch_embed.proj.weight" in tensors and "lm_head.weight" in tensors
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    for file in path.iterdir():
        if file.name != "model.safetensors":
            (tmp_path / file.name).symlink_to(file)
    renamed = tf.Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path).eval()
    pixels, grids = _reference(IMAGES[:1])
    tokens = _prompt(grids)
    assert tiny.rel_error(VisionLanguageModel.load(tmp_path).logits(tokens, IMAGES[:1]),
                          _reference_logits(renamed, tokens, pixels, grids)) <= 1e-4
