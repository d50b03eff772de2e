"""Every packed layout's kernels compiled for the GPU, on the GPU, at Llama-like widths: the planes decode GEMV
(with the shipped tiles, split-K included, also replayed from a CUDA graph) and the prefill GEMM against
poot_core's dequantizer (independently tested against the gguf package and the published layouts), on fresh
random weights. Skipped without a CUDA device; the interpreter tests (test_triton_layouts.py) cover CI.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from poot_core import PackedWeight
from poot_core.checkpoint.quant import dequantize

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")

GGUF = {"Q4_0": (32, 18, [0]), "Q4_1": (32, 20, [0, 2]), "Q5_0": (32, 22, [0]), "Q5_1": (32, 24, [0, 2]),
        "Q8_0": (32, 34, [0]), "Q2_K": (256, 84, [80, 82]), "Q3_K": (256, 110, [108]), "Q4_K": (256, 144, [0, 2]),
        "Q5_K": (256, 176, [0, 2]), "Q6_K": (256, 210, [208]), "IQ4_NL": (32, 18, [0]),
        "IQ4_XS": (256, 136, [0])}  # fmt: skip


def random_weight(kind: str, n: int, k: int, seed: int) -> PackedWeight:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    big = 2**31 - 1

    def ints(*shape: int) -> torch.Tensor:
        return torch.randint(-big, big, shape, dtype=torch.int32, device="cuda", generator=gen)

    if kind.startswith("gguf."):
        t = kind.removeprefix("gguf.")
        elems, size, halves = GGUF[t]
        b = torch.randint(0, 256, (n, k // elems, size), dtype=torch.uint8, device="cuda", generator=gen)
        for off in halves:
            d = (torch.rand(n, k // elems, device="cuda", generator=gen) * 0.02 - 0.01).half()
            b[:, :, off : off + 2] = d.view(torch.uint8).view(n, k // elems, 2)
        return PackedWeight("gguf", (n, k), {"blocks": b.reshape(n, -1)}, {"type": t})
    scales = (torch.rand(k // 128, n, device="cuda", generator=gen) * 0.02 + 0.001).half()
    if kind.startswith("gptq."):
        bits = int(kind.split(".")[1].rstrip("a"))
        g_idx = torch.arange(k, device="cuda", dtype=torch.int32) // 128
        if kind.endswith("a"):  # act-order
            g_idx = g_idx[torch.randperm(k, device="cuda", generator=gen)]
        parts = {"qweight": ints(k * bits // 32, n), "qzeros": ints(k // 128, n * bits // 32), "scales": scales,
                 "g_idx": g_idx}  # fmt: skip
        return PackedWeight("gptq", (n, k), parts, {"bits": bits, "group_size": 128, "desc_act": kind.endswith("a")})
    if kind == "awq.4":
        parts = {"qweight": ints(k, n // 8), "qzeros": ints(k // 128, n // 8), "scales": scales}
        return PackedWeight("awq", (n, k), parts, {"bits": 4, "group_size": 128, "version": "gemm"})
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, device="cuda", generator=gen)
    codes = torch.where((codes & 0x7F) == 0x7F, codes ^ 1, codes).view(torch.float8_e4m3fn)
    granularity = kind.removeprefix("fp8.")
    scale = {"tensor": torch.rand(1, device="cuda", generator=gen) * 1e-3,
             "channel": torch.rand(n, 1, device="cuda", generator=gen) * 1e-3,
             "block": torch.rand(n // 128, k // 128, device="cuda", generator=gen) * 1e-3}[granularity]  # fmt: skip
    meta = {"granularity": granularity, **({"block": (128, 128)} if granularity == "block" else {})}
    return PackedWeight("fp8", (n, k), {"weight": codes, "scale": scale}, meta)


# layouts that between them take every branch of the compiled kernels (bit widths, high bits, integer scales,
# zeros packed / constant / per column, minimums, the IQ4 byte permutes, FP8 and its blocks, act-order)
KINDS = ["gguf.Q4_0", "gguf.Q5_1", "gguf.Q2_K", "gguf.Q3_K", "gguf.Q4_K", "gguf.Q5_K", "gguf.Q6_K", "gguf.IQ4_XS",
         "gguf.Q8_0", "gptq.3", "gptq.4a", "gptq.8", "awq.4", "fp8.channel", "fp8.block"]  # fmt: skip


def reference(kind: str, w: PackedWeight) -> torch.Tensor:
    """float64 [n, k] on the GPU, from poot_core's dequantizer run on a CPU copy (3-bit GPTQ, which it does not
    decode: from the codes' bit stream, unpacked here)."""
    parts = {name: t.cpu() for name, t in w.parts.items()}
    if kind == "gptq.3":
        n, k = w.shape
        q = stream_values(parts["qweight"].numpy(), 3, k)
        z = stream_values(np.ascontiguousarray(parts["qzeros"].numpy().T), 3, n).T + 1
        g = parts["g_idx"].numpy()
        ref = torch.from_numpy(((q - z[g]) * parts["scales"].numpy()[g].astype(np.float64)).T.copy())
    else:
        ref = dequantize(PackedWeight(w.layout, w.shape, parts, w.meta)).double()
    return ref.cuda()


def stream_values(words: np.ndarray, bits: int, count: int) -> np.ndarray:
    """int32 [r, c]: each column one little-endian bit stream along the rows -> [count, c] values of `bits`."""
    raw = np.ascontiguousarray(words.astype("<u4")).view(np.uint8).reshape(words.shape[0], words.shape[1], 4)
    stream = np.unpackbits(raw.transpose(1, 0, 2).reshape(words.shape[1], -1), axis=1, bitorder="little")
    fields = stream[:, : count * bits].reshape(words.shape[1], count, bits).astype(np.int64)
    return (fields << np.arange(bits)).sum(-1).T


@pytest.mark.parametrize("kind", KINDS)
def test_gemv_and_gemm_on_the_gpu(kind: str) -> None:
    import poot_kernels_triton as ktr
    from poot_kernels_triton.weights import to_device

    n, k = 3072, 4096
    raw = random_weight(kind, n, k, seed=KINDS.index(kind))
    ref = reference(kind, raw)
    w = to_device(raw, torch.device("cuda"))  # the planes form, as upload makes it
    for rows in (1, 3, 64):
        x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
        want = x.double() @ ref.T
        got = ktr.linear(x, w, out_dtype=torch.float32).double()
        err = float((got - want).norm() / want.norm())
        # the GEMM rounds the rebuilt weights to bf16 for the tensor cores; the GEMV sums exact values
        assert err < (1e-5 if rows <= 4 else 1e-2), (rows, err)


def test_gemv_replays_in_a_cuda_graph() -> None:
    """Split-K partials and counters inside a captured graph: every replay gives the eager result."""
    import poot_kernels_triton as ktr
    from poot_kernels_triton.weights import to_device

    w = to_device(random_weight("gguf.Q4_K", 4096, 14336, seed=99), torch.device("cuda"))
    x = torch.randn(1, 14336, device="cuda").to(torch.bfloat16)
    eager = ktr.linear(x, w, out_dtype=torch.float32)
    ktr.linear(x, w, out_dtype=torch.float32)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ktr.linear(x, w, out_dtype=torch.float32)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    assert np.isfinite(out.cpu().numpy()).all()


# one matrix of each shape class the tile tables are keyed by (tuning.shape_class)
CLASS_SHAPES = {"square": (3072, 4096), "wide": (8448, 1024), "deep": (2560, 8448)}


def _table_cases() -> list:
    from poot_kernels_triton.tuning import HOPPER_PLANES

    cases = [(source, cls) for source, cls in HOPPER_PLANES if source != "*"]
    # the ("*", class) rows serve the layouts with no row of their own
    return cases + [(kind, cls) for kind in ("gguf.Q4_1", "gguf.Q3_K") for cls in CLASS_SHAPES]


@pytest.mark.parametrize(("kind", "cls"), _table_cases())
def test_every_tuned_gemv_tile_on_its_shape_class(kind: str, cls: str) -> None:
    """The decode GEMV with the tile the H200's table gives this layout and shape class (its own block_k and
    split), against the float64 reference."""
    import poot_kernels_triton as ktr
    from poot_kernels_triton.tuning import shape_class
    from poot_kernels_triton.weights import to_device

    n, k = CLASS_SHAPES[cls]
    assert shape_class(n, k) == cls
    raw = random_weight(kind, n, k, seed=sum(map(ord, kind + cls)))
    ref = reference(kind, raw)
    w = to_device(raw, torch.device("cuda"))
    x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    want = x.double() @ ref.T
    got = ktr.linear(x, w, out_dtype=torch.float32).double()
    assert float((got - want).norm() / want.norm()) < 1e-5
