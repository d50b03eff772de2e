"""`poot caption -m MODEL IMAGE [-p PROMPT] [-n N]`: a vision-language model's reply about one image.

The image (a file path or a data: URL) and the prompt go in one user message through the model's chat template,
as images in chat messages do in the Python API (poot-family-vision). Greedy decoding on the CPU executor.
"""

from __future__ import annotations

import argparse
import sys

from poot_core.cli.runtime import BACKEND_NAMES, BACKENDS
from poot_core.errors import Reason, RequestError, Unsupported

DEFAULT_PROMPT = "Describe this image."


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("caption", help="describe an image with a vision-language model")
    p.add_argument("-m", "--model", required=True,
                   help="a vision-language checkpoint directory (SmolVLM, Idefics3, Gemma 3), or with --mmproj "
                        "llama.cpp's text GGUF (required)")
    p.add_argument("--mmproj", default=None, help="llama.cpp's vision GGUF beside the text GGUF -m (Gemma 3)")
    p.add_argument("image", help="the image: a file path or a data: URL")
    p.add_argument("-p", "--prompt", default=DEFAULT_PROMPT, help="what to ask about the image")
    p.add_argument("-n", "--n-predict", dest="n", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--backend", choices=BACKENDS, default="cpu", help="the device to run on")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from poot_core import ModelHandle, open_executor

    if args.n < 1:
        raise RequestError(f"-n must be at least 1, got {args.n}")
    try:
        from poot_family_vision.runtime import VisionLanguageModel
    except ImportError as exc:
        raise Unsupported(Reason.REGISTRY, "images", "install poot-family-vision to caption images") from exc
    executor = open_executor(BACKEND_NAMES.get(args.backend, args.backend))
    handle = ModelHandle.load(args.model)
    # a text-only model: RequestError, before the image is read
    model = VisionLanguageModel(handle, executor, mmproj=args.mmproj)
    messages = [{"role": "user", "content": [{"type": "image", "image": args.image},
                                             {"type": "text", "text": args.prompt}]}]
    _, text = model.chat(messages, max_new=args.n)
    sys.stdout.write(text.strip() + "\n")
    return 0
