"""CPU prefill and decode speed for SmolLM2-135M-Instruct, beside its peers measured in the same run.

  python bench/cpu_decode.py                 # bf16 safetensors copy vs transformers, and the GGUF Q4_1 file
  python bench/cpu_decode.py --skip-gguf     # only the safetensors comparison
  python bench/cpu_decode.py --llama-cpp     # also llama.cpp (llama-cpp-python, built from source if absent)

Prints prefill tok/s for a 512-token prompt and decode tok/s for 128 new tokens, the memory floor (weight bytes
read per token over the measured copy bandwidth), and writes bench/results/cpu_decode.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import common  # noqa: E402
from helpers import smollm  # noqa: E402

PROMPT_TOKENS = 512
NEW_TOKENS = 128


def prompt_ids(encode) -> list[int]:
    text = " ".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog by the river." for i in range(80))
    return encode(text)[:PROMPT_TOKENS]


def poot_run(path: Path) -> dict[str, float]:
    from poot_core import Driver, DriverOptions, GenerateRequest, ModelHandle, open_executor

    handle = ModelHandle.load(path)
    driver = Driver(handle, open_executor("cpu"), DriverOptions(capacity=1024, prefill_chunk=512)).serve()
    ids = prompt_ids(handle.text().encode)
    driver.generate(GenerateRequest(ids[:16], max_new=8, ignore_eos=True))  # warm-up
    best = best_of(common.poot_round(driver, ids, NEW_TOKENS), common.poot_round(driver, ids, NEW_TOKENS))
    best["weight_bytes"] = float(handle.store().nbytes())
    return best


def transformers_run(path: Path) -> dict[str, float]:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    tok = tf.AutoTokenizer.from_pretrained(path)
    ids = torch.tensor([prompt_ids(lambda t: tok(t)["input_ids"])])
    best = {"prefill": 0.0, "decode": 0.0}
    with torch.no_grad():
        model(ids[:, :16])
        for _ in range(2):
            t0 = time.perf_counter()
            model(ids)
            best["prefill"] = max(best["prefill"], ids.shape[1] / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                           pad_token_id=0)
            total = time.perf_counter() - t0
            best["decode"] = max(best["decode"], (NEW_TOKENS - 1) / max(total - first, 1e-9))
    return best


def llama_cpp_run(gguf: Path) -> dict[str, float] | None:
    llama_cpp = common.llama_cpp()
    threads = torch.get_num_threads()
    llm = llama_cpp.Llama(str(gguf), n_ctx=1024, n_threads=threads, n_threads_batch=threads, n_batch=512,
                          verbose=False)
    ids = prompt_ids(lambda t: llm.tokenize(t.encode(), add_bos=True))
    return best_of(common.llama_cpp_round(llm, ids, NEW_TOKENS), common.llama_cpp_round(llm, ids, NEW_TOKENS))


def best_of(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: max(a[k], b[k]) for k in a}


def show(label: str, r: dict[str, float] | None, floor: float | None = None) -> None:
    if r is None:
        print(f"{label:<34} (not run)")
        return
    extra = f"   floor {floor:7.1f} tok/s" if floor else ""
    print(f"{label:<34} prefill {r['prefill']:8.1f} tok/s   decode {r['decode']:7.1f} tok/s{extra}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-gguf", action="store_true")
    parser.add_argument("--llama-cpp", action="store_true", help="measure llama.cpp on the same GGUF too")
    args = parser.parse_args()
    bandwidth = common.copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s, {torch.get_num_threads()} threads")
    results: dict[str, object] = {"copy_bandwidth_GBps": bandwidth / 1e9, "prompt_tokens": PROMPT_TOKENS,
                                  "new_tokens": NEW_TOKENS}
    bf16 = smollm.safetensors_copy(torch.bfloat16)
    ours = poot_run(bf16)
    peer = transformers_run(bf16)
    floor = bandwidth / 2 / ours["weight_bytes"]  # copy counts read+write; decode only reads the weights
    show("poot bf16 safetensors", ours, floor)
    show("transformers bf16 (same run)", peer)
    print(f"  poot/transformers: decode {ours['decode'] / peer['decode']:.2f}x, "
          f"prefill {ours['prefill'] / peer['prefill']:.2f}x")
    results["bf16"] = {"poot": ours, "transformers": peer, "floor_decode_tok_s": floor}
    if not args.skip_gguf:
        gguf = smollm.gguf_path()
        ours_q = poot_run(gguf)
        peer_q = llama_cpp_run(gguf) if args.llama_cpp else None
        if peer_q:  # a second round of each, alternating, so a slow spell of the machine hits both alike
            ours_q = best_of(ours_q, poot_run(gguf))
            peer_q = best_of(peer_q, llama_cpp_run(gguf))
        floor_q = bandwidth / 2 / ours_q["weight_bytes"]
        show("poot GGUF Q4_1", ours_q, floor_q)
        show("llama.cpp GGUF Q4_1 (same run)", peer_q)
        if peer_q:
            print(f"  poot/llama.cpp: decode {ours_q['decode'] / peer_q['decode']:.2f}x, "
                  f"prefill {ours_q['prefill'] / peer_q['prefill']:.2f}x")
        results["gguf_q4_1"] = {"poot": ours_q, "llama_cpp": peer_q, "floor_decode_tok_s": floor_q}
    print(f"wrote {common.write('cpu_decode', results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
