"""Gemma 3 from llama.cpp's pair of files: a tiny random Gemma3ForConditionalGeneration (released layout) through
llama.cpp's own converter, text GGUF + `--mmproj` GGUF, against transformers on the same weights (the converter
keeps the projection in F16, so the reference's projection is rounded to F16 too): chat prompt ids equal the
Gemma3Processor's, pixels equal, tower 1e-4, prompt logits 1e-4, greedy reply equal. And the released layout's
Hugging Face directory itself."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from poot_family_vision.runtime import VisionLanguageModel

from helpers import gemma3_vision as g3
from helpers import tiny, vision
from poot_core import ModelHandle, Unsupported

IMAGES = [vision.IMAGES[0], vision.image(300, 180, 4)]
TEXT = "What is in these two pictures?"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3-gguf")
    path, model, processor = g3.chat_checkpoint(root / "hf")
    text, mmproj = g3.llama_cpp_pair(root, path)
    rounded = copy.deepcopy(model)
    w = rounded.model.multi_modal_projector.mm_input_projection_weight
    with torch.no_grad():
        w.copy_(w.half().float())
    return text, mmproj, rounded, processor, root / "released", model


def _messages():
    return [{"role": "user", "content": [{"type": "image", "image": IMAGES[0]}, {"type": "text", "text": TEXT},
                                         {"type": "image", "image": IMAGES[1]}]}]


def _reference(processor):
    plain = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TEXT}, {"type": "image"}]}]
    text = processor.apply_chat_template(plain, add_generation_prompt=True)
    return processor(text=text, images=[IMAGES], return_tensors="pt", add_special_tokens=False)


def test_pair_matches_transformers(pair):
    text, mmproj, model, processor, _, _ = pair
    vlm = VisionLanguageModel.load(text, mmproj=mmproj)
    assert vlm.config.source_format == "gguf"
    tokens, images = vlm.chat_prompt(_messages())
    ref = _reference(processor)
    assert tokens == ref["input_ids"][0].tolist()
    pixels = vlm.pixel_values(images)
    assert np.array_equal(pixels, ref["pixel_values"].numpy())
    hidden, features = vlm.encode_images(pixels)
    with torch.no_grad():
        ref_hidden = model.model.vision_tower(pixel_values=ref["pixel_values"]).last_hidden_state
        ref_features = model.model.multi_modal_projector(ref_hidden)
        ref_logits = model(**ref).logits[0]
    assert tiny.rel_error(hidden, ref_hidden) <= 1e-4
    assert tiny.rel_error(features, ref_features) <= 1e-4
    assert tiny.rel_error(vlm.logits(tokens, images), ref_logits) <= 1e-4


def test_pair_greedy_reply_matches(pair):
    text, mmproj, model, processor, _, _ = pair
    handle = ModelHandle.load(text)
    VisionLanguageModel(handle, mmproj=mmproj)  # a second model over the same handle reads the pair afresh
    ids, _ = VisionLanguageModel(handle, mmproj=mmproj).chat(_messages(), max_new=6)
    ref = _reference(processor)
    out = model.generate(**ref, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=6)
    assert ids == out[0, ref["input_ids"].shape[1]:].tolist()


def test_released_layout_directory_matches(pair):
    """The Hugging Face directory in the released layout (vision_tower.vision_model.) reads the same model."""
    _, _, _, processor, released, model = pair
    vlm = VisionLanguageModel.load(released)
    tokens, images = vlm.chat_prompt(_messages())
    ref = _reference(processor)
    with torch.no_grad():
        ref_logits = model(**ref).logits[0]
    assert tiny.rel_error(vlm.logits(tokens, images), ref_logits) <= 1e-4


def test_a_text_file_as_mmproj_is_refused(pair):
    text, _, _, _, _, _ = pair
    with pytest.raises(Unsupported, match="mmproj"):
        VisionLanguageModel.load(text, mmproj=text)


def test_caption_from_the_pair(pair, tmp_path, capsys):
    from poot_core.cli.main import main

    text, mmproj, model, processor, _, _ = pair
    image = tmp_path / "wide.png"
    IMAGES[1].save(image)
    args = ["caption", "-m", str(text), "--mmproj", str(mmproj), str(image), "-p", "What is this?", "-n", "5"]
    assert main(args) == 0
    reply = capsys.readouterr().out
    plain = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    ref = processor(text=processor.apply_chat_template(plain, add_generation_prompt=True), images=[[IMAGES[1]]],
                    return_tensors="pt", add_special_tokens=False)
    out = model.generate(**ref, max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=5)
    expected = processor.tokenizer.decode(out[0, ref["input_ids"].shape[1]:], skip_special_tokens=True)
    assert expected.strip() and reply == expected.strip() + "\n"
