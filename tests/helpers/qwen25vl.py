"""Tiny random Qwen2.5-VL checkpoints (Qwen2_5_VLForConditionalGeneration) built from transformers configs, the
Qwen2-VL (Pillow) image processor, a chat checkpoint whose tokenizer has Qwen's image and turn tokens and a
template writing `<|vision_start|><|image_pad|><|vision_end|>` for an image part, and llama.cpp's text GGUF +
mmproj GGUF of a checkpoint through its own converter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import transformers as tf

from helpers import tiny

VISION_START, VISION_END, IMAGE_TOKEN = 290, 291, 292  # the checkpoints built by id (vocabulary 300)
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 16

# Qwen2.5-VL's template, cut to what an image chat needs
TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{% elif item['type'] == 'text' %}{{ item['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]


def config(vocab: int = 300, start: int = VISION_START, end: int = VISION_END, image: int = IMAGE_TOKEN,
           depth: int = 2, window: int = 56) -> tf.Qwen2_5_VLConfig:
    """Windows of window / 28 merged tokens a side (56: 2 x 2); layer 1 attends over the whole image."""
    text = {"vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
            "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 1,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
    vis = {"depth": depth, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4, "patch_size": 14,
           "temporal_patch_size": 2, "spatial_merge_size": 2, "window_size": window, "fullatt_block_indexes": [1],
           "out_hidden_size": 64, "hidden_act": "silu"}
    return tf.Qwen2_5_VLConfig(text_config=text, vision_config=vis, image_token_id=image,
                               vision_start_token_id=start, vision_end_token_id=end, tie_word_embeddings=False)


def build(cfg: tf.Qwen2_5_VLConfig, seed: int) -> Any:
    torch.manual_seed(0)
    m = tf.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    tiny._randomize(m, seed=seed)
    with torch.no_grad():
        m.model.visual.merger.ln_q.weight.add_(1.0)  # a norm whose name says none
    return m


def processor(**sizes: int) -> Any:
    """The image processor; without sizes this test suite's bounds (at most 16 merged tokens an image)."""
    if not sizes:
        return tf.Qwen2VLImageProcessorPil(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})
    return tf.Qwen2VLImageProcessorPil(**sizes)


def chat_checkpoint(path: Path, image_processor: Any = None, **shape: int) -> tuple[Path, Any, Any]:
    """A checkpoint whose tokenizer (with merges, as llama.cpp's converter needs) has Qwen's tokens and the
    template above; with transformers' Qwen2_5_VLProcessor over the same tokenizer and image processor."""
    image_processor = image_processor or processor()
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tiny.train_tokenizer(320), bos_token="<|bos|>",
                                      eos_token="<|eos|>", chat_template=TEMPLATE)
    fast.add_special_tokens({"additional_special_tokens": SPECIALS})
    ids = fast.convert_tokens_to_ids
    model = build(config(vocab=len(fast), start=ids("<|vision_start|>"), end=ids("<|vision_end|>"),
                         image=ids("<|image_pad|>"), **shape), seed=5)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    image_processor.save_pretrained(path)
    # without torchvision there is no video processor, whose class the processor would check; images need none
    with mock.patch.object(tf.ProcessorMixin, "check_argument_for_proper_class", lambda *args: None):
        full = tf.Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=fast, chat_template=TEMPLATE,
                                      video_processor=None)
    return path, model, full


def llama_cpp_pair(path: Path, hf: Path, text_type: str = "f32", mmproj: bool = True) -> tuple[Path, Path]:
    """llama.cpp's text GGUF (of `text_type`) and mmproj GGUF (f32) of the checkpoint `hf`, written under `path`
    (the text file alone without `mmproj`)."""
    from helpers.paths import TESTDATA, fetched

    converter = fetched(TESTDATA / "llama.cpp" / "convert" / "convert_hf_to_gguf.py").parent
    text, vision = path / "text.gguf", path / "mmproj.gguf"
    jobs = [{"src": str(hf), "outtype": text_type, "out": str(text)}]
    if mmproj:
        jobs.append({"src": str(hf), "outtype": "f32", "out": str(vision), "args": ["--mmproj"]})
    (path / "jobs.json").write_text(json.dumps(jobs))
    run = subprocess.run([sys.executable, str(Path(tiny.__file__).with_name("llama_cpp_convert.py")), str(converter),
                          str(path / "jobs.json")], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return text, vision
