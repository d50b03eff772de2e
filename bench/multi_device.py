"""Decode speed of one model over 1 and 2 ranks (Driver.placed over gloo, spawned processes), beside the
single-device driver, on a small llama shape with random bf16 weights on the CPU.

  python bench/multi_device.py                  # 8 layers of hidden 512 (8 heads, 4 KV heads, the tiny test
                                                # tokenizer's 256-id vocabulary), 32 new tokens
  python bench/multi_device.py --layers 4 --new 16

Prints decode tok/s for: one process (1 thread, and as many threads as there are ranks), 1 placed rank, 2 ranks
tensor parallel and 2 ranks pipeline (each rank 1 thread), and the memory floor (weight bytes read per token
over the measured copy bandwidth); writes bench/results/multi_device.json. The ranks' greedy tokens are checked
against the single process. On the CPU the ranks share one memory bus, so TP cannot beat the floor; the figure
shows the placement's overhead. `--serve N` (default 16) also runs N requests at once through the serving engine
over a two-stage pipeline, with whole steps (the default) and in two micro-batches (DriverOptions.micro_batches),
and prints the output tok/s of both.

With CUDA present it also runs the Llama-3-8B shape (random bf16 weights made on the GPU, 128-token prompt)
on the CUDA backend: the unplaced driver, and the same model placed tensor-parallel over a one-rank NCCL group
(Coordinator.from_env(backend="nccl")), whose decode should match it in speed and tokens. Rows over several GPUs
(one NCCL rank a GPU) are the two-GPU run's, not built here.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import common  # noqa: E402

PROMPT = [(7 * i + 3) % 200 + 2 for i in range(32)]


def build(path: Path, layers: int) -> Path:
    import transformers as tf

    from helpers import tiny

    config = tf.LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1408, num_hidden_layers=layers,
                            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                            tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config)
    tiny._randomize(model, 0)
    model.to(torch.bfloat16).save_pretrained(path)
    tiny.save_tokenizer(path)
    return path


def options() -> Any:
    from poot_core import DriverOptions

    return DriverOptions(capacity=256, prefill_chunk=64)


def single(path: str, new: int, threads: int) -> dict[str, Any]:
    from poot_core import Driver, ModelHandle, open_executor

    torch.set_num_threads(threads)
    driver = Driver(ModelHandle.load(Path(path)), open_executor("cpu"), options()).serve()
    common.poot_round(driver, PROMPT, 4)  # warm
    rounds = [common.poot_round(driver, PROMPT, new) for _ in range(2)]
    from poot_core import GenerateRequest

    tokens = driver.generate(GenerateRequest(PROMPT, max_new=new, ignore_eos=True)).tokens
    return {"decode_tok_s": max(r["decode"] for r in rounds), "tokens": tokens}


def placed(coordinator: Any, path: str, placement: str, new: int) -> dict[str, Any] | None:
    from poot_core import Driver, GenerateRequest, ModelHandle, open_executor
    from poot_core.distributed import Placement

    driver = Driver.placed(ModelHandle.load(Path(path)), coordinator, Placement(placement), open_executor("cpu"),
                           options())
    common.poot_round(driver, PROMPT, 4)
    rounds = [common.poot_round(driver, PROMPT, new) for _ in range(2)]
    tokens = driver.generate(GenerateRequest(PROMPT, max_new=new, ignore_eos=True)).tokens
    return {"decode_tok_s": max(r["decode"] for r in rounds), "tokens": tokens} if coordinator.first else None


def gpu_rows(new: int) -> dict[str, Any]:
    """The Llama-3-8B shape on the CUDA backend, unplaced and placed over a one-rank NCCL group."""
    import os

    import gpu_serve

    from poot_core import Driver, DriverOptions, GenerateRequest, open_executor
    from poot_core.distributed import Coordinator, Placement
    from poot_core.distributed.spawn import free_port

    handle = gpu_serve.random_handle(common.hf_config("llama3_8b"))
    ids = [(7 * i + 3) % 30000 + 2 for i in range(128)]
    opts = DriverOptions(capacity=1024)
    out: dict[str, Any] = {}
    plain = Driver(handle, open_executor("cuda"), opts)
    common.poot_round(plain, ids, 8)  # compile and capture
    rounds = [common.poot_round(plain, ids, new) for _ in range(2)]
    out["cuda_unplaced"] = {"decode_tok_s": max(r["decode"] for r in rounds),
                            "tokens": plain.generate(GenerateRequest(ids, max_new=new, ignore_eos=True)).tokens}
    del plain
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "1", "RANK": "0"})
    coordinator = Coordinator.from_env(backend="nccl")
    try:
        placed = Driver.placed(handle, coordinator, Placement.TENSOR, open_executor("cuda"), opts)
        common.poot_round(placed, ids, 8)
        rounds = [common.poot_round(placed, ids, new) for _ in range(2)]
        out["cuda_nccl_1_rank"] = {"decode_tok_s": max(r["decode"] for r in rounds),
                                   "tokens": placed.generate(GenerateRequest(ids, max_new=new,
                                                                             ignore_eos=True)).tokens}
    finally:
        coordinator.close()
    return out


def served(coordinator: Any, path: str, requests: int, new: int) -> dict[str, Any] | None:
    """`requests` prompts at once through the serving engine over a two-stage pipeline, with whole steps
    (micro_batches=1, the default) and in two micro-batches: output tok/s of each, best of two rounds."""
    import time

    from poot_core import Driver, DriverOptions, GenerateRequest, Layout, ModelHandle, open_executor
    from poot_core.distributed import Placement

    out = {}
    prompts = [[(5 * i + 11 * r) % 200 + 2 for i in range(24 + 8 * (r % 4))] for r in range(requests)]
    for micro in (1, 2):
        opts = DriverOptions(capacity=256, step_tokens=256, max_running=requests, micro_batches=micro)
        engine = Driver.placed(ModelHandle.load(Path(path)), coordinator, Placement.PIPELINE, open_executor("cpu"),
                               opts).serve(Layout.PAGED)
        rates, tokens = [], None
        for salt in ("warm", "a", "b"):  # a salt a round: no prefix-cache hits between rounds
            t0 = time.perf_counter()
            gens = engine.generate_batch([GenerateRequest(p, max_new=new, ignore_eos=True) for p in prompts],
                                         cache_salt=salt)
            rates.append(sum(len(g.tokens) for g in gens) / (time.perf_counter() - t0))
            tokens = [g.tokens for g in gens]
        out["whole_steps" if micro == 1 else "micro_batches"] = {"output_tok_s": max(rates[1:]), "tokens": tokens}
    return out if coordinator.first else None


def main() -> None:
    from poot_core.distributed import Coordinator

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--serve", type=int, default=16, metavar="N",
                    help="requests through the serving engine over a two-stage pipeline (0: skip)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build(Path(tmp) / "llama", args.layers))
        weights = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
        bandwidth = common.copy_bandwidth()
        results: dict[str, Any] = {"single_1_thread": single(path, args.new, 1),
                                   "single_2_threads": single(path, args.new, 2)}
        torch.set_num_threads(1)
        # gloo: these ranks run the CPU executor, also on a machine with GPUs (where NCCL would be the default)
        spawn = {"timeout": 900.0, "collective_timeout": 120.0, "threads": 1, "backend": "gloo"}
        for name, n, placement in (("placed_1_rank", 1, "tensor"), ("tensor_2_ranks", 2, "tensor"),
                                   ("pipeline_2_ranks", 2, "pipeline")):
            results[name] = Coordinator.spawn(n, placed, path, placement, args.new, **spawn)[0]
        serving = Coordinator.spawn(2, served, path, args.serve, args.new, **spawn)[0] if args.serve else {}
    reference = results["single_1_thread"]["tokens"]
    floor = bandwidth / weights
    common.log(f"llama shape, {args.layers} layers of 512, bf16, {weights / 2**20:.1f} MiB of weights; floor "
               f"{floor:.0f} tok/s ({bandwidth / 1e9:.1f} GB/s copy)")
    for name, r in results.items():
        r["same_tokens"] = r["tokens"] == reference
        common.log(f"{name:>18}: decode {r['decode_tok_s']:7.1f} tok/s  tokens equal: {r['same_tokens']}")
    for name, r in serving.items():
        r["same_tokens"] = r["tokens"] == serving["whole_steps"]["tokens"]
        common.log(f"{'serve ' + name:>18}: {r['output_tok_s']:7.1f} output tok/s, {args.serve} requests over a "
                   f"two-stage pipeline; tokens equal to whole steps: {r['same_tokens']}")
    llama8b: Any = "skipped: no CUDA device"
    if torch.cuda.is_available():
        rows = gpu_rows(args.new)
        same = rows["cuda_nccl_1_rank"]["tokens"] == rows["cuda_unplaced"]["tokens"]
        llama8b = {k: v["decode_tok_s"] for k, v in rows.items()} | {"same_tokens": same}
        common.log(f"Llama-3-8B shape, CUDA: unplaced {rows['cuda_unplaced']['decode_tok_s']:.1f} tok/s, placed over "
                   f"a one-rank NCCL group {rows['cuda_nccl_1_rank']['decode_tok_s']:.1f} tok/s, tokens equal: {same}")
    else:
        common.log(f"Llama-3-8B shape over GPU ranks: {llama8b}")
    out = common.write("multi_device", {"shape": {"layers": args.layers, "hidden": 512, "heads": 8, "kv_heads": 4,
                                                  "intermediate": 1408, "vocab": 256, "dtype": "bfloat16"},
                                        "weight_bytes": weights, "copy_bandwidth": bandwidth, "floor_tok_s": floor,
                                        "new_tokens": args.new,
                                        "results": {k: {"decode_tok_s": v["decode_tok_s"],
                                                        "same_tokens": v["same_tokens"]} for k, v in results.items()},
                                        "serve_pipeline_2_ranks": {k: {"output_tok_s": v["output_tok_s"],
                                                                       "same_tokens": v["same_tokens"]}
                                                                   for k, v in serving.items()},
                                        "llama3_8b": llama8b})
    common.log(f"wrote {out}")


if __name__ == "__main__":
    main()
