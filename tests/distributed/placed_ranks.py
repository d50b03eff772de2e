"""What each spawned rank runs in the distributed tests (a module of its own: a spawned process imports the
function it runs by module and name). Each returns its results on rank 0 only."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from poot_core import Driver, DriverOptions, GenerateRequest, Layout, ModelHandle, Unsupported, open_executor
from poot_core.distributed import Coordinator, Placement, RankFailure

OPTIONS = {"capacity": 64, "prefill_chunk": 8}


def executor(name: str) -> Any:
    """"cpu", or "interpreter": the Triton executor under Triton's interpreter (TRITON_INTERPRET=1 set first)."""
    if name == "cpu":
        return open_executor("cpu")
    os.environ["TRITON_INTERPRET"] = "1"
    from poot_kernels_triton.executor import TritonExecutor

    return TritonExecutor.on_interpreter()


def logits_and_tokens(coordinator: Coordinator, jobs: list[tuple[str, str, Any, list[int], int]],
                      on: str = "cpu") -> dict[str, Any]:
    """For each (key, checkpoint, placement, prompt, new tokens): the placed driver's logits over the prompt
    (chunked prefill), its greedy tokens, or the text of a typed refusal; `on`: the executor (see executor)."""
    out: dict[str, Any] = {}
    for key, path, placement, prompt, new in jobs:
        try:
            driver = Driver.placed(ModelHandle.load(Path(path)), coordinator, Placement(placement),
                                   executor(on), DriverOptions(**OPTIONS))
            logits = driver.logits(prompt)
            tokens = driver.generate(GenerateRequest(prompt, max_new=new, ignore_eos=True)).tokens
            out[key] = (logits, tokens)
        except Unsupported as exc:  # a typed refusal: every rank refuses alike
            out[key] = f"{type(exc).__name__}: {exc}"
    return out if coordinator.first else {}


def fail_while_decoding(coordinator: Coordinator, path: str, placement: str, how: str, gave_up: str) -> Any:
    """The last rank exits ("die") or stops answering ("hang") in the middle of a generation; the others
    report what they raised, and how soon. A hanging rank stays silent for 4 timeouts, or until the first rank
    has given up and touched the file `gave_up` (no need to sit out the rest of the silence)."""
    driver = Driver.placed(ModelHandle.load(Path(path)), coordinator, Placement(placement), open_executor("cpu"),
                           DriverOptions(**OPTIONS))
    steps = 0

    def on_token(token: int, piece: str) -> None:
        nonlocal steps
        steps += 1
        if steps == 3 and coordinator.last:
            until = time.monotonic() + 4 * coordinator.timeout
            while how == "hang" and time.monotonic() < until and not Path(gave_up).exists():
                time.sleep(0.05)
            os._exit(3)

    t0 = time.monotonic()
    try:
        driver.generate(GenerateRequest([5, 6, 7, 8], max_new=20, ignore_eos=True), on_token)
    except RankFailure as exc:
        seconds = time.monotonic() - t0
        if coordinator.first:
            Path(gave_up).touch()
        return {"error": str(exc), "type": type(exc).__name__, "seconds": seconds}
    return {"error": None, "seconds": time.monotonic() - t0}


def single(path: str, prompt: list[int], new: int) -> tuple[np.ndarray, list[int]]:
    """The same on one process, unplaced: the reference."""
    driver = Driver(ModelHandle.load(Path(path)), open_executor("cpu"), DriverOptions(**OPTIONS))
    logits = driver.logits(prompt)
    return logits, driver.generate(GenerateRequest(prompt, max_new=new, ignore_eos=True)).tokens


PAGED = {**OPTIONS, "block_size": 4, "step_tokens": 24, "max_running": 4}


def paged_batch(coordinator: Coordinator | None, jobs: list[tuple[str, str, Any, list[Any], int]]) -> Any:
    """For each (key, checkpoint, placement, prompts, new tokens): the serving engine's (paged KV) tokens and
    logits of each request, all submitted at once; a prompt may be a whole GenerateRequest (image features as
    its prompt embeddings). Without a coordinator: the same on one unplaced driver."""
    out: dict[str, Any] = {}
    for key, path, placement, prompts, new in jobs:
        handle = ModelHandle.load(Path(path))
        if coordinator is None:
            driver = Driver(handle, open_executor("cpu"), DriverOptions(**PAGED))
        else:
            driver = Driver.placed(handle, coordinator, Placement(placement), open_executor("cpu"),
                                   DriverOptions(**PAGED))
        engine = driver.serve(Layout.PAGED)
        engine.keep_logits = True
        gens = engine.generate_batch([p if isinstance(p, GenerateRequest) else
                                      GenerateRequest(p, max_new=new, ignore_eos=True) for p in prompts])
        out[key] = [(g.tokens, np.stack(engine.logits[i])) for i, g in enumerate(gens)]
    return out if coordinator is None or coordinator.first else {}


def micro_batched(coordinator: Coordinator, path: str, prompts: list[list[int]], new: int) -> Any:
    """The serving engine over a two-stage pipeline, by micro_batches (1, the default: whole steps; 2): each
    request's tokens, the steps run and how many of them ran as parts."""
    out = {}
    for micro in (1, 2):
        options = DriverOptions(**{**PAGED, "micro_batches": micro})
        driver = Driver.placed(ModelHandle.load(Path(path)), coordinator, Placement.PIPELINE, open_executor("cpu"),
                               options)
        engine = driver.serve(Layout.PAGED)
        parted = 0
        launch_parts = engine._launch_parts

        def counted(batch: Any, launch_parts: Any = launch_parts) -> Any:
            nonlocal parted
            parted += 1
            return launch_parts(batch)

        engine._launch_parts = counted
        gens = engine.generate_batch([GenerateRequest(p, max_new=new, ignore_eos=True) for p in prompts])
        out[micro] = ([g.tokens for g in gens], engine.steps, parted)
    return out
