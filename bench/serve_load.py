"""Load on an OpenAI-compatible server, like `vllm bench serve`: streamed completions of random prompts,
arriving as a Poisson process at --rate requests/s or kept at --concurrency in flight.

  python bench/serve_load.py --start [--concurrency 8] [--requests 32] [--prompt 64] [--new 32]
  python bench/serve_load.py --url http://127.0.0.1:8000 --model NAME --rate 2

--start runs `poot serve` on the packaged SmolLM2 (GGUF Q4_1) on a free local port and stops it at the end;
--url measures any server already running (llama-cpp-python's `python -m llama_cpp.server` on the same file
is the CPU peer). Prints request throughput, output tok/s, TTFT, TPOT and inter-token latency p50/p99 and the
failed requests; writes bench/results/serve_load.json (or --out).

  python bench/serve_load.py --random llama3_8b [--workloads 64x512+256,256x1024+128] [--layers N] [--small]

--random serves random bf16 weights of a model shape (bench/shapes) made on the device (bench/serve_random.py:
poot serve's own server and engine options), and for each workload N x (P + G) sends N streamed completions of
P random prompt token ids and G new tokens (EOS ignored), N kept in flight (--max-running N, every request's
window in the KV pool), after one warm round of other prompts of the same sizes. Then the offline engine
(`generate_batch`, with the options poot serve chose from the same flags) runs the same requests in this
process, after its own warm round, and the server's output tok/s is printed beside it (target: >= 90%).
--small shrinks the shape (a CPU check); writes bench/results/serve_load_random.json (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "number group problem fact river mountain city music paper light water story table window garden").split()


def _ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p99": 0.0, "mean": 0.0}
    return {"p50": float(np.percentile(values, 50)) * 1e3, "p99": float(np.percentile(values, 99)) * 1e3,
            "mean": float(np.mean(values)) * 1e3}


async def one(client: httpx.AsyncClient, model: str, prompt: str | list[int], new: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps: list[float] = []
    usage = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return {"ok": False, "error": f"HTTP {r.status_code}: {r.text[:200]}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"ok": False, "error": chunk["error"].get("message", "")}
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    stamps.append(time.perf_counter())
    except httpx.HTTPError as exc:
        return {"ok": False, "error": repr(exc)}
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else len(stamps)
    if not stamps:
        return {"ok": False, "error": "no tokens"}
    ttft = stamps[0] - t0
    return {"ok": True, "ttft": ttft, "e2e": end - t0, "tokens": tokens,
            "tpot": (end - stamps[0]) / (tokens - 1) if tokens > 1 else 0.0,
            "itl": [b - a for a, b in zip(stamps, stamps[1:], strict=False)]}


async def run_load(url: str, model: str, prompts: list[str] | list[list[int]], new: int, rate: float | None,
                   concurrency: int | None) -> tuple[list[dict], float]:
    limits = httpx.Limits(max_connections=max(concurrency or 0, len(prompts)))
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        if concurrency:
            queue = list(prompts)
            results: list[dict] = []

            async def worker() -> None:
                while queue:
                    results.append(await one(client, model, queue.pop(), new))

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:
            rng = random.Random(1)
            tasks = []
            for p in prompts:
                tasks.append(asyncio.create_task(one(client, model, p, new)))
                await asyncio.sleep(rng.expovariate(rate or 1.0))
            results = list(await asyncio.gather(*tasks))
        return results, time.perf_counter() - t0


def start_server(argv: list[str], port: int) -> subprocess.Popen:
    """Run a server (argv without --port) on `port`; returns once /health answers 200."""
    proc = subprocess.Popen([*argv, "--port", str(port)], cwd=ROOT)
    for _ in range(3000):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        time.sleep(0.2)
    proc.terminate()
    raise SystemExit("the server did not become healthy")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(timeout=120)


def smollm_server(max_running: int, threads: int) -> list[str]:
    from helpers import smollm

    return [sys.executable, "-m", "poot_core.cli.main", "serve", "-m", str(smollm.gguf_path()),
            "--served-model-name", "smollm2", "-c", "1024", "--backend", "cpu", "--max-running", str(max_running),
            "-t", str(threads)]


def summarize(results: list[dict], seconds: float) -> dict[str, Any]:
    ok = [r for r in results if r["ok"]]
    tokens = sum(r["tokens"] for r in ok)
    return {
        "seconds": seconds, "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if not r["ok"]})[:5],
        "request_throughput": len(ok) / seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds,
        "ttft_ms": _ms([r["ttft"] for r in ok]), "tpot_ms": _ms([r["tpot"] for r in ok if r["tpot"]]),
        "itl_ms": _ms([x for r in ok for x in r["itl"]]),
    }


def show(summary: dict[str, Any]) -> None:
    print(f"completed {summary['completed']}, failed {summary['failed']} in {summary['seconds']:.1f} s: "
          f"{summary['request_throughput']:.2f} req/s, {summary['output_tok_s']:.1f} output tok/s", flush=True)
    for key in ("ttft_ms", "tpot_ms", "itl_ms"):
        v = summary[key]
        print(f"  {key[:-3].upper():5s} p50 {v['p50']:8.1f} ms   p99 {v['p99']:8.1f} ms", flush=True)


def commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()


# --- a random-weight model: the server beside the offline engine ------------------------------------------


def random_flags(args: argparse.Namespace, n: int, prompt: int, new: int) -> list[str]:
    """serve_random.py's flags for the workload N x (P + G): the shape, N sequences a step, every request's
    window in the KV pool (nothing preempted), and the device flags given."""
    blocks = n * -(-(prompt + new) // 16)
    flags = ["-m", args.random, "--served-model-name", args.random, "--backend", args.backend, "-c",
             str(prompt + new), "--max-running", str(n), "--kv-blocks", str(blocks), "-t", str(args.threads)]
    if args.layers is not None:
        flags += ["--layers", str(args.layers)]
    if args.small:
        flags.append("--small")
    return flags


def offline(flags: list[str], handle: Any, executor: Any, warm: list[list[int]], prompts: list[list[int]],
            new: int) -> dict[str, Any]:
    """The offline engine with the options poot serve takes from `flags`: a warm round, then `prompts`."""
    import serve_random

    from poot_core import Driver, GenerateRequest, Layout
    from poot_core.cli import serve
    from poot_core.cli.args import Parser

    parser = Parser()
    serve_random.add_flags(parser)
    options = serve.engine_options(parser.parse_args(flags), executor, handle.config())
    engine = Driver(handle, executor, options).serve(Layout.PAGED)
    runs = []
    for batch in (warm, prompts):  # the first prepares the programs (on a GPU: compiles, captures graphs)
        t0 = time.perf_counter()
        gens = engine.generate_batch([GenerateRequest(p, max_new=new, ignore_eos=True) for p in batch])
        runs.append((time.perf_counter() - t0, gens))
    seconds, gens = runs[1]
    tokens = sum(len(g.tokens) for g in gens)
    decoding = [g.timings.decode_seconds / g.timings.decode_tokens for g in gens if g.timings.decode_tokens]
    return {"seconds": seconds, "warm_seconds": runs[0][0], "output_tokens": tokens, "output_tok_s": tokens / seconds,
            "ttft_ms": _ms([g.timings.prefill_seconds for g in gens]), "tpot_ms": _ms(decoding),
            "options": {"step_tokens": options.step_tokens, "prefill_chunk": options.prefill_chunk,
                        "max_running": engine.limits.max_running, "kv_blocks": engine.pool.blocks}}


def random_main(args: argparse.Namespace) -> None:
    import gpu_serve
    import serve_random

    hf = serve_random.shape(args.random, args.layers, args.small)
    url = f"http://127.0.0.1:{args.port}"
    result: dict[str, Any] = {"shape": args.random, "hf": hf, "backend": args.backend, "commit": commit(),
                              "workloads": []}
    out = Path(args.out or ROOT / "bench" / "results" / "serve_load_random.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    plans = []
    for n, prompt, new in gpu_serve.parse_workloads(args.workloads):
        rng = np.random.default_rng(n * 1000 + prompt)
        warm, prompts = ([rng.integers(0, hf["vocab_size"], prompt).tolist() for _ in range(n)] for _ in range(2))
        flags = random_flags(args, n, prompt, new)
        print(f"{n} x ({prompt} + {new}): poot serve {' '.join(flags)}", flush=True)
        proc = start_server([sys.executable, str(ROOT / "bench" / "serve_random.py"), *flags], args.port)
        try:
            asyncio.run(run_load(url, args.random, warm, new, None, n))
            results, seconds = asyncio.run(run_load(url, args.random, prompts, new, None, n))
        finally:
            stop_server(proc)
        row = {"requests": n, "prompt": prompt, "new": new, "server_flags": flags,
               "server": summarize(results, seconds)}
        show(row["server"])
        result["workloads"].append(row)
        plans.append((flags, warm, prompts, new))
        out.write_text(json.dumps(result, indent=2))
    from poot_core.cli import runtime

    opener = serve_random.open_model(hf, args.backend)  # before the device is opened (see open_model)
    executor = runtime.open_device(argparse.Namespace(backend=args.backend, threads=args.threads, threads_batch=None))
    runtime.Threads(args.threads, None).for_decode()
    handle = opener(args, executor)
    for row, (flags, warm, prompts, new) in zip(result["workloads"], plans, strict=True):
        row["offline"] = offline(flags, handle, executor, warm, prompts, new)
        row["server_over_offline"] = row["server"]["output_tok_s"] / row["offline"]["output_tok_s"]
        out.write_text(json.dumps(result, indent=2))
    print(f"\n=== {args.random} shape, random bf16 weights, backend {args.backend}: poot serve against the offline "
          "engine on the same requests ===")
    for row in result["workloads"]:
        srv, eng = row["server"], row["offline"]
        print(f"{row['requests']} x ({row['prompt']} + {row['new']}): server {srv['output_tok_s']:.1f} output tok/s "
              f"(failed {srv['failed']}, TTFT p50 {srv['ttft_ms']['p50']:.0f} ms p99 {srv['ttft_ms']['p99']:.0f}), "
              f"offline engine {eng['output_tok_s']:.1f} (TTFT p50 {eng['ttft_ms']['p50']:.0f} ms): "
              f"{row['server_over_offline']:.1%} (target >= 90%)")
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default=None, help="a running server (default with --start: the one started)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--start", action="store_true", help="start poot serve on SmolLM2 for the run")
    ap.add_argument("--port", type=int, default=8391)
    ap.add_argument("--threads", type=int, default=-1, help="-t of the server started (-1: torch's choice)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64, help="words per random prompt")
    ap.add_argument("--new", type=int, default=32, help="new tokens per request (EOS ignored)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=int, default=None, help="requests kept in flight (default 8)")
    mode.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests per second")
    ap.add_argument("--random", metavar="SHAPE", default=None,
                    help="serve random bf16 weights of this shape (bench/shapes), beside the offline engine")
    ap.add_argument("--workloads", default="64x512+256,256x1024+128", help="with --random: N x (P + G), N in flight")
    ap.add_argument("--layers", type=int, default=None, help="with --random: decoder layers (default: the shape's)")
    ap.add_argument("--small", action="store_true", help="with --random: the shape shrunk (a CPU check)")
    ap.add_argument("--backend", default="auto", help="with --random: poot serve's --backend")
    ap.add_argument("--out", default=None, help="the JSON written (default: bench/results/serve_load*.json)")
    args = ap.parse_args()
    if args.random:
        random_main(args)
        return
    if args.rate is None and args.concurrency is None:
        args.concurrency = 8
    proc = start_server(smollm_server(max(args.concurrency or 16, 8), args.threads), args.port) if args.start else None
    url = args.url or f"http://127.0.0.1:{args.port}"
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(args.prompt)) for _ in range(args.requests)]
    try:
        asyncio.run(run_load(url, args.model, prompts[:2], 2, None, 2))  # warm: the first steps prepare programs
        results, seconds = asyncio.run(run_load(url, args.model, prompts, args.new, args.rate, args.concurrency))
    finally:
        if proc is not None:
            stop_server(proc)
    summary = {"url": url, "model": args.model, "requests": args.requests, "prompt_words": args.prompt,
               "new": args.new, "concurrency": args.concurrency, "rate": args.rate, **summarize(results, seconds),
               "commit": commit()}
    show(summary)
    out = Path(args.out or ROOT / "bench" / "results" / "serve_load.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
