"""The recurrent ops of the hybrid families: the short causal convolution with its carried window, Mamba2's
selective scan, the gated delta rule (Qwen3-Next) and the gated group RMSNorm.

Same arithmetic as poot_core.cpu.recurrent (float32 whatever the inputs' dtype; results float32, the norm's in
the dtype asked). The state buffers (float32, [R, C, K - 1], [R, H, P, N], [R, Hv, Dk, Dv]) stay on the device
and are updated in place, so a CUDA graph can replay a decode step over them. Multi-token steps run the chunked
forms (one program per row, head and tile of the head's values walks its chunks in order, carrying the state in
registers); one-token steps run the recurrence, the scan's with whole heads a program (several when small, up
to STEP_TILE values of state). A convolution step of one token tile (every decode step) computes its outputs
and moves its window in one launch; longer steps move the window in a second launch, after every tile has read
it. Inputs may be views of a joined projection: every last axis must be contiguous, the other strides are
passed.

Paged decode (`paged`, a PagedRows): the serving engine's state is a pool of slots, and each of the R rows (one
token each) reads and writes the slot of its sequence (state_slots[seq[r]]) in place, so a step of many
sequences' decode tokens is one launch that reads nothing on the host. A padding row (seq -1) writes nothing
(its output is 0); a row at position 0 starts from a zero state. Each row's arithmetic is the one-row path's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import cdiv, check_float, launch, next_pow2, require, unit_stride_last
from .matmul import dot
from .tuning import Tile, tuning_for_device

# Tokens per chunk of the chunked forms (the order of summation only: any size gives the same result), and the
# smallest tile of any axis a product reads (tl.dot needs 16).
CHUNK = 32
MIN_TILE = 16
# Values of state a program of the one-token step kernels holds at most (32 KB of float32): a Mamba2 program
# covers whole heads (several where they are small) up to this many.
STEP_TILE = 8192


def _tile(n: int, cap: int | None = None) -> int:
    block = max(MIN_TILE, next_pow2(n))
    return block if cap is None else min(block, cap)


def _warps(x: torch.Tensor, elements: int = 0) -> Tile:
    """Launch settings of a recurrent kernel whose program holds a tile of `elements` float32 values (0: a small
    one): 8 warps from 8192 values on (at most 32 a thread), else 4; one warp under the interpreter."""
    tuning = tuning_for_device(x.device)
    warps = 1 if tuning.backend == "interpreter" else 8 if elements >= STEP_TILE else 4
    return Tile(num_warps=warps, num_stages=1)


@dataclass(frozen=True)
class PagedRows:
    """The rows of a paged decode launch: seq [R] (each row's sequence slot, -1 for padding), slots [S] (each
    sequence slot's state slot: the step's state_slots), positions [R]; int64 on the state's device."""

    seq: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor


def _paged_args(paged: PagedRows | None, state: torch.Tensor, shape: tuple[int, ...], rows: int) -> dict:
    """Check the state (a pool [slots, *shape] for a paged launch, else [rows, *shape]) and give the kernels'
    row arguments (dummy pointers in the contiguous layout)."""
    expect = (rows, *shape) if paged is None else (state.shape[0], *shape)
    require(state.dtype == torch.float32 and state.is_contiguous() and tuple(state.shape) == expect,
            f"recurrent state {tuple(state.shape)}, expected {expect}")
    if paged is None:
        return dict(seq_ptr=state, slot_ptr=state, pos_ptr=state, PAGED=False)
    require(tuple(paged.seq.shape) == (rows,) and tuple(paged.positions.shape) == (rows,),
            f"paged rows {tuple(paged.seq.shape)}, positions {tuple(paged.positions.shape)} for {rows} rows")
    return dict(seq_ptr=paged.seq, slot_ptr=paged.slots, pos_ptr=paged.positions, PAGED=True)


@triton.jit
def _state_row(row, seq_ptr, slot_ptr, pos_ptr, PAGED: tl.constexpr):
    """(the state row a program reads and writes, whether it writes it, whether it reads it): its own row, or in
    a paged decode launch its sequence's slot (padding writes nothing; a row at position 0 starts from zeros).
    The two flags are scalars: masks take them through tl.where (the interpreter refuses scalar & block)."""
    if PAGED:
        seq = tl.load(seq_ptr + row)
        slot = tl.load(slot_ptr + tl.maximum(seq, 0)).to(tl.int64)
        return slot, seq >= 0, tl.load(pos_ptr + row) != 0
    else:
        return row, row >= 0, row >= 0


@triton.jit
def _softplus(x):
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


# --- short convolution ---------------------------------------------------------------------------------------
@triton.jit
def _short_conv_kernel(
    x_ptr, w_ptr, b_ptr, win_ptr, out_ptr, seq_ptr, slot_ptr, pos_ptr, tokens, channels, x_sr, x_st, win_sr, out_sr,
    out_st, K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr, PAGED: tl.constexpr, WINDOW: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The outputs of a token tile and channel tile; WINDOW (the step is one token tile): then the window update
    of the program's channels too, in the same launch."""
    row = tl.program_id(0).to(tl.int64)
    srow, valid, carried = _state_row(row, seq_ptr, slot_ptr, pos_ptr, PAGED)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    tm, cm = t < tokens, c < channels
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + c, mask=cm, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(K):
        src = t - (K - 1) + j  # the input position tap j reads; before the step's first token: the window
        wj = tl.load(w_ptr + c * K + j, mask=cm, other=0.0).to(tl.float32)
        xm = ((src >= 0) & tm)[:, None] & cm[None, :]
        wm = tl.where(carried, ((src < 0) & tm)[:, None] & cm[None, :], False)
        xv = tl.load(x_ptr + row * x_sr + src[:, None] * x_st + c[None, :], mask=xm, other=0.0).to(tl.float32)
        wv = tl.load(win_ptr + srow * win_sr + c[None, :] * (K - 1) + (src + K - 1)[:, None], mask=wm, other=0.0)
        acc += (xv + wv) * wj[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    acc = tl.where(valid, acc, 0.0)
    tl.store(out_ptr + row * out_sr + t[:, None] * out_st + c[None, :], acc, mask=tm[:, None] & cm[None, :])
    if WINDOW:
        _conv_window(x_ptr, win_ptr, row, srow, valid, carried, c, cm, tokens, x_sr, x_st, win_sr, K, BLOCK_K)


@triton.jit
def _conv_window(x_ptr, win_ptr, row, srow, valid, carried, c, cm, tokens, x_sr, x_st, win_sr,
                 K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The window after the step for channels c: the last K - 1 inputs of (old window, the step's tokens). Every
    read of the old window in the program comes before this barrier, every write after it."""
    j = tl.arange(0, BLOCK_K)
    jm = j < K - 1
    src = tokens - (K - 1) + j
    both = cm[:, None] & jm[None, :]
    xv = tl.load(x_ptr + row * x_sr + src[None, :] * x_st + c[:, None], mask=both & (src >= 0)[None, :], other=0.0)
    wv = tl.load(win_ptr + srow * win_sr + c[:, None] * (K - 1) + (src + K - 1)[None, :],
                 mask=tl.where(carried, both & (src < 0)[None, :], False), other=0.0)
    new = xv.to(tl.float32) + wv
    tl.debug_barrier()  # every old entry is read before any is overwritten
    tl.store(win_ptr + srow * win_sr + c[:, None] * (K - 1) + j[None, :], new, mask=tl.where(valid, both, False))


@triton.jit
def _conv_window_kernel(
    x_ptr, win_ptr, seq_ptr, slot_ptr, pos_ptr, tokens, channels, x_sr, x_st, win_sr,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, PAGED: tl.constexpr,
):
    """The window update alone, after a step of several token tiles (each tile's program read the old window)."""
    row = tl.program_id(0).to(tl.int64)
    srow, valid, carried = _state_row(row, seq_ptr, slot_ptr, pos_ptr, PAGED)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    _conv_window(x_ptr, win_ptr, row, srow, valid, carried, c, c < channels, tokens, x_sr, x_st, win_sr, K, BLOCK_K)


def short_conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, window: torch.Tensor,
               silu: bool = False, *, paged: PagedRows | None = None) -> torch.Tensor:
    """x [R, T, C] (last axis contiguous), w [C, K], b [C] or None, window [R, C, K - 1] float32 contiguous,
    updated in place -> float32 [R, T, C]: out[t, c] = act(b[c] + sum_j w[c, j] * x[t - K + 1 + j, c]).
    paged: a paged decode launch (T = 1), window the pool [slots, C, K - 1]."""
    check_float("x", x)
    count, tokens, channels = x.shape
    kernel = w.shape[-1]
    require(tuple(w.shape) == (channels, kernel), f"conv weight {tuple(w.shape)} for {channels} channels")
    require(paged is None or tokens == 1, "a paged decode launch has one token a row")
    row_args = _paged_args(paged, window, (channels, kernel - 1), count)
    x, w = unit_stride_last(x), w.contiguous()
    out = torch.empty(count, tokens, channels, dtype=torch.float32, device=x.device)
    block_t, block_c = min(next_pow2(tokens), 32), _tile(channels, 128)  # no product: a decode tile is one token
    tile = _warps(x)
    token_tiles = cdiv(tokens, block_t)
    fused = kernel > 1 and token_tiles == 1  # decode: one launch computes the outputs and moves the window
    block_k = next_pow2(kernel - 1)
    launch(_short_conv_kernel, (count, token_tiles, cdiv(channels, block_c)), tile, x_ptr=x,
           w_ptr=w, b_ptr=w if b is None else b, win_ptr=window, out_ptr=out, tokens=tokens, channels=channels,
           x_sr=x.stride(0), x_st=x.stride(1), win_sr=window.stride(0), out_sr=out.stride(0), out_st=out.stride(1),
           K=kernel, HAS_BIAS=b is not None, SILU=silu, BLOCK_T=block_t, BLOCK_C=block_c, WINDOW=fused,
           BLOCK_K=block_k, **row_args)
    if kernel > 1 and not fused:  # after every token tile's program read the old window
        launch(_conv_window_kernel, (count, cdiv(channels, block_c)), tile, x_ptr=x, win_ptr=window, tokens=tokens,
               channels=channels, x_sr=x.stride(0), x_st=x.stride(1), win_sr=window.stride(0), K=kernel,
               BLOCK_K=block_k, BLOCK_C=block_c, **row_args)
    return out


# --- Mamba2's selective scan ---------------------------------------------------------------------------------
@triton.jit
def _ssm_heads(dtb_ptr, alog_ptr, d_ptr, h):
    """Per head: dt's bias, A = -exp(A_log) and D."""
    bias = tl.load(dtb_ptr + h).to(tl.float32)
    return bias, -tl.exp(tl.load(alog_ptr + h).to(tl.float32)), tl.load(d_ptr + h).to(tl.float32)


@triton.jit
def _ssm_step_kernel(
    x_ptr, dt_ptr, alog_ptr, b_ptr, c_ptr, d_ptr, dtb_ptr, s_ptr, y_ptr, seq_ptr, slot_ptr, pos_ptr, tokens, heads,
    head_dim, nstate, spread, x_sr, x_st, x_sh, dt_sr, dt_st, b_sr, b_st, b_sg, c_sr, c_st, c_sg, y_sr, y_st, y_sh,
    lo, hi, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr,
):
    """The recurrence, token by token: S = exp(dt a) S + dt x b^T, y = S c + d x. A program holds BLOCK_R rows of
    the state (head h, value p) in head order: whole heads, or part of one, always inside one group."""
    row = tl.program_id(0).to(tl.int64)
    srow, valid, carried = _state_row(row, seq_ptr, slot_ptr, pos_ptr, PAGED)
    first = tl.program_id(1) * BLOCK_R
    r = first + tl.arange(0, BLOCK_R)
    h = r // head_dim
    p = r - h * head_dim
    g = first // (head_dim * spread)
    n = tl.arange(0, BLOCK_N)
    nm = n < nstate
    bias, a, d = _ssm_heads(dtb_ptr, alog_ptr, d_ptr, h)
    s_off = (srow * heads * head_dim + r)[:, None] * nstate + n[None, :]
    sm = (r < heads * head_dim)[:, None] & nm[None, :]
    S = tl.load(s_ptr + s_off, mask=tl.where(carried, sm, False), other=0.0)
    for t in range(tokens):
        dt = _softplus(tl.load(dt_ptr + row * dt_sr + t * dt_st + h).to(tl.float32) + bias)
        dt = tl.minimum(tl.maximum(dt, lo), hi)
        x = tl.load(x_ptr + row * x_sr + t * x_st + h * x_sh + p).to(tl.float32)
        bv = tl.load(b_ptr + row * b_sr + t * b_st + g * b_sg + n, mask=nm, other=0.0).to(tl.float32)
        cv = tl.load(c_ptr + row * c_sr + t * c_st + g * c_sg + n, mask=nm, other=0.0).to(tl.float32)
        S = S * tl.exp(dt * a)[:, None] + (x * dt)[:, None] * bv[None, :]
        y = tl.sum(S * cv[None, :], axis=1) + d * x
        tl.store(y_ptr + row * y_sr + t * y_st + h * y_sh + p, tl.where(valid, y, 0.0))
    tl.store(s_ptr + s_off, S, mask=tl.where(valid, sm, False))


def _step_rows(head_dim: int, spread: int, block_n: int) -> int:
    """State rows per program of the scan's step kernel: the largest power of two that divides a group's rows
    (head_dim * spread, so a program never spans two groups or a partial tail) and keeps the tile within
    STEP_TILE values."""
    rows = (head_dim * spread) & -(head_dim * spread)  # its largest power-of-two divisor
    return max(1, min(rows, STEP_TILE // block_n))


@triton.jit
def _ssm_chunked_kernel(
    x_ptr, dt_ptr, alog_ptr, b_ptr, c_ptr, d_ptr, dtb_ptr, s_ptr, y_ptr, tokens, heads, head_dim, nstate, spread,
    x_sr, x_st, x_sh, dt_sr, dt_st, b_sr, b_st, b_sg, c_sr, c_st, c_sg, y_sr, y_st, y_sh, lo, hi,
    BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The SSD form, chunk by chunk: within a chunk y = (C B^T . decay) (dt x) + exp(cum) C S^T, then the state
    moves to the chunk's end."""
    row, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    g = h // spread
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    li = tl.arange(0, BLOCK_L)
    pm, nm = p < head_dim, n < nstate
    bias, a, d = _ssm_heads(dtb_ptr, alog_ptr, d_ptr, h)
    s_off = ((row * heads + h) * head_dim + p[:, None]) * nstate + n[None, :]
    sm = pm[:, None] & nm[None, :]
    S = tl.load(s_ptr + s_off, mask=sm, other=0.0)
    causal = li[None, :] <= li[:, None]
    for start in range(0, tokens, BLOCK_L):
        t = start + li
        tm = t < tokens
        dt = _softplus(tl.load(dt_ptr + row * dt_sr + t * dt_st + h, mask=tm, other=0.0).to(tl.float32) + bias)
        dt = tl.where(tm, tl.minimum(tl.maximum(dt, lo), hi), 0.0)  # past the end: no decay, no input
        cum = tl.cumsum(dt * a, axis=0)
        total = tl.sum(dt * a, axis=0)
        x = tl.load(x_ptr + row * x_sr + t[:, None] * x_st + h * x_sh + p[None, :],
                    mask=tm[:, None] & pm[None, :], other=0.0).to(tl.float32)
        bv = tl.load(b_ptr + row * b_sr + t[:, None] * b_st + g * b_sg + n[None, :],
                     mask=tm[:, None] & nm[None, :], other=0.0).to(tl.float32)
        cv = tl.load(c_ptr + row * c_sr + t[:, None] * c_st + g * c_sg + n[None, :],
                     mask=tm[:, None] & nm[None, :], other=0.0).to(tl.float32)
        xdt = x * dt[:, None]
        decay = tl.where(causal, tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0)), 0.0)
        scores = dot(cv, tl.trans(bv), tl.zeros((BLOCK_L, BLOCK_L), dtype=tl.float32)) * decay
        y = dot(scores, xdt, tl.zeros((BLOCK_L, BLOCK_P), dtype=tl.float32))
        y += dot(cv, tl.trans(S), tl.zeros((BLOCK_L, BLOCK_P), dtype=tl.float32)) * tl.exp(cum)[:, None]
        y += d * x
        tl.store(y_ptr + row * y_sr + t[:, None] * y_st + h * y_sh + p[None, :], y, mask=tm[:, None] & pm[None, :])
        S = S * tl.exp(total) + dot(tl.trans(xdt * tl.exp(total - cum)[:, None]), bv,
                                    tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32))
    tl.store(s_ptr + s_off, S, mask=sm)


def ssm_scan(x: torch.Tensor, dt: torch.Tensor, a_log: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
             d: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, dt_limit: tuple[float, float],
             *, chunked: bool | None = None, paged: PagedRows | None = None) -> torch.Tensor:
    """Mamba2's scan (Tracer.ssm_scan): x [R, T, H, P], dt [R, T, H], b and c [R, T, G, N], a_log, d, dt_bias
    [H], state [R, H, P, N] float32 contiguous, updated in place -> float32 [R, T, H, P] (skip term included).
    chunked: the SSD form (default for T > 1) or the recurrence (default for T = 1). paged: a paged decode launch
    (T = 1, the recurrence), state the pool [slots, H, P, N]."""
    for name, t in (("x", x), ("dt", dt), ("b", b), ("c", c)):
        check_float(name, t)
    rows, tokens, heads, head_dim = x.shape
    groups, nstate = b.shape[2], b.shape[3]
    require(heads % groups == 0 and tuple(c.shape) == tuple(b.shape), f"ssm groups {tuple(b.shape)}, {heads} heads")
    require(paged is None or tokens == 1, "a paged decode launch has one token a row")
    row_args = _paged_args(paged, state, (heads, head_dim, nstate), rows)
    x, dt, b, c = (unit_stride_last(t) for t in (x, dt, b, c))
    y = torch.empty(rows, tokens, heads, head_dim, dtype=torch.float32, device=x.device)
    block_p, block_n = _tile(head_dim, 32), _tile(nstate)
    chunked = tokens > 1 if chunked is None else chunked
    args = dict(x_ptr=x, dt_ptr=dt, alog_ptr=a_log, b_ptr=b, c_ptr=c, d_ptr=d, dtb_ptr=dt_bias, s_ptr=state,
                y_ptr=y, tokens=tokens, heads=heads, head_dim=head_dim, nstate=nstate, spread=heads // groups,
                x_sr=x.stride(0), x_st=x.stride(1), x_sh=x.stride(2), dt_sr=dt.stride(0), dt_st=dt.stride(1),
                b_sr=b.stride(0), b_st=b.stride(1), b_sg=b.stride(2), c_sr=c.stride(0), c_st=c.stride(1),
                c_sg=c.stride(2), y_sr=y.stride(0), y_st=y.stride(1), y_sh=y.stride(2), lo=float(dt_limit[0]),
                hi=float(dt_limit[1]), BLOCK_N=block_n)
    if chunked and paged is None:
        launch(_ssm_chunked_kernel, (rows, heads, cdiv(head_dim, block_p)), _warps(x),
               BLOCK_L=min(CHUNK, _tile(tokens)), BLOCK_P=block_p, **args)
    else:
        block_r = _step_rows(head_dim, heads // groups, block_n)
        launch(_ssm_step_kernel, (rows, heads * head_dim // block_r), _warps(x, block_r * block_n), BLOCK_R=block_r,
               **args, **row_args)
    return y


# --- the gated delta rule ------------------------------------------------------------------------------------
@triton.jit
def _delta_gates(a_ptr, b_ptr, alog, dt_bias, off, mask):
    """g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b) at `off`; 0 where masked (no decay, no write)."""
    a = tl.load(a_ptr + off, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + off, mask=mask, other=0.0).to(tl.float32)
    g = tl.where(mask, -tl.exp(alog) * _softplus(a + dt_bias), 0.0)
    return g, tl.where(mask, tl.sigmoid(b), 0.0)


@triton.jit
def _l2(x, eps, axis: tl.constexpr):
    return x * tl.rsqrt(tl.sum(x * x, axis=axis, keep_dims=True) + eps)


@triton.jit
def _delta_step_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, s_ptr, y_ptr, seq_ptr, slot_ptr, pos_ptr, tokens, v_heads,
    k_dim, v_dim, spread, q_sr, q_st, q_sh, k_sr, k_st, k_sh, v_sr, v_st, v_sh, a_sr, a_st, b_sr, b_st, y_sr, y_st,
    y_sh, eps, scale, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PAGED: tl.constexpr,
):
    """The recurrence, token by token: S = exp(g) S; S += k (beta (v - S^T k))^T; y = S^T q."""
    row, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    srow, valid, carried = _state_row(row, seq_ptr, slot_ptr, pos_ptr, PAGED)
    hk = h // spread
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    km, vm = kk < k_dim, vv < v_dim
    alog, bias = tl.load(alog_ptr + h).to(tl.float32), tl.load(dtb_ptr + h).to(tl.float32)
    s_off = ((srow * v_heads + h) * k_dim + kk[:, None]) * v_dim + vv[None, :]
    sm = km[:, None] & vm[None, :]
    S = tl.load(s_ptr + s_off, mask=tl.where(carried, sm, False), other=0.0)
    for t in range(tokens):
        q = tl.load(q_ptr + row * q_sr + t * q_st + hk * q_sh + kk[:, None], mask=km[:, None], other=0.0)
        k = tl.load(k_ptr + row * k_sr + t * k_st + hk * k_sh + kk[:, None], mask=km[:, None], other=0.0)
        q = _l2(q.to(tl.float32), eps, 0) * scale  # [BLOCK_K, 1]
        k = _l2(k.to(tl.float32), eps, 0)
        v = tl.load(v_ptr + row * v_sr + t * v_st + h * v_sh + vv, mask=vm, other=0.0).to(tl.float32)
        g, beta = _delta_gates(a_ptr, b_ptr, alog, bias, row * a_sr + t * a_st + h, True)
        S = S * tl.exp(g)
        delta = (v - tl.sum(S * k, axis=0)) * beta
        S = S + k * delta[None, :]
        tl.store(y_ptr + row * y_sr + t * y_st + h * y_sh + vv, tl.where(valid, tl.sum(S * q, axis=0), 0.0), mask=vm)
    tl.store(s_ptr + s_off, S, mask=tl.where(valid, sm, False))


@triton.jit
def _delta_chunked_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, s_ptr, y_ptr, tokens, v_heads, k_dim, v_dim, spread,
    q_sr, q_st, q_sh, k_sr, k_st, k_sh, v_sr, v_st, v_sh, a_sr, a_st, b_sr, b_st, y_sr, y_st, y_sh, eps, scale,
    BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """The WY form, chunk by chunk (poot_core.cpu.recurrent.delta_chunked): with G the cumulative gate and
    A[i, j] = beta_i k_i . k_j e^(G_i - G_j) for j < i, T = (I + A)^-1 by forward substitution, then
    U = T (beta v), W = T (beta e^G k), the chunk's writes U - W S, its outputs and the state at its end."""
    row, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    hk = h // spread
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    li = tl.arange(0, BLOCK_L)
    km, vm = kk < k_dim, vv < v_dim
    alog, bias = tl.load(alog_ptr + h).to(tl.float32), tl.load(dtb_ptr + h).to(tl.float32)
    s_off = ((row * v_heads + h) * k_dim + kk[:, None]) * v_dim + vv[None, :]
    sm = km[:, None] & vm[None, :]
    S = tl.load(s_ptr + s_off, mask=sm, other=0.0)
    causal = li[None, :] <= li[:, None]
    below = li[None, :] < li[:, None]
    eye = tl.where(li[None, :] == li[:, None], 1.0, 0.0)
    for start in range(0, tokens, BLOCK_L):
        t = start + li
        tm = t < tokens
        qk_mask = tm[:, None] & km[None, :]
        q = tl.load(q_ptr + row * q_sr + t[:, None] * q_st + hk * q_sh + kk[None, :], mask=qk_mask, other=0.0)
        k = tl.load(k_ptr + row * k_sr + t[:, None] * k_st + hk * k_sh + kk[None, :], mask=qk_mask, other=0.0)
        q = _l2(q.to(tl.float32), eps, 1) * scale  # [BLOCK_L, BLOCK_K]
        k = _l2(k.to(tl.float32), eps, 1)
        v = tl.load(v_ptr + row * v_sr + t[:, None] * v_st + h * v_sh + vv[None, :],
                    mask=tm[:, None] & vm[None, :], other=0.0).to(tl.float32)
        g, beta = _delta_gates(a_ptr, b_ptr, alog, bias, row * a_sr + t * a_st + h, tm)
        cum = tl.cumsum(g, axis=0)
        total = tl.sum(g, axis=0)
        decay = tl.where(causal, tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0)), 0.0)
        kk_dots = dot(k, tl.trans(k), tl.zeros((BLOCK_L, BLOCK_L), dtype=tl.float32))
        A = tl.where(below, kk_dots * decay * beta[:, None], 0.0)
        inv = eye  # row i of (I + A)^-1 is e_i - sum_{j < i} A[i, j] (row j): rows above i are final
        for i in range(1, BLOCK_L):
            a_row = tl.sum(tl.where(li[:, None] == i, A, 0.0), axis=0)  # A[i, :]
            inv = inv - tl.where(li[:, None] == i, tl.sum(a_row[:, None] * inv, axis=0)[None, :], 0.0)
        u = dot(inv, v * beta[:, None], tl.zeros((BLOCK_L, BLOCK_V), dtype=tl.float32))
        w = dot(inv, k * (beta * tl.exp(cum))[:, None], tl.zeros((BLOCK_L, BLOCK_K), dtype=tl.float32))
        fresh = u - dot(w, S, tl.zeros((BLOCK_L, BLOCK_V), dtype=tl.float32))
        y = dot(q * tl.exp(cum)[:, None], S, tl.zeros((BLOCK_L, BLOCK_V), dtype=tl.float32))
        qk = dot(q, tl.trans(k), tl.zeros((BLOCK_L, BLOCK_L), dtype=tl.float32)) * decay
        y = dot(qk, fresh, y)
        tl.store(y_ptr + row * y_sr + t[:, None] * y_st + h * y_sh + vv[None, :], y, mask=tm[:, None] & vm[None, :])
        S = S * tl.exp(total) + dot(tl.trans(k * tl.exp(total - cum)[:, None]), fresh,
                                    tl.zeros((BLOCK_K, BLOCK_V), dtype=tl.float32))
    tl.store(s_ptr + s_off, S, mask=sm)


def gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                a_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, eps: float,
                *, chunked: bool | None = None, paged: PagedRows | None = None) -> torch.Tensor:
    """The gated delta rule (Tracer.gated_delta): q, k [R, T, Hk, Dk], v [R, T, Hv, Dv], a, b [R, T, Hv], a_log
    and dt_bias [Hv], state [R, Hv, Dk, Dv] float32 contiguous, updated in place -> float32 [R, T, Hv, Dv].
    q and k are L2-normalized here (q also scaled by Dk^-1/2). chunked: the WY form (default for T > 1) or the
    recurrence (default for T = 1). paged: a paged decode launch (T = 1, the recurrence), state the pool
    [slots, Hv, Dk, Dv]."""
    for name, t in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b)):
        check_float(name, t)
    rows, tokens, k_heads, k_dim = q.shape
    v_heads, v_dim = v.shape[2], v.shape[3]
    require(tuple(k.shape) == tuple(q.shape) and v_heads % k_heads == 0, f"delta heads {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}")
    require(paged is None or tokens == 1, "a paged decode launch has one token a row")
    row_args = _paged_args(paged, state, (v_heads, k_dim, v_dim), rows)
    q, k, v, a, b = (unit_stride_last(t) for t in (q, k, v, a, b))
    y = torch.empty(rows, tokens, v_heads, v_dim, dtype=torch.float32, device=q.device)
    block_k, block_v = _tile(k_dim), _tile(v_dim, 64)
    chunked = tokens > 1 if chunked is None else chunked
    args = dict(q_ptr=q, k_ptr=k, v_ptr=v, a_ptr=a, b_ptr=b, alog_ptr=a_log, dtb_ptr=dt_bias, s_ptr=state, y_ptr=y,
                tokens=tokens, v_heads=v_heads, k_dim=k_dim, v_dim=v_dim, spread=v_heads // k_heads,
                q_sr=q.stride(0), q_st=q.stride(1), q_sh=q.stride(2), k_sr=k.stride(0), k_st=k.stride(1),
                k_sh=k.stride(2), v_sr=v.stride(0), v_st=v.stride(1), v_sh=v.stride(2), a_sr=a.stride(0),
                a_st=a.stride(1), b_sr=b.stride(0), b_st=b.stride(1), y_sr=y.stride(0), y_st=y.stride(1),
                y_sh=y.stride(2), eps=float(eps), scale=float(k_dim) ** -0.5, BLOCK_K=block_k, BLOCK_V=block_v)
    grid = (rows, v_heads, cdiv(v_dim, block_v))
    if chunked and paged is None:
        launch(_delta_chunked_kernel, grid, _warps(q), BLOCK_L=min(CHUNK, _tile(tokens)), **args)
    else:
        launch(_delta_step_kernel, grid, _warps(q, block_k * block_v), **args, **row_args)
    return y


# --- the gated group norm ------------------------------------------------------------------------------------
@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, z_ptr, w_ptr, out_ptr, group, x_stride, z_stride, out_stride, eps,
    NORM_FIRST: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * group + tl.arange(0, BLOCK)
    mask = tl.arange(0, BLOCK) < group
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + row * z_stride + cols, mask=mask, other=0.0).to(tl.float32)
    silu = z * tl.sigmoid(z)
    if not NORM_FIRST:
        x = x * silu
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / group + eps) * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if NORM_FIRST:
        y = y * silu
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, w: torch.Tensor, eps: float, group: int,
                   norm_first: bool = False, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x, gate [rows, D] (last axis contiguous), w [D]: w * rms_norm(x * silu(gate)) per group of `group`
    features, or (norm_first) w * rms_norm(x) * silu(gate)."""
    check_float("x", x)
    check_float("gate", gate)
    rows, width = x.shape
    require(tuple(gate.shape) == (rows, width) and width % group == 0 and w.numel() == width,
            f"gated_rms_norm x {tuple(x.shape)}, gate {tuple(gate.shape)}, group {group}")
    x, gate = unit_stride_last(x), unit_stride_last(gate)
    out = torch.empty(rows, width, dtype=out_dtype, device=x.device)
    block = next_pow2(group)  # one program a group: Granite's spans the whole inner width (8 warps from 8192)
    launch(_gated_rms_norm_kernel, (rows, width // group), _warps(x, block), x_ptr=x, z_ptr=gate, w_ptr=w,
           out_ptr=out, group=group, x_stride=x.stride(0), z_stride=gate.stride(0), out_stride=out.stride(0),
           eps=float(eps), NORM_FIRST=norm_first, BLOCK=block)
    return out


__all__ = ["CHUNK", "PagedRows", "gated_delta", "gated_rms_norm", "short_conv", "ssm_scan"]
