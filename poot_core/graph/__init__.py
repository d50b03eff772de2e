"""The traced step: a flat list of nodes over typed references to weights, inputs and KV state.

A family writes its forward once against a `Tracer`; tracing it for one `StepShape` gives a `Graph` that an
executor prepares once and runs many times. Shapes are concrete for the step shape they were traced for.

  ir.py       the data: `Ref` (`WeightRef`, `StateRef`, `ValueRef`), `Value`, `Node`, `StateSpec`, `Graph`
  tracer.py   `Tracer`, the methods families call, one per op
  passes.py   the op vocabulary (`OPS`) and what every executor derives from a graph: handler dispatch,
              liveness, the add -> rms_norm fusion, linears that share an input
  buffers.py  `BufferPool`: a step's device buffers by liveness, for backends that plan buffers themselves
  planner.py  `NodeArgs`: how such a backend finds a node's weights, inputs and values

This package is part of poot_core's public API: backend plugins import the passes from here.
"""

from poot_core.graph import passes
from poot_core.graph.buffers import BufferPool
from poot_core.graph.ir import (
    EMBED_ROWS,
    EMBED_VALUES,
    GROUPS,
    RECURRENT_KINDS,
    SECTION_POSITIONS,
    Graph,
    Node,
    Paging,
    Ref,
    StateRef,
    StateSpec,
    StepShape,
    Value,
    ValueRef,
    WeightRef,
    sequence_runs,
)
from poot_core.graph.passes import OPS, Dispatch, OpSpec, handled_ops
from poot_core.graph.planner import NodeArgs
from poot_core.graph.tracer import Tracer

__all__ = ["EMBED_ROWS", "EMBED_VALUES", "OPS", "RECURRENT_KINDS", "BufferPool", "Dispatch", "Graph", "Node",
           "NodeArgs", "OpSpec", "Paging", "Ref", "StateRef", "StateSpec", "StepShape", "Tracer", "Value", "ValueRef",
           "WeightRef", "handled_ops", "passes", "sequence_runs", "SECTION_POSITIONS", "GROUPS"]
