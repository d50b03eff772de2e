"""`poot generate --conversation` on a terminal, driven through a pseudo-terminal as a user types: the banner,
the `> ` prompt, line editing and history (readline), multi-line turns, Ctrl-C mid-reply (the conversation
goes on), Ctrl-C at the prompt and Ctrl-D, the commands, context full. Piped stdin is in test_cli_generate.py."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import termios
import time

import pytest
import torch

from helpers import smollm

POOT = [sys.executable, "-m", "poot_core.cli.main", "generate"]


class Terminal:
    """A poot process whose stdin, stdout and stderr are a pseudo-terminal it has as its controlling
    terminal, so that Ctrl-C typed there is a SIGINT from the terminal, as for a user."""

    def __init__(self, *args: str) -> None:
        master, slave = pty.openpty()
        env = {**os.environ, "TERM": "dumb", "INPUTRC": "/dev/null", "PYTHONUNBUFFERED": "1",
               "PYTHONFAULTHANDLER": "1"}  # Python stacks on SIGABRT, for a hang (see wait)
        self.proc = subprocess.Popen([*POOT, *args], stdin=slave, stdout=slave, stderr=slave, env=env,
                                     start_new_session=True, preexec_fn=_take_terminal, close_fds=True)
        os.close(slave)
        self.fd = master
        self.seen = b""  # everything the terminal showed
        self._pending = b""

    def expect(self, pattern: str, timeout: float = 240) -> str:
        """Wait until the output shows `pattern` (a regex); returns the output up to its end."""
        end = time.monotonic() + timeout
        regex = re.compile(pattern.encode(), re.S)
        while True:
            found = regex.search(self._pending)
            if found:
                text, self._pending = self._pending[: found.end()], self._pending[found.end():]
                return text.decode(errors="replace")
            if time.monotonic() > end or not self._read(min(1.0, end - time.monotonic())):
                if time.monotonic() > end or self.proc.poll() is not None:
                    raise AssertionError(f"no {pattern!r} on the terminal; it shows:\n"
                                         f"{self.seen.decode(errors='replace')}")

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], max(timeout, 0))
        if not ready:
            return self.proc.poll() is None
        try:
            chunk = os.read(self.fd, 65536)
        except OSError:  # the other end closed
            return False
        self.seen += chunk
        self._pending += chunk
        return bool(chunk)

    def type(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def type_when_reading(self, keys: str, timeout: float = 60) -> None:
        """Type `keys` once the chat is blocked reading the terminal. The prompt is printed before readline
        switches the terminal's mode and waits: a Ctrl-D typed in that gap is taken by the terminal's line
        editing (an end of file readline never sees), and a Ctrl-C whose signal lands before readline's wait
        is only acted on after the next key (CPython's readline checks signals when its wait is interrupted).
        Either way the chat would wait for input forever. Linux names the wait in /proc/PID/wchan."""
        end = time.monotonic() + timeout
        wchan = f"/proc/{self.proc.pid}/wchan"
        while os.path.exists(wchan) and time.monotonic() < end:
            with open(wchan) as f:
                where = f.read()
            if "poll" in where or "select" in where:
                break
            time.sleep(0.02)
        self.type(keys)

    def wait(self, timeout: float = 240) -> int:
        end = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < end:
            self._read(0.2)
        if self.proc.poll() is None:
            raise AssertionError(f"the chat did not exit within {timeout:.0f} s; where it waits:\n{self._stacks()}\n"
                                 f"the terminal showed:\n{self.seen.decode(errors='replace')}")
        return self.proc.wait()

    def _stacks(self) -> str:
        """The hung process's native stacks (gdb, where installed), then its Python stacks (faulthandler,
        enabled in the child, prints them on SIGABRT)."""
        native = ""
        if shutil.which("gdb"):
            run = subprocess.run(["gdb", "-p", str(self.proc.pid), "-batch", "-ex", "thread apply all bt"],
                                 capture_output=True, text=True, timeout=120)
            native = run.stdout[-20000:]
        self.proc.send_signal(signal.SIGABRT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self._read(1.0)
        return native

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.fd)


def _take_terminal() -> None:
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


@pytest.fixture()
def terminal():
    opened: list[Terminal] = []

    def start(*args: str) -> Terminal:
        opened.append(Terminal(*args))
        return opened[-1]

    yield start
    for t in opened:
        t.close()


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return str(tiny_checkpoint("llama", torch.float32))


def test_chat_on_a_terminal(terminal, tmp_path):
    """SmolLM2, as a user would: a short turn, history, a long turn stopped with Ctrl-C, a two-line turn
    (the conversation went on), Ctrl-D. No timings in the dialogue unless asked for."""
    saved = tmp_path / "chat.json"
    t = terminal("-m", str(smollm.gguf_path()), "--conversation", "-c", "1024", "-n", "400", "-t", "1")
    banner = t.expect(r"\n> ")
    assert re.search(r"poot \S+: SmolLM2-135M-Instruct\.Q4_1\.gguf \(llama\) on cpu, context 1024", banner)
    assert "Ctrl-D" in banner and "Ctrl-C" in banner
    t.type("Say hi.\r")
    t.expect(r"Say hi\.\r?\n")
    first = t.expect(r"\n> ")
    assert first.strip("\r\n> ")  # a reply, then the prompt again
    t.type("\x10")  # Ctrl-P: the previous line from the history
    t.expect(r"Say hi\.")
    t.type("\x15Write a long story about a dragon named Ember.\r")  # Ctrl-U clears the recalled line first
    t.expect(r"Ember\.\r?\n.{40}")  # the reply is under way
    t.type("\x03")
    t.expect(r"\[stopped\]")
    t.expect(r"\n> ")
    t.type("Thanks!\\\r")  # a line ending in \ goes on on the next
    t.type("Now say bye.\r")
    t.expect(r"Now say bye\.\r?\n")
    t.expect(r"\n> ")
    t.type(f"/save {saved}\r")
    t.expect(r"\[saved 6 messages")
    t.expect(r"\n> ")
    t.type_when_reading("\x04")
    assert t.wait() == 0
    messages = json.loads(saved.read_text())["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] * 3
    assert messages[0]["content"] == "Say hi." and messages[4]["content"] == "Thanks!\nNow say bye."
    assert messages[3]["content"].strip()  # what was generated before Ctrl-C stays in the conversation
    shown = t.seen.decode(errors="replace")
    assert "decode:" not in shown and "Traceback" not in shown


def test_commands_timings_and_ctrl_c_at_the_prompt(terminal, tiny, tmp_path):
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"messages": [{"role": "user", "content": "What is 2+2?"},
                                                {"role": "assistant", "content": "4."}]}))
    out, after_reset = tmp_path / "out.json", tmp_path / "reset.json"
    t = terminal("-m", tiny, "--conversation", "-n", "4", "--ignore-eos", "--show-timings",
                 "--system-prompt", "Be brief.")
    t.expect(r"\n> ")
    t.type("/help\r")
    assert "/reset" in t.expect(r"\n> ")
    t.type("/bogus\r")
    assert "unknown command /bogus" in t.expect(r"\n> ")
    t.type(f"/load {earlier}\r")
    t.expect(r"\[loaded 2 messages")
    t.type("And 3+3?\r")
    assert re.search(r"prefill: \d+ tokens .* decode: 3 tokens", t.expect(r"decode: .*?\n> "))  # asked for
    t.type(f"/save {out}\r")
    t.expect(r"\[saved 4 messages")
    t.type("/reset\r")
    t.expect(r"\[conversation reset\]")
    t.type(f"/save {after_reset}\r")
    t.expect(r"\[saved 1 message ")
    t.expect(r"\n> ")
    t.type_when_reading("\x03")  # Ctrl-C at the prompt ends the chat
    assert t.wait() == 130
    assert "Traceback" not in t.seen.decode(errors="replace")
    messages = json.loads(out.read_text())["messages"]
    assert [m["content"] for m in messages[:3]] == ["What is 2+2?", "4.", "And 3+3?"]  # /load replaced them all
    assert json.loads(after_reset.read_text())["messages"] == [{"role": "system", "content": "Be brief."}]


def test_context_full_keeps_the_chat_going(terminal, tiny):
    t = terminal("-m", tiny, "--conversation", "-c", "40", "--ignore-eos")
    t.expect(r"\n> ")
    t.type("hi\r")
    assert "context full" in t.expect(r"/reset starts a new conversation")  # the reply filled the window
    t.expect(r"\n> ")
    t.type("more\r")
    assert "does not fit" in t.expect(r"\n> ")  # this turn cannot run; the prompt comes back
    t.type("/reset\r")
    t.expect(r"\[conversation reset\]")
    t.type("hi\r")
    t.expect(r"context full")  # a fresh conversation answers again
    t.expect(r"\n> ")
    t.type_when_reading("\x04")
    assert t.wait() == 0
