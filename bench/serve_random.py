"""`poot serve` over random bf16 weights of a model shape (bench/shapes), made in memory on the serving device:
the server, engine and options of `poot serve` itself, without a checkpoint on disk. bench/serve_load.py
--random starts it, and builds the same model for the offline engine beside it.

    python bench/serve_random.py -m llama3_8b [--layers 32] [--small] --port 8391 [poot serve's flags]

-m names the shape (bench/shapes/<name>.json); --small keeps its family but shrinks it to a few layers of width
256 (a CPU check of the whole path). The ids are shown through the tiny test tokenizer (id mod its vocabulary),
as bench/gpu_serve.py does, so every streamed token still pays a real incremental detokenization.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import common  # noqa: E402

# --small: the shape cut to this (a quick run of the whole path on the CPU)
SMALL = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 4096}


def shape(name: str, layers: int | None = None, small: bool = False) -> dict[str, Any]:
    """The Hugging Face config of the model shape `name`, cut to `layers` layers or to the --small shape."""
    hf = {**common.hf_config(name), **(SMALL if small else {})}
    if layers is not None:
        hf["num_hidden_layers"] = layers
    return hf


def open_model(hf: dict[str, Any], backend: str) -> Any:
    """serve.run's model opener: random weights of the `hf` shape, made here and now on the GPU when `backend`
    (poot serve's --backend) may be CUDA and one is present, else on the CPU (the executor uploads them). Run it
    before any device is opened: the tiny tokenizer is built with transformers, whose import of Triton crashes
    in a process that has loaded another LLVM (the Vulkan and OpenCL CPU drivers that `auto` probes)."""
    import gpu_serve
    import torch

    cuda = backend in ("auto", "cuda", "ptx") and torch.cuda.is_available()
    handle = gpu_serve.random_handle(hf, device="cuda" if cuda else "cpu")
    return lambda args, executor: handle


def add_flags(p: argparse.ArgumentParser) -> None:
    """poot serve's flags (-m: the shape's name) and the shape's own."""
    from poot_core.cli import serve

    serve.add_flags(p)
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    p.add_argument("--small", action="store_true", help="the shape shrunk to a few layers of width 256")


def main() -> int:
    from poot_core.cli import serve
    from poot_core.cli.args import Parser

    parser = Parser(prog="serve_random.py", description=__doc__.splitlines()[0])
    add_flags(parser)
    args = parser.parse_args()
    return serve.run(args, open_model(shape(args.model, args.layers, args.small), args.backend))


if __name__ == "__main__":
    sys.exit(main())
