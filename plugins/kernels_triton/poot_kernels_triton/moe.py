"""Mixture of experts on the device: routing in plain torch ops, then the chosen experts' gated MLPs.

Two routes for the experts:
- fused (a few tokens, dense 16-bit experts): two kernels over every (token, chosen expert) pair at once, each
  program finding its expert's weights through a table of addresses on the device. No value crosses to the
  host, so a decode step holding `moe` can be captured as a CUDA graph, and only the chosen experts' weights
  are read: decode cost follows the active parameters.
- grouped (prefill, or packed experts): tokens grouped by expert (one stable sort of the (token, slot)
  choices) so an expert runs once over all the tokens that chose it through the package's `linear` (dense,
  GGUF or GPTQ alike) and an expert nobody chose costs nothing. Grouping needs the per-expert counts on the
  host: one device-to-host copy per moe op.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from poot_core import Expert, PackedWeight, Weight, by_expert, choose_experts, experts_of

from .activation import ACTIVATIONS, _tanh, gated_activation
from .launch import cdiv, launch
from .matmul import GEMV_MAX_ROWS
from .quant import linear
from .tuning import Tile, tuning_for_device

# Up to this many tokens per moe op the fused route runs (decode and short speculative steps).
FUSED_MAX_TOKENS = 4
_WEIGHT_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, ids_ptr, gate_table, up_table, h_ptr, d, inter, x_stride, slots,
    W_TYPE: tl.constexpr, ACT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """h[pair, n] = act(x[token] . gate_e[n]) * (x[token] . up_e[n]) for one (token, slot) pair and a tile of
    n, with e the expert the pair chose; gate_e, up_e [inter, d] found through the address tables."""
    pair = tl.program_id(1).to(tl.int64)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < inter
    token = pair // slots
    expert = tl.load(ids_ptr + pair)
    gate_ptr = tl.load(gate_table + expert).to(tl.pointer_type(W_TYPE))
    up_ptr = tl.load(up_table + expert).to(tl.pointer_type(W_TYPE))
    acc_g = tl.zeros([BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, d, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < d
        x = tl.load(x_ptr + token * x_stride + offs_k, mask=kmask, other=0.0).to(tl.float32)
        at = offs_n[:, None].to(tl.int64) * d + offs_k[None, :]
        wmask = nmask[:, None] & kmask[None, :]
        g = tl.load(gate_ptr + at, mask=wmask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        u = tl.load(up_ptr + at, mask=wmask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        acc_g += tl.sum(g * x[None, :], axis=1)
        acc_u += tl.sum(u * x[None, :], axis=1)
    if ACT == 0:
        a = acc_g * tl.sigmoid(acc_g)
    else:
        a = 0.5 * acc_g * (1.0 + _tanh(0.7978845608028654 * (acc_g + 0.044715 * acc_g * acc_g * acc_g)))
    tl.store(h_ptr + pair * inter + offs_n, a * acc_u, mask=nmask)


@triton.jit
def _moe_down_kernel(
    h_ptr, ids_ptr, weights_ptr, down_table, y_ptr, d, inter,
    W_TYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y[pair, n] = weight[pair] * (h[pair] . down_e[n]) for a tile of n; down_e [d, inter]."""
    pair = tl.program_id(1).to(tl.int64)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < d
    expert = tl.load(ids_ptr + pair)
    down_ptr = tl.load(down_table + expert).to(tl.pointer_type(W_TYPE))
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < inter
        h = tl.load(h_ptr + pair * inter + offs_k, mask=kmask, other=0.0)
        w = tl.load(
            down_ptr + offs_n[:, None].to(tl.int64) * inter + offs_k[None, :],
            mask=nmask[:, None] & kmask[None, :],
            other=0.0,
            eviction_policy="evict_first",
        ).to(tl.float32)
        acc += tl.sum(w * h[None, :], axis=1)
    tl.store(y_ptr + pair * d + offs_n, acc * tl.load(weights_ptr + pair), mask=nmask)


class FusedExperts:
    """Dense 16-bit experts prepared for the fused route: three device tables of weight addresses (the
    weights stay where they are; the tables hold no copy of them)."""

    def __init__(self, experts: list[Expert]) -> None:
        gate, up, down = experts[0]
        assert isinstance(gate, torch.Tensor) and isinstance(down, torch.Tensor)
        self.inter, self.d = gate.shape
        self.dtype = gate.dtype
        self.keep = experts  # the tables point into these tensors: keep them alive
        self.tables = [
            torch.tensor([e[i].data_ptr() for e in experts], dtype=torch.int64, device=gate.device) for i in range(3)
        ]

    @staticmethod
    def suits(experts: list[Expert]) -> bool:
        """Every expert dense, of one dtype, gate/up [inter, d] and down [d, inter] with contiguous rows."""
        first = experts[0][0]
        if not isinstance(first, torch.Tensor) or first.dim() != 2 or first.dtype not in _WEIGHT_TYPES:
            return False
        inter, d = first.shape
        for gate, up, down in experts:
            for w, shape in ((gate, (inter, d)), (up, (inter, d)), (down, (d, inter))):
                if (not isinstance(w, torch.Tensor) or w.dtype != first.dtype or tuple(w.shape) != shape
                        or w.stride() != (shape[1], 1) or w.device != first.device):
                    return False
        return True

    def run(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, act: str) -> torch.Tensor:
        """x [N, D] (activation dtype); ids, weights [N, k] -> float32 [N, D]."""
        n_tokens, slots = ids.shape
        pairs = n_tokens * slots
        ids = ids.reshape(-1).contiguous()
        weights = weights.reshape(-1).float().contiguous()
        x = x if x.stride(-1) == 1 else x.contiguous()
        h = torch.empty(pairs, self.inter, dtype=torch.float32, device=x.device)
        y = torch.empty(pairs, self.d, dtype=torch.float32, device=x.device)
        tuning = tuning_for_device(x.device)
        small = tuning.backend == "interpreter"
        block_n, block_k = (16, 64) if small else (16, 256)
        tile = Tile(block_n=block_n, block_k=block_k, num_warps=4, num_stages=2)
        w_type = _WEIGHT_TYPES[self.dtype]
        gate_table, up_table, down_table = self.tables
        launch(
            _moe_gate_up_kernel, (cdiv(self.inter, block_n), pairs), tile,
            x_ptr=x, ids_ptr=ids, gate_table=gate_table, up_table=up_table, h_ptr=h, d=self.d, inter=self.inter,
            x_stride=x.stride(0), slots=slots, W_TYPE=w_type, ACT=ACTIVATIONS[act], BLOCK_N=block_n,
            BLOCK_K=block_k,
        )  # fmt: skip
        launch(
            _moe_down_kernel, (cdiv(self.d, block_n), pairs), tile,
            h_ptr=h, ids_ptr=ids, weights_ptr=weights, down_table=down_table, y_ptr=y, d=self.d,
            inter=self.inter, W_TYPE=w_type, BLOCK_N=block_n, BLOCK_K=block_k,
        )  # fmt: skip
        return y.view(n_tokens, slots, self.d).sum(dim=1)


def router_logits(x: torch.Tensor, router: Weight) -> torch.Tensor:
    """x @ router^T in float32, so the choice of experts does not depend on the activation dtype. A few rows
    (decode) and packed routers go through the package's linear (its GEMV widens every value exactly and sums
    in float32, whatever the two dtypes); more rows through torch on float32 copies (a GEMM's tl.dot would
    round float32 inputs to tf32, or refuse two different dtypes)."""
    if isinstance(router, PackedWeight) or x.shape[0] <= GEMV_MAX_ROWS:
        return linear(x, router, out_dtype=torch.float32)
    return torch.nn.functional.linear(x.float(), router.float())


@triton.jit
def _moe_route_kernel(
    logits_ptr, ids_ptr, weights_ptr, experts, scale,
    TOP_K: tl.constexpr, NORM: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """One token's routing by softmax scores: the TOP_K best experts (highest first) and their scores,
    renormalized to sum 1 when NORM, times `scale`. The choices stay in registers until one store at the end."""
    token = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < experts
    logits = tl.load(logits_ptr + token * experts + offs, mask=mask, other=float("-inf"))
    e = tl.exp(logits - tl.max(logits, axis=0))
    e = tl.where(mask, e, 0.0)
    scores = e / tl.sum(e, axis=0)
    left = tl.where(mask, scores, -1.0)
    slots = tl.arange(0, TOP_K)
    chosen_ids = tl.zeros([TOP_K], tl.int64)
    chosen = tl.zeros([TOP_K], tl.float32)
    for slot in tl.static_range(TOP_K):
        best = tl.argmax(left, axis=0)
        chosen_ids = tl.where(slots == slot, best.to(tl.int64), chosen_ids)
        chosen = tl.where(slots == slot, tl.max(left, axis=0), chosen)
        left = tl.where(offs == best, -1.0, left)
    if NORM:
        chosen = chosen * (scale / (tl.sum(chosen, axis=0) + 1e-20))
    else:
        chosen = chosen * scale
    tl.store(ids_ptr + token * TOP_K + slots, chosen_ids)
    tl.store(weights_ptr + token * TOP_K + slots, chosen)


def route(logits: torch.Tensor, a: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """choose_experts for router logits [N, E] (float32), in one kernel where the routing is plain softmax
    top-k (no groups, no correction bias) with a power-of-two k; else choose_experts' torch ops."""
    k, experts = int(a["top_k"]), logits.shape[-1]
    simple = a["scoring"] == "softmax" and int(a.get("groups", 1)) <= 1 and k & (k - 1) == 0 and k <= experts
    if not simple or experts > 1024:
        return choose_experts(logits, None, a)
    logits = logits.float().contiguous()
    n = logits.shape[0]
    ids = torch.empty(n, k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(n, k, dtype=torch.float32, device=logits.device)
    launch(
        _moe_route_kernel, (n,), Tile(num_warps=4, num_stages=1),
        logits_ptr=logits, ids_ptr=ids, weights_ptr=weights, experts=experts, scale=float(a["routed_scale"]),
        TOP_K=k, NORM=bool(a["norm_topk"]), BLOCK_E=max(16, 1 << (experts - 1).bit_length()),
    )  # fmt: skip
    return ids, weights


def run_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: list[Expert], act: str
) -> torch.Tensor:
    """x [N, D] (activation dtype); ids, weights [N, k] -> float32 [N, D]."""
    out = torch.zeros(x.shape[0], x.shape[-1], dtype=torch.float32, device=x.device)
    for e, tok, w in by_expert(ids, weights, len(experts)):  # the one host sync: the counts per expert
        gate, up, down = experts[e]
        h = x.index_select(0, tok)
        y = linear(gated_activation(linear(h, gate), linear(h, up), kind=act), down, out_dtype=torch.float32)
        out.index_add_(0, tok, y * w[:, None])
    return out


__all__ = ["FUSED_MAX_TOKENS", "FusedExperts", "choose_experts", "experts_of", "route", "router_logits",
           "run_experts"]
