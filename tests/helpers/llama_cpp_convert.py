"""Run llama.cpp's own convert_hf_to_gguf.py (fetched by scripts/fetch_test_data.py) on several checkpoints in
one process, with its own gguf-py first on the path.

    python tests/helpers/llama_cpp_convert.py CONVERTER_DIR JOBS_JSON     (JOBS_JSON: [{"src", "outtype", "out"}, ...])

A job's optional "args" are more of the converter's own flags (a vision model's mmproj file: "--mmproj").

One change to the converter, and only one: the tiny test checkpoints' tokenizer is trained on the spot, so
its hash is in none of the converter's tables of known pre-tokenizers (it refuses unknown ones). That
tokenizer is a byte-level BPE with GPT-2's split pattern, so it is written as what it is, pre-tokenizer
"gpt-2". Weights and every other key are the converter's own work.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> int:
    converter, jobs = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    sys.path[:0] = [str(converter), str(converter / "gguf-py")]
    import conversion.base as base  # type: ignore[import-not-found]

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    import convert_hf_to_gguf  # type: ignore[import-not-found]

    for job in jobs:
        sys.argv = ["convert_hf_to_gguf.py", job["src"], "--outtype", job["outtype"], "--outfile", job["out"],
                    *job.get("args", [])]
        convert_hf_to_gguf.main()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
