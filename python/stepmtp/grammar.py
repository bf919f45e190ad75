"""Constrained decoding: JSON schemas, GBNF, Lark and regular expressions through llguidance.

llguidance (the library llama.cpp can use as its grammar backend) works on a
*byte-level* view of the vocabulary: every token is the bytes it decodes to, and
a grammar is matched against the bytes of the output, whatever the tokenization.
So the GGUF's vocabulary is all it needs, read here through ``Model``: each
token's piece, control tokens (those llama.cpp renders only with
``special=True``) marked with llguidance's 0xFF prefix so that no grammar text
can produce them, and every end-of-generation token as an EOS, allowed exactly
when the grammar is complete. Building that tokenizer walks the whole
vocabulary (1-2 s at 128k tokens), so it is made once per model
(``vocabulary``) and shared by every constraint compiled for it.

Three layers:

* ``Vocabulary``: llguidance's tokenizer for one model, and the mask's shape
  (``n_vocab`` tokens, ``n_words`` int32 words of 32 tokens each).
* ``Constraint``: one compiled grammar (``Constraint.compile(model, kind, spec)``),
  immutable, checked at compile time: an invalid grammar or schema raises
  ``GrammarError`` (a ValueError: the server's 400) with llguidance's message.
  ``start()`` gives a fresh state for one sequence (a cheap copy of the compiled
  matcher, so n sequences under one grammar compile it once).
* ``ConstraintState``: where one sequence is in the grammar. Per token:
  ``mask_into(logits)`` (disallowed tokens to -inf, in place), ``advance(token)``;
  ``rollback(n)`` undoes tokens (rejected drafts); ``done`` says only
  end-of-generation can follow. Masks are computed by llguidance straight into a
  preallocated int32 bitmask (the GIL released meanwhile) and applied with numpy.

Speculative decoding: the verifier needs, for a draft ``[d1..dn]``, the mask of
row i given the accepted prefix plus ``d1..di`` (i = 0..n). ``masks_along(drafts)``
computes the n+1 rows in one call into llguidance (its draft-aware executor:
it advances through the drafts and rolls back itself), leaving the state where
it was; rows past a draft the grammar rejects are all-disallowed (the verifier
never reaches them: that draft's own row forbids it). ``bitmasks_along_many``
does the same for several sequences at once, in parallel. The drafting side can
instead ``advance`` each draft as it is picked (masking the next head's row) and
``rollback(len(drafts))`` before verifying: the mask it used for depth i is the
verifier's row i.

End of generation is bookkept here rather than in llguidance: a token consumed
once the grammar has stopped (an EOS after ``}``) is not recorded by llguidance
(its rollback would undo the token before it), so the state keeps its own history
of which tokens llguidance counted, and ``rollback(n)`` always means "the last n
tokens given to ``advance``".
"""
from __future__ import annotations

import json
import re
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import numpy as np

import llguidance as llg
from llguidance.gbnf_to_lark import any_to_lark

if TYPE_CHECKING:
    from .llama import Model

__all__ = [
    "KINDS",
    "Constraint",
    "ConstraintState",
    "ConstraintFailed",
    "DisallowedToken",
    "GrammarError",
    "Vocabulary",
    "bitmasks_along_many",
    "lark_literal",
    "text_value_rules",
    "vocabulary",
]

#: the grammar kinds ``Constraint.compile`` takes
KINDS = ("json_schema", "json_object", "gbnf", "lark", "regex")

# llguidance's default allows unbounded whitespace between JSON tokens, and a model
# that starts emitting spaces or newlines can then fill the whole budget with them;
# llama.cpp's own schema converter bounds it (a newline or two and 20 of indent)
JSON_DEFAULTS: dict[str, Any] = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{1,22}"}

_CONTROL_MARKER = b"\xff"  # llguidance's special-token marker: never valid UTF-8


class GrammarError(ValueError):
    """The grammar or schema is invalid (or too large for llguidance's limits);
    the message is llguidance's."""


class DisallowedToken(ValueError):
    """``advance`` was given a token the grammar does not allow at this point."""

    def __init__(self, token: int, piece: bytes, position: int) -> None:
        self.token = token
        self.position = position
        super().__init__(f"token {token} ({piece!r}) is not allowed by the grammar after {position} tokens")


class ConstraintFailed(RuntimeError):
    """llguidance gave up during generation (a parser or lexer limit hit on this
    input); the state cannot go on."""


class Vocabulary:
    """llguidance's tokenizer for one vocabulary, and the shape of its masks.

    Use ``vocabulary(model)`` for a model's (cached); ``Vocabulary(pieces, ...)``
    builds one from token bytes directly (benchmarks, tests).

    Args:
        pieces: each token's bytes, control tokens prefixed with ``b"\\xff"``.
        eog: the end-of-generation token ids (allowed once the grammar is complete).
        tokenize: bytes to token ids, as the model tokenizes (llguidance uses it for
            the tokens a grammar forces, ``ConstraintState.forced``).
        bos: the BOS id, if any.
    """

    def __init__(self, pieces: Sequence[bytes], eog: Sequence[int], tokenize: Callable[[bytes], list[int]],
                 bos: int | None = None) -> None:
        if not eog:
            raise ValueError("the vocabulary has no end-of-generation token")
        self.n_vocab = len(pieces)
        self.n_words = (self.n_vocab + 31) // 32
        self.eog = np.array(sorted(set(int(t) for t in eog)), dtype=np.int64)
        self.pieces = pieces
        wrapped = _TokenizerSource(list(pieces), int(self.eog[0]), bos,
                                   [t for t, p in enumerate(pieces) if p.startswith(_CONTROL_MARKER)], tokenize)
        self.tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(wrapped), n_vocab=self.n_vocab,
                                         eos_token=[int(t) for t in self.eog])

    def piece(self, token: int) -> bytes:
        p = self.pieces[token]
        return p[1:] if p.startswith(_CONTROL_MARKER) else p


class _TokenizerSource:
    """The duck-typed tokenizer ``llguidance.TokenizerWrapper`` reads."""

    def __init__(self, tokens: list[bytes], eos: int, bos: int | None, special: list[int],
                 tokenize: Callable[[bytes], list[int]]) -> None:
        self.tokens = tokens
        self.eos_token_id = eos
        self.bos_token_id = bos
        self.special_token_ids = special
        self._tokenize = tokenize

    def __call__(self, data: bytes) -> list[int]:
        return self._tokenize(data)


_vocab_cache: "weakref.WeakKeyDictionary[Model, Vocabulary]" = weakref.WeakKeyDictionary()
_vocab_lock = threading.Lock()


def vocabulary(model: "Model") -> Vocabulary:
    """The llguidance vocabulary of a model, built on first use and kept as long as
    the model lives (1-2 s at 128k tokens: warm it at load time)."""
    with _vocab_lock:
        v = _vocab_cache.get(model)
        if v is None:
            v = _vocab_cache[model] = _model_vocabulary(model)
        return v


def _model_vocabulary(model: "Model") -> Vocabulary:
    pieces: list[bytes] = []
    for t in range(model.n_vocab):
        p = model.token_to_piece(t)
        if not p:
            # llama.cpp renders control tokens only when asked for special ones
            sp = model.token_to_piece(t, special=True)
            p = _CONTROL_MARKER + sp if sp else b""
        pieces.append(p)
    eog = [t for t in range(model.n_vocab) if model.is_eog(t)] or [model.eos]
    model_ref = weakref.ref(model)

    def tokenize(data: bytes) -> list[int]:
        m = model_ref()
        if m is None:
            raise RuntimeError("the model of this grammar was freed")
        return m.tokenize(data, add_special=False, parse_special=False)

    return Vocabulary(pieces, eog, tokenize, bos=model.bos if model.bos >= 0 else None)


def _grammar_text(kind: str, spec: Any, json_options: dict[str, Any] | None) -> str:
    if kind in ("json_schema", "json_object"):
        if kind == "json_object":
            schema: Any = {"type": "object"} if spec is None else spec
        else:
            schema = spec
        if isinstance(schema, (bytes, str)):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"a JSON schema is an object or a boolean, not {type(schema).__name__}")
        # an empty schema is an object to llama.cpp (llama-server's json_object)
        if (kind == "json_object" or schema == {}) and isinstance(schema, dict) and "type" not in schema:
            schema = {**schema, "type": "object"}
        schema = _typed_as_llama_cpp(schema)
        defaults = {**JSON_DEFAULTS, **(json_options or {})}
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
    if not isinstance(spec, str):
        raise GrammarError(f"a {kind} grammar is text, not {type(spec).__name__}")
    if kind == "gbnf":
        # as llama.cpp does with llguidance: a grammar opening with %llguidance
        # (or written in Lark) passes through, anything else is GBNF
        return llg.LLMatcher.grammar_from_lark(any_to_lark(spec))
    if kind == "lark":
        return llg.LLMatcher.grammar_from_lark(spec)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec)
    raise GrammarError(f"unknown grammar kind {kind!r} ({', '.join(KINDS)})")


# keywords whose subschemas are walked, and their shape: one schema, a list, a name -> schema map
_SUB_ONE = ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then", "else")
_SUB_LIST = ("items", "prefixItems", "anyOf", "oneOf", "allOf")
_SUB_MAP = ("properties", "patternProperties", "$defs", "definitions")
_STRING_FORMATS = ("date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5")


def _typed_as_llama_cpp(schema: Any) -> Any:
    """``schema`` with the type llama.cpp's schema converter (llama-server's default,
    without llguidance) gives a subschema that names none: ``properties`` or a
    non-``true`` ``additionalProperties`` make it an object, ``items`` or
    ``prefixItems`` an array, ``pattern`` or a date/time/uuid ``format`` a string.
    JSON Schema would let such a schema match any value (``{"items": [...]}`` then
    allows ``true``), where llama-server constrains to the array the client meant.
    Subschemas with ``$ref``, ``anyOf``/``oneOf``, ``const`` or ``enum`` keep theirs, as
    llama.cpp reads those first."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUB_MAP:
        if isinstance(out.get(key), dict):
            out[key] = {k: _typed_as_llama_cpp(v) for k, v in out[key].items()}
    for key in _SUB_LIST:
        if isinstance(out.get(key), list):
            out[key] = [_typed_as_llama_cpp(v) for v in out[key]]
    for key in _SUB_ONE:
        if isinstance(out.get(key), dict):
            out[key] = _typed_as_llama_cpp(out[key])
    if "type" in out or any(k in out for k in ("$ref", "anyOf", "oneOf", "const", "enum")):
        return out
    if "properties" in out or ("additionalProperties" in out and out["additionalProperties"] is not True):
        out["type"] = "object"
    elif "items" in out or "prefixItems" in out:
        out["type"] = "array"
    elif "pattern" in out or out.get("format") in _STRING_FORMATS:
        out["type"] = "string"
    return out


# -- one value written as text, held to its JSON schema (XML-like tool calls) ----------

# the string formats llama.cpp's schema converter knows, as the text they stand for
_DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,9})?([zZ]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_HEX = "[0-9a-fA-F]"
_TEXT_FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}[tT]{_TIME}",
    "uuid": f"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}",
}
_ANY = "(?s:.*)"


def _schema_type_set(schema: dict[str, Any]) -> set[str] | None:
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list) and all(isinstance(x, str) for x in t):
        return set(t)
    return None


def lark_literal(text: str) -> str:
    """``text`` as a literal of llguidance's Lark dialect (JSON's string syntax)."""
    return json.dumps(text, ensure_ascii=False)


def _text_literal(v: Any) -> str:
    """An enum or const value as such a format writes it: a string as itself."""
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False, separators=(",", ":"))


def _pattern_regex(pattern: str) -> str:
    """A JSON schema ``pattern`` as a regex over the whole text. JSON schema searches
    (``"a+"`` holds for ``"bab"``), as llguidance's converter does for
    ``response_format``: an end without its anchor takes any text."""
    head = pattern.startswith("^")
    tail = pattern.endswith("$") and not pattern.endswith("\\$")
    core = pattern[1 if head else 0: len(pattern) - 1 if tail else len(pattern)]
    return ("" if head else _ANY) + f"(?:{core})" + ("" if tail else _ANY)


def text_value_rules(name: str, schema: Any, close: str, marker: str,
                     json_options: dict[str, Any] | None = None,
                     defs: dict[str, Any] | None = None) -> list[str]:
    """Lark rules (llguidance's dialect) defining the rule ``name``: one value as
    XML-like tool-call formats write it (Step's, Qwen3-Coder's: a string as its own
    characters, any other value as JSON), held to its JSON schema, then ``close``,
    the markup that ends it.

    A string's text never holds ``marker`` (the parser ends the value at the first
    one) and follows the schema's ``enum``/``const``, ``minLength``/``maxLength``,
    ``pattern`` (but one llguidance cannot compile) and the ``format``s llama.cpp
    knows (others: any text, as there). It is one lexeme with ``close``: llguidance's
    lexer is greedy, and a string that can go on with ``close``'s first characters (a
    newline, ``<``) would never end.

    Any other value is JSON under llguidance's schema converter, as
    ``response_format`` is (lenient: what it does not support is not enforced, as
    with llama.cpp's converter); ``defs``: the tool's ``$defs``, for its ``$ref``s.
    A schema that allows a string and other types, or says nothing of its type,
    takes any text, as llama.cpp's grammar does (a string of digits is a string)."""
    if not isinstance(schema, dict):
        schema = {}
    terminal = name.upper()
    literals = schema.get("enum") if isinstance(schema.get("enum"), list) else (
        [schema["const"]] if "const" in schema else None)
    types = _schema_type_set(schema)
    if literals is not None:
        if not literals:
            raise GrammarError("an empty enum allows no value")
        body = "(" + " | ".join(lark_literal(_text_literal(v)) for v in literals) + ")"
    elif types is not None and "string" not in types:
        sub = _typed_as_llama_cpp(schema)
        sub = {**sub, "x-guidance": {**JSON_DEFAULTS, "lenient": True, **(json_options or {})}}
        for key, value in (defs or {}).items():
            sub.setdefault(key, value)
        return [f"{name}: %json {json.dumps(sub, ensure_ascii=False)} {lark_literal(close)}"]
    else:
        parts = []
        if types == {"string"}:
            lo, hi = schema.get("minLength"), schema.get("maxLength")
            if isinstance(lo, int) or isinstance(hi, int):
                lo = lo if isinstance(lo, int) and lo > 0 else 0
                hi = "" if not isinstance(hi, int) or hi < 0 else str(hi)
                parts.append(f"/(?s:.{{{lo},{hi}}})/")
            if isinstance(schema.get("pattern"), str):
                rx = "/" + llg.regex_to_lark(_pattern_regex(schema["pattern"]), "dw") + "/"
                # one llguidance cannot compile (a look-around) is not enforced, as
                # the rest of what the lenient converter does not support
                if not llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_lark(f"start: {rx}")):
                    parts.append(rx)
            if schema.get("format") in _TEXT_FORMATS:
                parts.append("/" + _TEXT_FORMATS[schema["format"]] + "/")
        # a negation may match bytes that are not UTF-8: another part keeps to text
        mark = llg.regex_to_lark(re.escape(marker))
        body = "(" + " & ".join(parts or [f"/{_ANY}/"]) + f" & ~/{_ANY}{mark}{_ANY}/)"
    return [f"{name}: {terminal}", f"{terminal}: {body} {lark_literal(close)}"]


_executor: llg.LLExecutor | None = None
_executor_lock = threading.Lock()


def _get_executor() -> llg.LLExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = llg.LLExecutor()
        return _executor


class Constraint:
    """One compiled grammar for one vocabulary; ``start()`` makes per-sequence states.

    Immutable and safe to share between threads (each state is its own copy).
    """

    def __init__(self, vocab: Vocabulary, kind: str, grammar: str, matcher: llg.LLMatcher) -> None:
        self.vocab = vocab
        self.kind = kind
        #: llguidance's grammar (JSON text), e.g. for logging
        self.grammar = grammar
        self._matcher = matcher
        self._lock = threading.Lock()
        #: llguidance's warnings about the grammar (unsupported schema keywords ...)
        self.warnings: list[str] = list(matcher.get_grammar_warnings())

    @classmethod
    def compile(cls, model: "Model | Vocabulary", kind: str, spec: Any = None, *,
                json_options: dict[str, Any] | None = None,
                limits: llg.LLParserLimits | None = None) -> "Constraint":
        """Compile a grammar for a model's vocabulary.

        Args:
            model: a ``Model`` (its vocabulary is built once and cached) or a ``Vocabulary``.
            kind: ``json_schema`` (spec: a dict or JSON text), ``json_object`` (any
                JSON object; spec: None or a schema to narrow it), ``gbnf`` (llama.cpp's
                GBNF, or Lark opening with ``%llguidance``), ``lark``, ``regex``.
            json_options: llguidance's JSON options over ``JSON_DEFAULTS``
                (``whitespace_pattern``, ``item_separator``, ``lenient`` ...).
            limits: llguidance's parser limits (its defaults otherwise).

        Raises:
            GrammarError: the grammar or schema is invalid; the message says where.
        """
        vocab = model if isinstance(model, Vocabulary) else vocabulary(model)
        try:
            grammar = _grammar_text(kind, spec, json_options)
        except GrammarError:
            raise
        except Exception as e:  # llguidance's own ValueErrors, the GBNF converter's errors
            raise GrammarError(f"invalid {kind}: {e}") from None
        matcher = llg.LLMatcher(vocab.tokenizer, grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise GrammarError(f"invalid {kind}: {matcher.get_error().strip()}")
        return cls(vocab, kind, grammar, matcher)

    def start(self) -> "ConstraintState":
        """A state at the start of the grammar, for one sequence."""
        with self._lock:  # deep_copy reads the matcher: one copy at a time
            matcher = self._matcher.deep_copy()
        return ConstraintState(self, matcher)

    def __repr__(self) -> str:
        return f"<Constraint {self.kind}, {self.vocab.n_vocab} tokens>"


class ConstraintState:
    """Where one sequence stands in a grammar. Not thread-safe: one owner at a time.

    The mask methods describe the next token after everything ``advance``d so far.
    """

    def __init__(self, constraint: Constraint, matcher: llg.LLMatcher) -> None:
        self.constraint = constraint
        self.vocab = constraint.vocab
        self._m = matcher
        #: the tokens given to ``advance``, in order
        self.tokens: list[int] = []
        self._counted: list[bool] = []  # whether llguidance recorded each of self.tokens
        v = self.vocab
        self._bits = np.zeros((1, v.n_words), dtype=np.int32)
        self._bits_fresh = False

    # -- state ----------------------------------------------------------------

    @property
    def accepting(self) -> bool:
        """The output so far is complete: end-of-generation is allowed now."""
        return self._m.is_accepting()

    @property
    def done(self) -> bool:
        """Only end-of-generation can follow (the grammar has nothing more to
        produce), or end-of-generation was consumed: stop the sequence."""
        return self._m.is_stopped()

    @property
    def stop_reason(self) -> str:
        """llguidance's reason (``NotStopped``, ``NoExtension``, ``EndOfSentence`` ...)."""
        return self._m.stop_reason()

    def copy(self) -> "ConstraintState":
        """An independent state at the same point (a fork: n samples of one prompt)."""
        c = ConstraintState(self.constraint, self._m.deep_copy())
        c.tokens = list(self.tokens)
        c._counted = list(self._counted)
        return c

    def _check(self) -> None:
        if self._m.is_error():
            raise ConstraintFailed(self._m.get_error().strip())

    # -- masks ----------------------------------------------------------------

    def fill_bitmask(self, out: np.ndarray | None = None) -> np.ndarray:
        """The next token's mask as int32 words (bit t % 32 of word t // 32 set:
        token t allowed): the state's own buffer, computed once per position (valid
        until the state moves), or a copy into ``out`` (int32, ``[n_words]``)."""
        if not self._bits_fresh:
            self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
            self._check()
            self._bits_fresh = True
        if out is None:
            return self._bits[0]
        if out.dtype != np.int32 or out.shape != (self.vocab.n_words,):
            raise ValueError(f"the bitmask must be int32 of shape ({self.vocab.n_words},)")
        out[...] = self._bits[0]
        return out

    def mask(self) -> np.ndarray:
        """The next token's mask as booleans, ``[n_vocab]`` (True: allowed)."""
        return _unpack(self.fill_bitmask(), self.vocab.n_vocab)

    def mask_into(self, logits: np.ndarray, bits: np.ndarray | None = None) -> None:
        """Set the logits of the tokens the grammar forbids next to -inf, in place.

        ``logits``: one row, at least ``n_vocab`` wide (columns past the vocabulary,
        padding some models carry, are forbidden too). ``bits``: a mask kept from
        ``fill_bitmask`` at the same position, instead of this state's."""
        _apply(logits, self.fill_bitmask() if bits is None else bits, self.vocab.n_vocab)

    def masked(self, logits: np.ndarray, bits: np.ndarray | None = None) -> np.ndarray:
        """A copy of ``logits`` with ``mask_into`` applied (the driver's rows are views
        into llama.cpp's output buffer)."""
        out = logits.copy()
        self.mask_into(out, bits)
        return out

    def allowed(self, token: int) -> bool:
        """Whether the mask allows ``token`` next (computing the mask if this position
        has none yet)."""
        t = int(token)
        if not 0 <= t < self.vocab.n_vocab:
            return False
        # Not llguidance's validate_tokens: where the grammar forces text, the mask
        # admits only the model's own tokenization of it ("ame" after '"n' for a
        # key "name", not "a"), which validate_tokens does not check, and once the
        # grammar has stopped validate_tokens refuses the EOS the mask allows.
        bits = self.fill_bitmask()
        return bool((int(bits[t >> 5]) >> (t & 31)) & 1)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens``, from the first, the masks allow in a row: drafts
        past that are rejected whatever the target says. Costs a mask per token."""
        toks = [int(t) for t in tokens]
        bits = self.bitmasks_along(toks)
        for i, t in enumerate(toks):
            if not 0 <= t < self.vocab.n_vocab or not (int(bits[i, t >> 5]) >> (t & 31)) & 1:
                return i
        return len(toks)

    def forced(self) -> list[int]:
        """The tokens the grammar forces from here (its only continuation, tokenized
        as the model would), possibly none: they can be appended without sampling."""
        return list(self._m.compute_ff_tokens())

    # -- moving ---------------------------------------------------------------

    def advance(self, token: int) -> None:
        """Consume one token. Raises ``DisallowedToken`` (the state unchanged) when
        the grammar does not allow it."""
        t = int(token)
        if not self.allowed(t):
            piece = self.vocab.piece(t) if 0 <= t < self.vocab.n_vocab else b""
            raise DisallowedToken(t, piece, len(self.tokens))
        counted = not self._m.is_stopped()
        if not self._m.consume_token(t):
            self._check()
            raise ConstraintFailed(f"llguidance refused token {t} it allowed")
        self.tokens.append(t)
        self._counted.append(counted)
        self._bits_fresh = False

    def advance_many(self, tokens: Iterable[int]) -> None:
        """``advance`` each token in turn; on a disallowed one the tokens before it
        stay consumed."""
        for t in tokens:
            self.advance(t)

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` tokens given to ``advance``."""
        if n < 0 or n > len(self.tokens):
            raise ValueError(f"cannot roll back {n} of {len(self.tokens)} tokens")
        if n == 0:
            return
        k = sum(self._counted[-n:])
        if k and not self._m.rollback(k):
            self._check()
            raise ConstraintFailed(f"llguidance could not roll back {k} tokens")
        del self.tokens[-n:]
        del self._counted[-n:]
        self._bits_fresh = False

    def begin_round(self) -> None:
        """The MTP driver starts a round: a grammar has nothing to pick up between rounds."""

    def reset(self) -> None:
        """Back to the start of the grammar."""
        self.rollback(len(self.tokens))

    # -- speculative decoding -------------------------------------------------

    def bitmasks_along(self, drafts: Sequence[int], out: np.ndarray | None = None) -> np.ndarray:
        """The masks of rows 0..n of a draft ``[d1..dn]`` as int32 words,
        ``[n+1, n_words]``: row i is the mask after the state's tokens plus
        ``d1..di``. The state is left as it was. Rows past the first draft the grammar
        forbids, or past an end-of-generation, are all zero."""
        return bitmasks_along_many([(self, drafts)], out)[0]

    def masks_along(self, drafts: Sequence[int]) -> np.ndarray:
        """``bitmasks_along`` as booleans, ``[n+1, n_vocab]`` (True: allowed)."""
        bits = self.bitmasks_along(drafts)
        return _unpack(bits, self.vocab.n_vocab)

    def mask_rows_into(self, logits: np.ndarray, drafts: Sequence[int]) -> np.ndarray:
        """Mask the verifier's logits rows ``[n+1, >= n_vocab]`` for a draft
        ``[d1..dn]`` in place (row i as ``bitmasks_along``); returns the bitmasks."""
        bits = self.bitmasks_along(drafts)
        if logits.ndim != 2 or logits.shape[0] != bits.shape[0]:
            raise ValueError(f"{len(drafts)} drafts need {bits.shape[0]} logits rows, got shape {logits.shape}")
        for row, b in zip(logits, bits):
            _apply(row, b, self.vocab.n_vocab)
        return bits

    def __repr__(self) -> str:
        return (f"<ConstraintState {self.constraint.kind}: {len(self.tokens)} tokens, "
                f"{'done' if self.done else 'accepting' if self.accepting else 'open'}>")


def bitmasks_along_many(items: Sequence[tuple[ConstraintState, Sequence[int]]],
                        out: np.ndarray | None = None) -> list[np.ndarray]:
    """``ConstraintState.bitmasks_along`` for several sequences in one call, computed
    in parallel by llguidance's thread pool (the GIL released).

    ``items``: (state, drafts) pairs, states of one vocabulary and each state at
    most once. ``out``: optional C-contiguous int32 ``[sum(len(drafts)+1), n_words]``
    to fill; the result is one view of it per item, ``[len(drafts)+1, n_words]``.
    """
    if not items:
        return []
    vocab = items[0][0].vocab
    rows = sum(len(d) + 1 for _, d in items)
    shape = (rows, vocab.n_words)
    if out is None:
        out = np.zeros(shape, dtype=np.int32)
    else:
        if out.dtype != np.int32 or out.shape != shape or not out.flags["C_CONTIGUOUS"]:
            raise ValueError(f"out must be C-contiguous int32 of shape {shape}")
        out.fill(0)  # llguidance leaves the rows after a rejected draft unwritten
    with_drafts, plain = [], []  # llguidance's draft call refuses an empty draft
    views = []
    r = 0
    for state, drafts in items:
        if state.vocab is not vocab:
            raise ValueError("the states belong to different vocabularies")
        state._check()
        if len(drafts):
            with_drafts.append((state._m, r, [int(t) for t in drafts]))
        else:
            plain.append((state._m, r))
        views.append(out[r:r + len(drafts) + 1])
        r += len(drafts) + 1
    ex = _get_executor()
    if with_drafts:
        ex.unsafe_compute_mask_ptr_with_draft_token(with_drafts, out.ctypes.data, vocab.n_words * 4, rows)
    if plain:
        ex.unsafe_compute_mask_ptr(plain, out.ctypes.data, vocab.n_words * 4, rows)
    for state, _ in items:
        state._check()
    return views


def _unpack(bits: np.ndarray, n_vocab: int) -> np.ndarray:
    """int32 mask words to booleans. On a little-endian host (every target of
    llama.cpp's CPU and CUDA builds) the bytes of a word hold its tokens in order."""
    flat = np.ascontiguousarray(bits).view(np.uint8)
    per_row = bits.shape[-1] * 32
    unpacked = np.unpackbits(flat.reshape(-1, per_row // 8), axis=1, bitorder="little")
    out = unpacked[:, :n_vocab].view(bool)
    return out[0] if bits.ndim == 1 else out


def _apply(logits: np.ndarray, bits: np.ndarray, n_vocab: int) -> None:
    """Forbidden tokens of one row to -inf.

    Token ids are in merge order, so allowed ones are scattered over the mask's
    words rather than in runs. Where few words hold any (JSON punctuation, a forced
    key: many rows of structured output) keeping those values and filling the row
    costs a fraction of numpy's masked copy over the whole row."""
    if logits.ndim != 1 or logits.shape[0] < n_vocab:
        raise ValueError(f"logits must be one row of at least {n_vocab} values, got shape {logits.shape}")
    if np.count_nonzero(bits) * 4 < bits.shape[0]:
        allowed = np.unpackbits(bits.view(np.uint8), count=n_vocab, bitorder="little").view(bool)
        keep = np.flatnonzero(allowed)
        values = logits[keep]
        logits.fill(-np.inf)
        logits[keep] = values
        return
    # unpacking the complement of the words is cheaper than negating the unpacked row
    forbidden = np.unpackbits(np.invert(bits).view(np.uint8), count=n_vocab, bitorder="little").view(bool)
    np.copyto(logits[:n_vocab], -np.inf, where=forbidden)
    if logits.shape[0] > n_vocab:
        logits[n_vocab:] = -np.inf
