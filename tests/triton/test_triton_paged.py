"""The Triton executor's paged KV layout (poot_kernels_triton.paged, paged_step): the paged decode kernel and the
block write against float64 torch references over random block tables, and the serving engine on the Triton
executor against the same requests run one by one on its contiguous layout (greedy tokens) and against the CPU
engine (logits). Runs in Triton's interpreter without a GPU, compiled on one with a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton  # noqa: F401 - a test dependency: missing, it must fail, not skip

from helpers import tiny
from helpers.triton_checks import rel_err
from helpers.triton_mode import interpreted
from poot_core import Driver, DriverOptions, GenerateRequest, Layout, ModelHandle, Unsupported, open_executor
from poot_kernels_triton.executor import TritonExecutor
from poot_kernels_triton.paged import paged_decode_attention, write_paged_kv

DEVICE = torch.device("cpu" if interpreted() else "cuda")
BOUND = {torch.float32: 2e-5, torch.bfloat16: 1.2e-2}  # ||out - ref|| / ||ref|| by the output's dtype
# engine logits against the CPU engine's, max |diff| / max |ref|: float32 rounding in the interpreter; on a GPU the
# float32 products may round through tf32, so the conformance suite's GPU float32 bound
LOGIT_BOUND = 1e-5 if interpreted() else 1e-2


def _executor() -> TritonExecutor:
    return TritonExecutor.on_interpreter() if interpreted() else TritonExecutor(0)


def _reference(q, k_pool, v_pool, positions, seqs, tables, scale, window, softcap) -> torch.Tensor:
    """Each token's attention over its sequence's keys 0..position, read through its table, in float64."""
    q, kp, vp = q.double().cpu(), k_pool.double().cpu(), v_pool.double().cpu()
    tokens, q_heads, dim = q.shape
    kv_heads, block = kp.shape[1], kp.shape[2]
    out = torch.zeros(tokens, q_heads, dim, dtype=torch.float64)
    for t in range(tokens):
        if seqs[t] < 0:
            continue
        p = int(positions[t])
        keys = torch.arange(p + 1)
        ids = tables[int(seqs[t])][keys // block].cpu()
        k, v = kp[ids, :, keys % block], vp[ids, :, keys % block]  # [p + 1, kv_heads, dim]
        for h in range(q_heads):
            g = h // (q_heads // kv_heads)
            s = (k[:, g] @ q[t, h]) * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            if window is not None:
                s = torch.where(p - keys < window, s, float("-inf"))
            out[t, h] = torch.softmax(s, 0) @ v[:, g]
    return out


@pytest.mark.parametrize("dtype,window,softcap", [(torch.float32, None, None), (torch.float32, 5, 20.0),
                                                   (torch.bfloat16, None, None)])
def test_paged_decode_kernel_against_float64_over_random_tables(dtype, window, softcap):
    gen = torch.Generator().manual_seed(1)
    blocks, kv_heads, block, dim, q_heads, slots, width = 20, 2, 4, 16, 4, 3, 6
    k_pool = torch.randn(blocks, kv_heads, block, dim, generator=gen).to(dtype).to(DEVICE)
    v_pool = torch.randn(blocks, kv_heads, block, dim, generator=gen).to(dtype).to(DEVICE)
    # each slot owns distinct random blocks; unused table entries point anywhere (never read)
    tables = torch.randperm(blocks, generator=gen)[: slots * width].reshape(slots, width)
    seqs = torch.tensor([0, 2, -1, 1, 2, 0])
    positions = torch.tensor([0, 22, 3, 9, 13, 17])  # several tokens of one slot, one padding token
    q = torch.randn(len(seqs), q_heads, dim, generator=gen).to(dtype).to(DEVICE)
    scale = 0.3
    out = paged_decode_attention(q, k_pool, v_pool, positions.to(DEVICE), seqs.to(DEVICE), tables.to(DEVICE),
                                 scale=scale, window=window, softcap=softcap)
    ref = _reference(q, k_pool, v_pool, positions, seqs, tables, scale, window, softcap)
    assert out.dtype == dtype
    assert float(out[2].abs().max()) == 0.0  # padding attends to nothing
    assert rel_err(out.cpu(), ref) < BOUND[dtype]


@pytest.mark.parametrize("dtype,window,softcap", [(torch.float32, None, None), (torch.float32, 5, 20.0),
                                                   (torch.bfloat16, None, None)])
def test_a_mixed_step_attends_on_the_device_through_its_tables(dtype, window, softcap):
    """A mixed step's prefill runs (longer than one query tile, and short) through the paged prefill kernel and its
    decode tokens through the paged decode kernel, split by prefill_tiles on the device: every token against the
    float64 reference, padding zero; the tile list holds each run's tiles, those that see the most keys first, and
    is padded with -1."""
    from poot_kernels_triton.paged import paged_prefill_attention, prefill_tile, prefill_tiles

    gen = torch.Generator().manual_seed(4)
    kv_heads, block, dim, q_heads, slots = 2, 4, 16, 4, 5
    block_m = prefill_tile(DEVICE, dim).block_m
    long_run = block_m + 3  # two query tiles, the second partial (the device's tile: 16 interpreted, 128 on a GPU)
    runs = [(3, 30, 1), (1, 2, long_run), (4, 11, 1), (0, 0, 5), (2, 9, 2)]  # (slot, first position, tokens)
    seqs = torch.tensor([s for s, _, n in runs for _ in range(n)] + [-1, -1])
    positions = torch.tensor([p + i for _, p, n in runs for i in range(n)] + [0, 0])
    width = -(-(int(positions.max()) + 1) // block)
    blocks = slots * width + 10
    k_pool = torch.randn(blocks, kv_heads, block, dim, generator=gen).to(dtype).to(DEVICE)
    v_pool = torch.randn(blocks, kv_heads, block, dim, generator=gen).to(dtype).to(DEVICE)
    tables = torch.randperm(blocks, generator=gen)[: slots * width].reshape(slots, width)
    q = torch.randn(len(seqs), q_heads, dim, generator=gen).to(dtype).to(DEVICE)
    tiles, decode = prefill_tiles(seqs.to(DEVICE), positions.to(DEVICE), block_m, slots)
    first = [sum(n for *_, n in runs[:i]) for i in range(len(runs))]
    expect = sorted(first[i] + j for i, (*_, n) in enumerate(runs) if n > 1 for j in range(0, n, block_m))
    expect.sort(key=lambda t: -int(positions[t]))  # the tiles that see the most keys first
    bound = -(-len(seqs) // block_m) + slots
    assert tiles.cpu().tolist() == expect + [-1] * (bound - len(expect))
    singles = [first[i] for i, (*_, n) in enumerate(runs) if n == 1]
    assert decode.cpu().tolist() == singles + [-1] * (slots - len(singles))
    args = (positions.to(DEVICE), seqs.to(DEVICE), tables.to(DEVICE))
    out = torch.zeros_like(q)
    out[singles] = paged_decode_attention(q[singles], k_pool, v_pool, args[0][singles], args[1][singles], args[2],
                                          scale=0.3, window=window, softcap=softcap)
    paged_prefill_attention(q, k_pool, v_pool, *args, tiles, out, scale=0.3, window=window, softcap=softcap)
    ref = _reference(q, k_pool, v_pool, positions, seqs, tables, 0.3, window, softcap)
    assert float(out[-2:].abs().max()) == 0.0
    assert rel_err(out.cpu(), ref) < BOUND[dtype]


def test_paged_write_puts_each_token_in_its_block():
    gen = torch.Generator().manual_seed(2)
    blocks, kv_heads, block, dim = 10, 2, 4, 8
    k_pool = torch.zeros(blocks, kv_heads, block, dim, device=DEVICE)
    v_pool = torch.zeros_like(k_pool)
    tables = torch.tensor([[7, 2, 5], [0, 9, 4]])
    seqs, positions = torch.tensor([1, 1, -1, 0]), torch.tensor([5, 6, 0, 9])
    k = torch.randn(4, kv_heads, dim, generator=gen)
    v = torch.randn(4, kv_heads, dim, generator=gen)
    write_paged_kv(k.to(DEVICE), v.to(DEVICE), k_pool, v_pool, positions.to(DEVICE), seqs.to(DEVICE),
                   tables.to(DEVICE))
    expect_k, expect_v = torch.zeros_like(k_pool).cpu(), torch.zeros_like(v_pool).cpu()
    for t in (0, 1, 3):
        b, off = int(tables[seqs[t], positions[t] // block]), int(positions[t] % block)
        expect_k[b, :, off], expect_v[b, :, off] = k[t], v[t]
    assert torch.equal(k_pool.cpu(), expect_k) and torch.equal(v_pool.cpu(), expect_v)  # padding wrote nothing


def test_few_tokens_of_a_contiguous_step_attend_through_the_paged_kernel():
    # a verify step's tokens (3 a row here) over contiguous caches, each row's cache read as one block
    from poot_kernels_triton.paged_step import few_tokens_attention

    gen = torch.Generator().manual_seed(3)
    rows, tokens, q_heads, kv_heads, capacity, dim = 2, 3, 4, 2, 12, 16
    caches = [torch.randn(rows, kv_heads, capacity, dim, generator=gen).to(DEVICE) for _ in range(2)]
    q = torch.randn(rows, tokens, q_heads, dim, generator=gen).to(DEVICE)
    positions = torch.tensor([[5, 6, 7], [0, 1, 2]])
    out = few_tokens_attention(q, *caches, positions.to(DEVICE), {}, scale=0.3, window=None, softcap=None)
    seqs = torch.arange(rows).repeat_interleave(tokens)
    ref = _reference(q.reshape(rows * tokens, q_heads, dim), *caches, positions.reshape(-1), seqs,
                     torch.arange(rows)[:, None], 0.3, None, None)
    assert out.shape == (rows, tokens, q_heads, dim)
    assert rel_err(out.reshape(rows * tokens, q_heads, dim).cpu(), ref) < BOUND[torch.float32]


# --- the serving engine on the Triton executor -----------------------------------------------------------------

CAPACITY, CHUNK = 20, 4
NEW = 3  # the first token from prefill, two from decode steps
# blocks of 4 positions, chunks of 4 tokens: the 7-token prompt spans two blocks and two chunks, and steps mix its
# second chunk with the others' decode tokens; mistral's window of 8 drops whole blocks from the 14-token
# prompt's last chunk and from its decode tokens
LENGTHS = {"llama": (2, 7, 4), "mistral": (2, 14, 4)}


def _prompts(arch: str) -> list[list[int]]:
    return [[(7 * i + 3 * j + 1) % 250 + 2 for j in range(n)] for i, n in enumerate(LENGTHS[arch])]


def _options(**serve) -> DriverOptions:
    options = DriverOptions(capacity=CAPACITY, prefill_chunk=CHUNK)
    for k, v in serve.items():
        setattr(options, k, v)
    return options


def _engine(handle, executor):
    return Driver(handle, executor, _options(block_size=4, step_tokens=8, max_running=4,
                                             kv_blocks=20)).serve(Layout.PAGED)


def _requests(prompts):
    return [GenerateRequest(list(p), max_new=NEW, ignore_eos=True) for p in prompts]


def _served(handle, executor, prompts):
    engine = _engine(handle, executor)
    engine.keep_logits = True  # every token picked on the host from the logits kept
    gens = engine.generate_batch(_requests(prompts))
    return gens, [np.stack(engine.logits[i]) for i in range(len(prompts))]


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_triton_engine_equals_contiguous_tokens_and_cpu_engine_logits(arch, tmp_path_factory):
    # one decoder layer: the interpreter's cost is per kernel launch, and one layer covers every op's paged form
    handle = ModelHandle.load(tiny.build(tmp_path_factory.mktemp(arch), arch, layers=1))
    prompts = _prompts(arch)
    ex = _executor()
    assert "paged" in ex.capabilities().layouts
    gens, logits = _served(handle, ex, prompts)
    solo = Driver(handle, ex, _options())
    for i, prompt in enumerate(prompts):
        alone = solo.generate(GenerateRequest(list(prompt), max_new=NEW, ignore_eos=True))
        assert gens[i].tokens == alone.tokens, f"request {i}"
    # the same requests with greedy tokens picked on the device (no logits cross): the same tokens; the steps
    # of decode tokens only run as their own programs (replayed CUDA graphs on a GPU)
    engine = _engine(handle, ex)
    assert [g.tokens for g in engine.generate_batch(_requests(prompts))] == [g.tokens for g in gens]
    decode_only = [prog for shape, prog in engine._programs.items() if shape.paging.decode]
    assert decode_only and all(prog.use_graph != interpreted() for prog in decode_only)
    _, cpu_logits = _served(handle, open_executor("cpu"), prompts)
    for i, (ours, ref) in enumerate(zip(logits, cpu_logits, strict=True)):
        assert ours.shape == ref.shape == (NEW, ours.shape[1])
        assert np.abs(ours - ref).max() / np.abs(ref).max() < LOGIT_BOUND, f"request {i}"


def test_latent_attention_refuses_the_paged_layout_by_name(tmp_path_factory):
    from helpers.moe import build

    handle = ModelHandle.load(build(tmp_path_factory.mktemp("deepseek_v2"), "deepseek_v2", torch.float32))
    with pytest.raises(Unsupported, match="mla_attention in a paged step"):
        Driver(handle, _executor(), _options(block_size=4, kv_blocks=8)).serve(Layout.PAGED)
