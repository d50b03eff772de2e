"""Speculative decoding on the CPU: SmolLM2-135M-Instruct bf16 (the safetensors copy) with each draft policy
beside no speculation, in the same run, on input-grounded tasks (rewrite a given code file with a small edit;
answer with quotes from a given text) and an open-ended one. Draft model: the packaged GGUF Q4_1 file.

  python bench/speculative.py [--new 160] [--repeats 2] [--threads 1] [--serving-only]

Prints, per task and policy, decode tok/s (proposals and draft-model steps included), the ratio to no
speculation, acceptance rate, and whether the text is identical (greedy: it must be). Then the serving engine
(Layout.PAGED): the three tasks as one batch, and the code edit alone, with prompt lookup beside no
speculation: output tok/s of the whole batch (prefill included), acceptance, identical text. Writes
bench/results/speculative.json. Targets: prompt lookup >= 2x on the input-grounded tasks and <= 5% slower on
the open-ended one; the draft-model pairing faster than bf16 alone.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import common  # noqa: E402
from helpers import smollm  # noqa: E402
from poot_core import Driver, DriverOptions, GenerateRequest, Layout, ModelHandle, open_executor  # noqa: E402
from poot_core.driver.speculation import DraftPolicy  # noqa: E402

CODE = '''import json
from dataclasses import dataclass


@dataclass
class Item:
    name: str
    price: float
    quantity: int


def load_items(path):
    with open(path) as f:
        data = json.load(f)
    return [Item(d["name"], d["price"], d["quantity"]) for d in data]


def compute_total(items):
    total = 0.0
    for item in items:
        total += item.price * item.quantity
    return total


def most_expensive(items):
    best = None
    for item in items:
        if best is None or item.price > best.price:
            best = item
    return best


def main():
    items = load_items("items.json")
    print("Total:", compute_total(items))
    print("Most expensive:", most_expensive(items).name)


if __name__ == "__main__":
    main()
'''

TEXT = ("The lighthouse at Skerry Point was built in 1852 by the engineer Thomas Reid. For forty years its lamp "
        "burned whale oil, until a paraffin burner replaced it in 1892. The keeper, Margaret Lowe, kept a daily "
        "log of every ship that passed. In the great storm of 1901 she rowed out alone and brought back eleven "
        "sailors from the wreck of the Northern Star. The lighthouse was automated in 1968, and today it is a "
        "museum where visitors can read her log.")

TASKS = {
    "code_edit": ("input-grounded", "Add a one-line docstring to each function of this Python file and output "
                                    f"the whole file:\n\n```python\n{CODE}```"),
    "quotes": ("input-grounded", f"Read this text:\n\n{TEXT}\n\nAnswer with exact quotes from the text: who built "
                                 "the lighthouse, what did Margaret Lowe do in 1901, and what is it today?"),
    "story": ("open-ended", "Write a short story about a robot who learns to paint."),
}


def prompt_ids(handle: ModelHandle, message: str) -> tuple[list[int], list[str]]:
    rendered = handle.text().render_chat_value([{"role": "user", "content": message}])
    return handle.text().encode_chat(rendered), list(rendered.stops)


def run(driver: Driver, ids: list[int], stops: list[str], new: int) -> dict[str, Any]:
    driver.reset()
    g = driver.generate(GenerateRequest(ids, max_new=new, stops=stops))
    t = g.timings
    return {"text": g.text, "tokens": len(g.tokens), "decode_tok_s": t.decode_tok_s,
            "total_tok_s": len(g.tokens) / (t.prefill_seconds + t.decode_seconds), "proposed": t.proposed,
            "accepted": t.accepted, "acceptance_rate": t.acceptance_rate, "verify_steps": t.verify_steps}


def serving(target: ModelHandle, ex: Any, new: int, repeats: int) -> dict[str, Any]:
    """The paged engine with and without prompt lookup: every task in one batch, then the first task alone."""
    import time

    prompts = [prompt_ids(target, message) for _, message in TASKS.values()]
    options = dict(capacity=1024, prefill_chunk=256, kv_blocks=256, max_running=8)
    engines = {name: Driver(target, ex, DriverOptions(**options, draft=p)).serve(Layout.PAGED)
               for name, p in (("off", DraftPolicy.OFF), ("lookup", DraftPolicy.PromptLookup()))}
    out: dict[str, Any] = {}
    for case, batch in (("batch_3", prompts), ("alone_code_edit", prompts[:1])):
        best: dict[str, dict[str, Any]] = {}
        for _ in range(repeats):
            for name, engine in engines.items():
                requests = [GenerateRequest(ids, max_new=new, stops=stops) for ids, stops in batch]
                before = engine.speculation.counters.accepted if engine.speculation else 0
                proposed = engine.speculation.counters.proposed if engine.speculation else 0
                t0 = time.perf_counter()
                gens = engine.generate_batch(requests)
                seconds = time.perf_counter() - t0
                c = engine.speculation.counters if engine.speculation else None
                r = {"tok_s": sum(len(g.tokens) for g in gens) / seconds, "texts": [g.text for g in gens],
                     "proposed": c.proposed - proposed if c else 0, "accepted": c.accepted - before if c else 0}
                if name not in best or r["tok_s"] > best[name]["tok_s"]:
                    best[name] = r
        for r in best.values():
            r["speedup"] = r["tok_s"] / best["off"]["tok_s"]
            r["identical"] = r["texts"] == best["off"]["texts"]
        out[case] = best
        print(f"serving {case}:")
        for name, r in best.items():
            print(f"  {name:11s} {r['tok_s']:7.1f} tok/s  {r['speedup']:5.2f}x  accepted "
                  f"{r['accepted']}/{r['proposed']}  identical={r['identical']}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, default=160, help="most new tokens per task")
    ap.add_argument("--repeats", type=int, default=2, help="rounds over all policies; the best of each kept")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch's CPU threads (on a loaded machine 1 is steadier than one per core)")
    ap.add_argument("--serving-only", action="store_true", help="only the serving engine's part")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = ModelHandle.load(smollm.safetensors_copy(torch.bfloat16))
    draft = ModelHandle.load(smollm.gguf_path())
    ex = open_executor("cpu")
    if args.serving_only:
        served = serving(target, ex, args.new, args.repeats)
        path = common.write("speculative_serving", {"target": "SmolLM2-135M-Instruct bf16", "new_tokens": args.new,
                                                    "load_average": os.getloadavg(), "serving": served})
        print(f"wrote {path}")
        return
    policies = {"off": DraftPolicy.OFF, "lookup": DraftPolicy.PromptLookup(),
                "draft_q4_1": DraftPolicy.DraftModel(draft)}
    options = dict(capacity=1024, prefill_chunk=256)
    drivers = {name: Driver(target, ex, DriverOptions(**options, draft=p)).serve() for name, p in policies.items()}
    for d in drivers.values():  # warm-up: the verify programs of every width are prepared here
        d.generate(GenerateRequest(prompt_ids(target, "Say hi.")[0] * 3, max_new=24))

    results: dict[str, Any] = {}
    for task, (kind, message) in TASKS.items():
        ids, stops = prompt_ids(target, message)
        best: dict[str, dict[str, Any]] = {}
        for _ in range(args.repeats):  # policies interleaved, so that the machine's load hits each alike
            for name, driver in drivers.items():
                r = run(driver, ids, stops, args.new)
                if name not in best or r["decode_tok_s"] > best[name]["decode_tok_s"]:
                    best[name] = r
        off = best["off"]
        for r in best.values():
            r["speedup"] = r["decode_tok_s"] / off["decode_tok_s"]
            r["identical"] = r["text"] == off["text"]
        results[task] = {"kind": kind, "prompt_tokens": len(ids), "policies": best}
        print(f"{task} ({kind}, {len(ids)} prompt tokens, {off['tokens']} new):")
        for name, r in best.items():
            print(f"  {name:11s} {r['decode_tok_s']:7.1f} tok/s  {r['speedup']:5.2f}x  accepted "
                  f"{r['accepted']}/{r['proposed']} ({100 * r['acceptance_rate']:.0f}%)  identical={r['identical']}")
    served = serving(target, ex, args.new, args.repeats)
    load = os.getloadavg()
    path = common.write("speculative", {"target": "SmolLM2-135M-Instruct bf16", "draft": "SmolLM2 GGUF Q4_1",
                                        "new_tokens": args.new, "load_average": load, "tasks": results,
                                        "serving": served})
    print(f"load average {load[0]:.1f}; wrote {path}")


if __name__ == "__main__":
    main()
