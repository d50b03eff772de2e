"""The Triton recurrent kernels' paged decode launch (poot_kernels_triton.recurrent with a PagedRows): one program
per row and head, each over its sequence's state slot in a pool, against the CPU executor's ops run one row at a
time over a copy of that slot: outputs and the pool after. Rows in slots out of order, one at position 0 (starts
from zeros), one padding row (writes nothing, gives zeros). Then a whole decode step of a one-layer Mamba2
prepared as the serving engine's decode program: captured as a CUDA graph (nothing read on the host: it runs here
with no host inputs at all) and equal to each sequence's step alone on the CPU executor.

Without a GPU this runs under the Triton interpreter (slow: small shapes, one layer)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton  # noqa: F401 - a test dependency: missing, it must fail, not skip

from helpers import paged_decode
from helpers.triton_checks import rel_err
from helpers.triton_mode import interpreted
from poot_core import Driver, DriverOptions, Layout, ModelHandle, open_executor
from poot_core.cpu import recurrent as cpu
from poot_kernels_triton import recurrent
from poot_kernels_triton.executor import TritonExecutor

BOUND = 2e-5
SEQ = [0, 1, 2, -1]  # each row's sequence slot; the last row is padding
STATE_SLOTS = [4, 0, 2, 0]  # sequence slot -> pool slot (the padding's entry reads 0 and must write nothing)
POSITIONS = [9, 0, 3, 0]
POOL = 6


def _rows(device: torch.device) -> recurrent.PagedRows:
    return recurrent.PagedRows(*(torch.tensor(v, dtype=torch.int64, device=device)
                                 for v in (SEQ, STATE_SLOTS, POSITIONS)))


def _check(values: list[torch.Tensor], pool: torch.Tensor, kernel, one_row) -> None:
    """kernel(values [R, 1, ...], pool, rows) against one_row(values of a row [1, 1, ...], state [1, ...])."""
    start = pool.clone()
    out = kernel(values, pool, _rows(pool.device))
    for r, seq in enumerate(SEQ):
        if seq < 0:
            assert torch.equal(out[r], torch.zeros_like(out[r]))
            continue
        slot = STATE_SLOTS[seq]
        state = torch.zeros_like(start[slot : slot + 1]) if POSITIONS[r] == 0 else start[slot : slot + 1].clone()
        ref = one_row([v[r : r + 1] for v in values], state)
        assert rel_err(out[r : r + 1], ref) <= BOUND, f"row {r}"
        assert state.numel() == 0 or rel_err(pool[slot], state[0]) <= BOUND, f"row {r} state"  # K = 1: no window
    for slot in (1, 3, 5):  # nobody's
        assert torch.equal(pool[slot], start[slot])


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.mark.interpreter
@pytest.mark.parametrize("kernel", [4, 1])
def test_short_conv_decode_rows(kernel: int) -> None:
    channels = 40
    x = torch.randn(len(SEQ), 1, channels + 3)[..., :channels]  # a view of a joined projection
    w, b = torch.randn(channels, kernel), torch.randn(channels)
    _check([x], torch.randn(POOL, channels, kernel - 1),
           lambda v, st, rows: recurrent.short_conv(v[0], w, b, st, silu=True, paged=rows),
           lambda v, st: cpu.short_conv(v[0], w, b, st, "silu"))


@pytest.mark.interpreter
def test_ssm_scan_decode_rows() -> None:
    heads, head_dim, groups, nstate = 8, 24, 2, 12
    r = len(SEQ)
    x, dt = torch.randn(r, 1, heads, head_dim), torch.randn(r, 1, heads)
    b, c = torch.randn(r, 1, groups, nstate), torch.randn(r, 1, groups, nstate)
    a_log, d, dt_bias = torch.rand(heads) * 2 - 1, torch.randn(heads), torch.randn(heads) * 0.5
    limit = (0.01, 0.5)
    _check([x, dt, b, c], torch.randn(POOL, heads, head_dim, nstate),
           lambda v, st, rows: recurrent.ssm_scan(v[0], v[1], a_log, v[2], v[3], d, dt_bias, st, limit, paged=rows),
           lambda v, st: cpu.ssm_scan(v[0], v[1], a_log, v[2], v[3], d, dt_bias, st, 8, limit))


@pytest.mark.interpreter
def test_gated_delta_decode_rows() -> None:
    k_heads, v_heads, k_dim, v_dim = 2, 4, 16, 24
    r = len(SEQ)
    q, k = torch.randn(r, 1, k_heads, k_dim), torch.randn(r, 1, k_heads, k_dim)
    v, a, b = torch.randn(r, 1, v_heads, v_dim), torch.randn(r, 1, v_heads), torch.randn(r, 1, v_heads)
    a_log, dt_bias = torch.rand(v_heads), torch.randn(v_heads) * 0.5
    _check([q, k, v, a, b], torch.randn(POOL, v_heads, k_dim, v_dim) * 0.3,
           lambda t, st, rows: recurrent.gated_delta(*t, a_log, dt_bias, st, 1e-6, paged=rows),
           lambda t, st: cpu.gated_delta(*t, a_log, dt_bias, st, 8, 1e-6))


def _engine(path, executor):
    options = DriverOptions(capacity=32, prefill_chunk=8, block_size=8, kv_blocks=24, max_running=6,
                            state_slots=paged_decode.SLOTS)
    return Driver(ModelHandle.load(path), executor, options).serve(Layout.PAGED)


def test_decode_step_is_one_graph_and_matches_each_sequence_alone_on_the_cpu(tmp_path) -> None:
    from helpers import hybrid

    path = hybrid.build(tmp_path / "mamba2", "mamba2", torch.float32, layers=1)
    ex = TritonExecutor.on_interpreter() if interpreted() else TritonExecutor(0)
    ex.use_cuda_graphs = True  # the decision is checked; the step below runs eagerly, with no host inputs
    engine = _engine(path, ex)
    program = engine.program(engine._shape(paged_decode.WIDTH, paged_decode.WIDTH, decode=True))
    assert program.use_graph  # nothing in the step is read on the host
    assert not engine.program(engine._shape(8, 4)).use_graph  # a mixed step finds its runs on the host
    state = engine._state
    paged_decode.fill_random(state)
    start = {n: t.detach().cpu().clone() for n, t in state.items()}
    inputs = paged_decode.decode_inputs(engine, paged_decode.ROWS, paged_decode.WIDTH)
    out = program._eager(state, program._device_inputs(inputs))[0]  # no host inputs: a read of one fails
    logits = ex.to_numpy(out).reshape(paged_decode.WIDTH, -1)

    solo = _engine(path, open_executor("cpu"))
    solo.program(solo._shape(1, 1))
    assert sorted(solo._state) == sorted(start)
    names = paged_decode.recurrent_names(solo)
    for i, row in enumerate(paged_decode.ROWS):
        alone = {n: t.clone() for n, t in start.items()}
        ref = paged_decode.run_decode(solo, alone, [row], 1)[0]
        assert np.abs(logits[i] - ref).max() <= 1e-4 * np.abs(ref).max(), f"row {i}"
        for name in names:
            assert rel_err(state[name][row[2]].cpu(), alone[name][row[2]]) <= 1e-4, f"{name} row {i}"
    for name in names:
        for slot in (0, 3, 5):
            assert torch.equal(state[name][slot].cpu(), start[name][slot]), f"{name} slot {slot}"
