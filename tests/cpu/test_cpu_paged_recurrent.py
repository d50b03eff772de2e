"""The CPU executor's recurrent ops in a paged step (poot_core.cpu.recurrent.per_run): the decode tokens of many
sequences computed together over their state slots, a prefill run beside them alone, padding writing nothing.
Checked against each sequence computed alone as one contiguous row over a copy of its slot (the ops' plain
one-row path), and a whole hand-built decode step of three hybrid families against each sequence's step alone."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers import paged_decode
from poot_core import Driver, DriverOptions, Layout, ModelHandle, open_executor
from poot_core.cpu import recurrent as cpu

BOUND = 1e-5
# the step's tokens: (sequence slot, position) per token; slot 1 a prefill run of 3 from position 0, slot 3 a
# prefill chunk continuing at 5, the others one decode token each; two padding tokens at the end
TOKENS = [(0, 7), (1, 0), (1, 1), (1, 2), (2, 0), (3, 5), (3, 6), (4, 12), (-1, 0), (-1, 0)]
STATE_SLOTS = [5, 2, 0, 6, 3]  # not in order; pool slots 1 and 4 are nobody's
POOL = 7


def _step() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    seq = torch.tensor([s for s, _ in TOKENS])
    positions = torch.tensor([[p for _, p in TOKENS]])
    return positions, seq, torch.tensor(STATE_SLOTS)


def _check(values: list[torch.Tensor], pool: torch.Tensor, out_shape: tuple[int, ...], one_row) -> None:
    """per_run's output and pool against one_row(values of a run [1, t, ...], state [1, ...]) per sequence."""
    positions, seq, slots = _step()
    args = [lambda e, s, v=v: v for v in values]
    ref_pool, batched_pool = pool.clone(), pool.clone()
    fn = cpu.per_run(SimpleNamespace(shape=out_shape), args, lambda e, s: batched_pool,
                     [lambda e, s: positions, lambda e, s: seq, lambda e, s: slots], one_row)
    out = fn({}, {})
    for sequence, slot in enumerate(STATE_SLOTS):
        index = (seq == sequence).nonzero()[:, 0]
        state = ref_pool[slot : slot + 1].clone()
        if int(positions[0, index[0]]) == 0:
            state.zero_()
        ref = one_row([v[:, index] for v in values], state)
        ref_pool[slot] = state[0]
        err = (out[:, index] - ref).abs().max() / ref.abs().max()
        assert err <= BOUND, f"sequence {sequence}: {err}"
    assert torch.equal(out[:, seq < 0], torch.zeros_like(out[:, seq < 0]))  # padding gives zeros
    assert (batched_pool - ref_pool).abs().max() <= BOUND * ref_pool.abs().max()
    for slot in (1, 4):  # nobody's (padding reads slot 0 of state_slots, writes nothing)
        assert torch.equal(batched_pool[slot], pool[slot])


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def test_short_conv_rows_match_each_sequence_alone() -> None:
    channels, kernel = 12, 4
    x = torch.randn(1, len(TOKENS), channels)
    w, b = torch.randn(channels, kernel), torch.randn(channels)
    _check([x], torch.randn(POOL, channels, kernel - 1), (1, len(TOKENS), channels),
           lambda v, st: cpu.short_conv(v[0], w, b, st, "silu"))


def test_ssm_scan_rows_match_each_sequence_alone() -> None:
    heads, head_dim, groups, nstate = 4, 8, 2, 6
    n = len(TOKENS)
    x, dt = torch.randn(1, n, heads, head_dim), torch.randn(1, n, heads)
    b, c = torch.randn(1, n, groups, nstate), torch.randn(1, n, groups, nstate)
    a_log, d, dt_bias = torch.rand(heads), torch.randn(heads), torch.randn(heads) * 0.5
    _check([x, dt, b, c], torch.randn(POOL, heads, head_dim, nstate), (1, n, heads, head_dim),
           lambda v, st: cpu.ssm_scan(v[0], v[1], a_log, v[2], v[3], d, dt_bias, st, 2, (0.0, float("inf"))))


def test_gated_delta_rows_match_each_sequence_alone() -> None:
    k_heads, v_heads, k_dim, v_dim = 2, 4, 8, 6
    n = len(TOKENS)
    q, k = torch.randn(1, n, k_heads, k_dim), torch.randn(1, n, k_heads, k_dim)
    v, a, b = torch.randn(1, n, v_heads, v_dim), torch.randn(1, n, v_heads), torch.randn(1, n, v_heads)
    a_log, dt_bias = torch.rand(v_heads), torch.randn(v_heads) * 0.5
    _check([q, k, v, a, b], torch.randn(POOL, v_heads, k_dim, v_dim) * 0.3, (1, n, v_heads, v_dim),
           lambda t, st: cpu.gated_delta(*t, a_log, dt_bias, st, 2, 1e-6))


@pytest.mark.parametrize("arch", ["lfm2", "mamba2", "qwen3next"])
def test_decode_step_matches_each_sequence_stepped_alone(hybrid_checkpoint, arch) -> None:
    """Three sequences at positions 9, 0 and 3 in slots 4, 1 and 2 and a padding row, in one decode step, against
    each one's own decode step from the same state: logits, its slot after, and the slots nobody holds."""
    options = DriverOptions(capacity=64, prefill_chunk=16, block_size=8, kv_blocks=64, max_running=6,
                            state_slots=paged_decode.SLOTS)
    engine = Driver(ModelHandle.load(hybrid_checkpoint(arch)), open_executor("cpu"), options).serve(Layout.PAGED)
    engine.program(engine._shape(1, 1))
    start = engine._state
    paged_decode.fill_random(start)
    names = paged_decode.recurrent_names(engine)
    batched = {n: t.clone() for n, t in start.items()}
    logits = paged_decode.run_decode(engine, batched, paged_decode.ROWS, paged_decode.WIDTH)
    for i, row in enumerate(paged_decode.ROWS):
        alone = {n: t.clone() for n, t in start.items()}
        ref = paged_decode.run_decode(engine, alone, [row], 1)[0]
        assert np.abs(logits[i] - ref).max() <= BOUND * np.abs(ref).max(), f"row {i}"
        for name in names:
            slot = row[2]
            assert torch.allclose(batched[name][slot], alone[name][slot], rtol=0, atol=BOUND), f"{name} row {i}"
    for name in names:
        for slot in (0, 3, 5):
            assert torch.equal(batched[name][slot], start[name][slot]), f"{name} slot {slot}"
