"""Structured output: every reply generated under a JSON schema parses and validates with `jsonschema` (a corpus
of schemas and a bounded hypothesis strategy), greedy and sampled, alone and batched, with speculative decoding;
regex and choice replies match (Python's `re`); GBNF grammars in llama.cpp's syntax are honoured (checked by
Python's own parser and regexes); a schema or grammar that does not compile is a RequestError before any token.

The tiny random models write whatever the mask leaves them, so their schemas bound every string, number and
array (and allow no extra properties): such a reply has a bounded length, and max_new above it means every reply
must complete. SmolLM2 (a real model) gets realistic schemas and prompts."""

from __future__ import annotations

import ast
import json
import re

import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import smollm
from helpers.constraint_doubles import HOWS, fail_after
from poot_core import (
    Constraint,
    DraftPolicy,
    Driver,
    DriverOptions,
    GenerateRequest,
    GenerationControl,
    Layout,
    ModelHandle,
    RequestError,
    Sampler,
    open_executor,
)
from poot_core.driver import constraints
from poot_core.driver.constraints import compile_constraint
from poot_core.driver.engine import FinishedEvent

TINY_NEW = 240  # above the longest reply any tiny-model schema below admits, in tokens (one byte or more each)

# --- schemas for the tiny models: everything bounded --------------------------------------------------------
TINY_SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]},
                                               "minItems": 1, "maxItems": 3},
                                      "inner": {"type": "object", "properties": {"ok": {"type": "boolean"},
                                                                                 "n": {"type": "null"}},
                                                "required": ["ok"], "additionalProperties": False}},
     "required": ["tags", "inner"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2,3}$"},
                                      "value": {"anyOf": [{"type": "integer", "minimum": -9, "maximum": 9},
                                                          {"type": "string", "maxLength": 3}]},
                                      "maybe": {"type": "boolean"}},
     "required": ["code", "value"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
                                                                       "maximum": 50}},
                                "required": ["x"], "additionalProperties": False},
     "minItems": 2, "maxItems": 3},
    {"enum": ["red", "green", "blue", 7, None]},
]

# --- realistic schemas for SmolLM2 (strings bounded so that a rambling reply still ends) --------------------
SMOL_CASES = [
    ("Give a JSON object describing a person named Alice who is 30 years old.",
     {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                       "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                       "email": {"type": "string", "maxLength": 40}},
      "required": ["name", "age"], "additionalProperties": False}),
    ("Name a city in France and two of its landmarks, as JSON.",
     {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                       "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 24},
                                                     "minItems": 1, "maxItems": 2}},
      "required": ["city", "landmarks"], "additionalProperties": False}),
    ("Is the sky blue? Answer as JSON with a three-letter code in capitals.",
     {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                                       "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                       "score": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 10},
                                                           {"type": "null"}]}},
      "required": ["answer", "code"], "additionalProperties": False}),
    ("Describe a book you like as JSON.",
     {"type": "object", "properties": {
         "book": {"type": "object", "properties": {"title": {"type": "string", "maxLength": 30},
                                                   "year": {"type": "integer", "minimum": 1000, "maximum": 2100}},
                  "required": ["title", "year"], "additionalProperties": False},
         "genres": {"type": "array", "items": {"enum": ["fiction", "history", "science"]}, "maxItems": 2}},
      "required": ["book"], "additionalProperties": False}),
]

# llama.cpp's GBNF syntax: an arithmetic expression and a list, bounded (repetition counts, no recursion) so a
# random model completes them too. The Python regexes are the same languages written independently.
ARITHMETIC = r"""
root ::= expr
expr ::= term (ws op ws term){0,3}
term ::= num | "(" num ws op ws num ")"
op   ::= "+" | "-" | "*"
num  ::= [1-9] [0-9]{0,2}
ws   ::= " "?
"""
NUM, OP = r"[1-9][0-9]{0,2}", r" ?[-+*] ?"
TERM = rf"(?:{NUM}|\({NUM}{OP}{NUM}\))"
ARITHMETIC_RE = re.compile(rf"{TERM}(?:{OP}{TERM}){{0,3}}")

LIST = r"""
# a short list, one item per line
root ::= item{1,3}
item ::= "- " [a-z] [a-z ]{0,10} "\n"
"""
# llama.cpp's grammars/list.gbnf, as it ships
LLAMA_CPP_LIST = r"""root ::= item+

# Excludes various line break characters
item ::= "- " [^\r\n\x0b\x0c\x85\u2028\u2029]+ "\n"
"""
LIST_RE = re.compile(r"(?:- [a-z][a-z ]{0,10}\n){1,3}")


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return ModelHandle.load(tiny_checkpoint("llama", torch.float32))


@pytest.fixture(scope="module")
def tiny_driver(tiny):
    return Driver(tiny, open_executor("cpu"), DriverOptions(capacity=320, prefill_chunk=32)).serve()


@pytest.fixture(scope="module")
def smol():
    return ModelHandle.load(smollm.gguf_path())


@pytest.fixture(scope="module")
def smol_driver(smol):
    return Driver(smol, open_executor("cpu"), DriverOptions(capacity=512, prefill_chunk=128)).serve()


def _sampled(seed: int) -> Sampler:
    return Sampler(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=seed)


def _tiny_prompt(tiny: ModelHandle, i: int = 0) -> list[int]:
    return tiny.text().encode(["Numbers: 0 1 2", "The capital of", "def add(a, b):"][i % 3])


def _chat(handle: ModelHandle, text: str) -> list[int]:
    services = handle.text()
    return services.encode_chat(services.render_chat_value([{"role": "user", "content": text}]))


def _valid(schema: dict, text: str) -> None:
    jsonschema.validate(json.loads(text), schema)


# --- the tiny model: every schema, greedy and sampled --------------------------------------------------------
@pytest.mark.parametrize("index", range(len(TINY_SCHEMAS)))
def test_tiny_model_replies_validate(tiny, tiny_driver, index):
    schema = TINY_SCHEMAS[index]
    for i, sampler in enumerate([Sampler.greedy(), _sampled(index), _sampled(100 + index),
                                 Sampler(temperature=0.0, repeat_penalty=1.5)]):
        out = tiny_driver.generate(GenerateRequest(_tiny_prompt(tiny, i), TINY_NEW, sampler,
                                                   constraint=Constraint.json_schema(schema)))
        assert out.stop_reason == "eos", (out.stop_reason, out.text)
        _valid(schema, out.text)
        assert tiny.text().decode(out.tokens) == out.text


def test_unconstrained_tiny_model_breaks_the_schema(tiny, tiny_driver):
    """The mask is what makes the replies valid: the same model without it writes no JSON."""
    out = tiny_driver.generate(GenerateRequest(_tiny_prompt(tiny), 40, Sampler.greedy()))
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        _valid(TINY_SCHEMAS[0], out.text)


# A bounded schema: strings of at most 4 characters, integers in ranges, arrays of at most 3, enums, anyOf, no
# extra properties, nesting of at most 2.
_LEAF = st.one_of(
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-20, 20), st.integers(0, 40)),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.integers(0, 4).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(st.text("abcxyz", min_size=1, max_size=3), min_size=1, max_size=3, unique=True).map(
        lambda v: {"enum": v}),
    st.sampled_from([{"type": "string", "pattern": "^[a-z]{1,3}$"}, {"type": "string", "pattern": "^[0-9]-[0-9]$"}]),
)


def _object(props: dict) -> st.SearchStrategy:
    """The object of these properties, with a drawn subset of them required."""
    return st.lists(st.sampled_from(sorted(props)), unique=True).map(
        lambda required: {"type": "object", "properties": props, "required": required,
                          "additionalProperties": False})


def _extend(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(
        st.dictionaries(st.sampled_from(["a", "id", "name", "x"]), children, min_size=1, max_size=3).flatmap(_object),
        st.builds(lambda item, lo, span: {"type": "array", "items": item, "minItems": lo, "maxItems": lo + span},
                  children, st.integers(0, 2), st.integers(0, 1)),
        st.builds(lambda a, b: {"anyOf": [a, b]}, children, children),
    )


SCHEMAS = st.recursive(_LEAF, _extend, max_leaves=5)


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=SCHEMAS, seed=st.integers(0, 2**16), greedy=st.booleans())
def test_generated_schemas_validate(tiny, tiny_driver, schema, seed, greedy):
    sampler = Sampler.greedy() if greedy else _sampled(seed)
    out = tiny_driver.generate(GenerateRequest(_tiny_prompt(tiny, seed), TINY_NEW, sampler,
                                               constraint=Constraint.json_schema(schema)))
    assert out.stop_reason == "eos", (schema, out.text)
    _valid(schema, out.text)


# --- regex, choice, grammars ---------------------------------------------------------------------------------
@pytest.mark.parametrize("pattern", [r"[0-9]{3}-[a-z]{2,4}", r"(yes|no)!", r"[A-Z][a-z]{0,5}( [A-Z][a-z]{0,5}){0,2}"])
def test_regex_replies_match(tiny, tiny_driver, pattern):
    for sampler in (Sampler.greedy(), _sampled(3)):
        out = tiny_driver.generate(GenerateRequest(_tiny_prompt(tiny), 40, sampler,
                                                   constraint=Constraint.regex(pattern)))
        assert out.stop_reason == "eos" and re.fullmatch(pattern, out.text), out.text


def test_choice_replies_are_one_of_the_options(tiny, tiny_driver):
    options = ["Paris", "Rome", "Tōkyō", "no idea"]
    seen = set()
    for seed in range(6):
        out = tiny_driver.generate(GenerateRequest(_tiny_prompt(tiny, seed), 20, _sampled(seed),
                                                   constraint=Constraint.choice(options)))
        assert out.stop_reason == "eos" and out.text in options, out.text
        seen.add(out.text)
    assert len(seen) > 1  # sampling reaches more than one option


@pytest.mark.parametrize("grammar,check", [(ARITHMETIC, ARITHMETIC_RE), (LIST, LIST_RE)], ids=["arithmetic", "list"])
def test_gbnf_grammars_are_honoured(tiny, tiny_driver, grammar, check):
    for i, sampler in enumerate([Sampler.greedy(), _sampled(1), _sampled(2)]):
        out = tiny_driver.generate(GenerateRequest(_tiny_prompt(tiny, i), 80, sampler,
                                                   constraint=Constraint.grammar(grammar)))
        assert out.stop_reason == "eos" and check.fullmatch(out.text), out.text
        if grammar is ARITHMETIC:
            tree = ast.parse(out.text, mode="eval")  # Python parses it as the same kind of expression
            assert all(isinstance(n, ast.Expression | ast.BinOp | ast.Constant | ast.Add | ast.Sub | ast.Mult)
                       for n in ast.walk(tree))


def test_llama_cpp_list_grammar_on_smollm2(smol, smol_driver):
    """llama.cpp's grammars/list.gbnf as it ships (unbounded): every finished line is an item."""
    grammar = LLAMA_CPP_LIST
    out = smol_driver.generate(GenerateRequest(_chat(smol, "List three fruits."), 30, Sampler.greedy(),
                                               constraint=Constraint.grammar(grammar)))
    lines = out.text.split("\n")
    assert len(lines) >= 2 and all(re.fullmatch(r"- [^\r\n]+", line) for line in lines[:-1]), out.text
    assert re.fullmatch(r"- [^\r\n]*|-?", lines[-1]), out.text  # the start of an item (or nothing)


# --- SmolLM2 ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("index", range(len(SMOL_CASES)))
def test_smollm2_json_schema_replies_validate(smol, smol_driver, index):
    prompt, schema = SMOL_CASES[index]
    samplers = [Sampler.greedy()] + ([_sampled(index)] if index < 2 else [])
    for sampler in samplers:
        out = smol_driver.generate(GenerateRequest(_chat(smol, prompt), 120, sampler,
                                                   constraint=Constraint.json_schema(schema)))
        assert out.stop_reason == "eos", out.text
        _valid(schema, out.text)


def test_smollm2_any_json_object_regex_and_choice(smol, smol_driver):
    out = smol_driver.generate(GenerateRequest(_chat(smol, "Give the name and age of a person as JSON."), 60,
                                               Sampler.greedy(), constraint=Constraint.json_object()))
    assert out.stop_reason == "eos" and isinstance(json.loads(out.text), dict), out.text
    out = smol_driver.generate(GenerateRequest(_chat(smol, "What year did World War II end?"), 10, Sampler.greedy(),
                                               constraint=Constraint.regex(r"[0-9]{4}")))
    assert out.stop_reason == "eos" and re.fullmatch(r"[0-9]{4}", out.text), out.text
    options = ["Paris", "London", "Berlin"]
    out = smol_driver.generate(GenerateRequest(_chat(smol, "What is the capital of France?"), 10, Sampler.greedy(),
                                               constraint=Constraint.choice(options)))
    assert out.stop_reason == "eos" and out.text in options


def test_smollm2_batched_replies_validate(smol):
    engine = Driver(smol, open_executor("cpu"), DriverOptions(capacity=256, prefill_chunk=64, block_size=16,
                                                             kv_blocks=64, max_running=8)).serve(Layout.PAGED)
    requests = [GenerateRequest(_chat(smol, prompt), 120, Sampler.greedy() if i % 2 == 0 else _sampled(i),
                                constraint=Constraint.json_schema(schema))
                for i, (prompt, schema) in enumerate(SMOL_CASES)]
    requests.append(GenerateRequest(_chat(smol, "Say hello."), 8, Sampler.greedy()))
    outs = engine.generate_batch(requests)
    for (_, schema), out in zip(SMOL_CASES, outs, strict=False):
        assert out.stop_reason == "eos", out.text
        _valid(schema, out.text)


# --- batched: each constrained row is what it is alone; unconstrained rows are untouched ----------------------
def test_batched_equals_alone(tiny):
    ex = open_executor("cpu")
    solo = Driver(tiny, ex, DriverOptions(capacity=320, prefill_chunk=16)).serve()
    options = DriverOptions(capacity=320, prefill_chunk=16, block_size=8, kv_blocks=256, step_tokens=64,
                            max_running=8)
    engine = Driver(tiny, ex, options).serve(Layout.PAGED)
    requests = []
    for i in range(8):
        kind = i % 4
        constraint = (None if kind == 3 else Constraint.json_schema(TINY_SCHEMAS[i % len(TINY_SCHEMAS)])
                      if kind < 2 else Constraint.regex(r"[a-z]{2,6}[0-9]"))
        requests.append((_tiny_prompt(tiny, i), 30 if constraint is None else TINY_NEW, i % 2, constraint))

    def make(prompt, new, sampled, constraint):
        return GenerateRequest(list(prompt), new, _sampled(7) if sampled else Sampler.greedy(), constraint=constraint)

    alone = [solo.generate(make(*r)) for r in requests]
    together = engine.generate_batch([make(*r) for r in requests])
    for r, a, b in zip(requests, alone, together, strict=True):
        assert (b.tokens, b.text, b.stop_reason) == (a.tokens, a.text, a.stop_reason)
        if r[3] is not None and r[3].kind == "json_schema":
            _valid(json.loads(r[3].source), b.text)


# --- speculative decoding --------------------------------------------------------------------------------------
def test_speculation_keeps_constrained_greedy_output(tiny):
    """Drafts are checked against the grammar and the verify step's logits are masked along them: greedy
    output under a constraint is the non-speculative output, with prompt lookup and with a draft model."""
    schema = TINY_SCHEMAS[1]
    # a prompt that holds JSON of the schema, so prompt lookup proposes tokens the grammar partly accepts
    prompt = tiny.text().encode('{"tags": ["a", "bb"], "inner": {"ok": true}} {"tags": ["a", "bb"], "inner": ')
    ex = open_executor("cpu")
    plain = Driver(tiny, ex, DriverOptions(capacity=320, prefill_chunk=32)).serve()
    policies = [DraftPolicy.PromptLookup(k=4, min_k=4), DraftPolicy.DraftModel(tiny, k=3, min_k=3)]
    def arithmetic(text: str) -> None:
        assert ARITHMETIC_RE.fullmatch(text), text

    for constraint, check in [(Constraint.json_schema(schema), lambda t: _valid(schema, t)),
                              (Constraint.grammar(ARITHMETIC), arithmetic)]:
        ref = plain.generate(GenerateRequest(prompt, TINY_NEW, Sampler.greedy(), constraint=constraint))
        check(ref.text)
        for policy in policies:
            spec = Driver(tiny, ex, DriverOptions(capacity=320, prefill_chunk=32, draft=policy)).serve()
            out = spec.generate(GenerateRequest(prompt, TINY_NEW, Sampler.greedy(), constraint=constraint))
            assert (out.tokens, out.text, out.stop_reason) == (ref.tokens, ref.text, ref.stop_reason), policy
            assert out.timings.verify_steps > 0
            sampled = spec.generate(GenerateRequest(prompt, TINY_NEW, _sampled(5), constraint=constraint))
            assert sampled.stop_reason == "eos"
            check(sampled.text)


def test_matcher_rolls_back_and_validates(tiny):
    """The matcher's answers against the text itself: a valid reply's tokens are all accepted, a token that
    breaks it is where validation stops, and rolling back returns to the state before."""
    schema = TINY_SCHEMAS[0]
    text = tiny.text()
    good = text.encode('{"name": "ab", "age": 7}', add_special=False)
    matcher = compile_constraint(Constraint.json_schema(schema), text.vocab.tokenizer, tiny.config().vocab_size,
                                 [1])
    assert matcher.validate(good) == len(good)
    bad = text.encode('{"name": 5', add_special=False)
    prefix = text.encode('{"name": ', add_special=False)
    assert bad[: len(prefix)] == prefix and matcher.validate(bad) == len(prefix)
    first = matcher.allowed().copy()
    for t in good:
        assert matcher.allowed()[t]
        matcher.advance(t)
    assert matcher.done
    matcher.rollback(len(good) - 1)
    assert not matcher.done and matcher.validate(good[1:]) == len(good) - 1
    matcher.rollback(1)
    assert np.array_equal(matcher.allowed(), first)
    with pytest.raises(RequestError):
        matcher.advance(text.encode("x", add_special=False)[0])  # not where a JSON value starts


# --- refusals ------------------------------------------------------------------------------------------------
BAD = [
    (lambda: Constraint.json_schema({"type": "wat"}), "JSON schema"),
    (lambda: Constraint.json_schema('{"type": "object",'), "not JSON"),
    (lambda: Constraint.json_schema({"type": "string", "format": "no-such-format"}), "format"),
    (lambda: Constraint.json_schema({"$ref": "#/definitions/missing"}), "JSON schema"),
    (lambda: Constraint.regex("[a-z"), "regex"),
    (lambda: Constraint.grammar("root ::= missing-rule"), "grammar"),
    (lambda: Constraint.grammar("root ::= [a-"), "grammar"),
    (lambda: Constraint.grammar("start: ( 'a'"), "grammar"),
    (lambda: Constraint.choice([]), "choice"),
    (lambda: Constraint("xml", "<a/>"), "kind"),
]


@pytest.mark.parametrize("index", range(len(BAD)))
def test_malformed_constraints_are_refused_before_any_token(tiny, tiny_driver, index):
    build, words = BAD[index]
    calls = []

    def on_token(token, piece):
        calls.append(token)
        return GenerationControl.CONTINUE

    with pytest.raises(RequestError, match=words):
        tiny_driver.generate(GenerateRequest(_tiny_prompt(tiny), 8, constraint=build()), on_token)
    assert not calls
    with pytest.raises(RequestError, match=words):
        build().check()  # refused without the model too (the command line checks before loading)


def test_engine_refuses_before_queueing(tiny):
    engine = Driver(tiny, open_executor("cpu"), DriverOptions(capacity=64, kv_blocks=16, block_size=8)).serve(
        Layout.PAGED)
    good = GenerateRequest(_tiny_prompt(tiny), 4)
    bad = GenerateRequest(_tiny_prompt(tiny), 4, constraint=Constraint.regex("(unclosed"))
    with pytest.raises(RequestError, match="regex"):
        engine.submit(bad)
    with pytest.raises(RequestError, match="regex"):
        engine.generate_batch([good, bad])
    assert engine.in_flight == 0


def test_a_constraint_no_text_satisfies_is_refused_before_any_token(tiny, tiny_driver):
    """An empty character class compiles, but llguidance's first mask is an error state (it would allow only
    end-of-sequence, an empty reply the regex does not match): refused when the request is taken."""
    never = Constraint.regex(r"[^\x00-\U0010FFFF]")
    never.check()  # the grammar itself is well formed
    with pytest.raises(RequestError, match="admits no reply"):
        tiny_driver.generate(GenerateRequest(_tiny_prompt(tiny), 8, constraint=never))
    engine = Driver(tiny, open_executor("cpu"), DriverOptions(capacity=64, kv_blocks=16, block_size=8)).serve(
        Layout.PAGED)
    with pytest.raises(RequestError, match="admits no reply"):
        engine.submit(GenerateRequest(_tiny_prompt(tiny), 8, constraint=never))
    assert engine.in_flight == 0


AFTER = 3  # tokens the failing constraint takes before it fails


@pytest.mark.parametrize("how", HOWS)
def test_a_failing_constraint_ends_only_its_own_request(tiny, monkeypatch, how):
    """A constrained request whose matcher (a test double, helpers/constraint_doubles.py) stops allowing any token
    (or raises) mid-generation, batched with two unconstrained requests: it alone finishes with reason "error" and
    the error; the other two give exactly the tokens they give alone, and the pool is whole at the end."""
    ex = open_executor("cpu")
    solo = Driver(tiny, ex, DriverOptions(capacity=320, prefill_chunk=16)).serve()
    engine = Driver(tiny, ex, DriverOptions(capacity=320, prefill_chunk=16, block_size=8, kv_blocks=128,
                                            step_tokens=64, max_running=4)).serve(Layout.PAGED)
    schema = TINY_SCHEMAS[1]

    def requests():
        return [GenerateRequest(_tiny_prompt(tiny, 0), 24, Sampler.greedy(), ignore_eos=True),
                GenerateRequest(_tiny_prompt(tiny, 1), TINY_NEW, _sampled(3),
                                constraint=Constraint.json_schema(schema)),
                GenerateRequest(_tiny_prompt(tiny, 2), 24, _sampled(11), ignore_eos=True)]

    alone = [solo.generate(r) for r in requests()]
    assert len(alone[1].tokens) > AFTER + 1
    real = engine.driver.constraint_matcher
    monkeypatch.setattr(engine.driver, "constraint_matcher", lambda request: fail_after(real(request), AFTER, how))
    ids = [engine.submit(r) for r in requests()]
    finished, step = {}, 0
    while len(finished) < len(ids):
        step += 1
        for event in engine.step():
            if isinstance(event, FinishedEvent):
                finished[event.request_id] = (step, event)
    a, bad, c = (finished[i] for i in ids)
    assert bad[1].reason == "error" and isinstance(bad[1].error, RequestError), bad[1]
    assert re.search("allows no next token" if how == "empty" else "the constraint failed", str(bad[1].error))
    assert bad[0] < a[0] and bad[0] < c[0]  # it failed while the others were still in the same steps
    tokens = bad[1].generation.tokens
    assert len(tokens) == AFTER + (how == "consume") and tokens == alone[1].tokens[: len(tokens)]
    for (_, event), ref in ((a, alone[0]), (c, alone[2])):
        assert event.reason == "length" and event.error is None
        assert (event.generation.tokens, event.generation.text) == (ref.tokens, ref.text)
    assert engine.in_flight == 0 and engine.pool.held == 0


# --- steps ahead: greedy constrained rows masked on the device, the next step fed from the masked argmax ------
def _ahead_requests(tiny: ModelHandle) -> list[GenerateRequest]:
    out = []
    for i in range(10):
        kind = i % 5
        constraint = (None if kind == 4 else Constraint.regex(r"[a-z]{2,6}[0-9]") if kind == 3
                      else Constraint.json_schema(TINY_SCHEMAS[i % len(TINY_SCHEMAS)]))
        out.append(GenerateRequest(_tiny_prompt(tiny, i), 30 if constraint is None else TINY_NEW, Sampler.greedy(),
                                   constraint=constraint))
    return out


def _solo_and_fed_engine(tiny: ModelHandle):
    """The contiguous driver, and the paged engine on an executor that feeds steps from the device and masks there
    (helpers.fed_cpu), as the Triton executor does on a GPU."""
    from helpers.fed_cpu import FedCpu

    solo = Driver(tiny, open_executor("cpu"), DriverOptions(capacity=320, prefill_chunk=16)).serve()
    engine = Driver(tiny, FedCpu(), DriverOptions(capacity=320, prefill_chunk=16, block_size=8, kv_blocks=256,
                                                  step_tokens=64, max_running=10)).serve(Layout.PAGED)
    return solo, engine


def _run_to_end(engine) -> dict[int, FinishedEvent]:
    finished: dict[int, FinishedEvent] = {}
    while engine.in_flight:
        for event in engine.step():
            if isinstance(event, FinishedEvent):
                finished[event.request_id] = event
    return finished


def test_greedy_constrained_rows_run_steps_ahead(tiny):
    """On an executor that feeds steps from the device and masks there (helpers.fed_cpu), a step whose picking rows
    are all greedy launches the next one before its ids are read, constrained rows too: each request gives its solo
    tokens, text and reason, every constrained reply validates, and most steps ran ahead."""
    solo, engine = _solo_and_fed_engine(tiny)
    assert engine.driver.masks.device is not None
    alone = [solo.generate(r) for r in _ahead_requests(tiny)]
    ids = [engine.submit(r) for r in _ahead_requests(tiny)]
    finished = _run_to_end(engine)
    for i, (rid, ref) in enumerate(zip(ids, alone, strict=True)):
        gen = finished[rid].generation
        assert (gen.tokens, gen.text, gen.stop_reason) == (ref.tokens, ref.text, ref.stop_reason), f"request {i}"
        if i % 5 < 3:
            _valid(TINY_SCHEMAS[i % len(TINY_SCHEMAS)], gen.text)
    assert engine.ahead.steps >= engine.steps // 2, (engine.ahead.steps, engine.steps)
    assert engine.in_flight == 0 and engine.pool.held == 0


def test_a_constraint_failing_in_a_step_ahead_ends_only_its_own_request(tiny, monkeypatch):
    """A greedy constrained request whose mask comes back empty part-way (helpers/constraint_doubles.py) while the
    steps run ahead: it alone ends with the error, after AFTER tokens; the others give their solo tokens."""
    solo, engine = _solo_and_fed_engine(tiny)
    alone = [solo.generate(r) for r in _ahead_requests(tiny)]
    real = engine.driver.constraint_matcher
    calls = iter(range(100))
    monkeypatch.setattr(engine.driver, "constraint_matcher",  # the second constrained request fails
                        lambda request: (fail_after(real(request), AFTER, "empty") if next(calls) == 1
                                         else real(request)))
    ids = [engine.submit(r) for r in _ahead_requests(tiny)]
    finished = _run_to_end(engine)
    bad = finished[ids[1]]
    assert bad.reason == "error" and re.search("allows no next token", str(bad.error)), bad
    assert bad.generation.tokens == alone[1].tokens[:AFTER]
    for i, (rid, ref) in enumerate(zip(ids, alone, strict=True)):
        if i != 1:
            gen = finished[rid].generation
            assert (gen.tokens, gen.text, gen.stop_reason) == (ref.tokens, ref.text, ref.stop_reason), f"request {i}"
    assert engine.ahead.steps > 0
    assert engine.in_flight == 0 and engine.pool.held == 0


# --- the server's helpers: response_format, vLLM's guided fields, forced tool calls -----------------------------
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
              "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                               "unit": {"enum": ["c", "f"]}},
              "required": ["city", "unit"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "add", "parameters": {
              "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "b": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["a", "b"], "additionalProperties": False}}}]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_tool_calls_parse_into_the_named_tools_arguments(tiny, tiny_driver, tool_choice):
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    constraint = constraints.tool_call_constraint(TOOLS, tool_choice, parallel_tool_calls=False)
    for seed in range(3):
        out = tiny_driver.generate(GenerateRequest(_tiny_prompt(tiny, seed), TINY_NEW, _sampled(seed),
                                                   constraint=constraint))
        assert out.stop_reason == "eos", out.text
        calls = constraints.tool_calls_from_text(out.text, tool_choice)
        assert calls and all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
        for call in calls:
            name = call["function"]["name"]
            assert name in parameters and (tool_choice == "required" or name == "add")
            jsonschema.validate(json.loads(call["function"]["arguments"]), parameters[name])


def test_openai_and_vllm_fields_map_to_constraints():
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    assert constraints.from_response_format(None) is None
    assert constraints.from_response_format({"type": "text"}) is None
    assert constraints.from_response_format({"type": "json_object"}) == Constraint.json_object()
    strict = constraints.from_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                                      "strict": True}})
    assert strict == Constraint.json_schema(schema) and strict.strict
    assert not constraints.from_response_format({"type": "json_schema", "json_schema": {"schema": schema}}).strict
    assert constraints.from_guided({"guided_regex": "[0-9]+"}) == Constraint.regex("[0-9]+")
    assert constraints.from_guided({"guided_choice": ["a", "b"]}) == Constraint.choice(["a", "b"])
    assert constraints.from_guided({"guided_json": schema}) == Constraint.json_schema(schema)
    assert constraints.from_guided({"structured_outputs": {"grammar": 'root ::= "a"'}}) == Constraint.grammar(
        'root ::= "a"')
    assert constraints.from_guided({"structured_outputs": {"json_object": True}}) == Constraint.json_object()
    assert constraints.from_guided({"temperature": 1}) is None
    assert constraints.tool_call_constraint(TOOLS, "auto") is None
    for bad in ({"type": "xml"}, {"type": "json_schema"}):
        with pytest.raises(RequestError):
            constraints.from_response_format(bad)
    with pytest.raises(RequestError, match="one structured output"):
        constraints.from_guided({"guided_regex": "a", "guided_choice": ["a"]})
    with pytest.raises(RequestError, match="structured_outputs.choice, guided_json"):
        constraints.from_guided({"guided_json": schema, "structured_outputs": {"choice": ["a"]}})
    assert constraints.from_guided({"structured_outputs": {"json": json.dumps(schema), "disable_fallback": True},
                                    "guided_decoding_backend": "xgrammar"}) == Constraint.json_schema(schema)
    assert [f for f, _, _ in constraints.guided_fields({"guided_grammar": "x", "guided_choice": None})] == [
        "guided_grammar"]
    for bad, words in (({"guided_regex": 5}, "guided_regex: a regex is a string"),
                       ({"guided_choice": 5}, "guided_choice: a choice needs a list"),
                       ({"structured_outputs": {"choice": []}}, "structured_outputs.choice: a choice needs"),
                       ({"structured_outputs": {"structural_tag": "{}"}}, "structural_tag is not supported"),
                       ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern is not supported"),
                       ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn is not a field"),
                       ({"structured_outputs": "json"}, "structured_outputs is an object")):
        with pytest.raises(RequestError, match=words):
            constraints.from_guided(bad)
    with pytest.raises(RequestError, match="not one of the tools"):
        constraints.tool_call_constraint(TOOLS, {"type": "function", "function": {"name": "nope"}})
