"""Tiny random Idefics3 / SmolVLM checkpoints and Pillow-made images, for the vision family's exactness tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers as tf
from PIL import Image

from helpers import tiny

IMAGE_TOKEN = 250  # the checkpoints built by id (the chat checkpoint's comes from its tokenizer)
IMAGE_SIZE, PATCH = 64, 16
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH) ** 2 // 4  # pixel shuffle by 2


def image(width: int, height: int, seed: int) -> Image.Image:
    """A smooth gradient with noise and a bright square: resizing it exercises Lanczos everywhere."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([255 * x / width, 255 * y / height, 128 + 60 * np.sin(x / 5.0 + y / 7.0)], axis=-1)
    rgb = rgb + rng.normal(0, 20, rgb.shape)
    rgb[height // 4 : height // 2, width // 3 : width // 2] = 250
    return Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8))


IMAGES = [image(97, 53, 1), image(40, 120, 2)]  # wide and tall, one smaller than the tower's 64


def configs(arch: str, vocab: int = 256) -> tuple[Any, type]:
    text = tf.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          bos_token_id=0, eos_token_id=1, rms_norm_eps=1e-5, tie_word_embeddings=False)
    if arch == "smolvlm":
        vision = tf.SmolVLMVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH)
        cfg = tf.SmolVLMConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), scale_factor=2,
                               image_token_id=IMAGE_TOKEN)
        return cfg, tf.SmolVLMForConditionalGeneration
    vision = tf.Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH)
    cfg = tf.Idefics3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), scale_factor=2,
                            image_token_id=IMAGE_TOKEN)
    return cfg, tf.Idefics3ForConditionalGeneration


def checkpoint(path: Path, arch: str = "smolvlm", seed: int = 3) -> Path:
    """A tiny random Idefics3 / SmolVLM saved at `path` with the test tokenizer and an unsplit processor."""
    cfg, cls = configs(arch)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    tiny._randomize(model, seed=seed)
    model.save_pretrained(path)
    tiny.save_tokenizer(path)
    processor().save_pretrained(path)
    return path


def processor(split: bool = False) -> tf.Idefics3ImageProcessorPil:
    return tf.Idefics3ImageProcessorPil(do_image_splitting=split, size={"longest_edge": 2 * IMAGE_SIZE},
                                        max_image_size={"longest_edge": IMAGE_SIZE})


# SmolVLM's template: image parts become <image>, turns end with <end_of_utterance>.
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def chat_checkpoint(path: Path, split: bool = False) -> tuple[Path, Any, Any]:
    """A tiny Idefics3 whose tokenizer has the processor's image tokens and SmolVLM's chat template."""
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tiny.train_tokenizer(), bos_token="<|bos|>",
                                      eos_token="<|eos|>", chat_template=SMOLVLM_TEMPLATE)
    fast.add_special_tokens({"additional_special_tokens": ["<fake_token_around_image>", "<image>", "<global-img>",
                                                          "<end_of_utterance>"]})
    cfg, cls = configs("idefics3", vocab=len(fast))
    cfg.image_token_id = fast.convert_tokens_to_ids("<image>")
    torch.manual_seed(0)
    model = cls(cfg).eval()
    tiny._randomize(model, seed=5)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    processor(split).save_pretrained(path)
    full = tf.Idefics3Processor(image_processor=processor(split), tokenizer=fast, image_seq_len=TOKENS_PER_IMAGE,
                                chat_template=SMOLVLM_TEMPLATE)
    return path, model, full




def prompt_for(vlm: Any, images: list[Image.Image]) -> list[int]:
    """A prompt for the VisionLanguageModel `vlm`: text, then each image's tokens (one per feature row its
    vision tower gives) between two text tokens."""
    tokens = [0, 17, 33, 48, 10, 11]
    image_token = vlm.params.image_token_id
    for i, image in enumerate(images):
        features = vlm.encode_images(*vlm.frames([image]))[1]
        tokens += [10 + i] + [image_token] * (features.size // features.shape[-1]) + [60]
    return tokens + [71, 5]
