"""The CPU executor with steps fed from the "device" (poot_core.executor.FedSteps), so that the serving engine's
steps ahead (poot_core/driver/ahead.py) run on the CPU as they do on a GPU: a step's argmax ids stay a torch
tensor the engine reads only through read_ids, and a fed step writes them into its token slots before it runs."""

from __future__ import annotations

import numpy as np
import torch

from poot_core.cpu.executor import CpuExecutor


class FedCpu(CpuExecutor):
    def greedy_rows(self, output: torch.Tensor) -> np.ndarray:
        return self.read_ids(self.greedy_ids(output))

    def greedy_ids(self, output: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.argmax(self.to_numpy(output)[0], axis=-1))

    def read_ids(self, ids: torch.Tensor) -> np.ndarray:
        return ids.numpy().astype(np.int64)

    def run_fed(self, program, state, inputs, ids, at, rows):
        tokens = inputs["tokens"].copy()
        tokens[0, at] = ids.numpy()[rows]
        return program.run(state, {**inputs, "tokens": tokens})
