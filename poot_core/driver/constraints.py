"""Structured output: a per-request constraint (a JSON schema, any JSON object, a regex, a choice among strings, a
grammar) compiled against the model's tokenizer into a matcher that gives each step's allowed tokens.

The grammar machinery is llguidance (guidance-ai, MIT), picked over xgrammar 0.2.9 because:
- it has no dependencies, where xgrammar requires transformers and apache-tvm-ffi at run time (poot-core does
  not depend on transformers);
- it reads a `tokenizers` JSON directly, so tokenizers built from GGUF metadata work as Hugging Face's do;
- it compiles lazily (no pass over the vocabulary per schema; the tokenizer's token trie is built once per
  vocabulary and cached here) and computes a mask in tens of microseconds on a 50k vocabulary (bench/structured.py
  measures both), with the GIL released;
- JSON schema, regex, choice, its Lark EBNF and llama.cpp's GBNF (through its own gbnf_to_lark), plus rollback
  and validate_tokens, which speculative decoding needs, and errors as messages instead of crashes.

A request's `Matcher` advances with each accepted token; `prefetch` computes the next masks of many matchers in
one batch (llguidance's own threads) while the model's step runs. The OpenAI helpers at the end turn
`response_format`, vLLM's guided fields and `tool_choice` into a Constraint (the server calls them).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import astuple, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from poot_core.driver import token_masks
from poot_core.errors import PootError, RequestError

if TYPE_CHECKING:
    import tokenizers

    from poot_core.driver.speculation import Proposal

# JSON as json.dumps writes it ({"a": 1, "b": [2, 3]}): the separators models are used to, and no free
# whitespace, so an output whose strings, numbers and arrays are bounded has a bounded length.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
_WHAT = {"json_schema": "the JSON schema", "json_object": "the JSON object constraint", "regex": "the regex",
         "choice": "the choice", "grammar": "the grammar"}


@dataclass(frozen=True)
class Constraint:
    """What a reply must be. Build one with Constraint.json_schema(schema), .json_object(), .regex(pattern),
    .choice(options) or .grammar(text) (llama.cpp's GBNF, or llguidance's Lark EBNF). strict=False lets a JSON
    schema use keywords llguidance does not implement (they are ignored); strict schemas refuse them."""

    kind: str
    source: str  # the schema as JSON, the regex, the choices as a JSON list, the grammar text
    strict: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise RequestError(f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str | bool, strict: bool = True) -> Constraint:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise RequestError(f"the JSON schema is not JSON: {exc}") from exc
        if not isinstance(schema, Mapping | bool):
            raise RequestError(f"a JSON schema is an object (or true/false), got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema), strict)

    @classmethod
    def json_object(cls) -> Constraint:
        return cls("json_object", json.dumps({"type": "object"}))

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        if not isinstance(pattern, str):
            raise RequestError(f"a regex is a string, got {type(pattern).__name__}")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> Constraint:
        if not isinstance(options, list | tuple) or not options or not all(isinstance(o, str) and o for o in options):
            raise RequestError("a choice needs a list of one or more non-empty strings")
        return cls("choice", json.dumps(list(options)))

    @classmethod
    def grammar(cls, text: str) -> Constraint:
        if not isinstance(text, str) or not text.strip():
            raise RequestError("the grammar is empty")
        return cls("grammar", text)

    def describe(self) -> str:
        return _WHAT[self.kind]

    def grammar_text(self) -> str:
        """llguidance's grammar for this constraint; RequestError where the source does not convert."""
        from llguidance import LLMatcher, grammar_from

        try:
            if self.kind in ("json_schema", "json_object"):
                options = JSON_OPTIONS if self.strict else {**JSON_OPTIONS, "lenient": True}
                return LLMatcher.grammar_from_json_schema(self.source, defaults=options)
            if self.kind == "regex":
                return LLMatcher.grammar_from_regex(self.source)
            return grammar_from("choice" if self.kind == "choice" else "grammar", self.source)
        except ValueError as exc:
            raise RequestError(f"{self.describe()} does not compile: {exc}") from exc

    def check(self) -> None:
        """Compile without a tokenizer (no model needed): RequestError naming the problem."""
        from llguidance import LLMatcher

        is_error, messages = LLMatcher.validate_grammar_with_warnings(self.grammar_text())
        if is_error:
            raise RequestError(f"{self.describe()} does not compile: {_first_line(messages[0])}")


def _first_line(message: str) -> str:
    message = message.split("<state>", 1)[0]  # llguidance appends its parser state to a runtime error
    return " ".join(message.strip().split())[:500]


# --- the tokenizer, once per vocabulary ---------------------------------------------------------------------
_TOKENIZERS: OrderedDict[tuple[str, int, tuple[int, ...]], Any] = OrderedDict()
_BY_OBJECT: OrderedDict[int, tuple[Any, str]] = OrderedDict()  # id(tokenizer) -> (tokenizer, content digest)
_LOCK = threading.Lock()
_KEEP = 8


def tokenizer_info(tokenizer: tokenizers.Tokenizer, vocab_size: int, eos_ids: Iterable[int]) -> Any:
    """llguidance's view of a tokenizer (its token trie), built once per vocabulary: keyed by the tokenizer's
    JSON, the logits' width and the ids that end generation."""
    from llguidance import LLTokenizer

    eos = tuple(sorted({int(i) for i in eos_ids}))
    with _LOCK:
        known = _BY_OBJECT.get(id(tokenizer))
        text: str | None = None
        if known is not None and known[0] is tokenizer:
            digest = known[1]
            _BY_OBJECT.move_to_end(id(tokenizer))
        else:
            text = tokenizer.to_str()
            digest = hashlib.sha256(text.encode()).hexdigest()
            _BY_OBJECT[id(tokenizer)] = (tokenizer, digest)  # holding it keeps its id from being reused
            while len(_BY_OBJECT) > _KEEP:
                _BY_OBJECT.popitem(last=False)
        key = (digest, vocab_size, eos)
        info = _TOKENIZERS.get(key)
        if info is not None:
            _TOKENIZERS.move_to_end(key)
            return info
        if text is None:
            text = tokenizer.to_str()
        n_vocab = max(vocab_size, tokenizer.get_vocab_size(with_added_tokens=True))
        try:
            info = LLTokenizer(text, n_vocab=n_vocab, eos_token=list(eos) or None)
        except Exception as exc:  # the library's own error type; a tokenizer it cannot read
            raise RequestError(f"structured output cannot read this model's tokenizer: {exc}") from exc
        _TOKENIZERS[key] = info
        while len(_TOKENIZERS) > _KEEP:
            _TOKENIZERS.popitem(last=False)
        return info


# --- one request's state ------------------------------------------------------------------------------------
_POOL: ThreadPoolExecutor | None = None
_EXECUTOR: Any = None


def mask_threads() -> int:
    """The library's threads for one batch of masks: half the cores, at least one, at most 16. On the H200's
    16-core host, 64 rows of a patterned JSON string over Llama 3's vocabulary (about a millisecond a mask) took
    2.2-2.3 ms a step on 8 threads, and 2.2-4.6 ms on 14, which crowd the engine's own thread."""
    return min(16, max(1, (os.cpu_count() or 2) // 2))


@dataclass
class MaskStats:
    """What the batches of masks cost since the process started (bench/structured.py reports it): masks filled,
    batches, seconds the mask thread spent filling them, seconds the engine's thread waited for them."""

    masks: int = 0
    batches: int = 0
    fill_seconds: float = 0.0
    wait_seconds: float = 0.0

    def since(self, earlier: MaskStats) -> MaskStats:
        """What was counted after `earlier` (a copy of STATS taken then)."""
        return MaskStats(*(now - then for now, then in zip(astuple(self), astuple(earlier), strict=True)))


STATS = MaskStats()


def _executor() -> Any:
    """llguidance's executor: it fills the masks of many matchers into one array on its own threads, without the
    GIL (one Python worker per mask was 6x slower at 64 rows: the workers and the engine's thread queued on the
    GIL)."""
    global _EXECUTOR
    if _EXECUTOR is None:
        from llguidance import LLExecutor

        _EXECUTOR = LLExecutor(mask_threads())
    return _EXECUTOR


def _pool() -> ThreadPoolExecutor:
    """One thread that waits for the library while the engine's thread goes on (the step it launched runs)."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="poot-mask")
    return _POOL


def _fill(matchers: Sequence[Any], words: int) -> np.ndarray:
    """int32 [len(matchers), words]: llguidance's packed masks of the matchers' current states (words: its width
    of a mask, from the tokenizer's vocabulary, which it checks)."""
    out = np.empty((len(matchers), words), dtype=np.int32)
    t0 = time.perf_counter()
    _executor().unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], out.ctypes.data, 4 * words,
                                        len(matchers))
    STATS.fill_seconds += time.perf_counter() - t0
    STATS.masks += len(matchers)
    STATS.batches += 1
    return out


@dataclass
class _Pending:
    """A matcher's mask in a batch being filled on the mask thread: row `row` of the batch's array."""

    batch: Future[np.ndarray]
    row: int


def prefetch(matchers: Iterable[Matcher]) -> None:
    """Start computing the next masks of these matchers (those without one) in one batch on the mask thread, so that
    they are ready when the step that runs meanwhile has its logits."""
    by_width: dict[int, list[Matcher]] = {}  # one array per width of llguidance's masks (one per vocabulary)
    for m in matchers:
        if m._mask is None and m._pending is None:
            by_width.setdefault(m._lib_words, []).append(m)
    for words, todo in by_width.items():
        batch = _pool().submit(_fill, [m._m for m in todo], words)
        for row, m in enumerate(todo):
            m._pending = _Pending(batch, row)


class Matcher:
    """A compiled constraint's state for one request: the allowed next tokens, advanced by each accepted token,
    rolled back by n tokens, done when the grammar admits nothing more (but end-of-sequence). Masks are kept as
    llguidance packs them (int32 words, bit b of word w allowing token 32 w + b: token_masks.py applies them)."""

    def __init__(self, matcher: Any, vocab_size: int, eos_ids: Iterable[int], allow_eos: bool,
                 tokenizer_vocab: int) -> None:
        self._m = matcher
        self.vocab_size = vocab_size
        self._words = token_masks.words(vocab_size)
        self._lib_words = token_masks.words(tokenizer_vocab)  # llguidance's masks: the tokenizer's width
        eos = np.array(sorted(int(i) for i in eos_ids if 0 <= int(i) < vocab_size), dtype=np.int64)
        # what every mask keeps of llguidance's: the bits of the logits' tokens, end-of-sequence only if allowed
        keep = np.full(self._words, -1, dtype=np.int32)
        if vocab_size % 32:
            keep[-1] = (1 << (vocab_size % 32)) - 1
        if not allow_eos and eos.size:
            np.bitwise_and.at(keep.view(np.uint32), eos // 32, ~(np.uint32(1) << (eos % 32).astype(np.uint32)))
        self._keep = keep
        self._mask: np.ndarray | None = None  # int32 [words]: the allowed tokens in the current state
        self._pending: _Pending | None = None

    def _lib(self, what: str, call: Callable[[], Any]) -> Any:
        """A call into the library: whatever it raises becomes a RequestError, so that a failing constraint ends
        only its own request (the serving engine catches poot's errors per request)."""
        try:
            return call()
        except PootError:
            raise
        except Exception as exc:  # the library's own error types, or a bug in it
            raise RequestError(f"the constraint failed in {what}: {type(exc).__name__}: {exc}") from exc

    def _checked(self, raw: np.ndarray) -> np.ndarray:
        if self._lib("is_error", self._m.is_error):  # llguidance then allows only end-of-sequence: not a reply
            raise RequestError(f"the constraint failed{self._why()}")
        return raw[: self._words] & self._keep

    def _compute(self) -> np.ndarray:
        """The mask of this matcher alone, on this thread."""
        raw = self._lib("compute_bitmask", self._m.compute_bitmask)
        return self._checked(np.frombuffer(raw, dtype="<i4", count=self._lib_words))

    def prefetch(self) -> None:
        """Start computing the next mask on the mask thread (prefetch() does many matchers at once)."""
        prefetch([self])

    def _settle(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            t0 = time.perf_counter()
            try:
                batch = pending.batch.result()
            except Exception:  # noqa: BLE001 - a library failure in the batch: each matcher alone, so that it
                self._mask = self._compute()  # ends only the request whose matcher fails
            else:
                self._mask = self._checked(batch[pending.row])
            finally:
                STATS.wait_seconds += time.perf_counter() - t0

    def words(self) -> np.ndarray:
        """int32 [words]: the packed mask of the tokens the constraint allows next (end-of-sequence where it is
        complete)."""
        self._settle()
        if self._mask is None:
            self._mask = self._compute()
        return self._mask

    def allowed(self) -> np.ndarray:
        """bool [vocab]: the tokens the constraint allows next."""
        return token_masks.unpack(self.words()[None], self.vocab_size)[0]

    def row_mask(self) -> np.ndarray:
        """words() for a row about to be sampled: RequestError when it allows no token."""
        mask = self.words()
        if not mask.any():
            raise RequestError(f"the constraint allows no next token{self._why()}")
        return mask

    def _why(self) -> str:
        try:
            error = self._m.get_error()
        except Exception:  # noqa: BLE001 - only the message is lost
            return ""
        return f": {_first_line(error)}" if error else ""

    def advance(self, token: int) -> None:
        self._settle()
        if not self._lib("consume_token", lambda: self._m.consume_token(int(token))):
            raise RequestError(f"token {token} breaks the constraint{self._why()}")
        self._mask = None

    def rollback(self, n: int) -> None:
        """Forget the last n accepted tokens."""
        self._settle()
        if n and not self._lib("rollback", lambda: self._m.rollback(n)):
            raise RequestError(f"cannot roll the constraint back by {n} tokens{self._why()}")
        self._mask = None

    def validate(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the constraint accepts from the current state (the state is kept)."""
        self._settle()
        if not tokens:
            return 0
        return int(self._lib("validate_tokens", lambda: self._m.validate_tokens([int(t) for t in tokens])))

    @property
    def done(self) -> bool:
        """The grammar is complete and admits no further token but end-of-sequence."""
        self._settle()
        return bool(self._lib("is_stopped", self._m.is_stopped))

    @property
    def accepting(self) -> bool:
        self._settle()
        return bool(self._lib("is_accepting", self._m.is_accepting))

    # --- speculative decoding -------------------------------------------------------------------------
    def trim(self, proposal: Proposal) -> Proposal:
        """The longest prefix of a proposal the constraint accepts."""
        from poot_core.driver.speculation import Proposal

        n = self.validate(proposal.tokens)
        if n == len(proposal.tokens):
            return proposal
        return Proposal(proposal.tokens[:n], None if proposal.q is None else proposal.q[:n])

    def masks_along(self, drafts: list[int]) -> np.ndarray:
        """int32 [len(drafts) + 1, words]: the packed mask before each draft and after the last, for a verify step
        whose logits row i follows the first i drafts; the state is left where it was. A row after a draft that
        completes the grammar allows everything where it allows nothing: the request ends before it is used."""
        rows = [self.words()]
        for d in drafts:
            self.advance(d)
            rows.append(self.words())
        self.rollback(len(drafts))
        out = np.stack(rows)
        out[~out.any(axis=1)] = -1
        return out


def compile_constraint(constraint: Constraint, tokenizer: tokenizers.Tokenizer, vocab_size: int,
                       eos_ids: Iterable[int], allow_eos: bool = True) -> Matcher:
    """A matcher for `constraint` over a vocabulary of `vocab_size` logits; RequestError naming the problem when
    the constraint does not compile. allow_eos=False (ignore_eos) keeps end-of-sequence out of every mask."""
    from llguidance import LLMatcher

    if not isinstance(constraint, Constraint):
        raise RequestError(f"GenerateRequest.constraint must be a Constraint, got {type(constraint).__name__}")
    eos = list(eos_ids)
    info = tokenizer_info(tokenizer, vocab_size, eos)
    matcher = LLMatcher(info, constraint.grammar_text(), log_level=0)
    if matcher.is_error():
        raise RequestError(f"{constraint.describe()} does not compile: {_first_line(matcher.get_error())}")
    out = Matcher(matcher, vocab_size, eos, allow_eos, info.vocab_size)
    try:  # the first mask now (it is needed first anyway): a constraint no text can satisfy is refused here
        out.words()
    except RequestError as exc:
        raise RequestError(f"{constraint.describe()} admits no reply: {exc}") from None
    return out


# --- OpenAI's and vLLM's request fields ---------------------------------------------------------------------
def from_response_format(response_format: Mapping[str, Any] | None) -> Constraint | None:
    """OpenAI's `response_format`: {"type": "text"} (None), {"type": "json_object"}, or {"type": "json_schema",
    "json_schema": {"name": ..., "schema": {...}, "strict": bool}}."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object()
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or "schema" not in spec:
            raise RequestError("response_format json_schema needs json_schema.schema")
        return Constraint.json_schema(spec["schema"], strict=bool(spec.get("strict", False)))
    raise RequestError(f"response_format type must be text, json_object or json_schema, got {kind!r}")


_GUIDED = {"json": Constraint.json_schema, "regex": Constraint.regex, "choice": Constraint.choice,
           "grammar": Constraint.grammar}
# vLLM's fields that would change the reply in ways llguidance's defaults here do not follow: refused by name
_GUIDED_UNSUPPORTED = ("structural_tag", "whitespace_pattern", "disable_any_whitespace",
                       "disable_additional_properties")
# ... and those that only pick a backend or its fallback (nothing to pick here): ignored
_GUIDED_IGNORED = ("disable_fallback", "_backend", "_backend_was_auto")


def guided_fields(fields: Mapping[str, Any]) -> list[tuple[str, str, Any]]:
    """(the field as the request spells it, the constraint kind, its value) for every vLLM structured-output
    field given: structured_outputs={"json"|"regex"|"choice"|"grammar": ..., "json_object": true} (vLLM 0.12+),
    or the older top-level guided_json, guided_regex, guided_choice, guided_grammar. A field poot cannot honour
    (structural_tag, whitespace_pattern, ...) is a RequestError naming it."""
    given: list[tuple[str, str, Any]] = []
    nested = fields.get("structured_outputs")
    if nested is not None and not isinstance(nested, Mapping):
        raise RequestError(f"structured_outputs is an object, got {type(nested).__name__}")
    for key, value in (nested or {}).items():
        if value is None or value is False:
            continue
        if key in _GUIDED:
            given.append((f"structured_outputs.{key}", key, value))
        elif key == "json_object":
            given.append(("structured_outputs.json_object", "json_object", True))
        elif key not in _GUIDED_IGNORED:
            raise RequestError(f"structured_outputs.{key} is not supported"
                               if key in _GUIDED_UNSUPPORTED else f"structured_outputs.{key} is not a field")
    for key, value in fields.items():
        kind = key.removeprefix("guided_")
        if not key.startswith("guided_") or value is None:
            continue
        if kind in _GUIDED:
            given.append((key, kind, value))
        elif kind in _GUIDED_UNSUPPORTED:
            raise RequestError(f"{key} is not supported")
    if fields.get("structural_tag") is not None:
        raise RequestError("structural_tag is not supported")
    return given


def from_guided(fields: Mapping[str, Any]) -> Constraint | None:
    """The Constraint of vLLM's structured-output fields (guided_fields), None without one; more than one is
    refused, and a value that is not a schema, regex, choice or grammar is a RequestError naming its field."""
    given = guided_fields(fields)
    if not given:
        return None
    if len(given) > 1:
        raise RequestError(f"give one structured output field, got {', '.join(f for f, _, _ in given)}")
    field, kind, value = given[0]
    try:
        return Constraint.json_object() if kind == "json_object" else _GUIDED[kind](value)
    except RequestError as exc:
        raise RequestError(f"{field}: {exc}") from None


def _tool_functions(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Mapping[str, Any]]:
    functions: dict[str, Mapping[str, Any]] = {}
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise RequestError("every tool needs a function with a name")
        functions[function["name"]] = function.get("parameters") or {"type": "object"}
    return functions


def _named_tool(tool_choice: Any) -> str | None:
    if isinstance(tool_choice, Mapping):
        function = tool_choice.get("function")
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            return function["name"]
        raise RequestError("tool_choice names a tool as {\"type\": \"function\", \"function\": {\"name\": ...}}")
    return None


def tool_call_constraint(tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any,
                         parallel_tool_calls: bool = True) -> Constraint | None:
    """The constraint of a forced tool call, as vLLM does it: a named tool -> its parameters' schema (the reply is
    the arguments); "required" -> a JSON array of one or more {"name": ..., "parameters": {...}} of the given
    tools (exactly one when parallel_tool_calls is false); "auto", "none" or None -> no constraint."""
    if tool_choice in (None, "auto", "none"):
        return None
    functions = _tool_functions(tools)
    name = _named_tool(tool_choice)
    if name is not None:
        if name not in functions:
            raise RequestError(f"tool_choice names {name!r}, which is not one of the tools")
        return Constraint.json_schema(functions[name])
    if tool_choice != "required":
        raise RequestError(f"tool_choice must be none, auto, required or a named function, got {tool_choice!r}")
    if not functions:
        raise RequestError("tool_choice required needs at least one tool")
    calls = [{"type": "object", "properties": {"name": {"const": n}, "parameters": p},
              "required": ["name", "parameters"], "additionalProperties": False} for n, p in functions.items()]
    item = calls[0] if len(calls) == 1 else {"anyOf": calls}
    bounds = {"minItems": 1} if parallel_tool_calls else {"minItems": 1, "maxItems": 1}
    return Constraint.json_schema({"type": "array", "items": item, **bounds})


def tool_calls_from_text(text: str, tool_choice: Any) -> list[dict[str, Any]]:
    """OpenAI `tool_calls` entries from a reply generated under tool_call_constraint(tools, tool_choice)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise RequestError(f"the tool call is not complete JSON (was the reply cut short?): {exc}") from exc
    name = _named_tool(tool_choice)
    if name is not None:  # the reply is the arguments: kept as generated (vLLM), so a stream of it adds up
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": name, "arguments": text.strip()}}]
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["parameters"], ensure_ascii=False)}}
            for c in value]


# --- tool calls in a free reply (tool_choice "auto") -------------------------------------------------------
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


def tool_call_format(chat_template: str | None) -> str:
    """How the model's chat template asks for tool calls: "hermes" (Hermes, Qwen 2.5/3: <tool_call>{"name": ...,
    "arguments": {...}}</tool_call> blocks) when the template spells the tag, else "json" (one bare JSON object
    {"name": ..., "arguments" or "parameters": {...}}, the Llama 3.1+ convention)."""
    return "hermes" if chat_template and HERMES_OPEN in chat_template else "json"


def _call(value: Any, names: set[str] | None) -> dict[str, Any] | None:
    if not isinstance(value, Mapping) or not isinstance(value.get("name"), str):
        return None
    if names is not None and value["name"] not in names:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments already serialised
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, Mapping):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def tool_calls_from_reply(text: str, tools: Sequence[Mapping[str, Any]] | None,
                          fmt: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a reply generated with tools offered and no constraint, as vLLM's hermes and
    llama3_json parsers read it. Hermes: the text before the first <tool_call> stays content (None when empty),
    every block is one call (an unclosed last block runs to the end). JSON: the whole reply is one object naming
    one of the tools. A reply with no call, or with a call that does not parse: (text, [])."""
    if fmt == "hermes":
        start = text.find(HERMES_OPEN)
        if start < 0:
            return text, []
        calls = []
        for block in text[start:].split(HERMES_OPEN)[1:]:
            body = block.split(HERMES_CLOSE, 1)[0].strip()
            try:
                call = _call(json.loads(body), None)
            except ValueError:
                return text, []
            if call is None:
                return text, []
            calls.append(call)
        content = text[:start]
        return (content if content.strip() else None), calls
    try:
        call = _call(json.loads(text), set(_tool_functions(tools)))
    except (ValueError, RequestError):
        return text, []
    return (text, []) if call is None else (None, [call])


def tool_call_start(text: str, fmt: str) -> int:
    """How much of a streamed reply is content for certain: where a tool call may begin (Hermes: at the tag or at
    a tail that could grow into it; JSON: at 0 while the reply is blank or starts with "{")."""
    if fmt == "hermes":
        at = text.find(HERMES_OPEN)
        if at >= 0:
            return at
        for k in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):
            if HERMES_OPEN.startswith(text[-k:]):
                return len(text) - k
        return len(text)
    head = text.lstrip()
    return 0 if not head or head.startswith("{") else len(text)
