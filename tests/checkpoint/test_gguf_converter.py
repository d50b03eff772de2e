"""Fidelity on the GGUF files people download: tiny random transformers checkpoints of every architecture the
llama and MoE families serve are converted by llama.cpp's own convert_hf_to_gguf.py (from the llama-cpp-python
source package, with its own gguf-py) at f32 and at q8_0; poot's logits from each file must match
transformers'.

f32 files: against transformers on the original checkpoint. q8_0 files: against transformers on the
weights the file holds (dequantized by the `gguf` package). Which Hugging Face element each file element
came from is not re-derived from poot's own name tables: a third conversion of the same checkpoint, with
every weight element set to its own index, tells (`_index_map`).

Honest adjustments to what the converter can express, each as real checkpoints have it:
- llama.cpp's qwen2moe/qwen3moe have no dense layers (the converter refuses `mlp_only_layers`): none here.
- The converter writes no sliding-window key for llama-architecture files (mistral, mixtral), and
  llama.cpp attends to every position there: these checkpoints have no window.
- Gemma 3: the converter keeps neither `layer_types` nor `query_pre_attn_scalar`; llama.cpp takes every
  6th layer as global and 1/sqrt(head_dim): the tiny gemma3 has that pattern and scalar, as released ones.
- DeepSeek V3's released config.json says `scoring_func: sigmoid`, which the converter turns into the
  gating key; transformers' own config does not write it, so the test adds it.
- The converter's pre-tokenizer check: see tests/helpers/llama_cpp_convert.py.
- Vocabulary size: the converter asserts every id AutoTokenizer gives is below vocab_size, and transformers 5
  loads a qwen2 directory with Qwen2Tokenizer, which adds <|endoftext|> after the trained ids; gemma3's
  converter keeps only as many embedding rows as tokenizer.json lists. Every model's vocab_size is that count.

Where llama.cpp itself reads less than the file says, poot follows the file (that is transformers' model):
llama.cpp's llama ignores rope.scaling.yarn_beta_fast/slow and yarn_attn_factor (it uses 32, 1 and its own
factor); the llama_yarn checkpoint sets other values on purpose.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers as tf

from helpers import tiny
from helpers.gguf_edit import finish_gguf
from helpers.moe import moe_config
from helpers.paths import TESTDATA, fetched
from poot_core import (
    Driver,
    DriverOptions,
    GenerateRequest,
    ModelHandle,
    Unsupported,
    open_executor,
    weight_kind,
)

CONVERTER = fetched(TESTDATA / "llama.cpp" / "convert" / "convert_hf_to_gguf.py").parent
PROMPT = [(7 * i + 3) % 250 + 2 for i in range(40)]  # longer than the chunk (16) and gemma's window (8)
TOKENIZER_SIZE = 320
FLOAT_TYPES = {gguf.GGMLQuantizationType.F32}


def _dense(arch: str, vocab: int) -> Any:
    common: dict[str, Any] = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                  bos_token_id=0, eos_token_id=1)
    ropes = {
        "llama": {"rope_type": "default", "rope_theta": 10000.0},
        "llama_linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        "llama_llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64, "rope_theta": 500000.0},
        "llama_yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                       "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 0.9, "rope_theta": 10000.0},
    }
    if arch in ropes:
        return tf.LlamaConfig(**common, tie_word_embeddings=arch == "llama", rope_parameters=ropes[arch])
    if arch == "mistral":
        return tf.MistralConfig(**common, sliding_window=None, tie_word_embeddings=False)
    if arch == "qwen2":
        return tf.Qwen2Config(**common, tie_word_embeddings=False)
    if arch == "qwen3":
        return tf.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    if arch == "gemma3":
        common["num_hidden_layers"] = 7  # layers 0-4 sliding, 5 global, 6 sliding
        return tf.Gemma3TextConfig(
            **common, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
            layer_types=[("full_attention" if (i + 1) % 6 == 0 else "sliding_attention") for i in range(7)],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}})
    raise ValueError(arch)


def _config(arch: str, vocab: int) -> Any:
    if arch in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"):
        config = moe_config({"mixtral": "mixtral_gguf", "deepseek_v3": "deepseek_v3_yarn"}.get(arch, arch))
        config.vocab_size = vocab
        if hasattr(config, "mlp_only_layers"):
            config.mlp_only_layers = []
        return config
    return _dense(arch, vocab)


ARCHS = ["llama", "llama_linear", "llama_llama3", "llama_yarn", "mistral", "qwen2", "qwen3", "gemma3", "mixtral",
         "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"]


def _build(path: Path, arch: str) -> Path:
    tokenizer = tiny.train_tokenizer(TOKENIZER_SIZE)
    data = json.loads(tokenizer.to_str())
    # Gemma's converter keeps as many embedding rows as tokenizer.json lists; every model gets that vocab.
    vocab = len(data["model"]["vocab"]) + len(data["added_tokens"])
    config = _config(arch, vocab)
    torch.manual_seed(0)
    model = tf.Gemma3ForCausalLM(config) if arch == "gemma3" else tf.AutoModelForCausalLM.from_config(config)
    tiny._randomize(model, 0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # give DeepSeek V3's choice bias a real effect
                buf.copy_(0.05 * torch.randn(buf.shape, generator=g))
    model.save_pretrained(path)
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|bos|>", eos_token="<|eos|>",
                                      chat_template=tiny.CHATML)
    fast.save_pretrained(path)
    if arch == "deepseek_v3":
        hf = json.loads((path / "config.json").read_text())
        hf.update(scoring_func="sigmoid", topk_method="noaux_tc")
        (path / "config.json").write_text(json.dumps(hf, indent=2))
    return path


def _stored(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def _index_copy(src: Path, dst: Path) -> Path:
    """The same checkpoint with every weight element set to its number over the whole file, in the order
    `_stored` lists the tensors (exact in float32 below 2^24)."""
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    state, start = _stored(src), 0
    for name, t in state.items():
        state[name] = torch.arange(start, start + t.numel(), dtype=torch.float32).reshape(t.shape)
        start += t.numel()
    assert start < 2**24
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    """arch -> {"hf", "index", "f32", "q8_0", "index.gguf"}: every checkpoint converted in one converter run."""
    root = tmp_path_factory.mktemp("converted")
    made: dict[str, dict[str, Path]] = {}
    jobs = []
    for arch in ARCHS:
        hf = _build(root / arch, arch)
        index = _index_copy(hf, root / f"{arch}-index")
        made[arch] = {"hf": hf, "index": index}
        for name, src, outtype in (("f32", hf, "f32"), ("q8_0", hf, "q8_0"), ("index.gguf", index, "f32")):
            made[arch][name] = root / f"{arch}-{name.replace('.gguf', '')}.gguf"
            jobs.append({"src": str(src), "outtype": outtype, "out": str(made[arch][name])})
    (root / "jobs.json").write_text(json.dumps(jobs))
    run = subprocess.run([sys.executable, str(Path(tiny.__file__).with_name("llama_cpp_convert.py")), str(CONVERTER),
                          str(root / "jobs.json")], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    return made


def _index_map(index_file: Path) -> dict[str, np.ndarray]:
    """GGUF tensor name -> the state-dict element numbers its elements hold (from the index conversion)."""
    reader = gguf.GGUFReader(index_file)
    out = {}
    for t in reader.tensors:
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, t.name
        out[t.name] = np.asarray(t.data, dtype=np.float32).reshape(-1)
    return out


def _dequantized_checkpoint(case: dict[str, Path], dst: Path) -> Path:
    """A Hugging Face checkpoint of the original with every element a q8_0 file stores in a lossy type
    (Q8_0, F16) replaced by the value the file holds."""
    from safetensors.torch import save_file

    state = _stored(case["hf"])
    flat = torch.cat([t.float().reshape(-1) for t in state.values()])
    index = _index_map(case["index.gguf"])
    seen = torch.zeros(flat.numel(), dtype=torch.bool)
    for t in gguf.GGUFReader(case["q8_0"]).tensors:
        if t.tensor_type in FLOAT_TYPES:
            continue  # stored exactly as converted from the original
        where = torch.from_numpy(index[t.name].astype(np.int64))
        values = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1))
        assert where.numel() == values.numel() and not seen[where].any(), t.name  # each element once
        seen[where] = True
        flat[where] = values
    assert seen.any()
    start = 0
    for name, t in state.items():
        state[name] = flat[start:start + t.numel()].reshape(t.shape).contiguous()
        start += t.numel()
    shutil.copytree(case["hf"], dst)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _poot_logits(path: Path) -> np.ndarray:
    driver = Driver(ModelHandle.load(path), open_executor("cpu"), DriverOptions(capacity=128, prefill_chunk=16))
    return driver.logits(PROMPT)


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_file_matches_transformers(converted, arch):
    case = converted[arch]
    ours, ref = _poot_logits(case["f32"]), tiny.reference_logits(case["hf"], PROMPT)
    assert ours.shape == tuple(ref.shape)
    error = tiny.rel_error(ours, ref)
    print(f"{arch} f32 file: max relative error {error:.2e}")
    assert error <= 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_q8_0_file_matches_transformers_on_its_weights(converted, arch, tmp_path):
    case = converted[arch]
    store = ModelHandle.load(case["q8_0"]).store()
    kinds = {weight_kind(store.get(n)) for n in store.names() if n.endswith("proj.weight")}
    assert "gguf.Q8_0" in kinds  # the matrices stay packed
    reference = _dequantized_checkpoint(case, tmp_path / "dequantized")
    ref = tiny.reference_logits(reference, PROMPT)
    error = tiny.rel_error(_poot_logits(case["q8_0"]), ref)
    moved = tiny.rel_error(ref, tiny.reference_logits(case["hf"], PROMPT))
    print(f"{arch} q8_0 file: max relative error {error:.2e} (q8_0 moved the logits by {moved:.2e})")
    assert error <= 1e-4
    assert moved > 1e-3  # the test can fail: the file's weights move the logits far more than the bound


@pytest.mark.parametrize("arch", ["llama_llama3", "llama_yarn", "gemma3", "deepseek_v3"])
def test_greedy_tokens_from_the_f32_file_match_transformers(converted, arch):
    """Decode steps (one token per step, the CPU's fused decode route) with the converted rope and windows."""
    case = converted[arch]
    driver = Driver(ModelHandle.load(case["f32"]), open_executor("cpu"),
                    DriverOptions(capacity=128, prefill_chunk=16)).serve()
    ours = driver.generate(GenerateRequest(PROMPT[:20], max_new=12, ignore_eos=True)).tokens
    model = tf.AutoModelForCausalLM.from_pretrained(case["hf"], dtype=torch.float32)
    out = model.generate(torch.tensor([PROMPT[:20]]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    assert ours == out[0, 20:].tolist()


def test_llama3_rope_freqs_matter(converted):
    """The llama3 scaling lives only in the rope_freqs tensor: without it the logits are clearly wrong (what
    poot computed before it read the tensor)."""
    case = converted["llama_llama3"]
    handle = ModelHandle.load(case["f32"])
    p = handle.config().params
    assert all(s["rope_type"] == "freq_factors" for s in p.layer_scaling)
    p.layer_scaling = [{} for _ in p.layer_scaling]
    driver = Driver(handle, open_executor("cpu"), DriverOptions(capacity=128, prefill_chunk=16))
    assert tiny.rel_error(driver.logits(PROMPT), tiny.reference_logits(case["hf"], PROMPT)) > 1e-2


def _rewrite(src: Path, dst: Path, keys: dict[str, tuple[Any, Any]] | None = None,
             edit: Any = None) -> Path:
    """A copy of an all-F32 GGUF file with metadata `keys` (name -> (value, GGUFValueType)) added or replaced,
    each tensor passed through `edit(name, array) -> [(name, array), ...]`."""
    keys = keys or {}
    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, str(reader.fields["general.architecture"].contents()))
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in keys:
            continue
        array = field.types[0] == gguf.GGUFValueType.ARRAY
        w.add_key_value(name, field.contents(), field.types[0], sub_type=field.types[-1] if array else None)
    for name, (value, vtype) in keys.items():
        sub = gguf.GGUFValueType.get_type(value[0]) if isinstance(value, list) else None
        w.add_key_value(name, value, vtype, sub_type=sub)
    for t in reader.tensors:
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, t.name
        for name, data in (edit or (lambda n, a: [(n, a)]))(t.name, np.array(t.data)):
            w.add_tensor(name, np.ascontiguousarray(data))
    finish_gguf(w)
    return dst


def test_old_per_expert_tensor_names(converted, tmp_path):
    """Older GGUF files hold one tensor per expert (blk.N.ffn_gate.E.weight): the same model as stacked."""
    case = converted["mixtral"]

    def split(name: str, data: np.ndarray) -> list[tuple[str, np.ndarray]]:
        if "_exps." not in name:
            return [(name, data)]
        stem = name.replace("_exps.weight", "")
        return [(f"{stem}.{e}.weight", data[e]) for e in range(data.shape[0])]

    path = _rewrite(case["f32"], tmp_path / "per-expert.gguf", edit=split)
    names = ModelHandle.load(path).store().names()
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in names
    assert not any("_exps" in n for n in names)
    assert tiny.rel_error(_poot_logits(path), tiny.reference_logits(case["hf"], PROMPT)) <= 1e-4


U32, F32, STR = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.STRING


@pytest.mark.parametrize("key,value,vtype", [
    ("llama.attention.sliding_window", 8, U32),  # llama.cpp's llama never reads a window
    ("llama.rope.scaling.type", "longrope", STR),
    ("llama.rope.scaling.attn_factor", 0.5, F32),
    ("llama.attention.head_count_kv", [2, 2, 1], gguf.GGUFValueType.ARRAY),
    ("llama.attention.clamp_kqv", 8.0, F32),
], ids=["window", "longrope", "attn_factor", "per-layer-kv-heads", "unknown"])
def test_metadata_poot_does_not_understand_is_refused_by_name(converted, tmp_path, key, value, vtype):
    path = _rewrite(converted["llama"]["f32"], tmp_path / "odd.gguf", {key: (value, vtype)})
    with pytest.raises(Unsupported) as refused:
        ModelHandle.load(path)
    assert key in str(refused.value)


def test_tensor_poot_does_not_know_is_refused_by_name(converted, tmp_path):
    def add(name: str, data: np.ndarray) -> list[tuple[str, np.ndarray]]:
        extra = [("blk.0.attn_qkv.weight", np.zeros((128, 64), np.float32))] if name == "blk.0.attn_q.weight" else []
        return [(name, data), *extra]

    path = _rewrite(converted["qwen3"]["f32"], tmp_path / "fused.gguf", edit=add)
    with pytest.raises(Unsupported, match=r"blk\.0\.attn_qkv\.weight"):
        ModelHandle.load(path)
