"""Load on an OpenAI-compatible server, like `vllm bench serve`: streamed completions of random prompts,
arriving as a Poisson process at --rate requests/s or kept at --concurrency in flight.

  python bench/serve_load.py --start [--concurrency 8] [--requests 32] [--prompt 64] [--new 32]
  python bench/serve_load.py --url http://127.0.0.1:8000 --model NAME --rate 2

--start runs `poot serve` on the packaged SmolLM2 (GGUF Q4_1) on a free local port and stops it at the end;
--url measures any server already running (llama-cpp-python's `python -m llama_cpp.server` on the same file
is the CPU peer). Prints request throughput, output tok/s, TTFT, TPOT and inter-token latency p50/p99 and the
failed requests; writes bench/results/serve_load.json (or --out).
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

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "number group problem fact river mountain city music paper light water story table window garden").split()


def _ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p99": 0.0, "mean": 0.0}
    return {"p50": float(np.percentile(values, 50)) * 1e3, "p99": float(np.percentile(values, 99)) * 1e3,
            "mean": float(np.mean(values)) * 1e3}


async def one(client: httpx.AsyncClient, model: str, prompt: str, new: int) -> dict:
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


async def run_load(url: str, model: str, prompts: list[str], new: int, rate: float | None,
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


def start_server(port: int, max_running: int, threads: int) -> subprocess.Popen:
    from helpers import smollm

    argv = [sys.executable, "-m", "poot_core.cli.main", "serve", "-m", str(smollm.gguf_path()), "--port", str(port),
            "--served-model-name", "smollm2", "-c", "1024", "--backend", "cpu", "--max-running", str(max_running),
            "-t", str(threads)]
    proc = subprocess.Popen(argv, cwd=ROOT)
    for _ in range(1500):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"poot serve exited with {proc.returncode}")
        time.sleep(0.2)
    proc.terminate()
    raise SystemExit("poot serve did not become healthy")


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
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve_load.json"))
    args = ap.parse_args()
    if args.rate is None and args.concurrency is None:
        args.concurrency = 8
    proc = start_server(args.port, max(args.concurrency or 16, 8), args.threads) if args.start else None
    url = args.url or f"http://127.0.0.1:{args.port}"
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(args.prompt)) for _ in range(args.requests)]
    try:
        asyncio.run(run_load(url, args.model, prompts[:2], 2, None, 2))  # warm: the first steps prepare programs
        results, seconds = asyncio.run(run_load(url, args.model, prompts, args.new, args.rate, args.concurrency))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=120)
    ok = [r for r in results if r["ok"]]
    tokens = sum(r["tokens"] for r in ok)
    summary = {
        "url": url, "model": args.model, "requests": args.requests, "prompt_words": args.prompt, "new": args.new,
        "concurrency": args.concurrency, "rate": args.rate, "seconds": seconds, "completed": len(ok),
        "failed": len(results) - len(ok), "errors": sorted({r["error"] for r in results if not r["ok"]})[:5],
        "request_throughput": len(ok) / seconds, "output_tok_s": tokens / seconds,
        "ttft_ms": _ms([r["ttft"] for r in ok]), "tpot_ms": _ms([r["tpot"] for r in ok if r["tpot"]]),
        "itl_ms": _ms([x for r in ok for x in r["itl"]]),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                 text=True).stdout.strip(),
    }
    print(f"completed {summary['completed']}, failed {summary['failed']} in {seconds:.1f} s: "
          f"{summary['request_throughput']:.2f} req/s, {summary['output_tok_s']:.1f} output tok/s")
    for key in ("ttft_ms", "tpot_ms", "itl_ms"):
        v = summary[key]
        print(f"  {key[:-3].upper():5s} p50 {v['p50']:8.1f} ms   p99 {v['p99']:8.1f} ms")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
