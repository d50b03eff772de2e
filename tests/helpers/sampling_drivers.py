"""Drivers the sampler tests share: a contiguous Driver and a paged serving engine that records the logits each
token was sampled from, both on one CPU executor, and a prompt-lookup speculating Driver beside them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from poot_core import (
    DraftPolicy,
    Driver,
    DriverOptions,
    GenerateRequest,
    Generation,
    Layout,
    ModelHandle,
    open_executor,
)
from poot_core.driver.engine import FinishedEvent

PROMPT = [(7 * i + 5) % 200 + 3 for i in range(20)]


def solo_and_engine(checkpoint: Path):
    """The contiguous Driver and the paged engine (keep_logits on) over one handle and executor."""
    handle = ModelHandle.load(checkpoint)
    ex = open_executor("cpu")
    solo = Driver(handle, ex, DriverOptions(capacity=96, prefill_chunk=8)).serve()
    options = DriverOptions(capacity=96, prefill_chunk=8, block_size=4, step_tokens=48, max_running=4)
    engine = Driver(handle, ex, options).serve(Layout.PAGED)
    engine.keep_logits = True
    return solo, engine


def serve_recorded(engine, request: GenerateRequest) -> tuple[Generation, list[np.ndarray]]:
    """Steps the engine until the request finishes: its generation and the logits recorded for its tokens."""
    rid = engine.submit(request)
    served = None
    while served is None:
        served = next((e.generation for e in engine.step() if isinstance(e, FinishedEvent)), None)
    return served, engine.logits.pop(rid)


def prompt_lookup(solo):
    """A Driver beside `solo` (same handle and executor) that speculates with prompt lookup."""
    options = DriverOptions(capacity=96, prefill_chunk=8, draft=DraftPolicy.PromptLookup(k=4))
    return Driver(solo.handle, solo.executor, options).serve()
