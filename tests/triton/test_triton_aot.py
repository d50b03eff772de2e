"""Every Triton kernel compiles ahead of time, without a GPU, for CUDA sm_90 and HIP gfx942/gfx90a/gfx1100.

The public functions are called on small CPU tensors with launches recorded instead of run (under the
target's own tuning), and each recorded launch is compiled with triton.compile(ASTSource(...)). Triton 3.9
needs nothing outside its wheel for this: ptxas ships in triton/backends/nvidia/bin, and the HIP backend
links the HSACO in-process (no ld.lld, no ROCm install). The work runs in a child process because the
kernel tests in this suite import the package under TRITON_INTERPRET=1, which turns kernels into
interpreted functions that cannot be compiled.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import triton  # noqa: E402, F401 - a test dependency: missing, it must fail, not skip

TARGETS = {
    "cuda:90": ("cuda", 90, 32),
    "hip:gfx942": ("hip", "gfx942", 64),
    "hip:gfx90a": ("hip", "gfx90a", 64),
    "hip:gfx1100": ("hip", "gfx1100", 32),
}
# shared memory (LDS) a block may use: a kernel over it compiles but fails to launch (OutOfResources)
SHARED_LIMIT = {"cuda:90": 232448, "hip:gfx942": 65536, "hip:gfx90a": 65536, "hip:gfx1100": 65536}


def planes_layouts() -> list:
    """Planes matrices [256, 512] of layouts that together take every branch of the planes kernels."""
    import torch

    from poot_core.checkpoint.layouts import PackedWeight
    from poot_kernels_triton import relayout

    n, k = 256, 512
    made = []
    for name in ("Q4_K", "Q6_K", "Q5_K", "Q5_0", "Q3_K", "Q8_0", "IQ4_XS", "Q4_1", "Q2_K"):
        elems, size = relayout.GGUF_BLOCKS[name]
        blocks = torch.zeros(n, k // elems * size, dtype=torch.uint8)
        made.append(PackedWeight("gguf", (n, k), {"blocks": blocks}, {"type": name}))
    g_idx = torch.arange(k, dtype=torch.int32).flip(0) // 128  # act-order: rows sorted by group at upload
    gptq = {"qweight": torch.zeros(k // 8, n, dtype=torch.int32), "qzeros": torch.zeros(4, n // 8, dtype=torch.int32),
            "scales": torch.zeros(4, n, dtype=torch.float16), "g_idx": g_idx}  # fmt: skip
    made.append(PackedWeight("gptq", (n, k), gptq, {"bits": 4, "group_size": 128, "desc_act": True}))
    awq = {"qweight": torch.zeros(k, n // 8, dtype=torch.int32), "qzeros": torch.zeros(4, n // 8, dtype=torch.int32),
           "scales": torch.zeros(4, n, dtype=torch.float16)}  # fmt: skip
    made.append(PackedWeight("awq", (n, k), awq, {"bits": 4, "group_size": 128}))
    fp8 = {"weight": torch.zeros(n, k, dtype=torch.float8_e4m3fn), "scale": torch.ones(2, 4)}
    made.append(PackedWeight("fp8", (n, k), fp8, {"granularity": "block", "block": (128, 128)}))
    return [relayout.to_planes(w) for w in made]


def record_all_launches() -> list:
    """Call every public function in each of its kernel variants; return the recorded launches."""
    import torch

    import poot_kernels_triton as ktr
    from poot_core.checkpoint.layouts import PackedWeight

    bf = torch.bfloat16
    with ktr.record_launches() as launches:
        x, w = torch.zeros(4, 4096, dtype=bf), torch.zeros(4096, dtype=bf)
        ktr.add_rms_norm(x, x.clone(), w, 1e-6, weight_offset=1.0)
        ktr.add_rms_norm(x, None, w, 1e-6)
        ktr.gated_activation(torch.zeros(4, 2 * 1024, dtype=bf), kind="silu")
        ktr.gated_activation(torch.zeros(4, 1024, dtype=bf), torch.zeros(4, 1024, dtype=bf), kind="gelu_tanh")
        q, k = torch.zeros(4, 32, 128, dtype=bf), torch.zeros(4, 8, 128, dtype=bf)
        pos = torch.zeros(4, dtype=torch.int64)
        cos = torch.zeros(64, 32)
        ktr.apply_rope(q, k, pos, cos, cos, inplace=False)  # partial rotary, out of place
        ktr.apply_rope(q, k, pos, torch.zeros(64, 64), torch.zeros(64, 64))
        cache = torch.zeros(2, 8, 64, 128, dtype=bf)
        ktr.write_kv(k, k, cache, cache, pos, layer=1)
        ktr.prefill_attention(q, cache[0], cache[0], 0)
        ktr.prefill_attention(q, cache[0], cache[0], 2, window=16, softcap=50.0)
        lens = torch.zeros(2, dtype=torch.int32)
        ktr.decode_attention(torch.zeros(2, 32, 128, dtype=bf), cache, cache, lens)
        ktr.decode_attention(torch.zeros(2, 32, 128, dtype=bf), cache, cache, lens, window=16, softcap=30.0)
        from poot_kernels_triton.paged import paged_decode_attention, paged_prefill_attention, write_paged_kv

        pool, tables = torch.zeros(6, 8, 16, 128, dtype=bf), torch.zeros(2, 3, dtype=torch.int64)
        write_paged_kv(k, k, pool, pool, pos, pos, tables)
        paged_decode_attention(q, pool, pool, pos, pos, tables)
        paged_decode_attention(q, pool, pool, pos, pos, tables, window=16, softcap=30.0)
        tiles = torch.zeros(2, dtype=torch.int64)
        paged_prefill_attention(q, pool, pool, pos, pos, tables, tiles, q.clone())
        paged_prefill_attention(q, pool, pool, pos, pos, tables, tiles, q.clone(), window=16, softcap=30.0)
        paged_prefill_attention(q, pool, pool, pos, pos, tables, tiles, q.clone(), window=16,
                                limits=torch.zeros(4, dtype=torch.int32))  # group attention's
        for m in (1, 16):
            xm = torch.zeros(m, 512, dtype=bf)
            ktr.linear(xm, torch.zeros(256, 512, dtype=bf), torch.zeros(256, dtype=bf))
        # float32 logits keep the Triton GEMM on targets whose 16-bit products go to the vendor BLAS
        ktr.linear(torch.zeros(16, 512, dtype=bf), torch.zeros(256, 512, dtype=bf), out_dtype=torch.float32)
        # GGUF blocks as the file stores them (stacked experts): every type's decoder in the GEMV, two in the GEMM
        for name, (_, elems, nbytes) in ktr.GGUF_TYPES.items():
            blocks = torch.zeros(256, 512 // elems * nbytes, dtype=torch.uint8)
            weight = PackedWeight("gguf", (256, 512), {"blocks": blocks}, {"type": name})
            for m in (1, 16) if name in ("Q4_K", "Q5_0") else (1,):
                ktr.linear(torch.zeros(m, 512, dtype=bf), weight)
        # the planes kernels, over layouts that between them take every branch (bit widths, high bits, integer
        # scales, zeros packed / constant / per column, minimums, code book, FP8 and its blocks, act-order)
        for weight in planes_layouts():
            for m in (1, 16):
                ktr.linear(torch.zeros(m, 512, dtype=bf), weight)
        for weight in planes_layouts()[:2]:
            ktr.planes_rows(weight, torch.zeros(2, dtype=torch.int64))
        from poot_kernels_triton.moe import FusedExperts, route

        route(torch.zeros(2, 128), {"top_k": 8, "scoring": "softmax", "norm_topk": True, "routed_scale": 1.0})

        expert = (torch.zeros(768, 2048, dtype=bf), torch.zeros(768, 2048, dtype=bf), torch.zeros(2048, 768, dtype=bf))
        FusedExperts([expert] * 4).run(torch.zeros(1, 2048, dtype=bf), torch.zeros(1, 2, dtype=torch.int64),
                                       torch.zeros(1, 2), "silu")
        record_recurrent()
        logits = torch.zeros(2, 32000)
        ktr.greedy(logits)
        ktr.sample(logits, torch.zeros(2), temperature=0.8, top_k=40, top_p=0.9, min_p=0.05)
        from poot_kernels_triton.sampling import apply_bitmask

        apply_bitmask(logits, torch.zeros(2, 1000, dtype=torch.int32), torch.zeros(2, dtype=torch.int64))
    return launches


def record_recurrent() -> None:
    """The hybrid families' kernels at Granite-4.0-H / Qwen3-Next-sized heads: a conv over x, B and C with its
    window, the scan (128 heads of 64, state 128, 1 group) chunked and stepped, the delta rule (16 key heads of
    128 for 32 value heads of 128) chunked and stepped, the three one-token steps as the serving engine's paged
    decode launches them, and the gated norm in both orders."""
    import torch

    from poot_kernels_triton import recurrent

    bf = torch.bfloat16
    for tokens in (1, 64):
        xbc = torch.zeros(1, tokens, 8192 + 2 * 128, dtype=bf)
        recurrent.short_conv(xbc, torch.zeros(xbc.shape[-1], 4, dtype=bf), torch.zeros(xbc.shape[-1], dtype=bf),
                             torch.zeros(1, xbc.shape[-1], 3), silu=True)
        heads = torch.zeros(128)
        recurrent.ssm_scan(torch.zeros(1, tokens, 128, 64), torch.zeros(1, tokens, 128), heads,
                           torch.zeros(1, tokens, 1, 128), torch.zeros(1, tokens, 1, 128), heads, heads,
                           torch.zeros(1, 128, 64, 128), (0.0, float("inf")))
        qk, vh = torch.zeros(1, tokens, 16, 128), torch.zeros(32)
        recurrent.gated_delta(qk, qk, torch.zeros(1, tokens, 32, 128), torch.zeros(1, tokens, 32),
                              torch.zeros(1, tokens, 32), vh, vh, torch.zeros(1, 32, 128, 128), 1e-6)
    rows = torch.zeros(2, dtype=torch.int64)  # the serving engine's decode launch: 2 rows over pools of 4 slots
    paged = recurrent.PagedRows(rows, rows, rows)
    xbc = torch.zeros(2, 1, 8192 + 2 * 128, dtype=bf)
    recurrent.short_conv(xbc, torch.zeros(xbc.shape[-1], 4, dtype=bf), torch.zeros(xbc.shape[-1], dtype=bf),
                         torch.zeros(4, xbc.shape[-1], 3), silu=True, paged=paged)
    recurrent.ssm_scan(torch.zeros(2, 1, 128, 64), torch.zeros(2, 1, 128), heads, torch.zeros(2, 1, 1, 128),
                       torch.zeros(2, 1, 1, 128), heads, heads, torch.zeros(4, 128, 64, 128), (0.0, float("inf")),
                       paged=paged)
    qk = torch.zeros(2, 1, 16, 128)
    recurrent.gated_delta(qk, qk, torch.zeros(2, 1, 32, 128), torch.zeros(2, 1, 32), torch.zeros(2, 1, 32), vh, vh,
                          torch.zeros(4, 32, 128, 128), 1e-6, paged=paged)
    for first in (False, True):
        x = torch.zeros(4, 4096)
        recurrent.gated_rms_norm(x, x, torch.zeros(4096), 1e-5, 128 if first else 4096, first, bf)


def jitted_kernels() -> set[str]:
    """Names of the package's @triton.jit functions that are launched directly (kernels, not helpers)."""
    import importlib
    import pkgutil

    import poot_kernels_triton as ktr

    names = set()
    for info in pkgutil.iter_modules(ktr.__path__):
        module = importlib.import_module(f"poot_kernels_triton.{info.name}")
        for attr, value in vars(module).items():
            if isinstance(value, triton.runtime.JITFunction) and attr.endswith("_kernel"):
                names.add(f"{info.name}.{attr}")
    return names


def compile_for(target_key: str) -> dict:
    """Child-process body: compile every recorded launch for one target; report what came out."""
    from triton.backends.compiler import GPUTarget

    import poot_kernels_triton as ktr
    from poot_kernels_triton.aot import compile_launch

    backend, arch, warp = TARGETS[target_key]
    target = GPUTarget(backend, arch, warp)
    with ktr.use_tuning(ktr.tuning_for_target(backend, arch)):
        launches = record_all_launches()
    compiled, failures = [], []
    for launch in launches:
        name = f"{launch.kernel.fn.__module__.rsplit('.', 1)[-1]}.{launch.kernel.fn.__name__}"
        try:
            kernel = compile_launch(launch, target)
            binary = kernel.asm["cubin" if backend == "cuda" else "hsaco"]
            compiled.append({"kernel": name, "bytes": len(binary), "shared": kernel.metadata.shared})
        except Exception as err:  # report every failure, not just the first
            failures.append({"kernel": name, "error": f"{type(err).__name__}: {str(err)[-2000:]}"})
    return {"compiled": compiled, "failures": failures, "all_kernels": sorted(jitted_kernels())}


@pytest.fixture(scope="module")
def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    return env


@pytest.mark.parametrize("target_key", sorted(TARGETS))
def test_every_kernel_compiles_ahead_of_time(target_key: str, child_env: dict[str, str]) -> None:
    from helpers.aot import compiled_in_child  # not at the top: the child runs this file without tests/ on its path

    report = compiled_in_child([str(Path(__file__).resolve()), target_key], child_env)
    built = {c["kernel"] for c in report["compiled"]}
    assert built == set(report["all_kernels"]), f"never compiled: {set(report['all_kernels']) - built}"
    assert all(c["bytes"] > 0 for c in report["compiled"])
    over = [c for c in report["compiled"] if c["shared"] > SHARED_LIMIT[target_key]]
    assert not over, f"over {SHARED_LIMIT[target_key]} bytes of shared memory: {over}"


if __name__ == "__main__":
    print(json.dumps(compile_for(sys.argv[1])))
