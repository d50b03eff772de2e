"""Step sizes the executor chooses: DriverOptions fields left as None take the executor's RunDefaults (the
serving engine's budget, slots and KV share, the prefill chunk), explicit values win, and the serving KV pool
is sized with the executor's own bytes per state value (`state_nbytes`), float32 when it has none."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest
import torch

from poot_core import Driver, DriverOptions, Layout, ModelHandle, RunDefaults, open_executor
from poot_core.cli.runtime import MIN_BATCH, batch_size
from poot_core.executor import Capabilities

FREE = 256 << 10  # the memory the stand-in executor reports free: a KV pool of some tens of tiny blocks


class _Chosen:
    """The CPU executor, reporting other RunDefaults and a fixed free memory; with `value_bytes` it also says
    its state takes that many bytes a value."""

    def __init__(self, defaults: RunDefaults, value_bytes: int | None = None) -> None:
        self._cpu = open_executor("cpu")
        self._defaults = defaults
        self.name = "chosen"
        if value_bytes is not None:
            self.state_nbytes = lambda graph, weights: sum(
                value_bytes * int(torch.Size(spec.shape).numel()) for spec in graph.state.values())

    def capabilities(self) -> Capabilities:
        caps = self._cpu.capabilities()
        return Capabilities(caps.ops, caps.weight_kinds, caps.notes, caps.layouts, self._defaults)

    def memory(self) -> dict[str, int]:
        return {"total": FREE, "free": FREE}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cpu, name)


def _block_bytes(path, value_bytes: int, block: int) -> int:
    """One KV block of every layer from the checkpoint's config: layers x (K, V) x kv heads x positions x dim."""
    config = json.loads((path / "config.json").read_text())
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * block * dim * value_bytes


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return tiny_checkpoint("llama", torch.float32)


def test_unset_fields_take_the_cpu_defaults_and_explicit_ones_stay(llama):
    handle = ModelHandle.load(llama)
    cpu = open_executor("cpu")
    options = Driver(handle, cpu, DriverOptions(capacity=64)).options
    core = RunDefaults()
    assert (options.prefill_chunk, options.step_tokens, options.max_running, options.kv_fraction) == (
        core.prefill_chunk, core.step_tokens, core.max_running, core.kv_fraction)
    given = DriverOptions(capacity=64, prefill_chunk=8, step_tokens=40, max_running=5, kv_fraction=0.5)
    options = Driver(handle, cpu, given).options
    assert (options.prefill_chunk, options.step_tokens, options.max_running, options.kv_fraction) == (8, 40, 5, 0.5)
    assert given.prefill_chunk == 8 and DriverOptions().prefill_chunk is None  # the caller's object is not changed


@pytest.mark.parametrize("value_bytes", [None, 2])
def test_the_engine_takes_the_executor_defaults_and_its_state_bytes(llama, value_bytes):
    defaults = RunDefaults(prefill_chunk=8, step_tokens=48, max_running=3, kv_fraction=0.5)
    executor = _Chosen(defaults, value_bytes)
    engine = Driver(ModelHandle.load(llama), executor, DriverOptions(capacity=256)).serve(Layout.PAGED)
    assert (engine.limits.step_tokens, engine.limits.max_running, engine.limits.prefill_chunk) == (48, 3, 8)
    per_block = _block_bytes(llama, value_bytes or 4, engine.block_size)
    assert engine.pool.blocks == min(int(0.5 * FREE) // per_block, 3 * engine.max_blocks)
    assert engine.pool.blocks < 3 * engine.max_blocks  # the memory share decided it, not the slots


def test_command_line_batch_default_follows_the_backend():
    args = argparse.Namespace(batch_size=None)
    assert batch_size(args, open_executor("cpu")) == MIN_BATCH
    assert batch_size(args, _Chosen(RunDefaults(prefill_chunk=2048))) == 2048
    assert batch_size(argparse.Namespace(batch_size=17), _Chosen(RunDefaults(prefill_chunk=2048))) == 17
