"""Shared pieces of the benchmarks: the memory-bandwidth floor, timing, resident memory, llama.cpp as the peer,
and writing results as JSON; the model shapes they build."""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = Path(__file__).resolve().parent / "shapes"  # config.json of each model shape the benchmarks build
LLAMA_CPP = "llama-cpp-python==0.3.36"  # the version whose sdist scripts/fetch_test_data.py unpacks


def hf_config(name: str) -> dict[str, Any]:
    """The Hugging Face config of a model shape (bench/shapes/<name>.json: the fields of its config.json that
    the benchmarks need)."""
    return json.loads((SHAPES / f"{name}.json").read_text())


def copy_bandwidth(nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Measured bytes/s of a large memory copy (read + write counted), the floor's denominator."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def anonymous_bytes() -> int:
    """This process's resident anonymous memory (copies, caches, heaps), after freeing what can be freed:
    malloc keeps freed scratch that is not the model's."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no Anonymous line in /proc/self/smaps_rollup")


def mapped_bytes(path: Path) -> int:
    """Resident bytes of this process's mappings of the file at `path` (its pages actually read)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):  # a mapping's header line
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(head[1]) * 1024
    return total


def llama_cpp() -> Any:
    """The llama_cpp module, built from source into this environment the first time (several minutes)."""
    try:
        import llama_cpp
    except ImportError:
        print(f"building {LLAMA_CPP} from source (several minutes) ...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", LLAMA_CPP], check=True)
        import llama_cpp
    return llama_cpp


def poot_round(driver: Any, ids: list[int], new_tokens: int) -> dict[str, float]:
    """One prefill of `ids` from an empty cache and `new_tokens` greedy tokens: tok/s of each."""
    from poot_core import GenerateRequest

    driver.reset()  # nothing reused from the previous round
    r = driver.generate(GenerateRequest(ids, max_new=new_tokens, ignore_eos=True))
    return {"prefill": r.timings.prefill_tok_s, "decode": r.timings.decode_tok_s}


def llama_cpp_round(llm: Any, ids: list[int], new_tokens: int) -> dict[str, float]:
    """poot_round for a llama_cpp.Llama, timed as poot's Timings are: decode is `new_tokens` samples and
    `new_tokens - 1` steps."""
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    prefill = len(ids) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    token = llm.sample(temp=0.0)
    for _ in range(new_tokens - 1):
        llm.eval([token])
        token = llm.sample(temp=0.0)
    return {"prefill": prefill, "decode": (new_tokens - 1) / (time.perf_counter() - t0)}


def write(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"machine": platform.machine(), "processor": platform.processor(), "threads": torch.get_num_threads(),
               "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **payload}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path


def step_programs(family: Any, config: Any, executor: Any, weights: Any, shapes: dict[str, tuple[int, ...]],
                  capacity: int) -> Any:
    """A function tokens -> (prepared program, graph) for steps of one row of `tokens` tokens: the family's
    model traced for that shape and prepared on `executor` over the uploaded `weights`."""
    from poot_core import StepShape, Tracer

    def program(tokens: int) -> tuple[Any, Any]:
        shape = StepShape(1, tokens, capacity)
        tracer = Tracer(shape, shapes)
        family.trace(config, tracer, shape)
        return executor.prepare(tracer.graph, weights), tracer.graph

    return program


def paged_step(engine: Any, seqs: int, tokens_each: int, context: int) -> tuple[Any, dict[str, np.ndarray]]:
    """A serving engine's program and inputs for a step of `seqs` sequences, each with `tokens_each` new tokens
    ending at position `context` (1: a decode step, replayed; more: prefill chunks, eager), over blocks of the
    pool and, for a model with recurrent state, state slots 0 to seqs - 1."""
    decode = tokens_each == 1
    tokens = seqs * tokens_each
    shape = engine._shape(tokens, seqs, decode=decode)
    prog = engine.program(shape)
    paging = shape.paging
    per_seq = math.ceil((context + 1) / paging.block_size)
    assert seqs * per_seq <= paging.blocks, "the pool is too small for the probe"
    tables = np.zeros((paging.seqs, paging.max_blocks), dtype=np.int64)
    tables[:seqs, :per_seq] = np.arange(seqs * per_seq).reshape(seqs, per_seq)
    positions = np.concatenate([np.arange(context - tokens_each + 1, context + 1)] * seqs)[None, :]
    inputs = {"tokens": np.ones((1, tokens), dtype=np.int64), "positions": positions,
              "seq_index": np.repeat(np.arange(seqs, dtype=np.int64), tokens_each), "block_tables": tables,
              "logit_index": np.arange(seqs, dtype=np.int64) * tokens_each + tokens_each - 1}
    if paging.state_slots:
        assert seqs <= paging.state_slots, "the state pool is too small for the probe"
        inputs["state_slots"] = np.arange(paging.seqs, dtype=np.int64) % paging.state_slots
    return prog, inputs


def greedy(executor: Any, out: Any) -> int:
    """The id of the largest logit of the last position of `out`: on the device where the executor can."""
    if hasattr(executor, "greedy_token"):
        return int(executor.greedy_token(out))
    return int(np.asarray(executor.to_numpy(out)).reshape(-1, out.shape[-1])[-1].argmax())


def greedy_generate(executor: Any, pre: Any, dec: Any, state: Any, ids: np.ndarray, new: int,
                    sync: Any = lambda: None) -> tuple[float, float, list[int]]:
    """The prompt `ids` through the prepared program `pre`, then `new - 1` greedy steps of one token through
    `dec`: the seconds of the prefill and of the steps, and the `new` tokens. `sync` waits for the device
    before each clock read (a step that returns its token to the host has waited already)."""
    prompt = len(ids)
    t0 = time.perf_counter()
    out = pre.run(state, {"tokens": ids[None, :], "positions": np.arange(prompt)[None, :]})[0]
    token = greedy(executor, out)
    sync()
    t1 = time.perf_counter()
    tokens = [token]
    for step in range(new - 1):
        out = dec.run(state, {"tokens": np.array([[token]]), "positions": np.array([[prompt + step]])})[0]
        token = greedy(executor, out)
        tokens.append(token)
    sync()
    return t1 - t0, time.perf_counter() - t1, tokens


def synced_ms(fn: Any, reps: int = 20, warmup: int = 3) -> float:
    """Median wall milliseconds of fn() with the GPU synchronized before and after each call: what a caller
    waits for (host work, copies and the device's work together)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def log(*args: Any) -> None:
    print(*args, flush=True)


def decode_args(doc: str) -> argparse.Namespace:
    """The batch-1 decode benchmarks' command line (vulkan_decode, opencl_decode); --smoke caps the tokens at 4."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--models", default=None, help="comma-separated, all when left out")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, a few tokens: checks the script")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (a quick check)")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--no-cuda", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.prompt, args.new = min(args.prompt, 4), min(args.new, 4)
    return args


def decode_bandwidth() -> tuple[float, str]:
    """The copy bandwidth the decode benchmarks measure against, and how it was measured (logged)."""
    if torch.cuda.is_available():
        from gpu_decode import copy_bandwidth as device_copy_bandwidth

        bandwidth, how = device_copy_bandwidth() * 1e9, "torch device-to-device copy"
    else:
        bandwidth, how = copy_bandwidth(), "torch host memory copy"
    log(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s ({how})")
    return bandwidth, how


def decode_payload(args: argparse.Namespace, bandwidth: float, how: str) -> dict[str, Any]:
    """The head of a decode benchmark's result file; the caller fills "models"."""
    payload: dict[str, Any] = {
        "copy_GBps": bandwidth / 1e9,
        "copy_how": how,
        "prompt": args.prompt,
        "new_tokens": args.new,
        "weights": "random bf16, N(0, 0.02), or GGUF blocks with scales 0.001, seed 0, the same for every backend",
        "smoke": args.smoke,
        "models": {},
    }
    if torch.cuda.is_available():
        payload["device"] = torch.cuda.get_device_name()
    return payload


# run(backend, model key, its config, stored kind, args, copy bandwidth) -> that backend's result for the model
DecodeRun = Callable[[str, str, dict[str, Any], str, argparse.Namespace, float], dict[str, Any]]
# extra(model key, its config, its entry, args, copy bandwidth): more measurements of one model, into its entry
DecodeExtra = Callable[[str, dict[str, Any], dict[str, Any], argparse.Namespace, float], None]


def decode_rows(doc: str, backend: str, models: dict[str, tuple[dict[str, Any], str]], run: DecodeRun,
                row: Callable[[str, str, dict[str, Any]], str], tiny: Callable[[str], dict[str, Any]],
                extra: DecodeExtra | None = None) -> dict[str, Any]:
    """The loop of a batch-1 decode benchmark (vulkan_decode, opencl_decode): the command line (decode_args),
    the copy bandwidth, then for each model asked for (its config with `tiny(key)` over it under --smoke and
    --layers applied) `run` on `backend` and on CUDA when present, an error recorded in place of a result
    (one backend failing still reports the other), and how many greedy tokens the two share. Writes the
    payload to --out or results/<backend>_decode.json, then a summary line per result (`row(key, backend,
    result)` after the model and backend names) and returns the payload."""
    args = decode_args(doc)
    args.models = args.models or ",".join(models)
    backends = [backend] + (["cuda"] if torch.cuda.is_available() and not args.no_cuda else [])
    bandwidth, how = decode_bandwidth()
    payload = decode_payload(args, bandwidth, how)
    for key in args.models.split(","):
        base, kind = models[key]
        hf = {**base, **(tiny(key) if args.smoke else {})}
        if args.layers:
            hf["num_hidden_layers"] = args.layers
        entry: dict[str, Any] = {"layers": hf["num_hidden_layers"], "hidden": hf["hidden_size"], "kind": kind}
        for name in backends:
            log(f"{key}: {name} ...")
            try:
                entry[name] = run(name, key, hf, kind, args, bandwidth)
            except Exception as error:  # one backend failing still reports the other
                entry[name] = {"error": f"{type(error).__name__}: {error}"}
            log(f"  {json.dumps({k: v for k, v in entry[name].items() if k != 'tokens'})}")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if "tokens" in entry.get(backend, {}) and "tokens" in entry.get("cuda", {}):
            entry["greedy_tokens_equal_prefix"] = equal_prefix(entry[backend]["tokens"], entry["cuda"]["tokens"])
        if extra is not None:
            extra(key, hf, entry, args, bandwidth)
        payload["models"][key] = entry
    if args.out:
        args.out.write_text(json.dumps(payload, indent=1))
    else:
        log(f"wrote {write(f'{backend}_decode', payload)}")
    log("\n=== summary (batch 1) ===")
    log(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    for key, entry in payload["models"].items():
        for name in (backend, "cuda"):
            r = entry.get(name)
            if r is not None:  # None: not run (no CUDA device, or --no-cuda)
                log(f"{key:11s} {name:6s}: {r if 'error' in r else row(key, name, r)}")
    return payload


def equal_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy replies share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


class DeviceStore:
    """A WeightStore stand-in over tensors already made on the device (upload then moves nothing); a subclass
    fills `w` (name -> tensor or PackedWeight)."""

    def __init__(self) -> None:
        self.w: dict[str, Any] = {}

    def names(self) -> list[str]:
        return list(self.w)

    def get(self, name: str) -> Any:
        return self.w[name]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(w.shape) for n, w in self.w.items()}
