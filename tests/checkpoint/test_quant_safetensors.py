"""GPTQ, AWQ and FP8 layers against independent numpy implementations of the published layouts.

Each test draws random integer codes, zero points and scales, packs them the way the quantizers write their
checkpoints (numpy, written here from the formats' descriptions), and checks that packed_from_safetensors +
dequantize give back (q - zero) * scale, and that packed_linear agrees with the dequantized matmul.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.quant_pack import e4m3_to_float, pack_along_cols, pack_along_rows
from poot_core.checkpoint.quant import dequantize, packed_from_safetensors, supported_kinds
from poot_core.cpu.packed_linear import packed_linear
from poot_core.errors import CheckpointError, Unsupported


def getter(tensors: dict[str, np.ndarray | torch.Tensor]):
    def get(name: str) -> torch.Tensor:
        t = tensors[name]  # KeyError for a missing part, like a WeightStore lookup
        return t if isinstance(t, torch.Tensor) else torch.from_numpy(t)

    return get




def check_against(w, ref: np.ndarray, part: slice, rows: int) -> None:
    """w dequantizes to ref [out, in] (as a whole and the rows of `part`), and packed_linear of `rows` random
    inputs is the matmul with ref."""
    np.testing.assert_allclose(dequantize(w).numpy(), ref, rtol=1e-6)
    np.testing.assert_allclose(dequantize(w, part).numpy(), ref[part], rtol=1e-6)
    x = torch.randn(rows, ref.shape[1])
    expect = x @ torch.from_numpy(ref).float().T
    torch.testing.assert_close(packed_linear(x, w), expect, rtol=1e-5, atol=1e-5 * expect.abs().max().item())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, -1])
@pytest.mark.parametrize("desc_act", [False, True])
@pytest.mark.parametrize("sym", [True, False])
def test_gptq(bits: int, group_size: int, desc_act: bool, sym: bool) -> None:
    rng = np.random.default_rng(bits * 100 + group_size + 7 * desc_act + 3 * sym)
    in_f, out_f = 128, 64
    groups = 1 if group_size == -1 else in_f // group_size
    q = rng.integers(0, 2**bits, size=(in_f, out_f))
    zero = (
        np.full((groups, out_f), 2 ** (bits - 1)) if sym else rng.integers(1, 2**bits, size=(groups, out_f))
    )  # the true zero point
    scales = rng.uniform(0.001, 0.05, size=(groups, out_f)).astype(np.float16)
    g_idx = np.arange(in_f) // (in_f if group_size == -1 else group_size)
    if desc_act:
        g_idx = rng.permutation(g_idx)
    tensors = {
        "l.qweight": pack_along_rows(q, bits),
        "l.qzeros": pack_along_cols(zero - 1, bits),  # v1: zero - 1
        "l.scales": scales,
        "l.g_idx": g_idx.astype(np.int32),
    }
    cfg = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym}
    w = packed_from_safetensors(getter(tensors), "l", cfg)
    assert w is not None and w.shape == (out_f, in_f) and w.kind == f"gptq.{bits}" and w.kind in supported_kinds()
    ref = ((q - zero[g_idx]) * scales[g_idx].astype(np.float32)).T
    check_against(w, ref, slice(8, 40), 3)


def test_gptq_v2_has_no_plus_one_and_g_idx_may_be_absent() -> None:
    rng = np.random.default_rng(3)
    in_f, out_f, group = 64, 16, 32
    q = rng.integers(0, 16, size=(in_f, out_f))
    zero = rng.integers(0, 16, size=(in_f // group, out_f))
    scales = rng.uniform(0.01, 0.1, size=zero.shape).astype(np.float16)
    tensors = {"l.qweight": pack_along_rows(q, 4), "l.qzeros": pack_along_cols(zero, 4), "l.scales": scales}
    cfg = {"quant_method": "gptq", "bits": 4, "group_size": group, "checkpoint_format": "gptq_v2"}
    w = packed_from_safetensors(getter(tensors), "l", cfg)
    g = np.arange(in_f) // group
    np.testing.assert_allclose(dequantize(w).numpy(), ((q - zero[g]) * scales[g].astype(np.float32)).T, rtol=1e-6)


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # the column each nibble of an AWQ GEMM word holds


@pytest.mark.parametrize("group_size", [32, 64])
def test_awq_gemm(group_size: int) -> None:
    rng = np.random.default_rng(group_size)
    in_f, out_f = 128, 48
    groups = in_f // group_size
    q = rng.integers(0, 16, size=(in_f, out_f))
    zero = rng.integers(0, 16, size=(groups, out_f))
    scales = rng.uniform(0.001, 0.05, size=(groups, out_f)).astype(np.float16)
    tensors = {
        "m.qweight": pack_along_cols(q, 4, AWQ_ORDER),
        "m.qzeros": pack_along_cols(zero, 4, AWQ_ORDER),
        "m.scales": scales,
    }
    cfg = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    w = packed_from_safetensors(getter(tensors), "m", cfg)
    assert w is not None and w.kind == "awq.4" and w.shape == (out_f, in_f)
    g = np.arange(in_f) // group_size
    ref = ((q - zero[g]) * scales[g].astype(np.float32)).T
    check_against(w, ref, slice(5, 29), 2)




def fp8_weight(rng: np.random.Generator, out_f: int, in_f: int) -> np.ndarray:
    raw = rng.integers(0, 256, size=(out_f, in_f), dtype=np.uint8)
    return np.where((raw & 0x7F) == 0x7F, 0, raw).astype(np.uint8)  # no NaN codes


@pytest.mark.parametrize("kind", ["tensor", "channel", "block", "block-hf"])
def test_fp8(kind: str) -> None:
    rng = np.random.default_rng(len(kind))
    out_f, in_f = 200, 300  # not multiples of the 128 block
    raw = fp8_weight(rng, out_f, in_f)
    values = e4m3_to_float(raw)
    weight = torch.from_numpy(raw).view(torch.float8_e4m3fn)
    if kind == "tensor":
        scale = np.array([0.02], dtype=np.float32)
        ref = values * scale[0]
    elif kind == "channel":
        scale = rng.uniform(0.001, 0.1, size=(out_f, 1)).astype(np.float32)
        ref = values * scale
    else:
        scale = rng.uniform(0.001, 0.1, size=(2, 3)).astype(np.float32)
        ref = values * np.repeat(np.repeat(scale, 128, axis=0), 128, axis=1)[:out_f, :in_f]
    if kind == "block-hf":
        tensors = {"p.weight": weight, "p.weight_scale_inv": scale}
        cfg = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    else:
        tensors = {"p.weight": weight, "p.weight_scale": scale}
        weights = {"num_bits": 8, "type": "float", "strategy": kind}
        if kind == "block":
            weights["block_structure"] = [128, 128]
        cfg = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {"group_0": {"weights": weights, "targets": ["Linear"]}},
        }
    w = packed_from_safetensors(getter(tensors), "p", cfg)
    assert w is not None and w.kind == f"fp8.{kind.removesuffix('-hf')}" and w.kind in supported_kinds()
    check_against(w, ref, slice(120, 140), 2)


def test_unquantized_layer_is_none_and_bad_parts_are_typed_errors() -> None:
    dense = {"d.weight": torch.randn(4, 4), "d.weight_scale": torch.ones(1)}
    assert packed_from_safetensors(getter(dense), "d", {"quant_method": "fp8"}) is None
    assert packed_from_safetensors(getter({}), "x", {"quant_method": "gptq", "bits": 4}) is None
    with pytest.raises(Unsupported, match="gptq.3"):
        packed_from_safetensors(
            getter({"l.qweight": np.zeros((3, 8), np.int32)}), "l", {"quant_method": "gptq", "bits": 3}
        )
    with pytest.raises(Unsupported, match="bitsandbytes"):
        packed_from_safetensors(getter({}), "l", {"quant_method": "bitsandbytes"})
    bad = {
        "l.qweight": np.zeros((16, 8), np.int32),
        "l.qzeros": np.zeros((1, 1), np.int32),
        "l.scales": np.zeros((1, 8), np.float16),
        "l.g_idx": np.full(128, 5, np.int32),
    }
    with pytest.raises(CheckpointError, match="g_idx"):
        packed_from_safetensors(getter(bad), "l", {"quant_method": "gptq", "bits": 4, "group_size": -1})
    with pytest.raises(CheckpointError, match="qzeros"):
        packed_from_safetensors(
            getter({"l.qweight": np.zeros((16, 8), np.int32)}), "l", {"quant_method": "gptq", "bits": 4}
        )


# End to end: a tiny random llama whose linear layers are quantized here (numpy, from the published layouts) into
# GPTQ, AWQ and FP8 checkpoints. poot runs the packed checkpoint; transformers runs a float32 checkpoint holding
# the dequantized weights (computed by the same numpy code). The two must agree to float32 summation noise.

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _affine_codes(w_in_out: np.ndarray, groups_of_rows: np.ndarray, n_groups: int, bits: int, sym: bool):
    """Per (group, output column) min/max quantization of w [in, out]: codes, zero points, float16 scales."""
    top = 2**bits - 1
    in_f, out_f = w_in_out.shape
    scales = np.zeros((n_groups, out_f), np.float16)
    zeros = np.zeros((n_groups, out_f), np.int64)
    for g in range(n_groups):
        rows = w_in_out[groups_of_rows == g]
        lo, hi = np.minimum(rows.min(0), 0), np.maximum(rows.max(0), 0)
        if sym:
            amax = np.maximum(np.abs(lo), np.abs(hi))
            scales[g] = np.maximum(2 * amax / top, 1e-6)
            zeros[g] = 2 ** (bits - 1)
        else:
            scales[g] = np.maximum((hi - lo) / top, 1e-6)
            zeros[g] = np.clip(np.round(-lo / scales[g].astype(np.float32)), 0, top)
    s, z = scales[groups_of_rows].astype(np.float32), zeros[groups_of_rows]
    q = np.clip(np.round(w_in_out / s) + z, 0, top).astype(np.int64)
    return q, zeros, scales, ((q - z) * s).astype(np.float32)


def _quantize_layer(scheme: str, prefix: str, w: np.ndarray, rng: np.random.Generator):
    """Stored tensors of one linear layer and its dequantized float32 weight [out, in]."""
    out_f, in_f = w.shape
    if scheme.startswith("gptq"):
        bits, group, desc_act, sym = {"gptq4": (4, 32, True, False), "gptq8": (8, -1, False, True)}[scheme]
        n_groups = 1 if group == -1 else in_f // group
        g_idx = np.arange(in_f) // (in_f if group == -1 else group)
        if desc_act:
            g_idx = rng.permutation(g_idx)
        q, zeros, scales, deq = _affine_codes(w.T, g_idx, n_groups, bits, sym)
        stored = {
            f"{prefix}.qweight": pack_along_rows(q, bits),
            f"{prefix}.qzeros": pack_along_cols(zeros - 1, bits),  # the v1 checkpoints' "zero - 1"
            f"{prefix}.scales": scales,
            f"{prefix}.g_idx": g_idx.astype(np.int32),
        }
        return stored, deq.T
    if scheme == "awq":
        group = 32
        q, zeros, scales, deq = _affine_codes(w.T, np.arange(in_f) // group, in_f // group, 4, False)
        stored = {
            f"{prefix}.qweight": pack_along_cols(q, 4, AWQ_ORDER),
            f"{prefix}.qzeros": pack_along_cols(zeros, 4, AWQ_ORDER),
            f"{prefix}.scales": scales,
        }
        return stored, deq.T
    # FP8 e4m3: codes from torch's rounding, values read back by this file's own e4m3 decoder.
    if scheme == "fp8-tensor":
        scale = np.array([np.abs(w).max() / 448.0], np.float32)
        full = np.full_like(w, scale[0])
    elif scheme == "fp8-channel":
        scale = (np.abs(w).max(1, keepdims=True) / 448.0).astype(np.float32)
        full = np.broadcast_to(scale, w.shape)
    else:
        scale = rng.uniform(0.5, 2.0, size=(-(-out_f // 32), -(-in_f // 32))).astype(np.float32) / 448.0
        full = np.repeat(np.repeat(scale, 32, 0), 32, 1)[:out_f, :in_f]
    codes = torch.from_numpy(np.clip(w / full, -448, 448).astype(np.float32)).to(torch.float8_e4m3fn)
    deq = e4m3_to_float(codes.view(torch.uint8).numpy()) * full
    name = f"{prefix}.weight_scale_inv" if scheme == "fp8-block" else f"{prefix}.weight_scale"
    return {f"{prefix}.weight": codes, name: torch.from_numpy(np.ascontiguousarray(scale))}, deq


def _quant_config(scheme: str) -> dict:
    if scheme == "gptq4":
        return {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False}
    if scheme == "gptq8":
        return {"quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": False, "sym": True}
    if scheme == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    if scheme == "fp8-block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
    strategy = scheme.removeprefix("fp8-")
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {"weights": weights, "targets": ["Linear"]}},
        "ignore": ["lm_head"],
    }


@pytest.mark.parametrize("scheme", ["gptq4", "gptq8", "awq", "fp8-tensor", "fp8-channel", "fp8-block"])
def test_tiny_llama_quantized_checkpoint_matches_float_reference(tmp_path, scheme: str) -> None:
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from helpers import tiny
    from poot_core import Driver, DriverOptions, ModelHandle, open_executor

    source = tiny.build(tmp_path / "float", "llama", seed=4)
    weights = load_file(source / "model.safetensors")
    rng = np.random.default_rng(11)
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        prefix = name.removesuffix(".weight")
        if prefix.rsplit(".", 1)[-1] in LINEARS and name.endswith(".weight"):
            stored, deq = _quantize_layer(scheme, prefix, tensor.numpy(), rng)
            quantized.update({k: torch.as_tensor(v) for k, v in stored.items()})
            dequantized[name] = torch.from_numpy(np.ascontiguousarray(deq))
        else:
            quantized[name] = dequantized[name] = tensor
    qdir, rdir = tmp_path / "quantized", tmp_path / "reference"
    for target, tensors in ((qdir, quantized), (rdir, dequantized)):
        shutil.copytree(source, target)
        (target / "model.safetensors").unlink()
        save_file({k: v.contiguous() for k, v in tensors.items()}, target / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = _quant_config(scheme)
    (qdir / "config.json").write_text(json.dumps(config))

    handle = ModelHandle.load(qdir)
    layer = handle.store().get("model.layers.0.self_attn.q_proj.weight")
    assert layer.layout == {"gptq4": "gptq", "gptq8": "gptq", "awq": "awq"}.get(scheme, "fp8")  # kept packed
    ids = handle.text().encode("def add(a, b): return a + b")
    ours = Driver(handle, open_executor("cpu"), DriverOptions(capacity=64, prefill_chunk=8)).logits(ids)
    assert tiny.rel_error(ours, tiny.reference_logits(rdir, ids)) <= 1e-4
