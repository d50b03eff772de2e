"""`poot caption` on a tiny random Idefics3: its reply is transformers' greedy reply to the same chat."""

from __future__ import annotations

import pytest
import torch

from helpers import tiny, vision
from poot_core.cli.main import main


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory):
    return vision.chat_checkpoint(tmp_path_factory.mktemp("caption"))


def test_caption_matches_transformers(chat_checkpoint, tmp_path, capsys):
    path, model, processor = chat_checkpoint
    image = tmp_path / "wide.png"
    vision.IMAGES[0].save(image)
    assert main(["caption", "-m", str(path), str(image), "-p", "What is this?", "-n", "5"]) == 0
    reply = capsys.readouterr().out
    plain = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    ref = processor(text=processor.apply_chat_template(plain, add_generation_prompt=True),
                    images=[[vision.IMAGES[0]]], return_tensors="pt")
    ids = ref["input_ids"]
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=ref["pixel_values"],
                         max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=5)
    expected = processor.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert expected.strip() and reply == expected.strip() + "\n"


def test_caption_refuses_text_only_models_and_bad_images(chat_checkpoint, tmp_path, capsys):
    text_model = tiny.build(tmp_path / "llama", "llama")
    image = tmp_path / "wide.png"
    vision.IMAGES[0].save(image)
    assert main(["caption", "-m", str(text_model), str(image)]) == 1
    assert "takes no images" in capsys.readouterr().err
    path, _, _ = chat_checkpoint
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"\xff\xd8 not a jpeg")
    assert main(["caption", "-m", str(path), str(broken)]) == 1
    assert "unreadable image" in capsys.readouterr().err
