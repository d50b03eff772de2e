"""`poot generate` with structured output: --grammar/--grammar-file (llama.cpp's GBNF), -j/--json-schema (the JSON
text or a file), -jf/--json-schema-file, --json-object. Replies follow them (checked by jsonschema and Python's
`re`); a schema or grammar that does not compile, or two of them at once, is refused in one line before the
checkpoint is read."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from helpers import smollm
from poot_core.cli.main import main

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
GRAMMAR = 'root ::= num (" " op " " num){1,2}\nop ::= "+" | "-"\nnum ::= [1-9] [0-9]?\n'
GRAMMAR_RE = re.compile(r"[1-9][0-9]?( [-+] [1-9][0-9]?){1,2}")


@pytest.fixture()
def broken(tmp_path):
    """A 'checkpoint' that fails the moment anything reads it: refusals must come first."""
    (tmp_path / "config.json").write_text("{not json")
    return str(tmp_path)


def _reply(capsys, *argv: str) -> dict:
    assert main(["generate", "-c", "256", "-t", "1", "-tb", "1", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("flags,words", [
    (["--json-schema", '{"type": "wat"}'], "JSON schema does not compile"),
    (["-j", "no-such-file.json"], "neither JSON nor a file"),
    (["-jf", "/no/such/schema.json"], "cannot read --json-schema-file"),
    (["--grammar", "root ::= missing"], "grammar does not compile"),
    (["--grammar-file", "/no/such/grammar.gbnf"], "cannot read --grammar-file"),
    (["--grammar", "root ::= [a-"], "grammar does not compile"),
    (["--json-object", "--grammar", 'root ::= "a"'], "give one"),
])
def test_refusals_come_before_the_checkpoint_is_read(broken, flags, words, capsys):
    assert main(["generate", "-m", broken, "-p", "hi", *flags]) == 1
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1, err


def test_json_schema_and_json_object_on_smollm2(capsys):
    model = str(smollm.gguf_path())
    out = _reply(capsys, "-m", model, "-p", "Describe a person named Bob, aged 41, as JSON.", "-n", "60",
                 "-j", json.dumps(SCHEMA))
    assert out["stop_reason"] == "eos", out["text"]
    jsonschema.validate(json.loads(out["text"]), SCHEMA)
    out = _reply(capsys, "-m", model, "-p", "Give the name and age of a person as JSON.", "-n", "60", "--json-object")
    assert out["stop_reason"] == "eos" and isinstance(json.loads(out["text"]), dict), out["text"]


def test_json_schema_from_a_file(tiny_checkpoint, tmp_path, capsys):
    """--json-schema takes a file as well as JSON text, and -jf a file (a tiny model: SCHEMA bounds the reply)."""
    path = tmp_path / "person.json"
    path.write_text(json.dumps(SCHEMA))
    model = str(tiny_checkpoint("llama", torch.float32))
    for flags in (["--json-schema", str(path)], ["-jf", str(path), "--temp", "0.9", "-s", "5"]):
        out = _reply(capsys, "-m", model, "--no-chat-template", "-p", "Numbers: 1 2", "-n", "160", *flags)
        assert out["stop_reason"] == "eos", out["text"]
        jsonschema.validate(json.loads(out["text"]), SCHEMA)


def test_grammar_file(tiny_checkpoint, tmp_path, capsys):
    path = tmp_path / "sum.gbnf"
    path.write_text(GRAMMAR)
    model = str(tiny_checkpoint("llama", torch.float32))
    for flags in (["--grammar-file", str(path)], ["--grammar", GRAMMAR, "--temp", "0.8", "-s", "3"]):
        out = _reply(capsys, "-m", model, "--no-chat-template", "-p", "Numbers: 1 2", "-n", "40", *flags)
        assert out["stop_reason"] == "eos" and GRAMMAR_RE.fullmatch(out["text"]), out["text"]
