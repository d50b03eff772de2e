"""Tile sizes and launch settings per vendor and architecture.

One `Tuning` per target. NVIDIA warps are 32 lanes; AMD CDNA wavefronts (gfx90a, gfx942) are 64 lanes and
have less LDS per CU than Hopper has shared memory, so their attention and GEMM tiles are smaller and use
fewer warps. RDNA (gfx1100) runs wave32. The interpreter entry keeps tiles tiny and upcasts every tl.dot
operand to float32 (the interpreter mis-computes bf16 arithmetic).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from poot_core.errors import Reason, Unsupported


@dataclass(frozen=True)
class Tile:
    """Launch settings of one kernel: block sizes (0 when unused), warps, pipeline stages, backend options."""

    block_m: int = 0
    block_n: int = 0
    block_k: int = 0
    num_warps: int = 4
    num_stages: int = 2
    extra: dict[str, int] = field(default_factory=dict)
    split_k: int = 0  # GEMV only: programs sharing one output tile along k (0: chosen from the shape)


@dataclass(frozen=True)
class Tuning:
    """Every kernel's tile for one target. `upcast_dot` widens tl.dot operands to float32."""

    name: str
    backend: str  # "cuda", "hip" or "interpreter"
    warp_size: int
    upcast_dot: bool
    row_warps: int  # most warps a one-row kernel (norm, rope, activation, sampling) uses
    prefill: Tile
    decode: Tile
    gemv: Tile
    gemm: Tile
    qgemv: Tile
    qgemm: Tile
    decode_programs: int  # how many programs flash-decoding aims to keep busy
    # Q4_K blocks as the file stores them (stacked experts), read in whole words: block_k elements = block_k / 64
    # chunks of 32 bytes per step
    q4k_gemv: Tile = field(default_factory=lambda: Tile(block_n=16, block_k=512, num_warps=4, num_stages=2))
    # GEMVs split along k until about this many programs run (enough loads in flight to cover memory latency)
    gemv_programs: int = 0
    # packed weights in their planes form (planes.py): the GEMV tile (block_n output columns, block_k inputs a
    # step), the prefill GEMM tile, and measured tiles by (source layout, shape class), "*" for any class
    planes_gemv: Tile = field(default_factory=lambda: Tile(block_n=512, block_k=128, num_warps=4, num_stages=1))
    planes_gemm: Tile = field(default_factory=lambda: Tile(block_m=64, block_n=64, block_k=64, num_warps=4))
    planes_table: dict[tuple[str, str], Tile] = field(default_factory=dict)
    # programs the planes GEMV splits k to reach (each holds whole columns of a step: fewer, larger programs
    # than the dense GEMV's)
    planes_programs: int = 0
    # dense 16-bit products of at least this many rows go to the vendor's BLAS through torch (cuBLAS,
    # hipBLASLt), whose kernels choose tiles and split-K by shape; 0: never (the interpreter, targets where it was
    # not measured). Fewer rows take the GEMV kernel either way.
    vendor_gemm_rows: int = 0
    # paged decode attention (serving steps): its tile (None: `decode`'s) and the keys one split of a token
    # covers (0: split to fill decode_programs for one token). A fixed split keeps a token's arithmetic the
    # same whatever else is in the launch; many tokens a launch then fill the device without deep splits.
    paged_decode: Tile | None = None
    paged_split_keys: int = 0




def _planes_tile(block_n: int, warps: int, split: int, block_k: int = 128) -> Tile:
    return Tile(block_n=block_n, block_k=block_k, num_warps=warps, num_stages=1, split_k=split)


# Planes GEMV tiles measured best on the H200 (2026-12-01, `bench/gpu_decode.py --sweep` with --sweep-tiles, the
# Llama-3-8B shapes: q/k/v joined and o are "square" (the tile best for the two together), gate/up joined
# "wide", down "deep"), by (source layout, shape class). A tile was changed only where it beat the previous
# one by more than 2%. Steps of 64 inputs (block_k 64: fewer chunks a step, fewer registers, more programs
# resident) won for most wide and deep matrices, by up to 23% (Q5_0 gate/up); 4 columns a thread (128 columns
# in 1 warp, 512 in 4) still beat 1-2 columns a thread for the square ones. The ("*", class) rows serve the
# layouts not swept (Q4_1, Q5_1, Q2_K, Q3_K, IQ4_NL, other GPTQ widths): the tiles best across most swept ones.
HOPPER_PLANES: dict[tuple[str, str], Tile] = {
    ("gptq.4", "square"): _planes_tile(512, 4, 32),
    ("gptq.4", "wide"): _planes_tile(128, 1, 16, 64),
    ("gptq.4", "deep"): _planes_tile(128, 1, 32, 64),
    ("awq.4", "square"): _planes_tile(512, 4, 32),
    ("awq.4", "wide"): _planes_tile(512, 4, 16),
    ("awq.4", "deep"): _planes_tile(64, 1, 32, 64),
    ("fp8.channel", "square"): _planes_tile(64, 1, 32, 64),
    ("fp8.channel", "wide"): _planes_tile(512, 4, 32),
    ("fp8.channel", "deep"): _planes_tile(64, 1, 64, 64),
    ("gguf.IQ4_XS", "square"): _planes_tile(512, 4, 32),
    ("gguf.IQ4_XS", "wide"): _planes_tile(128, 1, 16, 64),
    ("gguf.IQ4_XS", "deep"): _planes_tile(128, 1, 32, 64),
    ("gguf.Q4_0", "square"): _planes_tile(512, 4, 32),
    ("gguf.Q4_0", "wide"): _planes_tile(128, 1, 32, 64),
    ("gguf.Q4_0", "deep"): _planes_tile(64, 1, 32, 64),
    ("gguf.Q4_K", "square"): _planes_tile(128, 1, 32),
    ("gguf.Q4_K", "wide"): _planes_tile(512, 2, 16),
    ("gguf.Q4_K", "deep"): _planes_tile(64, 1, 64, 64),
    ("gguf.Q5_0", "square"): _planes_tile(128, 1, 32, 64),
    ("gguf.Q5_0", "wide"): _planes_tile(128, 1, 16, 64),
    ("gguf.Q5_0", "deep"): _planes_tile(64, 1, 32, 64),
    ("gguf.Q5_K", "square"): _planes_tile(128, 1, 32, 64),
    ("gguf.Q5_K", "wide"): _planes_tile(64, 1, 16, 64),
    ("gguf.Q5_K", "deep"): _planes_tile(64, 1, 32, 64),
    ("gguf.Q6_K", "square"): _planes_tile(128, 1, 32, 64),
    ("gguf.Q6_K", "wide"): _planes_tile(128, 1, 16, 64),
    ("gguf.Q6_K", "deep"): _planes_tile(128, 1, 32, 64),
    ("gguf.Q8_0", "square"): _planes_tile(512, 4, 32),
    ("gguf.Q8_0", "wide"): _planes_tile(128, 1, 16, 64),
    ("gguf.Q8_0", "deep"): _planes_tile(64, 1, 32, 64),
    ("*", "square"): _planes_tile(512, 4, 32),
    ("*", "wide"): _planes_tile(128, 1, 16, 64),
    ("*", "deep"): _planes_tile(64, 1, 32, 64),
}

_HOPPER = Tuning(
    name="cuda.sm90",
    backend="cuda",
    warp_size=32,
    upcast_dot=False,
    row_warps=8,
    prefill=Tile(block_m=128, block_n=64, num_warps=8, num_stages=3),
    decode=Tile(block_m=16, block_n=64, num_warps=4, num_stages=2),
    # 8x256 was the best dense GEMV tile for every Llama-3-8B projection on the H200 (split-K by default)
    gemv=Tile(block_n=8, block_k=256, num_warps=4, num_stages=3),
    gemm=Tile(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4),
    qgemv=Tile(block_n=32, block_k=256, num_warps=4, num_stages=2),
    qgemm=Tile(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3),
    decode_programs=264,  # two waves over the H100/H200's 132 SMs
    q4k_gemv=Tile(block_n=16, block_k=512, num_warps=4, num_stages=2),
    gemv_programs=2112,  # 16 per SM: a 4096-wide GEMV in 8-row tiles is split 4 ways along k
    # 4 warps of 32 lanes, 4 columns a load: 512 columns (see HOPPER_PLANES)
    planes_gemv=Tile(block_n=512, block_k=128, num_warps=4, num_stages=1),
    planes_gemm=Tile(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3),
    planes_table=dict(HOPPER_PLANES),
    planes_programs=528,  # 4 per SM
    # cuBLAS against the Triton GEMM on the H200, Llama-3-8B projections: 1.4-3.4x faster from 8 to 4096 rows
    # (bench/gemm_probe.py, 2026-12-01)
    vendor_gemm_rows=5,
    # bench/paged_probe.py (2026-12-01, the 8B heads): against the decode tile split to fill the device, 128 keys
    # a tile and splits of 512 keys took 1 token at 768 positions from 272 to 175 us, 64 at 768 from 220 to 220,
    # 256 at 1088 from 680 to 474 and 256 at 4000 from 1567 to 1243 (the best single setting over the four)
    paged_decode=Tile(block_m=16, block_n=128, num_warps=4, num_stages=2),
    paged_split_keys=512,
)

_AMPERE = Tuning(
    name="cuda.sm80",
    backend="cuda",
    warp_size=32,
    upcast_dot=False,
    row_warps=8,
    prefill=Tile(block_m=64, block_n=64, num_warps=4, num_stages=3),
    decode=Tile(block_m=16, block_n=64, num_warps=4, num_stages=2),
    gemv=Tile(block_n=64, block_k=256, num_warps=4, num_stages=3),
    gemm=Tile(block_m=128, block_n=128, block_k=32, num_warps=4, num_stages=3),
    qgemv=Tile(block_n=32, block_k=256, num_warps=4, num_stages=2),
    qgemm=Tile(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=2),
    decode_programs=216,
    gemv_programs=1728,
    planes_gemv=Tile(block_n=512, block_k=128, num_warps=2, num_stages=1),
    planes_gemm=Tile(block_m=128, block_n=64, block_k=32, num_warps=4, num_stages=3),
    planes_programs=432,
)

# CDNA: 64-lane wavefronts, 64 KiB LDS per CU; the stream-pipeliner wants num_stages 2 at most here.
_CDNA3 = Tuning(
    name="hip.gfx942",
    backend="hip",
    warp_size=64,
    upcast_dot=False,
    row_warps=4,
    prefill=Tile(block_m=64, block_n=32, num_warps=4, num_stages=1, extra={"waves_per_eu": 2}),
    decode=Tile(block_m=16, block_n=32, num_warps=4, num_stages=1),
    gemv=Tile(block_n=32, block_k=256, num_warps=4, num_stages=1),
    gemm=Tile(block_m=128, block_n=128, block_k=32, num_warps=4, num_stages=2, extra={"waves_per_eu": 0}),
    qgemv=Tile(block_n=16, block_k=256, num_warps=4, num_stages=1),
    qgemm=Tile(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=1),
    decode_programs=608,  # two waves over the MI300X's 304 CUs
    q4k_gemv=Tile(block_n=8, block_k=512, num_warps=4, num_stages=1),
    gemv_programs=2432,
    planes_gemv=Tile(block_n=512, block_k=128, num_warps=1, num_stages=1),  # 64 lanes: 256 columns a warp
    planes_gemm=Tile(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=1),
    planes_programs=1216,
)

_CDNA2 = Tuning(
    name="hip.gfx90a",
    backend="hip",
    warp_size=64,
    upcast_dot=False,
    row_warps=4,
    prefill=Tile(block_m=64, block_n=32, num_warps=4, num_stages=1),
    decode=Tile(block_m=16, block_n=32, num_warps=4, num_stages=1),
    gemv=Tile(block_n=32, block_k=256, num_warps=4, num_stages=1),
    gemm=Tile(block_m=64, block_n=128, block_k=32, num_warps=4, num_stages=1),
    qgemv=Tile(block_n=16, block_k=256, num_warps=4, num_stages=1),
    qgemm=Tile(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=1),
    decode_programs=220,  # MI250X GCD: 110 CUs
    q4k_gemv=Tile(block_n=8, block_k=512, num_warps=4, num_stages=1),
    gemv_programs=880,
    planes_gemv=Tile(block_n=512, block_k=128, num_warps=1, num_stages=1),
    planes_gemm=Tile(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=1),
    planes_programs=440,
)

# RDNA3: wave32, WMMA, 64 KiB LDS per workgroup processor.
_RDNA3 = Tuning(
    name="hip.gfx1100",
    backend="hip",
    warp_size=32,
    upcast_dot=False,
    row_warps=8,
    prefill=Tile(block_m=64, block_n=32, num_warps=4, num_stages=1),
    decode=Tile(block_m=16, block_n=32, num_warps=4, num_stages=1),
    gemv=Tile(block_n=32, block_k=256, num_warps=4, num_stages=1),
    gemm=Tile(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=1),
    qgemv=Tile(block_n=16, block_k=256, num_warps=4, num_stages=1),
    qgemm=Tile(block_m=32, block_n=64, block_k=32, num_warps=4, num_stages=1),
    decode_programs=192,
    q4k_gemv=Tile(block_n=8, block_k=512, num_warps=4, num_stages=1),
    gemv_programs=768,
    planes_gemv=Tile(block_n=256, block_k=128, num_warps=1, num_stages=1),
    planes_gemm=Tile(block_m=32, block_n=64, block_k=32, num_warps=4, num_stages=1),
    planes_programs=192,
)

INTERPRETER = Tuning(
    name="interpreter",
    backend="interpreter",
    warp_size=32,
    upcast_dot=True,
    row_warps=1,
    prefill=Tile(block_m=16, block_n=16, num_warps=1, num_stages=1),
    decode=Tile(block_m=16, block_n=16, num_warps=1, num_stages=1),
    gemv=Tile(block_n=16, block_k=64, num_warps=1, num_stages=1),
    gemm=Tile(block_m=16, block_n=16, block_k=32, num_warps=1, num_stages=1),
    qgemv=Tile(block_n=8, block_k=256, num_warps=1, num_stages=1),
    qgemm=Tile(block_m=16, block_n=16, block_k=64, num_warps=1, num_stages=1),
    decode_programs=4,
    q4k_gemv=Tile(block_n=4, block_k=128, num_warps=1, num_stages=1),
    gemv_programs=8,
    planes_gemv=Tile(block_n=32, block_k=64, num_warps=1, num_stages=1),
    planes_gemm=Tile(block_m=16, block_n=32, block_k=32, num_warps=1, num_stages=1),
)

TUNINGS: dict[str, Tuning] = {t.name: t for t in (_HOPPER, _AMPERE, _CDNA3, _CDNA2, _RDNA3, INTERPRETER)}

_override: contextvars.ContextVar[Tuning | None] = contextvars.ContextVar("poot_triton_tuning", default=None)


def tuning_for_target(backend: str, arch: int | str) -> Tuning:
    """The tuning of a compile target, e.g. ("cuda", 90) or ("hip", "gfx942"); nearest family for others."""
    if backend == "cuda":
        return _HOPPER if int(arch) >= 90 else _AMPERE
    if backend == "hip":
        name = str(arch).split(":")[0]
        if name in ("gfx940", "gfx941", "gfx942", "gfx950"):
            return _CDNA3
        if name.startswith("gfx9"):
            return _CDNA2
        if name.startswith(("gfx11", "gfx12")):
            return _RDNA3
        return _CDNA2
    raise Unsupported(Reason.BACKEND, backend, "Triton kernels are tuned for the cuda and hip backends")


def tuning_for_device(device: torch.device) -> Tuning:
    """The tuning for tensors on `device`: a cuda device by its architecture, the cpu to the interpreter."""
    forced = _override.get()
    if forced is not None:
        return forced
    if device.type == "cpu":
        return INTERPRETER
    if device.type != "cuda":
        raise Unsupported(Reason.BACKEND, device.type, "Triton kernels run on cuda/hip devices or the interpreter")
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _tuning_of_gpu(index)


@functools.cache
def _tuning_of_gpu(index: int) -> Tuning:
    # Cached: every kernel launch asks, and reading the device's properties costs microseconds each time.
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip:
        return tuning_for_target("hip", props.gcnArchName)
    return tuning_for_target("cuda", props.major * 10 + props.minor)


@contextlib.contextmanager
def use_tuning(tuning: Tuning) -> Iterator[None]:
    """Force one tuning whatever the tensors' device (used to record launches for ahead-of-time builds)."""
    token = _override.set(tuning)
    try:
        yield
    finally:
        _override.reset(token)


def row_warps(block: int, tuning: Tuning) -> int:
    """Warps for a kernel that reduces one row of `block` elements: about 4 elements per lane, capped."""
    warps = max(1, block // (tuning.warp_size * 4))
    warps = 1 << (warps.bit_length() - 1)
    return min(warps, tuning.row_warps)


def shape_class(n: int, k: int) -> str:
    """The coarse GEMV shape classes tile tables are keyed by: deep (k > 8192, down projections), wide
    (n > 8192: gate/up, output heads), narrow (n <= 2048: k/v) and square (the rest: q, o, q/k/v joined)."""
    if k > 8192:
        return "deep"
    if n > 8192:
        return "wide"
    if n <= 2048:
        return "narrow"
    return "square"


def planes_tile(tuning: Tuning, source: str, n: int, k: int) -> Tile:
    """The GEMV tile for a packed matrix of layout `source` ("gguf.Q4_K", "gptq.4", ...) and shape [n, k]: the
    table's entry for (source, class), else (source, "*"), else ("*", class), else the tuning's default."""
    table, cls = tuning.planes_table, shape_class(n, k)
    for key in ((source, cls), (source, "*"), ("*", cls)):
        if key in table:
            return table[key]
    return tuning.planes_gemv
