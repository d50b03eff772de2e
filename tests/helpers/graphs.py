"""A loaded checkpoint's graph for one step shape, traced as the Driver traces it."""

from __future__ import annotations

from poot_core import Graph, ModelHandle, StepShape, Tracer


def trace(handle: ModelHandle, shape: StepShape) -> Graph:
    tracer = Tracer(shape, handle.store().shapes())
    handle.family.trace(handle.config(), tracer, shape)
    return tracer.graph
