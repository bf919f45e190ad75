"""Request bodies, as pydantic models with llama-server's field names and defaults.

Validation is strict about types (``"n_predict": "8"`` is an error, not 8) and
about the ranges llama-server refuses (``n_predict`` below -1, ...); a field it
clamps (``top_p`` above 1, a negative ``temperature``) is clamped the same way
later. Fields this server does not know are accepted and ignored, as llama-server
does; the sampling features it lacks are refused when a request turns them on.
Errors become llama-server's 400 error JSON (``format_validation_error``).
"""
from __future__ import annotations

from typing import Annotated, Any, Optional, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, WithJsonSchema,
                      field_validator)

from ..sampling import parse_samplers

INT32_MAX = 2**31 - 1


def _integral(v: Any) -> Any:
    # 8.0 is an integer to JSON clients that only have doubles; "8" and true are not
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


Int = Annotated[int, BeforeValidator(_integral)]

# -- prompt ---------------------------------------------------------------------

#: A prompt after validation: its pieces in order, strings to tokenize and token ids.
PromptPieces = list[Union[int, str]]

_PROMPT_SCHEMA = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
        {"type": "array", "items": {"anyOf": [
            {"type": "string"},
            {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
        ]}},
    ],
    "description": "A string, a list of token ids (and strings), or a list of such prompts.",
}

_PROMPT_SHAPE = ("must be a string, a list of token ids (strings may be mixed in), "
                 "or a list of such prompts")


def _is_token(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) or isinstance(x, float) and x.is_integer()


def _pieces(p: Any) -> PromptPieces:
    if isinstance(p, str):
        return [p]
    if isinstance(p, list):
        out: PromptPieces = []
        for x in p:
            if isinstance(x, str):
                out.append(x)
            elif _is_token(x):
                out.append(int(x))
            else:
                raise ValueError(f"'prompt' {_PROMPT_SHAPE}; found {type(x).__name__} {x!r} in a token list")
        return out
    if isinstance(p, dict):
        if "multimodal_data" in p:
            raise ValueError("multimodal prompts are not supported by this server")
        if isinstance(p.get("prompt_string"), str):
            return [p["prompt_string"]]
    raise ValueError(f"'prompt' {_PROMPT_SHAPE}")


def parse_prompts(value: Any) -> list[PromptPieces]:
    """llama-server's reading of ``prompt``: a list holding a number is one prompt
    (tokens, strings mixed in); any other list is a list of prompts."""
    if isinstance(value, list):
        if not value:
            raise ValueError("'prompt' must not be empty")
        if any(_is_token(x) for x in value):
            return [_pieces(value)]
        return [_pieces(p) for p in value]
    return [_pieces(value)]


Prompt = Annotated[Any, WithJsonSchema(_PROMPT_SCHEMA)]


# -- the common fields of the completion routes --------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class GenerationFields(_Request):
    """Sampling and stopping, shared by /completion, /v1/completions and /v1/chat/completions."""

    n_predict: Optional[Int] = Field(None, ge=-1, le=INT32_MAX,
                                     description="Tokens to generate at most; -1: no limit (default)")
    max_tokens: Optional[Int] = Field(None, ge=-1, le=INT32_MAX, description="OpenAI's name for n_predict")
    max_completion_tokens: Optional[Int] = Field(None, ge=-1, le=INT32_MAX,
                                                 description="OpenAI's newer name for n_predict")
    temperature: Optional[float] = Field(None, description="0: greedy. Default: the server's --temp (0.8)")
    top_k: Optional[Int] = Field(None, description="0: disabled. Default 40")
    top_p: Optional[float] = Field(None, description="1.0: disabled. Default 0.95")
    min_p: Optional[float] = Field(None, description="0.0: disabled. Default 0.05")
    repeat_penalty: Optional[float] = Field(None, description="1.0: disabled (default)")
    repeat_last_n: Optional[Int] = Field(None, ge=-1, le=INT32_MAX,
                                         description="Tokens the penalties look back at; -1: all. Default 64")
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    seed: Optional[Int] = Field(None, description="-1: random (default)")
    stop: Annotated[Any, WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}},
                                                   {"type": "null"}]})] = Field(None, validate_default=True)
    ignore_eos: bool = False
    logit_bias: Annotated[Any, WithJsonSchema({"anyOf": [{"type": "array"}, {"type": "object"}, {"type": "null"}]})] = Field(
        None, validate_default=True)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n_cmpl: Optional[Int] = Field(None, ge=1, description="Completions per prompt (also 'n')")
    n: Optional[Int] = Field(None, ge=1)
    return_tokens: bool = False
    #: stream: prompt_progress reports while the prompt is decoded (llama-server's)
    return_progress: bool = False
    cache_prompt: bool = True
    #: stream: every chunk carries the timings so far (llama-server's)
    timings_per_token: bool = False
    id_slot: Int = -1
    #: report each token's probability and the n most likely tokens' (completion_probabilities)
    n_probs: Int = Field(0, ge=0)
    #: the probabilities after the sampling chain instead of the raw logits'
    post_sampling_probs: bool = False
    # llama-server's other samplers (None: the server's value)
    typical_p: Optional[float] = None
    top_n_sigma: Optional[float] = None
    xtc_probability: Optional[float] = None
    xtc_threshold: Optional[float] = None
    dynatemp_range: Optional[float] = None
    dynatemp_exponent: Optional[float] = None
    min_keep: Optional[Int] = Field(None, ge=0, le=INT32_MAX)
    samplers: Annotated[Any, WithJsonSchema({"anyOf": [{"type": "array", "items": {"type": "string"}},
                                                       {"type": "string"}, {"type": "null"}]})] = Field(
        None, description="The samplers' order: names, or a string of llama.cpp's sampler letters")
    # llama-server's samplers this server does not have: refused when turned on
    mirostat: Int = 0
    dry_multiplier: float = 0.0
    grammar: Optional[str] = None
    json_schema: Optional[Any] = None
    #: llama-server's LoRA scales for this request: [{"id": N, "scale": S}, ...]; the
    #: adapters it does not name are off (an empty list or none: the server's scales)
    lora: Annotated[Any, WithJsonSchema({"anyOf": [{"type": "array", "items": {"type": "object"}},
                                                   {"type": "null"}]})] = None

    @field_validator("stop", mode="after")
    @classmethod
    def _stop(cls, v: Any) -> list[str]:
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            return list(v)
        raise ValueError("'stop' must be a string or a list of strings")

    @field_validator("logit_bias", mode="after")
    @classmethod
    def _logit_bias(cls, v: Any) -> list[tuple[Union[int, str], Optional[float]]]:
        """[[token or text, bias or false], ...] or {"token or text": bias or false}; None = -inf."""
        if v is None:
            return []
        pairs: list[tuple[Any, Any]]
        if isinstance(v, dict):
            pairs = list(v.items())
        elif isinstance(v, list):
            pairs = []
            for p in v:
                if not (isinstance(p, list) and len(p) == 2):
                    raise ValueError("'logit_bias' must be [[token, bias], ...] or {token: bias}")
                pairs.append((p[0], p[1]))
        else:
            raise ValueError("'logit_bias' must be [[token, bias], ...] or {token: bias}")
        out: list[tuple[Union[int, str], Optional[float]]] = []
        for key, bias in pairs:
            if isinstance(key, str) and key.lstrip("-").isdigit():
                key = int(key)
            elif not (isinstance(key, str) or _is_token(key)):
                raise ValueError(f"'logit_bias': {key!r} is neither a token id nor a text")
            if bias is False:
                b: Optional[float] = None
            elif isinstance(bias, (int, float)) and not isinstance(bias, bool) and bias == bias \
                    and abs(bias) != float("inf"):
                b = float(bias)
            else:
                raise ValueError(f"'logit_bias': the bias of {key!r} must be a number or false")
            out.append((int(key) if not isinstance(key, str) else key, b))
        return out

    def requested_n_probs(self) -> int:
        """How many top tokens to report per token (0: no probabilities)."""
        return self.n_probs

    def requested_n_predict(self) -> int | None:
        for v in (self.n_predict, self.max_completion_tokens, self.max_tokens):
            if v is not None:
                return v
        return None

    def unsupported(self) -> list[str]:
        """Features the request turns on that this server lacks."""
        out = []
        if self.mirostat != 0:
            out.append("mirostat")
        if self.dry_multiplier != 0.0:
            out.append("dry_multiplier (DRY)")
        return out  # a sampler order naming one this server lacks: SamplingParams refuses it

    def requested_samplers(self) -> tuple[str, ...] | None:
        """The samplers' order the request gives (llama-server: a list of names, or a
        string of one-letter codes), or None."""
        v = self.samplers
        if v is None:
            return None
        if isinstance(v, str):
            return parse_samplers(v, chars=True)
        if isinstance(v, list):
            return parse_samplers([x for x in v if isinstance(x, str)])
        return None  # llama-server reads only a list or a string

    def requested_grammar(self) -> tuple[str, Any] | None:
        """llama-server's json_schema / grammar (GBNF): (kind, spec) for grammar.Constraint."""
        if self.json_schema is not None:
            return ("json_schema", self.json_schema)
        if self.grammar:
            return ("gbnf", self.grammar)
        return None


class CompletionRequest(GenerationFields):
    """``POST /completion``: llama-server's native completion."""

    prompt: Prompt = Field(..., description=_PROMPT_SCHEMA["description"])
    response_fields: Optional[list[str]] = None

    @field_validator("prompt", mode="after")
    @classmethod
    def _prompt(cls, v: Any) -> list[PromptPieces]:
        return parse_prompts(v)


class OAICompletionRequest(CompletionRequest):
    """``POST /v1/completions``: OpenAI's completions."""

    model: Optional[str] = None
    echo: bool = False
    logprobs: Optional[Int] = None
    best_of: Optional[Any] = None
    suffix: Optional[Any] = None

    def requested_n_probs(self) -> int:
        return self.logprobs if self.logprobs else self.n_probs

    def unsupported(self) -> list[str]:
        out = super().unsupported()
        if self.echo:
            out.append("echo (only no echo is supported)")
        if self.best_of is not None:
            out.append("best_of")
        if self.suffix is not None:
            out.append("suffix")
        return out


class ContentPart(_Request):
    type: str
    text: Optional[str] = None


class ChatMessage(_Request):
    role: str
    content: Union[str, list[ContentPart], None] = None

    def text(self, sep: str = "\n") -> str:
        """The content as text: parts joined by ``sep`` (llama.cpp joins a message's
        parts with a newline, an assistant prefill's with a blank line)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for p in self.content:
            if p.type != "text":
                raise ValueError(f"content parts of type {p.type!r} are not supported (text only)")
            parts.append(p.text or "")
        return sep.join(parts)


class ChatCompletionRequest(GenerationFields):
    """``POST /v1/chat/completions``: OpenAI's chat completions, rendered with the GGUF's template."""

    #: may be empty, as llama-server's: the template renders the generation prompt alone
    messages: list[ChatMessage]
    model: Optional[str] = None
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None
    response_format: Optional[dict[str, Any]] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None
    reasoning_format: Optional[str] = None
    reasoning_effort: Optional[str] = None
    #: llama-server's per-request --reasoning-budget (-1: the server's)
    thinking_budget_tokens: Optional[Int] = Field(None, ge=-1, le=INT32_MAX)
    #: llama-server's: the reasoning can be ended while it runs (/v1/chat/completions/control)
    reasoning_control: bool = False
    #: vLLM's: continue the last (assistant) message instead of starting a new one
    continue_final_message: Optional[bool] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[Int] = Field(None, ge=0)

    def requested_n_probs(self) -> int:
        """OpenAI's logprobs / top_logprobs, as llama-server maps them (20 by default)."""
        if self.logprobs:
            return self.top_logprobs if self.top_logprobs is not None else 20
        if self.top_logprobs is not None:
            raise ValueError("top_logprobs requires logprobs to be set to true")
        return self.n_probs

    def unsupported(self) -> list[str]:
        out = super().unsupported()
        return out

    def requested_grammar(self) -> tuple[str, Any] | None:
        """OpenAI's response_format (json_object, json_schema), else llama-server's fields."""
        rf = self.response_format
        if rf is None or rf.get("type", "text") == "text":
            return super().requested_grammar()
        kind = rf.get("type")
        if kind == "json_object":
            schema = rf.get("schema")
            if schema is not None and not isinstance(schema, dict):
                raise ValueError("response_format.schema must be an object")
            return ("json_schema", schema) if isinstance(schema, dict) else ("json_object", None)
        if kind == "json_schema":
            js = rf.get("json_schema")
            schema = js.get("schema") if isinstance(js, dict) else None
            if schema is None:
                schema = rf.get("schema")
            if not isinstance(schema, dict):
                raise ValueError("response_format json_schema needs a 'json_schema': {'schema': {...}}")
            return ("json_schema", schema)
        raise ValueError(f"response_format type must be text, json_object or json_schema, not {kind!r}")


class TokenizeRequest(_Request):
    content: Prompt = Field(..., description="Text (or a list of texts and token ids) to tokenize")
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False

    @field_validator("content", mode="after")
    @classmethod
    def _content(cls, v: Any) -> PromptPieces:
        if isinstance(v, str):
            return [v]
        return _pieces(v)


class DetokenizeRequest(_Request):
    tokens: list[Int] = Field(default_factory=list)


# -- errors ---------------------------------------------------------------------


def format_validation_error(exc: ValidationError | Any) -> str:
    """One line naming each bad field, e.g. ``n_predict: Input should be greater than or equal to -1``."""
    errors = exc.errors() if hasattr(exc, "errors") else []
    msgs = []
    for e in errors:
        typ = e.get("type", "")
        if typ == "json_invalid":
            ctx = e.get("ctx") or {}
            msgs.append(f"the body is not valid JSON: {ctx.get('error', e.get('msg', ''))}")
            continue
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        msg = e.get("msg", "invalid")
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        if typ == "missing":
            msgs.append(f"'{where}' is required")
        elif typ == "model_type" and not loc:
            msgs.append("the body must be a JSON object")
        elif where and not msg.startswith(f"'{where.split('.')[0]}'"):
            msgs.append(f"{where}: {msg}")
        else:
            msgs.append(msg)
    seen: list[str] = []
    for m in msgs:
        if m not in seen:
            seen.append(m)
    return "; ".join(seen) or "invalid request"
