"""Idefics3 / SmolVLM against transformers on tiny random checkpoints and Pillow-made images: pixel values
equal the Idefics3 (Pillow) image processor's, the vision tower and the whole prompt's logits match the float32
forward, greedy tokens equal."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from poot_family_vision.preprocess import ImageSettings, load_image, pixel_values
from poot_family_vision.runtime import VisionLanguageModel

from helpers import tiny, vision
from poot_core import ModelHandle, RequestError

IMAGE_TOKEN, AROUND, GLOBAL = vision.IMAGE_TOKEN, 251, 252  # prompts built by id; the chat test's from its tokenizer
IMAGE_SIZE, TOKENS_PER_IMAGE = vision.IMAGE_SIZE, vision.TOKENS_PER_IMAGE


IMAGES = vision.IMAGES


@pytest.fixture(scope="module", params=["idefics3", "smolvlm"])
def checkpoint(request, tmp_path_factory):
    cfg, cls = vision.configs(request.param)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    tiny._randomize(model, seed=3)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    tiny.save_tokenizer(path)
    vision.processor().save_pretrained(path)
    return path, model


def _prompt(images: int) -> list[int]:
    ids = [0, 17, 33, 48]
    for _ in range(images):
        ids += [AROUND, GLOBAL] + [IMAGE_TOKEN] * TOKENS_PER_IMAGE + [AROUND]
    return ids + [60, 71, 5]


def _reference_pixels(images: list[Image.Image]) -> np.ndarray:
    out = vision.processor()(images=[[i] for i in images], return_tensors="pt")
    return out["pixel_values"].reshape(-1, 3, IMAGE_SIZE, IMAGE_SIZE).numpy()


def test_pixel_values_equal_the_processor(checkpoint):
    path, _ = checkpoint
    settings = ImageSettings.from_dir(path, IMAGE_SIZE)
    ours = np.concatenate([pixel_values(load_image(i), settings) for i in IMAGES])
    ref = _reference_pixels(IMAGES)
    assert ours.shape == ref.shape
    assert np.array_equal(ours, ref)


def test_vision_tower_matches(checkpoint):
    path, model = checkpoint
    vlm = VisionLanguageModel.load(path)
    pixels = _reference_pixels(IMAGES)
    hidden, features = vlm.encode_images(pixels)
    with torch.no_grad():
        ref_hidden = model.model.vision_model(pixel_values=torch.from_numpy(pixels)).last_hidden_state
        ref_features = model.model.connector(ref_hidden)
    assert tiny.rel_error(hidden, ref_hidden) <= 1e-4
    assert tiny.rel_error(features, ref_features) <= 1e-4


def test_prompt_logits_match(checkpoint):
    path, model = checkpoint
    vlm = VisionLanguageModel.load(path)
    tokens = _prompt(len(IMAGES))
    ours = vlm.logits(tokens, IMAGES)
    pixels = torch.from_numpy(_reference_pixels(IMAGES))[None]
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([tokens]), pixel_values=pixels).logits[0]
    assert tiny.rel_error(ours, ref) <= 1e-4
    # the comparison can fail: other images give other logits at and after the image tokens
    other = vlm.logits(tokens, IMAGES[::-1])
    assert tiny.rel_error(other, ref) > 1e-2


def test_greedy_tokens_match(checkpoint):
    path, model = checkpoint
    vlm = VisionLanguageModel.load(path)
    tokens = _prompt(1)
    ours = vlm.generate(tokens, IMAGES[:1], max_new=8, ignore_eos=True)
    pixels = torch.from_numpy(_reference_pixels(IMAGES[:1]))[None]
    ids = torch.tensor([tokens])  # the attention mask given: generate would mask the bos id 0 as padding
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels, max_new_tokens=8,
                         do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=8)
    assert ours == out[0, len(tokens):].tolist()


def test_text_only_prompt_through_the_family(checkpoint):
    """Without images the checkpoint is its text model: the driver's own path gives transformers' logits."""
    from poot_core import Driver, DriverOptions, open_executor

    path, model = checkpoint
    tokens = [0, 17, 33, 48, 60, 71]
    driver = Driver(ModelHandle.load(path), open_executor("cpu"), DriverOptions(capacity=64, prefill_chunk=4))
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([tokens])).logits[0]
    assert tiny.rel_error(driver.logits(tokens), ref) <= 1e-4


@pytest.fixture(scope="module", params=[False, True], ids=["whole", "split"])
def chat_checkpoint(request, tmp_path_factory):
    return vision.chat_checkpoint(tmp_path_factory.mktemp("chat"), split=request.param)


def test_chat_with_images_matches_the_processor(chat_checkpoint, tmp_path):
    import base64
    import io

    path, model, processor = chat_checkpoint
    file = tmp_path / "tall.png"
    IMAGES[1].save(file)
    buf = io.BytesIO()
    IMAGES[0].save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "What is in these two pictures?"},
        {"type": "image_url", "image_url": {"url": str(file)}}]}]
    vlm = VisionLanguageModel.load(path)
    tokens, images = vlm.chat_prompt(messages)
    plain = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in these two pictures?"},
                                          {"type": "image"}]}]
    text = processor.apply_chat_template(plain, add_generation_prompt=True)
    ref = processor(text=text, images=[[IMAGES[0], IMAGES[1]]], return_tensors="pt")
    assert tokens == ref["input_ids"][0].tolist()
    frames = ref["pixel_values"].shape[1]
    assert frames == (8 if processor.image_processor.do_image_splitting else 2)  # 2x2 and 2x1 tiles + globals
    assert np.array_equal(vlm.pixel_values(images), ref["pixel_values"][0].numpy())
    ids, _ = vlm.chat(messages, max_new=6)
    ids_t = ref["input_ids"]
    out = model.generate(input_ids=ids_t, attention_mask=torch.ones_like(ids_t), pixel_values=ref["pixel_values"],
                         max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=6)
    assert ids == out[0, ids_t.shape[1]:].tolist()


def test_bad_images_are_request_errors(checkpoint, tmp_path):
    path, _ = checkpoint
    vlm = VisionLanguageModel.load(path)
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png")
    for bad in (broken, "data:image/png;base64,!!!", "data:image/png;base64,AAAA", b"\x00\x01", 3):
        with pytest.raises(RequestError):
            vlm.pixel_values([bad])
    bomb = tmp_path / "bomb.png"  # 12000 x 8000 one-bit pixels: a few kB on disk, 288 MB as RGB
    Image.new("1", (12000, 8000)).save(bomb)
    with pytest.raises(RequestError, match="larger than"):
        vlm.pixel_values([bomb])
    with pytest.raises(RequestError):  # image tokens without as many features
        vlm.logits(_prompt(2), IMAGES[:1])


def test_image_to_a_text_only_model_is_a_request_error(tmp_path):
    handle = ModelHandle.load(tiny.build(tmp_path / "llama", "llama"))
    for part in ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                 {"type": "image", "image": "photo.png"}):
        messages = [{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]
        with pytest.raises(RequestError, match="reads text only"):
            handle.text().render_chat_value(messages)
    with pytest.raises(RequestError, match="takes no images"):
        VisionLanguageModel(handle)


def test_bf16_checkpoint_logits(tmp_path):
    """bf16 weights stay bf16: within 1e-4 of transformers' float32 forward over the same (bf16) weights and
    within 2e-2 of its bf16 forward."""
    cfg, cls = vision.configs("idefics3")
    torch.manual_seed(0)
    model = cls(cfg).eval()
    tiny._randomize(model, seed=3)
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    tiny.save_tokenizer(tmp_path)
    vision.processor().save_pretrained(tmp_path)
    vlm = VisionLanguageModel.load(tmp_path)
    assert vlm.weights["model.connector.modality_projection.proj.weight"].dtype == torch.bfloat16
    tokens = _prompt(2)
    ours = vlm.logits(tokens, IMAGES)
    pixels = torch.from_numpy(_reference_pixels(IMAGES))[None]
    wide = cls.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = wide(input_ids=torch.tensor([tokens]), pixel_values=pixels).logits[0]
        ref16 = model(input_ids=torch.tensor([tokens]), pixel_values=pixels.bfloat16()).logits[0].float()
    assert tiny.rel_error(ours, ref) <= 1e-4
    assert tiny.rel_error(ours, ref16) <= 2e-2
