"""`poot generate`: flags, refusals before the checkpoint is read, streaming, conversation K/V reuse, the
context window and its memory, threads, --json and --verbose-prompt, Ctrl-C and broken pipes. The chat on a
terminal is in test_cli_chat.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import smollm
from helpers.paths import ROOT
from poot_core import Driver, DriverOptions, GenerateRequest, ModelHandle, open_executor

POOT = [sys.executable, "-m", "poot_core.cli.main"]


def poot(*args: str, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*POOT, *args], input=stdin, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return str(tiny_checkpoint("llama", torch.float32))


@pytest.fixture()
def broken(tmp_path):
    """A 'checkpoint' that fails the moment anything reads it: refusals must come first."""
    (tmp_path / "config.json").write_text("{not json")
    return str(tmp_path)


@pytest.mark.parametrize("flags,words", [
    (["--chat-template", "chatml"], "not a jinja template"),
    (["--chat-template-file", "/no/such/file.jinja"], "cannot read"),
    (["--chat-template", "{% for m in messages %}"], "does not compile"),
    (["--no-chat-template", "--chat-template", "{{ x }}"], "does not combine"),
    (["--chat-template", "{{ x }}", "--chat-template-file", "f"], "do not combine"),
    (["--conversation", "--no-chat-template"], "needs a chat template"),
    (["--system-prompt", "be brief", "--no-chat-template"], "does not combine"),
    (["--single-turn", "--no-conversation"], "does not combine"),
    (["--conversation", "--json"], "does not combine"),
    (["-n", "-5"], "-n must be"),
    (["-c", "-1"], "-c must be"),
    (["-t", "0"], "-t must be"),
    (["-tb", "-3"], "-tb must be"),
    (["-b", "0"], "-b must be"),
])
def test_refusals_come_before_the_checkpoint_is_read(broken, flags, words):
    out = poot("generate", "-m", broken, "-p", "hi", *flags)
    assert out.returncode != 0
    assert words in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1  # one line, no traceback


def test_conversation_needs_a_template(model, tmp_path):
    plain = tmp_path / "plain"
    shutil.copytree(model, plain)
    tc = json.loads((plain / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(tc))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    out = poot("generate", "-m", str(plain), "--conversation", stdin="hello\n")
    assert out.returncode != 0 and "ships none" in out.stderr


def test_prompt_that_does_not_fit_the_window_is_refused(model):
    out = poot("generate", "-m", model, "--no-chat-template", "-p", "hello world " * 40, "-n", "40", "-c", "48")
    assert out.returncode != 0 and "does not fit" in out.stderr


def test_greedy_output_streams_the_drivers_text(model):
    out = poot("generate", "-m", model, "--no-chat-template", "-p", "The capital of France is", "-n", "12",
               "--ignore-eos", "--backend", "cpu")
    assert out.returncode == 0, out.stderr
    handle = ModelHandle.load(model)
    driver = Driver(handle, open_executor("cpu"), DriverOptions(capacity=512, prefill_chunk=256)).serve()
    expected = driver.generate(GenerateRequest(handle.text().encode("The capital of France is"), 12,
                                               ignore_eos=True)).text
    assert out.stdout == expected + "\n"
    assert re.search(r"prefill: \d+ tokens .* decode: \d+ tokens", out.stderr)  # timings on by default
    quiet = poot("generate", "-m", model, "--no-chat-template", "-p", "x", "-n", "2", "--no-show-timings")
    assert "decode:" not in quiet.stderr


def test_conversation_second_turn_prefills_only_its_own_tokens(model):
    out = poot("generate", "-m", model, "--conversation", "-p", "Hello there!", "-n", "6", "--ignore-eos", "-v",
               stdin="Tell me more.\n")
    assert out.returncode == 0, out.stderr
    turns = re.findall(r"turn: (\d+) prompt tokens, (\d+) reused from the cache, (\d+) prefilled", out.stderr)
    assert len(turns) == 2
    (p1, r1, f1), (p2, r2, f2) = [tuple(map(int, t)) for t in turns]
    assert r1 == 0 and f1 == p1
    assert r2 >= p1 and f2 == p2 - r2 and f2 < p2 - p1 + 8  # only the new turn (and the reply's end marker)


def test_sampling_flags_and_seed_repeat(model):
    args = ["generate", "-m", model, "--no-chat-template", "-p", "Once upon", "-n", "10", "--ignore-eos",
            "--temp", "0.8", "--top-k", "20", "--top-p", "0.9", "--min-p", "0.05", "--repeat-penalty", "1.1",
            "-s", "42", "--no-show-timings"]
    a, b = poot(*args), poot(*args)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout


def test_reverse_prompt_stops(model):
    full = poot("generate", "-m", model, "--no-chat-template", "-p", "Once", "-n", "16", "--ignore-eos",
                "--no-show-timings").stdout.rstrip("\n")
    assert len(full) > 4
    stop = full[2:4]
    cut = poot("generate", "-m", model, "--no-chat-template", "-p", "Once", "-n", "16", "--ignore-eos",
               "-r", stop, "--no-show-timings").stdout.rstrip("\n")
    assert cut == full[: full.index(stop)]


def test_named_absent_backend_is_refused(model):
    out = poot("generate", "-m", model, "-p", "x", "-n", "1", "--backend", "rocm")
    assert out.returncode != 0 and "rocm" in out.stderr


def test_broken_pipe_exits_quietly(model):
    cmd = " ".join([*POOT, "generate", "-m", model, "--no-chat-template", "-p", "'Once upon'", "-n", "200",
                    "--ignore-eos", "--no-show-timings", "|", "head", "-c", "1"])
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, timeout=300)
    err = out.stderr.decode(errors="replace")
    assert "Traceback" not in err and "BrokenPipe" not in err


def test_ctrl_c_stops_cleanly_and_prints_timings():
    """A real model, so that generation is still running when the signal comes."""
    proc = subprocess.Popen([*POOT, "generate", "-m", str(smollm.gguf_path()), "--no-chat-template", "-p",
                             "Once upon a time", "-n", "1000", "-c", "2048", "--ignore-eos"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    proc.stdout.read(1)  # generation has started
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert "decode:" in err and "Traceback" not in err


def test_progress_bar_only_for_large_checkpoints_on_a_terminal(tmp_path):
    import io

    from poot_core.cli import progress

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    big = tmp_path / "model.gguf"
    with open(big, "wb") as f:
        f.truncate(progress.LARGE + 1)
    shown = Tty()
    assert progress.warm_with_progress(big, shown) and "loading [" in shown.getvalue()
    assert not progress.warm_with_progress(big, io.StringIO())  # not a terminal
    small = tmp_path / "small.gguf"
    small.write_bytes(b"x")
    assert not progress.warm_with_progress(small, Tty())


def _without_template(model: str, target) -> str:
    shutil.copytree(model, target)
    tc = json.loads((target / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (target / "tokenizer_config.json").write_text(json.dumps(tc))
    (target / "chat_template.jinja").unlink(missing_ok=True)
    return str(target)


def _with_window(model: str, target, window: int) -> str:
    """The tiny checkpoint with a config that claims a `window`-position context."""
    shutil.copytree(model, target)
    config = json.loads((target / "config.json").read_text())
    config["max_position_embeddings"] = window
    (target / "config.json").write_text(json.dumps(config))
    return str(target)


def test_system_prompt_needs_a_template(model, tmp_path):
    plain = _without_template(model, tmp_path / "plain")
    out = poot("generate", "-m", plain, "-p", "hi", "--system-prompt", "be brief", "-n", "1")
    assert out.returncode == 1 and "--system-prompt needs a chat template" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_single_turn_without_a_prompt_answers_the_first_line(model):
    for flags in (["--conversation", "--single-turn"], ["--single-turn"]):
        out = poot("generate", "-m", model, *flags, "-n", "3", "--ignore-eos", "-v", stdin="first\nsecond\n")
        assert out.returncode == 0, out.stderr
        assert len(re.findall(r"turn: \d+ prompt tokens", out.stderr)) == 1  # one reply, to "first"
        assert out.stdout.strip()


def _reference(model: str, prompt_ids: list[int], n: int, capacity: int = 512):
    handle = ModelHandle.load(model)
    driver = Driver(handle, open_executor("cpu"), DriverOptions(capacity=capacity, prefill_chunk=256)).serve()
    return driver.generate(GenerateRequest(prompt_ids, n, ignore_eos=True))


def test_json_prints_one_object_with_the_drivers_result(model):
    out = poot("generate", "-m", model, "--no-chat-template", "-p", "The capital of France is", "-n", "9",
               "--ignore-eos", "--json")
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.splitlines()) == 1
    result = json.loads(out.stdout)
    ids = ModelHandle.load(model).text().encode("The capital of France is")
    expected = _reference(model, ids, 9)
    assert result["text"] == expected.text and result["tokens"] == expected.tokens
    assert result["stop_reason"] == "length" and result["prompt_tokens"] == len(ids)
    assert result["timings"]["decode_tokens"] == 8 and result["timings"]["load_seconds"] > 0
    assert result["backend"] == "cpu" and result["context"] == 512


def test_verbose_prompt_shows_the_rendered_prompt_and_its_tokens(model):
    out = poot("generate", "-m", model, "-p", "Hello there", "-n", "1", "--verbose-prompt", "--no-show-timings")
    assert out.returncode == 0, out.stderr
    handle = ModelHandle.load(model)
    rendered = handle.text().render_chat_value([{"role": "user", "content": "Hello there"}])
    ids = handle.text().encode_chat(rendered)
    assert f"prompt: {rendered.text!r}" in out.stderr
    assert f"number of tokens in prompt = {len(ids)}" in out.stderr
    shown = [int(i) for i in re.findall(r"^ *(\d+) -> ", out.stderr, re.M)]
    assert shown == ids


def test_ignore_eos_generates_through_the_end_of_turn_marker():
    """SmolLM2's reply ends at <|im_end|>; with --ignore-eos it goes on for the -n asked."""
    gguf = str(smollm.gguf_path())
    args = ["generate", "-m", gguf, "-p", "Say hello.", "--json", "-c", "256", "-t", "1"]
    first = json.loads(poot(*args, "-n", "48").stdout)
    assert first["stop_reason"] in ("eos", "stop") and len(first["tokens"]) < 48
    through = json.loads(poot(*args, "-n", str(len(first["tokens"]) + 4), "--ignore-eos").stdout)
    assert through["stop_reason"] == "length" and len(through["tokens"]) == len(first["tokens"]) + 4
    assert through["text"].startswith(first["text"]) and "<|im_end|>" in through["text"]


def _kv_mib(stderr: str) -> tuple[float, int]:
    size, unit, positions = re.search(r"KV cache: ([\d.]+) (KiB|MiB|GiB) for (\d+) positions", stderr).groups()
    return float(size) * {"KiB": 2**-10, "MiB": 1, "GiB": 2**10}[unit], int(positions)


def test_default_context_is_4096_capped_at_the_models_window(model, tmp_path):
    config = json.loads((Path(model) / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    # float32 K and V per layer, per KV head, per position: the CPU executor's cache
    per_position = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 4
    long = _with_window(model, tmp_path / "long", 32768)
    for path, flags, expected in ((long, [], 4096), (model, [], 512), (long, ["-c", "0"], 32768),
                                  (long, ["-c", "1000"], 1000)):
        out = poot("generate", "-m", path, "--no-chat-template", "-p", "hi", "-n", "1", "-v", *flags)
        assert out.returncode == 0, out.stderr
        assert f"context {expected} of the model's" in out.stderr
        mib, positions = _kv_mib(out.stderr)
        assert positions == expected and mib == pytest.approx(per_position * expected / 2**20, rel=1e-3)
    out = poot("generate", "-m", model, "-p", "hi", "-c", "1024")
    assert out.returncode == 1 and "larger than the model's window of 512" in out.stderr


def test_a_window_that_does_not_fit_in_memory_is_refused_before_it_is_allocated(model, tmp_path):
    huge = _with_window(model, tmp_path / "huge", 2**31)
    start = time.perf_counter()
    out = poot("generate", "-m", huge, "--no-chat-template", "-p", "hi", "-n", "1", "-c", "0")
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1
    assert re.search(r"-c 2147483648 needs a KV cache of [\d.]+ GiB .* available; give -c \d+ or less", out.stderr)
    assert time.perf_counter() - start < 120  # refused, not allocated and paged


def test_load_time_and_context_full_show_without_verbose(model):
    out = poot("generate", "-m", model, "--no-chat-template", "-p", "hi", "-c", "24", "--ignore-eos")
    assert out.returncode == 0, out.stderr
    assert "context full" in out.stderr and re.search(r"load: [\d.]+ s \| prefill", out.stderr)


def test_sampling_flags_under_greedy_decoding_warn(model):
    out = poot("generate", "-m", model, "--no-chat-template", "-p", "hi", "-n", "1", "--top-k", "5", "-s", "3")
    assert out.returncode == 0
    assert "warning: --top-k, -s have no effect at --temp 0" in out.stderr


def test_an_encoder_checkpoint_is_refused_with_what_to_use():
    from helpers.encoders import minilm_path

    out = poot("generate", "-m", str(minilm_path()), "-p", "hi", "-n", "1")
    assert out.returncode == 1 and "encoder model" in out.stderr and "poot embed" in out.stderr
    assert "StepShape" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_threads_set_the_cpu_thread_count_for_prefill_and_decode(model, monkeypatch, capsys):
    """-tb while the prompt is prefilled, -t while tokens are decoded: the count every CPU kernel reads."""
    from poot_core.cli.main import main
    from poot_core.cpu.executor import CpuProgram

    seen: list[tuple[int, int]] = []
    run = CpuProgram.run

    def spy(self, state, inputs):
        seen.append((int(inputs["tokens"].shape[1]), torch.get_num_threads()))
        return run(self, state, inputs)

    monkeypatch.setattr(CpuProgram, "run", spy)
    before = torch.get_num_threads()
    try:
        rc = main(["generate", "-m", model, "--no-chat-template", "-p", "hello world", "-n", "4", "--ignore-eos",
                   "-t", "1", "-tb", "3", "--backend", "cpu"])
    finally:
        torch.set_num_threads(before)
    assert rc == 0, capsys.readouterr().err
    assert seen[0][0] > 1 and {t for n, t in seen if n > 1} == {3}
    assert len([n for n, _ in seen if n == 1]) == 3 and {t for n, t in seen if n == 1} == {1}


MEASURE = r"""
import json, sys
import torch
from poot_core.cli.main import main

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

torch.ones(64, 64) @ torch.ones(64, 64)  # torch's compute libraries are in before the baseline
before = status("VmRSS")
rc = main(["generate", "-m", sys.argv[1], "--no-chat-template", "-p", "Once upon a time", "-n", "8", "--ignore-eos",
           "--backend", "cpu", "--no-show-timings", *sys.argv[2:]])
print("\n" + json.dumps({"rc": rc, "grown": status("VmHWM") - before}))
"""


def test_resident_memory_with_defaults_on_a_32k_window_model(tmp_path):
    """The weights plus the default 4096-position KV cache, within 1.2x: not a cache for the whole 32k."""
    from gguf import GGUFReader

    from helpers.gguf_edit import gguf_copy

    path = gguf_copy(smollm.gguf_path(), tmp_path / "long.gguf", **{"llama.context_length": 32768})
    meta = GGUFReader(path).fields

    def value(key: str) -> int:
        return int(meta[key].parts[meta[key].data[0]][0])

    head_dim = value("llama.embedding_length") // value("llama.attention.head_count")
    per_position = value("llama.block_count") * 2 * value("llama.attention.head_count_kv") * head_dim * 4  # f32 K, V
    weights = path.stat().st_size
    bound = 1.2 * (weights + 4096 * per_position)
    assert weights + 32768 * per_position > bound  # a cache for the whole window would break it
    out = subprocess.run([sys.executable, "-c", MEASURE, str(path), "-t", "1"], capture_output=True, text=True,
                         timeout=600)
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    assert measured["rc"] == 0, out.stderr
    # the peak resident memory the run added: the weights' mapped pages, the KV cache, everything else
    assert measured["grown"] <= bound, (measured, bound)


def test_the_readme_python_example_runs_as_it_says(tmp_path):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    assert 'scripts/default_model.py' in code  # it says where its model comes from
    example = tmp_path / "example.py"
    example.write_text(code)
    out = subprocess.run([sys.executable, str(example), str(smollm.gguf_path())], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert re.search(r"(eos|stop|length) [\d.]+ tok/s$", out.stdout.strip())
