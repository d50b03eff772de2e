"""Decode time of a Granite-4.0-H-shaped hybrid (Mamba2 layers beside a few attention layers) at several batch
sizes and context lengths, beside two models cut from the same shape: its Mamba2 layers alone (their share of
the step; with the embedding and the output head, which do not grow with the context either) and a pure-attention
model of the same depth and width (the peer whose cost grows with the context).

Weights are random, made directly on the executor's device in the layout transformers saves (bf16 on a GPU,
float32 on the CPU). Each variant runs in the paged serving engine (Layout.PAGED): for each batch size B its
decode program of B sequences (one token each, every sequence at the same position over its own KV blocks and
recurrent state slot: the step the engine replays as a CUDA graph on the GPU) is timed at each context. Prints
ms per step and per token, the growth from the first context to the last, and the floor: the bytes a step reads
(every weight but the embedding table, B of its rows, the KV of B x (context + 1) positions, and each sequence's
recurrent state read and written) over the measured copy bandwidth. A batch whose KV does not fit the engine's
pool (80% of free memory on the GPU) is reported as not fitting. Target (issue 21): the Mamba2 layers' time at
16k <= 1.3x their time at 512; the hybrid's per-token time growing far less than the attention model's.
--contiguous also times the batch-1 one-token program of the contiguous Driver (the earlier figure); --profile
prints the device time by kernel of each variant's largest batch. Writes bench/results/hybrid_decode.json.

    python bench/hybrid_decode.py                                   # cuda, Granite-4.0-H-Micro-like shape
    python bench/hybrid_decode.py --backend cpu --shape tiny --contexts 64,512 --batch 1,4 --reps 3   # smoke
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

# Granite-4.0-H-Micro-like (dense hybrid, ~3B): 40 layers of which 4 attention, Mamba2 heads of 64 with a state
# of 128 in one group, GQA 32/8 without rope; the tiny shape is for smoke runs.
SHAPES: dict[str, dict[str, Any]] = {
    "granite_h": dict(hidden_size=2560, num_hidden_layers=40, attention_layers=(9, 19, 29, 39),
                      num_attention_heads=40, num_key_value_heads=8, shared_intermediate_size=8192,
                      mamba_n_heads=80, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4,
                      mamba_expand=2, mamba_chunk_size=256, vocab_size=100352),
    "tiny": dict(hidden_size=64, num_hidden_layers=4, attention_layers=(1,), num_attention_heads=4,
                 num_key_value_heads=2, shared_intermediate_size=96, mamba_n_heads=8, mamba_d_head=16,
                 mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
                 vocab_size=320),
}
VARIANTS = ("hybrid", "mamba_layers", "attention")


def hf_config(shape: dict[str, Any], variant: str, capacity: int) -> Any:
    """The transformers config of one variant: the hybrid, its Mamba2 layers only, or all layers attention."""
    import transformers as tf

    fields = {k: v for k, v in shape.items() if k != "attention_layers"}
    layers = fields["num_hidden_layers"]
    types = ["attention" if i in shape["attention_layers"] else "mamba" for i in range(layers)]
    if variant == "mamba_layers":
        types = [t for t in types if t == "mamba"]
    elif variant == "attention":
        types = ["attention"] * layers
    fields.update(num_hidden_layers=len(types), layer_types=types, intermediate_size=fields["shared_intermediate_size"],
                  num_local_experts=0, position_embedding_type=None, tie_word_embeddings=False,
                  max_position_embeddings=capacity, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    return tf.GraniteMoeHybridConfig(**fields)


class RandomStore(common.DeviceStore):
    """The checkpoint's tensors (names and shapes of transformers' model, built on the meta device), random on
    `device`: small normal values, the per-head A_log and dt_bias in the ranges Mamba2 initializes them to."""

    def __init__(self, config: Any, device: torch.device, dtype: torch.dtype) -> None:
        import transformers as tf

        super().__init__()
        with torch.device("meta"):
            model = tf.AutoModelForCausalLM.from_config(config)
        g = torch.Generator(device=device).manual_seed(0)
        for name, p in model.state_dict().items():
            if name.endswith("A_log"):
                w = torch.rand(p.shape, generator=g, device=device) * 2.7  # A in [1, 16)
            elif name.endswith("dt_bias"):
                w = torch.rand(p.shape, generator=g, device=device) * 4 - 6
            elif name.endswith(("norm.weight", ".D")):
                w = torch.ones(p.shape, device=device)
            else:
                w = torch.randn(p.shape, generator=g, device=device) * 0.02
            self.w[name] = w.to(dtype)


def open_backend(name: str) -> tuple[Any, torch.device, torch.dtype, Any]:
    """The executor, its device, the weights' dtype and a timer of one call in ms."""
    if name == "cpu":
        from poot_core import open_executor

        def cpu_ms(fn: Any, reps: int) -> float:
            for _ in range(2):
                fn()
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times) * 1000

        return open_executor("cpu"), torch.device("cpu"), torch.float32, cpu_ms
    from poot_backend_cuda.executor import CudaExecutor

    return CudaExecutor(), torch.device("cuda", 0), torch.bfloat16, lambda fn, reps: common.synced_ms(fn, reps=reps)


def model_parts(variant: str, config: Any, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any, Any]:
    """(family, model config, random store) of one variant."""
    from poot_core import Registry

    hf = {**config.to_dict(), "architectures": ["GraniteMoeHybridForCausalLM"]}
    family = Registry.builtin().resolve("GraniteMoeHybridForCausalLM")
    return family, family.config_from_hf(hf), RandomStore(config, device, dtype)


def weight_bytes(store: RandomStore, batch: int) -> int:
    """Weight bytes a decode step of `batch` rows reads: every weight but the embedding table, and its rows."""
    embed = store.w["model.embed_tokens.weight"]
    total = sum(w.numel() * w.element_size() for w in store.w.values())
    return total - embed.numel() * embed.element_size() + batch * embed.shape[1] * embed.element_size()


def paged_rows(executor: Any, device: torch.device, dtype: torch.dtype, timer: Any, variant: str, config: Any,
               batches: list[int], contexts: list[int], capacity: int, reps: int, bandwidth: float,
               profile: bool = False) -> dict[str, Any]:
    """ms per decode step of the serving engine at each batch and context, with each step's floor; profile: the
    device time by kernel of the largest batch's step at its longest context that fits (GPU only)."""
    from poot_core import Driver, DriverOptions, Layout, ModelHandle

    family, model_config, store = model_parts(variant, config, device, dtype)
    handle = ModelHandle(Path(f"random-{variant}"), family, model_config, None, store, [])
    most = max(batches)
    options = DriverOptions(capacity=capacity, max_running=most, state_slots=most, prefix_cache=False)
    engine = Driver(handle, executor, options).serve(Layout.PAGED)
    graph = engine.driver._trace(engine._shape(1, 1, decode=True))
    recurrent = {n for n, spec in graph.state.items() if spec.recurrent}
    state = engine._state
    slots = engine.slots.slots if engine.slots is not None else 1
    per_slot = sum(t.numel() * t.element_size() for n, t in state.items() if n in recurrent) // slots
    positions = engine.pool.blocks * engine.block_size
    per_position = sum(t.numel() * t.element_size() for n, t in state.items() if n not in recurrent) / positions
    out: dict[str, Any] = {"kv_blocks": engine.pool.blocks, "state_slots": slots, "kv_bytes_per_position":
                           per_position, "state_bytes_per_slot": per_slot, "batches": {}}
    common.log(f"{variant}: {engine.pool.blocks} KV blocks ({per_position * positions / 1e9:.1f} GB), {slots} state "
               f"slots of {per_slot / 1e6:.1f} MB")
    for batch in batches:
        rows: dict[str, Any] = {}
        for context in contexts:
            need = batch * -(-(context + 1) // engine.block_size)
            if need > engine.pool.blocks:
                rows[str(context)] = {"not_run": f"{batch} x {context + 1} positions of KV "
                                      f"({need * engine.block_size * per_position / 1e9:.1f} GB) do not fit the pool "
                                      f"of {engine.pool.blocks} blocks ({positions * per_position / 1e9:.1f} GB)"}
                continue
            prog, inputs = common.paged_step(engine, batch, 1, context)
            ms = timer(lambda prog=prog, inputs=inputs, state=state: prog.run(state, inputs), reps)
            read = weight_bytes(store, batch) + batch * (context + 1) * per_position + 2 * batch * per_slot
            floor = read / bandwidth * 1000
            rows[str(context)] = {"ms_per_step": ms, "ms_per_token": ms / batch, "floor_ms": floor,
                                  "of_floor": floor / ms, "bytes_read": read}
        timed = [c for c in contexts if "ms_per_step" in rows[str(c)]]
        entry: dict[str, Any] = {"contexts": rows}
        if timed:  # whether the step was replayed as a captured graph (the CPU has none)
            entry["graph"] = bool(getattr(engine.program(engine._shape(batch, batch, decode=True)), "use_graph", False))
        if len(timed) > 1:
            entry["growth"] = rows[str(timed[-1])]["ms_per_step"] / rows[str(timed[0])]["ms_per_step"]
            entry["growth_of"] = f"{timed[-1]}/{timed[0]}"
        out["batches"][str(batch)] = entry
        common.log(f"{variant:>12} B={batch:<3}: " + "; ".join(
            f"{c}: {r['ms_per_step']:.3f} ms/step {r['ms_per_token']:.4f} ms/tok (floor {r['floor_ms']:.3f}, "
            f"{r['of_floor']:.0%})" if "ms_per_step" in r else f"{c}: does not fit" for c, r in rows.items())
            + (f"; {entry['growth_of']}: {entry['growth']:.2f}x" if "growth" in entry else "")
            + ("; CUDA graph" if entry.get("graph") else ""))
        if profile and device.type == "cuda" and batch == most and timed:
            import gpu_decode

            prog, inputs = common.paged_step(engine, batch, 1, timed[-1])
            kernels = gpu_decode.kernel_profile(prog, state, inputs)
            totals = {k: kernels.pop(k) for k in ("_kernels_total_us", "_launches_per_step")}
            top = {k: round(v, 1) for k, v in list(kernels.items())[:14]}
            entry["profile_us"] = {"context": timed[-1], **totals, **top}
            common.log(f"  B={batch} at {timed[-1]}: {totals['_kernels_total_us']:.0f} us of kernels, "
                       f"{totals['_launches_per_step']:.0f} launches; by kernel (us): "
                       + ", ".join(f"{k[:48]} {v:.0f}" for k, v in top.items()))
    return out


def contiguous_ms(executor: Any, device: torch.device, dtype: torch.dtype, timer: Any, config: Any,
              contexts: list[int], capacity: int, reps: int) -> dict[int, float]:
    """ms per one-token decode step of the contiguous Driver's program (batch 1) at each context."""
    family, model_config, store = model_parts("contiguous", config, device, dtype)
    weights = executor.upload(store)
    shapes = {n: tuple(w.shape) for n, w in weights.items()} if isinstance(weights, dict) else \
        {n: tuple(w.shape) for n, w in weights.tensors.items()}
    program = common.step_programs(family, model_config, executor, weights, shapes, capacity)
    decode, graph = program(1)
    state = executor.allocate_state(graph)
    out = {}
    for context in contexts:
        inputs = {"tokens": np.ones((1, 1), dtype=np.int64), "positions": np.array([[context]], dtype=np.int64)}
        out[context] = timer(lambda inputs=inputs: decode.run(state, inputs), reps)
    return out


def free_device(device: torch.device) -> None:
    """Give back a variant's weights and state before the next is built."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--shape", default="granite_h", choices=sorted(SHAPES))
    ap.add_argument("--contexts", default="512,4096,16384")
    ap.add_argument("--batch", default="1,16,64", help="sequences per decode step of the serving engine")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--contiguous", action="store_true", help="also the contiguous Driver's batch-1 program")
    ap.add_argument("--profile", action="store_true", help="device time by kernel of the largest batch (GPU)")
    ap.add_argument("--out", default="hybrid_decode", help="results name (bench/results/<name>.json)")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batch.split(",")]
    capacity = max(contexts) + 16
    executor, device, dtype, timer = open_backend(args.backend)
    if device.type == "cuda":
        import gpu_decode

        bandwidth = gpu_decode.copy_bandwidth() * 1e9
    else:
        bandwidth = common.copy_bandwidth()
    shape = SHAPES[args.shape]
    result: dict[str, Any] = {"backend": args.backend, "shape": args.shape, "shape_fields": shape,
                              "dtype": str(dtype), "contexts": contexts, "batches": batches,
                              "copy_GBps": bandwidth / 1e9, "variants": {}}
    if device.type == "cuda":
        result["device"] = torch.cuda.get_device_name(device)
    common.log(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    variants = result["variants"]
    for variant in args.variants.split(","):
        config = hf_config(shape, variant, capacity)
        entry = variants[variant] = paged_rows(executor, device, dtype, timer, variant, config, batches, contexts,
                                               capacity, args.reps, bandwidth, args.profile)
        free_device(device)
        if args.contiguous:
            ms = contiguous_ms(executor, device, dtype, timer, config, contexts, capacity, args.reps)
            free_device(device)
            entry["contiguous_batch1"] = {"ms_per_token": {str(c): v for c, v in ms.items()},
                                          "growth": ms[contexts[-1]] / ms[contexts[0]]}
            common.log(f"{variant:>12} contiguous B=1: " + ", ".join(f"{c}: {v:.3f} ms" for c, v in ms.items()))
        common.write(args.out, result)  # what ran so far survives a later variant's failure
    summary(result, batches, contexts)
    print("wrote", common.write(args.out, result))
    return 0


def summary(result: dict[str, Any], batches: list[int], contexts: list[int]) -> None:
    """Per batch: the hybrid's and the attention model's per-token time and growth side by side, and the Mamba2
    layers' growth (the target)."""
    variants = result["variants"]

    def row(variant: str, batch: int) -> dict[str, Any]:
        return variants.get(variant, {}).get("batches", {}).get(str(batch), {})

    common.log("\n=== summary: ms per token (per step / batch); growth from the first context to the last ===")
    for batch in batches:
        for variant in VARIANTS:
            r = row(variant, batch)
            if not r:
                continue
            cells = [f"{r['contexts'][str(c)]['ms_per_token']:.4f}" if "ms_per_token" in r["contexts"][str(c)]
                     else "n/f" for c in contexts]
            growth = f"{r['growth']:.2f}x ({r['growth_of']})" if "growth" in r else "-"
            common.log(f"B={batch:<3} {variant:>12}: " + " / ".join(cells) + f" at {contexts}; growth {growth}")
        hybrid, attention = row("hybrid", batch), row("attention", batch)
        if hybrid and attention:
            ratio = {str(c): hybrid["contexts"][str(c)]["ms_per_token"] / attention["contexts"][str(c)]["ms_per_token"]
                     for c in contexts if "ms_per_token" in hybrid["contexts"][str(c)]
                     and "ms_per_token" in attention["contexts"][str(c)]}
            hybrid["vs_attention"] = ratio
            common.log(f"B={batch:<3} hybrid / attention per token: " + ", ".join(f"{c}: {v:.2f}x"
                                                                              for c, v in ratio.items()))
        mamba = row("mamba_layers", batch)
        if mamba and "growth" in mamba:
            common.log(f"B={batch:<3} Mamba2 layers' growth {mamba['growth']:.2f}x (target <= 1.3x)")


if __name__ == "__main__":
    sys.exit(main())
