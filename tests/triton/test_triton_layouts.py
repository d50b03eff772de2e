"""Every packed layout on the shared Triton executor, under the interpreter: the planes form each matrix is
rearranged into at upload (relayout.py) and its kernels (planes.py: decode GEMV with and without split-K,
prefill GEMM, embedding rows), against float64 references that never touch poot's own decoders: the `gguf`
package's dequantizer for GGUF blocks, and for GPTQ / AWQ / FP8 the integer codes and scales drawn here and
packed with plain numpy from the published layouts. Then whole tiny models in those layouts, the Triton
executor against the CPU executor.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import triton  # noqa: F401 - a test dependency: missing, it must fail, not skip

import poot_kernels_triton as ktr
from helpers.gguf_blocks import F16_FIELDS, random_blocks
from helpers.quant_pack import e4m3_to_float, pack_along_cols, pack_along_rows
from helpers.triton_checks import counters_are_zero, rel_err
from poot_core import PackedWeight, Reason, Unsupported
from poot_kernels_triton import planes, relayout
from poot_kernels_triton.tuning import Tile
from poot_kernels_triton.weights import DeviceWeights

pytestmark = pytest.mark.interpreter  # kernels on CPU tensors

BF16_BOUND = 1.2e-2  # bf16 output rounding (the sums are float32)
F32_BOUND = 1e-5  # float32 output: what the kernels' own arithmetic costs
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def check_all_routes(w: PackedWeight, ref: torch.Tensor, seed: int) -> None:
    """w's planes form against ref [n, k] (float64): GEMV of 1 row, of 3 rows with a bias, GEMM of 5 rows,
    and embedding rows (the float32 value of each element, to its rounding)."""
    n, k = ref.shape
    pw = relayout.to_planes(w)
    assert relayout.is_planes(pw) and relayout.source_kind(pw) == w.kind
    gen = torch.Generator().manual_seed(seed)
    for rows, bias in ((1, None), (3, torch.randn(n, generator=gen)), (5, None)):
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        want = x.double() @ ref.T + (0 if bias is None else bias.double())
        assert rel_err(planes.planes_linear(x, pw, bias, out_dtype=torch.float32), want) < F32_BOUND, rows
        if rows == 1:  # through the package's entry point, in x's dtype
            out = ktr.linear(x, pw)
            assert out.dtype == torch.bfloat16 and rel_err(out, want) < BF16_BOUND
    ids = torch.tensor([n - 1, 0, n // 2])
    torch.testing.assert_close(planes.planes_rows(pw, ids).double(), ref[ids], rtol=2**-23, atol=0)
    assert counters_are_zero()


# ---------------------------------------------------------------- GGUF

def random_gguf(type_name: str, n: int, k: int, seed: int) -> tuple[PackedWeight, torch.Tensor]:
    """Random valid blocks (finite float16 scales, every other bit random) and gguf's dequantization of them."""
    blocks = random_blocks(type_name, n, k, seed)
    ref = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[type_name]).astype(np.float64)
    weight = PackedWeight("gguf", (n, k), {"blocks": torch.from_numpy(blocks)}, {"type": type_name})
    return weight, torch.from_numpy(ref)


def test_every_gguf_type_has_a_planes_form() -> None:
    assert set(relayout.GGUF_BLOCKS) == set(F16_FIELDS) == set(ktr.GGUF_TYPES)


@pytest.mark.parametrize("type_name", sorted(F16_FIELDS))
def test_gguf_planes(type_name: str) -> None:
    weight, ref = random_gguf(type_name, 24, 256, seed=sorted(F16_FIELDS).index(type_name))
    check_all_routes(weight, ref, seed=1)


# ---------------------------------------------------------------- GPTQ, AWQ, FP8


def pack_stream(q: np.ndarray, bits: int) -> np.ndarray:
    """[r, c] codes -> int32 [r * bits / 32, c]: each column one little-endian bit stream along the rows (GPTQ's
    3-bit packing, 32 values in 3 words; for 2/4/8 bits the same as pack_along_rows)."""
    r, c = q.shape
    out = np.zeros((r * bits // 32 + 1, c), dtype=np.uint64)
    for i in range(r):
        word, bit = divmod(i * bits, 32)
        v = q[i].astype(np.uint64) << np.uint64(bit)
        out[word] |= v & np.uint64(0xFFFFFFFF)
        out[word + 1] |= v >> np.uint64(32)
    return out[: r * bits // 32].astype(np.uint32).view(np.int32)


def gptq_weight(bits: int, k: int, n: int, group: int, act_order: bool, v2: bool, rng: np.random.Generator):
    """Codes, zeros and scales drawn here, packed as GPTQ stores them; the float64 [n, k] they stand for."""
    groups = k // group
    q = rng.integers(0, 2**bits, size=(k, n))
    zero = rng.integers(1, 2**bits, size=(groups, n))  # the true zero point
    scales = rng.uniform(0.001, 0.05, size=(groups, n)).astype(np.float16)
    g_idx = np.arange(k) // group
    if act_order:
        g_idx = rng.permutation(g_idx)
    stored_zero = zero if v2 else zero - 1  # v1 checkpoints store zero - 1
    if bits == 3:
        qweight, qzeros = pack_stream(q, 3), pack_stream(stored_zero.T, 3).T
    else:
        qweight, qzeros = pack_along_rows(q, bits), pack_along_cols(stored_zero, bits)
    parts = {"qweight": torch.from_numpy(np.ascontiguousarray(qweight)),
             "qzeros": torch.from_numpy(np.ascontiguousarray(qzeros)), "scales": torch.from_numpy(scales),
             "g_idx": torch.from_numpy(g_idx.astype(np.int32))}  # fmt: skip
    meta = {"bits": bits, "group_size": group, "desc_act": act_order, "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    ref = (q - zero[g_idx]) * scales[g_idx].astype(np.float64)
    return PackedWeight("gptq", (n, k), parts, meta), torch.from_numpy(ref.T.copy())


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_planes(bits: int, act_order: bool) -> None:
    rng = np.random.default_rng(10 * bits + act_order)
    weight, ref = gptq_weight(bits, 256, 64, 64, act_order, v2=bits == 8, rng=rng)
    check_all_routes(weight, ref, seed=bits)


def test_gptq_one_group_and_the_direct_function() -> None:
    rng = np.random.default_rng(3)
    weight, ref = gptq_weight(4, 128, 16, 128, False, v2=False, rng=rng)
    check_all_routes(weight, ref, seed=3)
    p = weight.parts
    x = torch.randn(2, 128).to(torch.float16)
    out = ktr.gptq_linear(x, p["qweight"], p["qzeros"], p["scales"], p["g_idx"], out_dtype=torch.float32)
    assert rel_err(out, x.double() @ ref.T) < F32_BOUND


def test_gptq_groups_of_unequal_size_are_refused() -> None:
    rng = np.random.default_rng(4)
    weight, _ = gptq_weight(4, 128, 16, 32, False, v2=False, rng=rng)
    g = weight.parts["g_idx"].clone()
    g[:40] = 0  # group 0 now holds 40 rows, group 1 only 24
    uneven = PackedWeight("gptq", weight.shape, {**weight.parts, "g_idx": g}, weight.meta)
    with pytest.raises(Unsupported) as err:
        relayout.to_planes(uneven)
    assert err.value.reason is Reason.QUANTIZATION


def test_awq_planes() -> None:
    rng = np.random.default_rng(5)
    k, n, group = 256, 64, 64
    q = rng.integers(0, 16, size=(k, n))
    zero = rng.integers(0, 16, size=(k // group, n))
    scales = rng.uniform(0.001, 0.05, size=(k // group, n)).astype(np.float16)
    parts = {"qweight": torch.from_numpy(pack_along_cols(q, 4, AWQ_ORDER)),
             "qzeros": torch.from_numpy(pack_along_cols(zero, 4, AWQ_ORDER)),
             "scales": torch.from_numpy(scales)}  # fmt: skip
    weight = PackedWeight("awq", (n, k), parts, {"bits": 4, "group_size": group, "version": "gemm"})
    g = np.arange(k) // group
    ref = ((q - zero[g]) * scales[g].astype(np.float64)).T
    check_all_routes(weight, torch.from_numpy(ref.copy()), seed=5)


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_fp8_planes(granularity: str) -> None:
    rng = np.random.default_rng(6)
    n, k = 40, 256
    values = rng.standard_normal((n, k)) * 60
    values[0, :6] = [1e-3, -3e-3, 7e-3, 0.0, 2e-4, -1e-4]  # subnormal e4m3 codes (below 2^-6)
    codes = torch.from_numpy(np.clip(values, -440, 440).astype(np.float32)).to(torch.float8_e4m3fn)
    decoded = e4m3_to_float(codes.view(torch.uint8).numpy()).astype(np.float64)
    assert (np.abs(decoded[0, :6]) < 2**-6).all() and decoded[0, 0] != 0
    if granularity == "tensor":
        scale = rng.uniform(0.5, 2.0, size=(1,)).astype(np.float32)
        full, meta = np.full((n, k), scale[0], np.float64), {}
    elif granularity == "channel":
        scale = rng.uniform(0.5, 2.0, size=(n, 1)).astype(np.float32)
        full, meta = np.broadcast_to(scale, (n, k)).astype(np.float64), {}
    else:
        scale = rng.uniform(0.5, 2.0, size=(-(-n // 32), k // 64)).astype(np.float32)
        full, meta = np.repeat(np.repeat(scale, 32, 0), 64, 1)[:n].astype(np.float64), {"block": (32, 64)}
    weight = PackedWeight("fp8", (n, k), {"weight": codes, "scale": torch.from_numpy(scale)},
                          {"granularity": granularity, **meta})  # fmt: skip
    check_all_routes(weight, torch.from_numpy(decoded * full), seed=6)


# ---------------------------------------------------------------- split-K, joined matrices


def test_planes_split_k(gemv_override) -> None:
    """Programs sharing an output tile along k (an uneven share): partials summed by the last one, counters
    back to zero."""
    weight, ref = random_gguf("Q4_K", 20, 512, seed=7)
    pw = relayout.to_planes(weight)
    gemv_override["planes"] = Tile(block_n=16, block_k=64, num_warps=1, num_stages=1, split_k=3)
    x = torch.randn(1, 512).to(torch.bfloat16)
    for _ in range(2):  # the counters reset themselves: a second launch is right too
        assert rel_err(planes.planes_linear(x, pw, out_dtype=torch.float32), x.double() @ ref.T) < F32_BOUND
        assert counters_are_zero()


def test_planes_matrices_join_into_views() -> None:
    """q/k/v of one layout share one GEMV: the originals become column views of the joined planes."""
    made = {name: random_gguf("Q5_0", n, 256, seed=8 + n) for name, n in (("q", 32), ("k", 16), ("v", 16))}
    device = DeviceWeights({n: relayout.to_planes(w) for n, (w, _) in made.items()}, torch.bfloat16,
                           torch.device("cpu"))  # fmt: skip
    joined = device.concatenated(("q", "k", "v"))
    assert joined is not None and joined.shape == (64, 256)
    assert device.tensors["k"].parts["lo"].data_ptr() == joined.parts["lo"][:, 32:].data_ptr()
    x = torch.randn(1, 256).to(torch.bfloat16)
    ref = torch.cat([r for _, r in made.values()])
    assert rel_err(ktr.linear(x, joined, out_dtype=torch.float32), x.double() @ ref.T) < F32_BOUND
    assert rel_err(ktr.linear(x, device.tensors["v"], out_dtype=torch.float32), x.double() @ made["v"][1].T) < F32_BOUND
    # a different layout does not join
    device.tensors["o"] = relayout.to_planes(random_gguf("Q8_0", 16, 256, seed=9)[0])
    assert device.concatenated(("q", "o")) is None


def test_unknown_layouts_are_refused() -> None:
    with pytest.raises(Unsupported):
        relayout.to_planes(PackedWeight("gguf", (4, 256), {"blocks": torch.zeros(4, 66, dtype=torch.uint8)},
                                        {"type": "IQ2_XXS"}))  # fmt: skip
    assert relayout.to_planes(PackedWeight("gguf", (2, 4, 256), {"blocks": torch.zeros(8, 144, dtype=torch.uint8)},
                                           {"type": "Q4_K"})) is None  # stacked experts stay as stored


# ---------------------------------------------------------------- whole models: Triton executor vs CPU executor

PROMPT = [(7 * i + 3) % 250 + 2 for i in range(6)]


def both_logits(path) -> tuple[np.ndarray, np.ndarray]:
    """Logits of PROMPT from the CPU executor and the Triton executor's binding under the interpreter, in
    chunks of 5 then 1 token: the prefill GEMM route, then the decode GEMV route."""
    from poot_core import Driver, DriverOptions, ModelHandle, open_executor
    from poot_kernels_triton.executor import TritonExecutor

    handle = ModelHandle.load(path)
    opts = DriverOptions(capacity=16, prefill_chunk=5)
    ref = Driver(handle, open_executor("cpu"), opts).logits(PROMPT)
    ours = Driver(handle, TritonExecutor.on_interpreter(), opts).logits(PROMPT)
    return np.asarray(ours, dtype=np.float64), np.asarray(ref, dtype=np.float64)


def max_rel(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def test_gguf_model_matches_cpu(tmp_path) -> None:
    """A tiny llama GGUF whose matrices are all Q5_0 (most of a common Q4_K_M file of a small model): the
    embedding table stays as stored, the matrices go to planes (every other type: test_gguf_planes). One layer
    of width 128 (every matrix kind, each still several tiles and k steps wide): the interpreter's cost is
    per program, and the planes kernels were nine tenths of this test at two layers of width 256."""
    from helpers.gguf_models import build

    path, _ = build(tmp_path, "Q5_0", layers=1, width=128)
    ours, ref = both_logits(path)
    assert max_rel(ours, ref) < 3e-2  # bf16 activations between the matmuls on the Triton side


def _packed_linear(scheme: str, w: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray | torch.Tensor]:
    """Random codes in `scheme`'s stored form for a linear of w's shape [out, in], scaled like w."""
    out_f, in_f = w.shape
    scale = float(np.abs(w).max()) / 8
    scales = rng.uniform(0.5, 1.5, size=(in_f // 32, out_f)).astype(np.float16) * np.float16(scale)
    if scheme == "gptq":  # 4-bit, groups of 32, act-order
        g_idx = rng.permutation(np.arange(in_f) // 32)
        q = rng.integers(0, 16, size=(in_f, out_f))
        zeros = rng.integers(1, 16, size=(in_f // 32, out_f))
        return {"qweight": pack_along_rows(q, 4), "qzeros": pack_along_cols(zeros - 1, 4),
                "scales": scales, "g_idx": g_idx.astype(np.int32)}  # fmt: skip
    if scheme == "awq":
        q, zeros = rng.integers(0, 16, size=(in_f, out_f)), rng.integers(0, 16, size=(in_f // 32, out_f))
        return {"qweight": pack_along_cols(q, 4, AWQ_ORDER), "qzeros": pack_along_cols(zeros, 4, AWQ_ORDER),
                "scales": scales}
    codes = torch.from_numpy(np.clip(rng.standard_normal((out_f, in_f)) * 50, -440, 440).astype(np.float32))
    block = rng.uniform(0.5, 1.5, size=(-(-out_f // 32), -(-in_f // 32))).astype(np.float32) * scale / 100
    return {"weight": codes.to(torch.float8_e4m3fn), "weight_scale_inv": torch.from_numpy(block)}


QUANT_CONFIGS = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]},
}


@pytest.mark.parametrize("scheme", sorted(QUANT_CONFIGS))
def test_quantized_checkpoint_matches_cpu(tmp_path, scheme: str) -> None:
    """A tiny llama whose linears are GPTQ (act-order), AWQ or FP8 (blocks) codes, saved as those quantizers
    save them: the Triton executor (planes at upload) against the CPU executor on the same file."""
    import json

    from safetensors.torch import load_file, save_file

    from helpers import tiny

    source = tiny.build(tmp_path / "float", "llama", seed=4)
    rng = np.random.default_rng(12)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in load_file(source / "model.safetensors").items():
        prefix = name.removesuffix(".weight")
        if name.endswith("_proj.weight"):
            for part, v in _packed_linear(scheme, t.numpy(), rng).items():
                tensors[f"{prefix}.{part}"] = torch.as_tensor(v).contiguous()
        else:
            tensors[name] = t
    save_file(tensors, source / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = QUANT_CONFIGS[scheme]
    (source / "config.json").write_text(json.dumps(config))
    ours, ref = both_logits(source)
    assert max_rel(ours, ref) < 3e-2
