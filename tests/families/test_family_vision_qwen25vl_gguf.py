"""Qwen2.5-VL from llama.cpp's pair of files: a tiny random Qwen2_5_VLForConditionalGeneration (3 vision layers,
the converter's smallest; llama.cpp's window of 112 pixels, 4 x 4 merged tokens) through llama.cpp's own
converter, text GGUF ("qwen2vl") + `--mmproj` GGUF, against transformers on the same weights: pixels equal the
image processor's (its default bounds, as llama.cpp's file gives none), tower 1e-4, prompt logits 1e-4, chat
prompt ids equal the processor's, greedy reply equal, `poot caption -m text.gguf --mmproj mmproj.gguf`; a Q8_0 text
GGUF with the mmproj against transformers over the gguf package's dequantized weights."""

from __future__ import annotations

import copy

import gguf
import numpy as np
import pytest
import torch
from poot_family_vision.runtime import VisionLanguageModel

from helpers import qwen25vl as q25
from helpers import tiny, vision
from poot_core import Driver, DriverOptions, ModelHandle, open_executor

# wide (12 x 22 patches: windows of 4 x 4 merged tokens cut it into 2 x 3) and tall
IMAGES = [vision.image(300, 180, 4), vision.image(120, 260, 6)]
TEXT = "What is in these two pictures?"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen25vl-gguf")
    path, model, full = q25.chat_checkpoint(root / "hf", q25.processor(size={"shortest_edge": 56 * 56,
                                                                               "longest_edge": 28 * 28 * 1280}),
                                            depth=3, window=112)
    text, mmproj = q25.llama_cpp_pair(root, path)
    return text, mmproj, model, full


def _content() -> list[dict]:
    return [{"type": "image", "image": IMAGES[0]}, {"type": "text", "text": TEXT},
            {"type": "image", "image": IMAGES[1]}]


def test_tower_and_prompt_logits_match(pair):
    text, mmproj, model, full = pair
    vlm = VisionLanguageModel.load(text, mmproj=mmproj)
    pixels, grids = vlm.frames(IMAGES)
    ref = full.image_processor(images=IMAGES, return_tensors="pt")
    assert grids == [tuple(g) for g in ref["image_grid_thw"].tolist()] == [(1, 12, 22), (1, 18, 8)]
    assert np.array_equal(pixels, ref["pixel_values"].numpy())
    hidden, features = vlm.encode_images(pixels, grids)
    with torch.no_grad():
        out = model.model.visual(torch.from_numpy(pixels), grid_thw=torch.tensor(grids))
    assert tiny.rel_error(hidden[0], out.last_hidden_state) <= 1e-4
    assert tiny.rel_error(features, out.pooler_output) <= 1e-4
    tokens, images = vlm.chat_prompt([{"role": "user", "content": _content()}])
    plain = [{"type": "image"}, {"type": "text", "text": TEXT}, {"type": "image"}]
    prompt = full.apply_chat_template([{"role": "user", "content": plain}], add_generation_prompt=True)
    inputs = full(text=[prompt], images=IMAGES, return_tensors="pt")
    assert tokens == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        ref_logits = model(**inputs).logits[0]
    assert tiny.rel_error(vlm.logits(tokens, images), ref_logits) <= 1e-4


def test_greedy_reply_and_caption(pair, tmp_path, capsys):
    from poot_core.cli.main import main

    text, mmproj, model, full = pair
    vlm = VisionLanguageModel.load(text, mmproj=mmproj)
    plain = [{"type": "image"}, {"type": "text", "text": TEXT}, {"type": "image"}]
    prompt = full.apply_chat_template([{"role": "user", "content": plain}], add_generation_prompt=True)
    inputs = full(text=[prompt], images=IMAGES, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0,
                         min_new_tokens=6)
    ids, _ = vlm.chat([{"role": "user", "content": _content()}], max_new=6)
    assert ids == out[0, inputs["input_ids"].shape[1]:].tolist()
    image = tmp_path / "wide.png"
    IMAGES[0].save(image)
    assert main(["caption", "-m", str(text), "--mmproj", str(mmproj), str(image), "-p", "Describe.", "-n", "5"]) == 0
    one = [{"type": "image"}, {"type": "text", "text": "Describe."}]
    inputs = full(text=[full.apply_chat_template([{"role": "user", "content": one}], add_generation_prompt=True)],
                  images=IMAGES[:1], return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0,
                         min_new_tokens=5)
    expected = full.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert expected.strip() and capsys.readouterr().out == expected.strip() + "\n"


def test_text_gguf_alone_through_the_driver(pair):
    text, _, model, _ = pair
    tokens = [5, 17, 33, 48, 60, 71, 9, 12]
    driver = Driver(ModelHandle.load(text), open_executor("cpu"), DriverOptions(capacity=64, prefill_chunk=3))
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([tokens])).logits[0]
    assert tiny.rel_error(driver.logits(tokens), ref) <= 1e-4


BLOCK_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
               "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
TOP_NAMES = {"token_embd.weight": "model.language_model.embed_tokens.weight",
             "output_norm.weight": "model.language_model.norm.weight", "output.weight": "lm_head.weight"}


def _dequantized(model, text_gguf):
    """transformers' model with its text weights replaced by the gguf package's dequantization of the file's."""
    ref = copy.deepcopy(model)
    state = ref.state_dict()
    for t in gguf.GGUFReader(text_gguf).tensors:
        block = t.name.split(".")
        if t.name in TOP_NAMES:
            name = TOP_NAMES[t.name]
        else:
            name = f"model.language_model.layers.{block[1]}.{BLOCK_NAMES[block[2]]}.{block[3]}"
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        state[name].copy_(torch.from_numpy(np.array(values, dtype=np.float32)).reshape(state[name].shape))
    return ref


def test_quantized_text_gguf_with_the_mmproj(pair, tmp_path):
    """A Q8_0 text GGUF (packed weights stay packed) beside the f32 mmproj: the prompt's logits match transformers
    over the gguf package's dequantized weights, and are not the unquantized model's."""
    text, mmproj, model, full = pair
    q8, _ = q25.llama_cpp_pair(tmp_path, text.parent / "hf", text_type="q8_0", mmproj=False)
    vlm = VisionLanguageModel.load(q8, mmproj=mmproj)
    tokens, images = vlm.chat_prompt([{"role": "user", "content": _content()}])
    ours = vlm.logits(tokens, images)
    prompt = full.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TEXT},
                                                                   {"type": "image"}]}], add_generation_prompt=True)
    inputs = full(text=[prompt], images=IMAGES, return_tensors="pt")
    with torch.no_grad():
        ref = _dequantized(model, q8)(**inputs).logits[0]
        plain = model(**inputs).logits[0]
    assert tiny.rel_error(ours, ref) <= 1e-4
    assert tiny.rel_error(ours, plain) > tiny.rel_error(ours, ref) * 10
