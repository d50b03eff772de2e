"""Tiny random checkpoints built from transformers configs, for exactness tests.

Each is saved with `save_pretrained` (float32 or bfloat16) next to a byte-level BPE tokenizer trained on the
spot with `tokenizers`, so poot loads it exactly as it would load a real Hugging Face checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "def add(a, b):\n    return a + b\n",
    "Once upon a time there was a small cat who liked to sleep in the sun.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000; symbols: !@#$%^&*()",
    "Unicode: café, naïve, 東京, Привет, emoji 🙂🚀",
] * 20

SPECIALS = ["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tokenizer(vocab_size: int = 200) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B",
                                                       special_tokens=[("<|bos|>", bos)])
    return tok


def save_tokenizer(path: Path, vocab_size: int = 200) -> Any:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(vocab_size), bos_token="<|bos|>",
                                   eos_token="<|eos|>", chat_template=CHATML)
    fast.save_pretrained(path)
    return fast


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Random weights large enough that logits are far from uniform; norms around 1 (around 0 for the
    (1 + w) norms gemma uses)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                base = 0.0 if "gemma" in type(model).__name__.lower() else 1.0
                p.copy_(base + 0.1 * noise)
            else:
                p.copy_(noise * (0.5 / max(p.shape[-1], 1) ** 0.5) if p.dim() > 1 else 0.1 * noise)


def tiny_config(arch: str, vocab: int = 256) -> Any:
    import transformers as tf

    common: dict[str, Any] = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                  bos_token_id=0, eos_token_id=1)
    if arch == "llama":
        return tf.LlamaConfig(**common, tie_word_embeddings=True, rms_norm_eps=1e-5,
                              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if arch == "mistral":
        return tf.MistralConfig(**common, sliding_window=8, tie_word_embeddings=False)
    if arch == "qwen2":
        return tf.Qwen2Config(**common, tie_word_embeddings=False)
    if arch == "qwen3":
        return tf.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    if arch == "gemma3":
        common["num_hidden_layers"] = 4
        return tf.Gemma3TextConfig(**common, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                                   layer_types=["sliding_attention", "full_attention"] * 2,
                                   rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                          "rope_theta": 10000.0},
                                                    "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                       "rope_theta": 1000000.0}})
    raise ValueError(arch)


def with_layers(config: Any, layers: int | None) -> Any:
    """`config` cut to its first `layers` decoder layers (None: as it is), with the per-layer attention types
    qwen2/qwen3/gemma3 configs list (gemma3 needs 2 to keep one sliding and one full layer)."""
    if layers is not None:
        if config.__dict__.get("layer_types"):  # a stored list (Mamba2 derives its own)
            config.layer_types = config.layer_types[:layers]
        config.num_hidden_layers = layers
    return config


def build(path: Path, arch: str, dtype: torch.dtype = torch.float32, seed: int = 0, layers: int | None = None) -> Path:
    """Save a tiny random `arch` checkpoint (weights in `dtype`) with its tokenizer into `path`; `layers`: fewer
    decoder layers than the config's (tests whose kernels run in Triton's interpreter)."""
    import transformers as tf

    config = with_layers(tiny_config(arch), layers)
    classes = {"gemma3": tf.Gemma3ForCausalLM}
    model_cls = classes.get(arch, tf.AutoModelForCausalLM)
    torch.manual_seed(seed)
    model = model_cls.from_config(config) if model_cls is tf.AutoModelForCausalLM else model_cls(config)
    _randomize(model, seed)
    model.to(dtype).save_pretrained(path)
    save_tokenizer(path)
    return path


def reference_logits(path: Path, ids: list[int]) -> torch.Tensor:
    """transformers' float32 forward on the CPU: logits [positions, vocab]."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def rel_error(ours: Any, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref|."""
    ours_t = torch.as_tensor(ours, dtype=torch.float32)
    return float((ours_t - ref).abs().max() / ref.abs().max())
