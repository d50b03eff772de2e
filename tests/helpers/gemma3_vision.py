"""Tiny random Gemma 3 vision-language checkpoints (Gemma3ForConditionalGeneration) built from transformers
configs, with Gemma 3's image processor and, for chat, a tokenizer holding its image tokens and a chat template
that writes `<start_of_image>` for an image part as Gemma 3's does."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import transformers as tf

from helpers import tiny

IMAGE_SIZE, PATCH = 64, 8  # 8 x 8 patches
TOKENS_PER_IMAGE = 16  # pooled 2 x 2
WINDOW = 6  # smaller than an image's tokens: the sliding layers cut into its bidirectional block
BOI, EOI, IMAGE_TOKEN = 290, 291, 292  # the checkpoints built by id (vocabulary 300)

# Gemma 3's template, cut to what an image chat needs: turns, image parts as <start_of_image>, text trimmed.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


# layer types: three with a global one in the middle (checkpoints by id); or Gemma 3's released pattern, five
# sliding then a global one, the only one llama.cpp's GGUF can say (it writes no per-layer types)
MIXED = ["sliding_attention", "full_attention", "sliding_attention"]
RELEASED = ["sliding_attention"] * 5 + ["full_attention"]


def config(vocab: int = 300, boi: int = BOI, eoi: int = EOI, image: int = IMAGE_TOKEN,
           layer_types: list[str] = MIXED) -> tf.Gemma3Config:
    text = tf.Gemma3TextConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=len(layer_types), num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, sliding_window=WINDOW, layer_types=layer_types,
                               max_position_embeddings=512, query_pre_attn_scalar=16, bos_token_id=0,
                               eos_token_id=1, pad_token_id=0)
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   image_size=IMAGE_SIZE, patch_size=PATCH)
    return tf.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                           mm_tokens_per_image=TOKENS_PER_IMAGE, boi_token_index=boi, eoi_token_index=eoi,
                           image_token_index=image)


def model(cfg: tf.Gemma3Config, seed: int) -> tf.Gemma3ForConditionalGeneration:
    """Random weights: Gemma's (1 + w) RMS norms around 0, the SigLIP tower's layer norms around 1."""
    torch.manual_seed(0)
    m = tf.Gemma3ForConditionalGeneration(cfg).eval()
    tiny._randomize(m, seed=seed)
    with torch.no_grad():
        for name, p in m.model.vision_tower.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.add_(1.0)
    return m


def processor() -> tf.Gemma3ImageProcessorPil:
    return tf.Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})


def checkpoint(path: Path, dtype: torch.dtype = torch.float32, seed: int = 3) -> tuple[Path, Any]:
    """A checkpoint prompted by id (the plain tiny tokenizer)."""
    m = model(config(), seed)
    m.to(dtype).save_pretrained(path)
    tiny.save_tokenizer(path)
    processor().save_pretrained(path)
    return path, m


def chat_checkpoint(path: Path) -> tuple[Path, Any, Any]:
    """A checkpoint in Gemma 3's layer pattern whose tokenizer (with merges, as llama.cpp's converter needs) has
    Gemma 3's image and turn tokens and the chat template above; with the transformers Gemma3Processor over the
    same tokenizer."""
    fast = tf.PreTrainedTokenizerFast(
        tokenizer_object=tiny.train_tokenizer(320), bos_token="<|bos|>", eos_token="<|eos|>",
        chat_template=GEMMA3_TEMPLATE,
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"})
    fast.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    cfg = config(vocab=len(fast), boi=fast.boi_token_id, eoi=fast.eoi_token_id, image=fast.image_token_id,
                 layer_types=RELEASED)
    cfg.text_config.bos_token_id = fast.bos_token_id
    m = model(cfg, seed=5)
    m.save_pretrained(path)
    fast.save_pretrained(path)
    processor().save_pretrained(path)
    full = tf.Gemma3Processor(image_processor=processor(), tokenizer=fast, image_seq_length=TOKENS_PER_IMAGE,
                              chat_template=GEMMA3_TEMPLATE)
    return path, m, full


def released_layout(path: Path) -> None:
    """Re-key a saved checkpoint to the released Gemma 3 layout (vision_tower.vision_model.), which llama.cpp's
    converter expects (transformers 5 saves vision_tower.), and give preprocessor_config.json the processor's
    image_seq_length, as released checkpoints do (the converter reads the pooling from it)."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = {("vision_tower.vision_model." + k[len("vision_tower."):] if k.startswith("vision_tower.") else k): v
               for k, v in load_file(file).items()}
    save_file(tensors, file, metadata={"format": "pt"})
    pre = path / "preprocessor_config.json"
    pre.write_text(json.dumps(json.loads(pre.read_text()) | {"image_seq_length": TOKENS_PER_IMAGE}, indent=2))


def llama_cpp_pair(path: Path, hf: Path) -> tuple[Path, Path]:
    """llama.cpp's text GGUF and mmproj GGUF (f32; the converter keeps the projection F16) of the checkpoint
    `hf`, converted from a released-layout copy under `path`."""
    from helpers.paths import TESTDATA, fetched

    converter = fetched(TESTDATA / "llama.cpp" / "convert" / "convert_hf_to_gguf.py").parent
    source = path / "released"
    shutil.copytree(hf, source)
    released_layout(source)
    text, mmproj = path / "text.gguf", path / "mmproj.gguf"
    jobs = [{"src": str(source), "outtype": "f32", "out": str(text)},
            {"src": str(source), "outtype": "f32", "out": str(mmproj), "args": ["--mmproj"]}]
    (path / "jobs.json").write_text(json.dumps(jobs))
    run = subprocess.run([sys.executable, str(Path(tiny.__file__).with_name("llama_cpp_convert.py")), str(converter),
                          str(path / "jobs.json")], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return text, mmproj
