"""Gemma 3 (Gemma3ForConditionalGeneration) against transformers on tiny random checkpoints and Pillow-made
images of several sizes and aspect ratios: pixel values equal Gemma 3's (Pillow) image processor's, the vision
tower and the projected image features match the float32 forward, the whole prompt's logits match with the
bidirectional attention inside each image (f32 1e-4, bf16 2e-2), greedy tokens equal, chat prompts and
`poot caption` equal the Gemma3Processor's and transformers' generate."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from poot_family_vision.runtime import VisionLanguageModel

from helpers import gemma3_vision as g3
from helpers import tiny, vision
from poot_core import Driver, DriverOptions, ModelHandle, open_executor

# wide, tall, square, larger than the tower in both ways, very tall and narrow
IMAGES = [*vision.IMAGES, vision.image(64, 64, 3), vision.image(300, 180, 4), vision.image(33, 200, 5)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return g3.checkpoint(tmp_path_factory.mktemp("gemma3"))


def _prompt(images: int) -> list[int]:
    ids = [0, 17, 33, 48]
    for _ in range(images):
        ids += [g3.BOI] + [g3.IMAGE_TOKEN] * g3.TOKENS_PER_IMAGE + [g3.EOI, 55]
    return ids + [60, 71, 5]


def _reference_pixels(images) -> np.ndarray:
    return g3.processor()(images=images, return_tensors="pt")["pixel_values"].numpy()


def _reference_logits(model, tokens: list[int], pixels: np.ndarray, causal: bool = False) -> torch.Tensor:
    ids = torch.tensor([tokens])
    types = None if causal else (ids == model.config.image_token_id).long()  # the processor's token_type_ids
    with torch.no_grad():
        pv = torch.from_numpy(pixels).to(model.dtype)
        return model(input_ids=ids, pixel_values=pv, token_type_ids=types).logits[0].float()


def test_pixel_values_equal_the_processor(checkpoint):
    path, _ = checkpoint
    ours = VisionLanguageModel.load(path).pixel_values(IMAGES)
    ref = _reference_pixels(IMAGES)
    assert ours.shape == ref.shape == (len(IMAGES), 3, g3.IMAGE_SIZE, g3.IMAGE_SIZE)
    assert np.array_equal(ours, ref)


def test_vision_tower_and_projector_match(checkpoint):
    path, model = checkpoint
    pixels = _reference_pixels(IMAGES)
    hidden, features = VisionLanguageModel.load(path).encode_images(pixels)
    with torch.no_grad():
        ref_hidden = model.model.vision_tower(pixel_values=torch.from_numpy(pixels)).last_hidden_state
        ref_features = model.model.multi_modal_projector(ref_hidden)
    assert features.shape == (len(IMAGES), g3.TOKENS_PER_IMAGE, 64)
    assert tiny.rel_error(hidden, ref_hidden) <= 1e-4
    assert tiny.rel_error(features, ref_features) <= 1e-4


def test_prompt_logits_match(checkpoint):
    path, model = checkpoint
    vlm = VisionLanguageModel.load(path)
    tokens, images = _prompt(2), IMAGES[:2]
    ours = vlm.logits(tokens, images)
    pixels = _reference_pixels(images)
    assert tiny.rel_error(ours, _reference_logits(model, tokens, pixels)) <= 1e-4
    # the comparison can fail: a causal mask over the images, or other images, give other logits
    assert tiny.rel_error(ours, _reference_logits(model, tokens, pixels, causal=True)) > 1e-2
    assert tiny.rel_error(vlm.logits(tokens, images[::-1]), _reference_logits(model, tokens, pixels)) > 1e-2


def test_greedy_tokens_match(checkpoint):
    path, model = checkpoint
    tokens = _prompt(1)
    ours = VisionLanguageModel.load(path).generate(tokens, IMAGES[3:4], max_new=8, ignore_eos=True)
    ids = torch.tensor([tokens])
    types = (ids == g3.IMAGE_TOKEN).long()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), token_type_ids=types,
                         pixel_values=torch.from_numpy(_reference_pixels(IMAGES[3:4])), max_new_tokens=8,
                         do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=8)
    assert ours == out[0, len(tokens):].tolist()


def test_text_only_prompt_through_the_driver(checkpoint):
    """Without images the checkpoint is the Gemma 3 text model: the driver's chunked prefill gives transformers'
    logits (the sliding window of 6 is crossed)."""
    path, model = checkpoint
    tokens = [0, 17, 33, 48, 60, 71, 5, 9, 12, 40]
    driver = Driver(ModelHandle.load(path), open_executor("cpu"), DriverOptions(capacity=64, prefill_chunk=4))
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([tokens])).logits[0]
    assert tiny.rel_error(driver.logits(tokens), ref) <= 1e-4


def test_bf16_checkpoint_logits(tmp_path):
    """bf16 weights stay bf16: within 1e-4 of transformers' float32 forward over the same (bf16) weights and
    within 2e-2 of its bf16 forward."""
    path, model = g3.checkpoint(tmp_path, dtype=torch.bfloat16)
    vlm = VisionLanguageModel.load(path)
    assert vlm.weights["language_model.model.embed_tokens.weight"].dtype == torch.bfloat16
    tokens, images = _prompt(2), IMAGES[1:3]
    ours = vlm.logits(tokens, images)
    pixels = _reference_pixels(images)
    wide = type(model).from_pretrained(path, dtype=torch.float32).eval()
    assert tiny.rel_error(ours, _reference_logits(wide, tokens, pixels)) <= 1e-4
    assert tiny.rel_error(ours, _reference_logits(model, tokens, pixels)) <= 2e-2


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory):
    return g3.chat_checkpoint(tmp_path_factory.mktemp("gemma3-chat"))


def test_chat_with_images_matches_the_processor(chat_checkpoint, tmp_path):
    path, model, processor = chat_checkpoint
    file = tmp_path / "tall.png"
    IMAGES[4].save(file)
    messages = [{"role": "user", "content": [
        {"type": "image", "image": IMAGES[0]}, {"type": "text", "text": "What is in these two pictures?"},
        {"type": "image_url", "image_url": {"url": str(file)}}]}]
    vlm = VisionLanguageModel.load(path)
    tokens, images = vlm.chat_prompt(messages)
    plain = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in these two pictures?"},
                                          {"type": "image"}]}]
    text = processor.apply_chat_template(plain, add_generation_prompt=True)
    # the template writes the BOS itself (as apply_chat_template(tokenize=True) does: no second one)
    ref = processor(text=text, images=[[IMAGES[0], IMAGES[4]]], return_tensors="pt", add_special_tokens=False)
    assert tokens == ref["input_ids"][0].tolist()
    assert tokens.count(model.config.image_token_id) == 2 * g3.TOKENS_PER_IMAGE
    assert np.array_equal(vlm.pixel_values(images), ref["pixel_values"].numpy())
    ids, _ = vlm.chat(messages, max_new=6)
    out = model.generate(**ref, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0,
                         min_new_tokens=6)
    assert ids == out[0, ref["input_ids"].shape[1]:].tolist()


def test_caption_matches_transformers(chat_checkpoint, tmp_path, capsys):
    from poot_core.cli.main import main

    path, model, processor = chat_checkpoint
    image = tmp_path / "wide.png"
    IMAGES[3].save(image)
    assert main(["caption", "-m", str(path), str(image), "-p", "What is this?", "-n", "5"]) == 0
    reply = capsys.readouterr().out
    plain = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    ref = processor(text=processor.apply_chat_template(plain, add_generation_prompt=True), images=[[IMAGES[3]]],
                    return_tensors="pt", add_special_tokens=False)
    out = model.generate(**ref, max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0,
                         min_new_tokens=5)
    expected = processor.tokenizer.decode(out[0, ref["input_ids"].shape[1]:], skip_special_tokens=True)
    assert expected.strip() and reply == expected.strip() + "\n"


def test_pan_and_scan_as_the_processor_does_it(chat_checkpoint, checkpoint):
    """Off by default, as in Gemma3Processor, even where preprocessor_config.json turns it on (the processor's
    own default wins there); asked for, the crops of wide and tall images (4 and 2 here, none for the small
    one) as Gemma3Processor(do_pan_and_scan=True) makes them: pixels, prompt ids and the greedy reply."""
    path, model, processor = chat_checkpoint
    wide, tall, small = vision.image(1100, 300, 6), vision.image(280, 700, 7), IMAGES[0]
    vlm = VisionLanguageModel.load(path, pan_and_scan=True)
    messages = [{"role": "user", "content": [{"type": "image", "image": wide}, {"type": "text", "text": "Compare."},
                                             {"type": "image", "image": tall}, {"type": "image", "image": small}]}]
    tokens, images = vlm.chat_prompt(messages)
    plain = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Compare."},
                                          {"type": "image"}, {"type": "image"}]}]
    ref = processor(text=processor.apply_chat_template(plain, add_generation_prompt=True),
                    images=[[wide, tall, small]], return_tensors="pt", add_special_tokens=False, do_pan_and_scan=True)
    assert ref["pixel_values"].shape[0] == 3 + 4 + 2
    assert tokens == ref["input_ids"][0].tolist()
    assert np.array_equal(vlm.pixel_values(images), ref["pixel_values"].numpy())
    ids, _ = vlm.chat(messages, max_new=4)
    out = model.generate(**ref, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0,
                         min_new_tokens=4)
    assert ids == out[0, ref["input_ids"].shape[1]:].tolist()
    # a preprocessor_config.json that says do_pan_and_scan does not turn it on, for the processor or for poot
    import transformers as tf

    on = tf.Gemma3ImageProcessorPil(size={"height": g3.IMAGE_SIZE, "width": g3.IMAGE_SIZE}, do_pan_and_scan=True,
                                    pan_and_scan_min_crop_size=256, pan_and_scan_max_num_crops=4,
                                    pan_and_scan_min_ratio_to_activate=1.2)
    assert on(images=[wide], return_tensors="pt")["pixel_values"].shape[0] == 5  # the image processor alone pans
    over = tf.Gemma3Processor(image_processor=on, tokenizer=processor.tokenizer, image_seq_length=g3.TOKENS_PER_IMAGE)
    assert over(text="<start_of_image>", images=[[wide]], return_tensors="pt")["pixel_values"].shape[0] == 1
    base, _ = checkpoint
    config = json.loads((base / "preprocessor_config.json").read_text())
    (base / "preprocessor_config.json").write_text(json.dumps(config | {"do_pan_and_scan": True}))
    try:
        assert VisionLanguageModel.load(base).pixel_values([wide]).shape[0] == 1
    finally:
        (base / "preprocessor_config.json").write_text(json.dumps(config))


def test_released_config_reads_as_transformers_fills_it():
    """A released config.json (gemma-3-4b-it's shape) leaves most keys to transformers' defaults: read bare, it
    gives the parameters of the config transformers completes."""
    import transformers as tf
    from poot_family_vision.gemma3 import gemma3_config

    released = {"boi_token_index": 255999, "eoi_token_index": 256000, "eos_token_id": [1, 106],
                "image_token_index": 262144, "mm_tokens_per_image": 256,
                "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                                "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                                "sliding_window": 1024},
                "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                                  "model_type": "siglip_vision_model", "num_attention_heads": 16,
                                  "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}
    bare = gemma3_config("gemma3-vision", {"architectures": ["Gemma3ForConditionalGeneration"], **released})
    full = gemma3_config("gemma3-vision", tf.Gemma3Config(**released).to_dict())
    assert bare.params == full.params
    assert (bare.vocab_size, bare.max_positions) == (full.vocab_size, full.max_positions)
    assert bare.params.vision.tokens_per_image == 256 and bare.params.text.layer_window[5] is None
