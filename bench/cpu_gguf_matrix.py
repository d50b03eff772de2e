"""CPU decode and prefill of poot beside llama.cpp on the GGUF file types people download, file by file.

  python bench/cpu_gguf_matrix.py                        # both models, all 14 types (tens of minutes)
  python bench/cpu_gguf_matrix.py --quick --types Q4_K_M,Q5_0 --models smollm2

The files are made here, once, into .cache/bench/<model>/<TYPE>.gguf: a float32 Hugging Face checkpoint is
converted by llama.cpp's own convert_hf_to_gguf.py (unpacked by scripts/fetch_test_data.py) to an F32 GGUF,
then written in each type by llama.cpp's quantizer (llama_cpp.llama_model_quantize), so each file holds the
mix of block types llama.cpp chooses for it. Two models:

  smollm2    SmolLM2-135M-Instruct, real weights: the float32 copy tests/helpers/smollm.py makes (hidden 576: most
             rows are not a multiple of 256, so llama.cpp falls back from K-quants to Q5_0/Q5_1/Q8_0/IQ4_NL)
  llama2048  a random llama (seed 0): hidden 2048, intermediate 5632, 4 layers, 32 heads / 4 K/V heads,
             vocab 32000 (llama's SentencePiece vocabulary from llama.cpp's test data), untied head: every
             row a multiple of 256, so the K-quants apply everywhere; 4 layers keep the run to minutes

Per file, poot and llama.cpp each run in a worker process of their own (so one's memory and threads do not
count against the other), with the same thread count and the same prompt ids: one warm-up, then rounds
alternating between the two, best of each. Printed: decode tok/s (new tokens after the prompt) and prefill
tok/s of the prompt (512 tokens; --quick: 128 and 16 new tokens), their ratios, the memory floor (file bytes
over half the measured copy bandwidth: a copy reads and writes, decode only reads), poot's resident memory
after load and warm-up against the file size, the block types each file really holds, and the machine's
load average beside each file (the development machine is shared: figures under load are noisy). JSON goes to
bench/results/cpu_gguf_matrix.json (--quick: cpu_gguf_matrix_quick.json; --cpu-activations q8 adds _q8: poot
loads with LoadOptions(cpu_activations="q8"), llama.cpp is unchanged).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for extra in (HERE, ROOT / "tests", ROOT / "scripts"):
    sys.path.insert(0, str(extra))

from cpu_decode import prompt_ids  # noqa: E402  (the text cpu_decode.py measures, at most 512 tokens)

import common  # noqa: E402

CACHE = ROOT / ".cache" / "bench"
TYPES = ("F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_0", "Q4_K_M", "Q4_K_S", "Q4_0", "Q3_K_M", "Q2_K",
         "IQ4_XS", "IQ4_NL")
MODELS = ("smollm2", "llama2048")
LLAMA2048 = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 4, "num_attention_heads": 32,
             "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
             "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
CAPACITY = 1024


# ---- making the files -------------------------------------------------------------------------------------

def _hf_checkpoint(model: str) -> Path:
    """The float32 Hugging Face checkpoint a model's files are made from."""
    import torch

    if model == "smollm2":
        from helpers import smollm

        return smollm.safetensors_copy(torch.float32)
    target = CACHE / model / "hf"
    if (target / ".complete").exists():
        return target
    import fetch_test_data
    import transformers as tf

    fetch_test_data.main()
    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA2048)).save_pretrained(target)
    # transformers builds llama's tokenizer from llama.cpp's test vocabulary (32000 SentencePiece pieces)
    tokenizer = tf.AutoTokenizer.from_pretrained(fetch_test_data.DEST / "vocab", gguf_file="ggml-vocab-llama-spm.gguf")
    tokenizer.save_pretrained(target)
    (target / ".complete").write_text("ok\n")
    return target


def _run_quiet(cmd: list[str], what: str) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{what} failed ({out.returncode}):\n{(out.stdout + out.stderr)[-4000:]}")


def _base_gguf(model: str) -> Path:
    """The model as an F32 GGUF written by llama.cpp's converter: the source of every quantized file."""
    path = CACHE / model / "F32.gguf"
    if path.exists():
        return path
    import fetch_test_data

    fetch_test_data.main()
    converter = fetch_test_data.DEST / "convert" / "convert_hf_to_gguf.py"
    source = _hf_checkpoint(model)
    print(f"converting {source} to {path} ...", file=sys.stderr, flush=True)
    partial = path.with_suffix(".part")
    partial.parent.mkdir(parents=True, exist_ok=True)
    _run_quiet([sys.executable, str(converter), str(source), "--outtype", "f32", "--outfile", str(partial)],
               "convert_hf_to_gguf.py")
    partial.rename(path)
    return path


def gguf_file(model: str, file_type: str, threads: int) -> Path:
    path = CACHE / model / f"{file_type}.gguf"
    if not path.exists():
        base = _base_gguf(model)
        print(f"quantizing {path} ...", file=sys.stderr, flush=True)
        partial = path.with_suffix(".part")
        _run_quiet([sys.executable, __file__, "--quantize", str(base), str(partial), file_type,
                    "--threads", str(threads)], f"quantizing to {file_type}")
        partial.rename(path)
    return path


def _quantize(src: str, dst: str, file_type: str, threads: int) -> int:
    llama_cpp = common.llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{file_type}")
    return llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))


def tensor_mix(path: Path) -> dict[str, Any]:
    """Bytes and tensor counts per block type as stored in the file, and the types of the embedding and head."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    by_type: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    named: dict[str, str] = {}
    for t in reader.tensors:
        by_type[t.tensor_type.name][0] += 1
        by_type[t.tensor_type.name][1] += int(t.n_bytes)
        named[t.name] = t.tensor_type.name
    total = sum(b for _, b in by_type.values())
    return {"types": {k: {"tensors": n, "bytes": b, "share": b / total}
                      for k, (n, b) in sorted(by_type.items(), key=lambda kv: -kv[1][1])},
            "token_embd": named.get("token_embd.weight"), "output": named.get("output.weight", "tied")}


def mix_text(mix: dict[str, Any]) -> str:
    parts = [f"{k} {v['share']:.0%} ({v['tensors']})" for k, v in mix["types"].items()]
    return ", ".join(parts) + f"; embedding {mix['token_embd']}, head {mix['output']}"


# ---- the workers: one process per engine and file, driven over stdin/stdout by JSON lines ------------------

def _serve(engine: str, path: Path, threads: int, out: IO[str], activations: str = "exact") -> None:
    if engine == "poot":
        import torch

        torch.set_num_threads(threads)
        import poot_core.cpu.executor  # noqa: F401  (code paged in is not load memory)
        from poot_core import Driver, DriverOptions, LoadOptions, ModelHandle, open_executor

        before = common.anonymous_bytes()
        handle = ModelHandle.load(path, options=LoadOptions(cpu_activations=activations))
        driver = Driver(handle, open_executor("cpu"), DriverOptions(capacity=CAPACITY, prefill_chunk=512)).serve()
        ids = prompt_ids(handle.text().encode)
        loaded = common.anonymous_bytes() - before

        def round_(ids: list[int], new: int) -> dict[str, float]:
            return common.poot_round(driver, ids, new)
    else:
        llama_cpp = common.llama_cpp()
        before = common.anonymous_bytes()
        llm = llama_cpp.Llama(str(path), n_ctx=CAPACITY, n_threads=threads, n_threads_batch=threads, n_batch=512,
                              verbose=False)
        ids = prompt_ids(lambda t: llm.tokenize(t.encode(), add_bos=True))
        loaded = common.anonymous_bytes() - before

        def round_(ids: list[int], new: int) -> dict[str, float]:
            return common.llama_cpp_round(llm, ids, new)

    def send(payload: dict[str, Any]) -> None:
        out.write(json.dumps(payload) + "\n")
        out.flush()

    send({"ids": ids})
    for line in sys.stdin:
        cmd = json.loads(line)
        reply: dict[str, Any] = round_(cmd["ids"], cmd["new"])
        if cmd.get("memory"):
            reply["anonymous_bytes"] = common.anonymous_bytes() - before
            reply["anonymous_loaded_bytes"] = loaded
            reply["mapped_bytes"] = common.mapped_bytes(path)
        send(reply)


class Worker:
    def __init__(self, engine: str, path: Path, threads: int, activations: str = "exact") -> None:
        self.engine = engine
        self.log = tempfile.TemporaryFile(mode="w+")
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", engine, str(path), "--threads",
                                      str(threads), "--cpu-activations", activations],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env)

    def receive(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.log.seek(0)
            raise RuntimeError(f"{self.engine} worker ended ({self.proc.returncode}):\n{self.log.read()[-4000:]}")
        return json.loads(line)

    def round(self, ids: list[int], new: int, memory: bool = False) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"ids": ids, "new": new, "memory": memory}) + "\n")
        self.proc.stdin.flush()
        return self.receive()

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait()
        self.log.close()


def measure(path: Path, threads: int, prompt_tokens: int, new_tokens: int, rounds: int,
            activations: str = "exact") -> dict[str, Any]:
    bandwidth = common.copy_bandwidth()
    workers = {e: Worker(e, path, threads, activations) for e in ("poot", "llama_cpp")}  # both load at once
    try:
        ids = workers["poot"].receive()["ids"][:prompt_tokens]
        workers["llama_cpp"].receive()
        # warm-up: the full prompt once (traces poot's prefill shape, pages in the file), memory read after it
        memory = {e: w.round(ids, 4, memory=True) for e, w in workers.items()}
        best: dict[str, dict[str, float]] = {e: {"prefill": 0.0, "decode": 0.0} for e in workers}
        for _ in range(rounds):
            for e, w in workers.items():
                r = w.round(ids, new_tokens)
                best[e] = {k: max(best[e][k], r[k]) for k in best[e]}
    finally:
        for w in workers.values():
            w.close()
    size = path.stat().st_size
    return {"file_bytes": size, "copy_bandwidth_GBps": bandwidth / 1e9,
            "floor_decode_tok_s": bandwidth / 2 / size, "prompt_tokens": len(ids),
            **{e: {**best[e], **{k: v for k, v in memory[e].items() if k.endswith("_bytes")}} for e in workers},
            "decode_ratio": best["poot"]["decode"] / best["llama_cpp"]["decode"],
            "prefill_ratio": best["poot"]["prefill"] / best["llama_cpp"]["prefill"]}


HEADER = (f"{'type':<7} {'MiB':>6} {'floor':>6} | {'decode poot':>11} {'llama':>7} {'ratio':>6} | "
          f"{'prefill poot':>12} {'llama':>7} {'ratio':>6} | load")


def row(file_type: str, r: dict[str, Any]) -> str:
    p, q = r["poot"], r["llama_cpp"]
    return (f"{file_type:<7} {r['file_bytes'] / 2**20:6.1f} {r['floor_decode_tok_s']:6.0f} | "
            f"{p['decode']:11.1f} {q['decode']:7.1f} {r['decode_ratio']:5.2f}x | "
            f"{p['prefill']:12.1f} {q['prefill']:7.1f} {r['prefill_ratio']:5.2f}x")


def memory_text(r: dict[str, Any]) -> str:
    def one(m: dict[str, Any]) -> str:
        mib = 2**20
        return (f"{(m['mapped_bytes'] + m['anonymous_bytes']) / r['file_bytes']:.2f}x the file "
                f"(mapped {m['mapped_bytes'] / mib:.0f} + anonymous {m['anonymous_bytes'] / mib:.0f} MiB, "
                f"{m['anonymous_loaded_bytes'] / mib:.0f} of it before the first step)")

    return f"poot {one(r['poot'])}; llama.cpp {one(r['llama_cpp'])}"


def _code_state() -> str:
    """The commit measured, and whether the working tree had changes (the tree is shared while people work)."""
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + (" with uncommitted changes" if git("status", "--porcelain") else "")


def _names(value: str, allowed: tuple[str, ...]) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {','.join(allowed)}")
    return names


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", type=lambda v: _names(v, TYPES), default=list(TYPES), help="comma-separated")
    parser.add_argument("--models", type=lambda v: _names(v, MODELS), default=list(MODELS), help="comma-separated")
    parser.add_argument("--quick", action="store_true", help="128-token prompt, 16 new tokens")
    parser.add_argument("--new-tokens", type=int, help="decode this many tokens (default 128, --quick 16)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per engine (best of them)")
    parser.add_argument("--threads", type=int, default=2, help="threads of each engine")
    parser.add_argument("--cpu-activations", choices=("exact", "q8"), default="exact",
                        help="poot's LoadOptions(cpu_activations=...): q8 quantizes decode activations as llama.cpp")
    parser.add_argument("--prepare", action="store_true", help="only make the files and print their block types")
    parser.add_argument("--serve", nargs=2, metavar=("ENGINE", "GGUF"), help=argparse.SUPPRESS)  # a worker
    parser.add_argument("--quantize", nargs=3, metavar=("SRC", "DST", "TYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quantize:
        return _quantize(*args.quantize, args.threads)
    if args.serve:
        out = os.fdopen(os.dup(1), "w")  # the protocol's channel; anything else printed goes to stderr
        os.dup2(2, 1)
        _serve(args.serve[0], Path(args.serve[1]), args.threads, out, args.cpu_activations)
        return 0

    prompt_tokens, new_tokens = (128, 16) if args.quick else (512, 128)
    new_tokens = args.new_tokens or new_tokens
    results: dict[str, Any] = {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "rounds": args.rounds,
                               "engine_threads": args.threads, "cpu_activations": args.cpu_activations,
                               "llama2048": LLAMA2048, "code": _code_state(),
                               "models": {}}
    name = "cpu_gguf_matrix_quick" if args.quick else "cpu_gguf_matrix"
    if args.cpu_activations != "exact":
        name += f"_{args.cpu_activations}"
    t0 = time.perf_counter()
    for model in args.models:
        files = {t: gguf_file(model, t, args.threads) for t in args.types}  # all made before any timing
        if args.prepare:
            print(f"{model}:")
            for file_type, path in files.items():
                print(f"  {file_type:<7} {path.stat().st_size / 2**20:7.1f} MiB  {mix_text(tensor_mix(path))}")
            continue
        print(f"\n{model}: poot cpu_activations={args.cpu_activations}; prompt {prompt_tokens} tokens, "
              f"{new_tokens} new, {args.threads} threads each, "
              f"best of {args.rounds} alternating rounds; floor = decode tok/s at half the copy bandwidth")
        print(HEADER, flush=True)
        entries: dict[str, Any] = results["models"].setdefault(model, {})
        for file_type, path in files.items():
            started = time.perf_counter()
            entries[file_type] = {**measure(path, args.threads, prompt_tokens, new_tokens, args.rounds,
                                            args.cpu_activations),
                                  "mix": tensor_mix(path)}
            entries[file_type]["seconds"] = time.perf_counter() - started
            entries[file_type]["load_average_1min"] = os.getloadavg()[0]  # others' work on a shared machine
            print(f"{row(file_type, entries[file_type])} | {os.getloadavg()[0]:4.1f}", flush=True)
            common.write(name, results)  # after each file: a long run stopped half-way keeps what it measured
        for kind in ("decode", "prefill"):
            below = [f"{t} {e[kind + '_ratio']:.2f}x" for t, e in entries.items() if e[kind + "_ratio"] < 1.0]
            print(f"{kind} below llama.cpp: {', '.join(below) or 'none'}")
        print("resident memory after load and the warm-up prompt (anonymous includes the K/V cache written):")
        for file_type, entry in entries.items():
            print(f"  {file_type:<7} {memory_text(entry)}")
        print("block types by bytes (tensor count):")
        for file_type, entry in entries.items():
            print(f"  {file_type:<7} {mix_text(entry['mix'])}")
    if not args.prepare:
        print(f"\n{time.perf_counter() - t0:.0f} s; wrote {common.write(name, results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
