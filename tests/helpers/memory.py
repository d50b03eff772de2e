"""What one forward pass of a checkpoint costs in memory, measured in a fresh interpreter so that nothing the
test process already holds is counted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers.paths import ROOT

# Run as `python -c MEASURE <path> <text>`; prints "rss anonymous mapped" (bytes) on its last line.
MEASURE = """
import ctypes, gc, sys
import psutil
from poot_core import Driver, DriverOptions, ModelHandle, open_executor
import poot_core.checkpoint.gguf_file, poot_core.checkpoint.gguf_load, poot_core.checkpoint.safetensors_load
import poot_core.cpu.executor, poot_core.cpu.packed_linear, poot_core.text.gguf_vocab, poot_core.text.hf_vocab
path, text = sys.argv[1], sys.argv[2]

def anonymous():
    gc.collect(); ctypes.CDLL('libc.so.6').malloc_trim(0)  # malloc's kept scratch is not the model
    for line in open('/proc/self/smaps_rollup'):
        if line.startswith('Anonymous:'): return int(line.split()[1]) * 1024

def mapped():
    total, inside = 0, False
    for line in open('/proc/self/smaps'):
        head = line.split()
        if head and '-' in head[0] and not head[0].endswith(':'):  # a mapping's header line
            inside = head[-1] == path or head[-1].startswith(path + '/')
        elif inside and line.startswith('Rss:'): total += int(head[1]) * 1024
    return total

process = psutil.Process()
rss, anon = process.memory_info().rss, anonymous()
h = ModelHandle.load(path)
d = Driver(h, open_executor('cpu'), DriverOptions(capacity=64, prefill_chunk=16))
d.logits(h.text().encode(text))
grown_anon = anonymous() - anon
print(process.memory_info().rss - rss, grown_anon, mapped())
"""


def forward_pass_memory(path: Path, text: str) -> dict[str, int]:
    """Load the checkpoint at `path` (a GGUF file or a Hugging Face directory) on the CPU executor in a fresh
    interpreter and compute the logits of `text`. Returns the growth of resident memory ("rss") and of
    anonymous memory ("anonymous": copies made by the loader or executor), both after malloc's freed scratch
    is returned, and the resident bytes of the mappings of the checkpoint's files ("mapped"). The modules a
    load uses are imported before measuring: code is not load memory."""
    out = subprocess.run([sys.executable, "-c", MEASURE, str(path), text], capture_output=True, text=True,
                         timeout=600, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, out.stderr
    rss, anonymous, mapped = (int(v) for v in out.stdout.strip().splitlines()[-1].split())
    return {"rss": rss, "anonymous": anonymous, "mapped": mapped}
