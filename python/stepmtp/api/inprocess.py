"""``Engine.create_chat_completion`` and ``Engine.create_completion``: llama-cpp-python's
``Llama`` calls, answered in the process by the server's own request handling.

A call's keywords become the request body the server would have received (llama-cpp-
python's names mapped to OpenAI's and llama-server's), validated by the same request
models, planned by the same ``API`` (prompt, tool-call grammar, reasoning budget,
sampling), run in the calling thread on the engine, and read back by the same parsers
and response builders. The result is what the server's JSON would be: dicts, or an
iterator of chunk dicts with ``stream=True``.
"""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from .defaults import RequestDefaults
from .errors import bad_request
from .schemas import ChatCompletionRequest, OAICompletionRequest, format_validation_error
from .service import API, SpecReport, run_stream, run_whole

__all__ = ["api_of", "chat_completion", "completion"]


def api_of(eng: Any) -> API:
    """The engine's request handling, made on first use: its defaults are llama-server's
    (``RequestDefaults``, the engine's seed), its model name the model file's path."""
    api = eng._api
    if api is None:
        mode = eng.spec.mode
        spec = SpecReport("draft-mtp" if mode != "none" else "none", mode if mode != "none" else "chain",
                          eng.spec.n_max, eng.spec.n_min, eng.spec.p_min)
        api = API(eng, RequestDefaults(seed=eng.seed), model_name=str(eng.model.path), spec=spec, mtp_mode=mode)
        eng._api = api
    return api


def _validated(model: type[Any], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise bad_request(format_validation_error(e)) from None


def _body(call: str, model: type[Any], args: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """The request body of a call: llama-cpp-python's keywords (``args``) in the API's
    names, then the request fields given by their own names (``extra``)."""
    body: dict[str, Any] = {}
    for name in ("logits_processor", "stopping_criteria"):
        if args.pop(name, None) is not None:
            raise bad_request(f"{name} is not supported: the sampling runs in the engine's own loop "
                              "(use logit_bias, grammar or response_format)")
    if args.pop("tfs_z", 1.0) != 1.0:
        raise bad_request("tfs_z: tail-free sampling is not in llama.cpp any more (1.0, off, only)")
    args.pop("mirostat_tau", None)
    args.pop("mirostat_eta", None)
    body["mirostat"] = args.pop("mirostat_mode", 0)  # refused unless 0, as the server refuses it
    grammar = args.pop("grammar", None)
    if grammar is not None:
        if not isinstance(grammar, str):
            raise bad_request("grammar must be GBNF text (llama-cpp-python's LlamaGrammar is not used here)")
        body["grammar"] = grammar
    name = args.pop("model", None)
    for key, value in args.items():
        if value is not None:
            body[key] = list(value) if isinstance(value, tuple) else value
    for key, value in extra.items():
        if key not in model.model_fields:
            raise TypeError(f"{call}() got an unexpected keyword argument {key!r}")
        body[key] = value
    if name is not None:
        body["model"] = name
    return body


def chat_completion(eng: Any, args: dict[str, Any], extra: dict[str, Any]) -> Any:
    """``Engine.create_chat_completion``: the OpenAI chat response (dict), or its chunks."""
    args = dict(args)
    functions, function_call = args.pop("functions", None), args.pop("function_call", None)
    if functions is not None and args.get("tools") is None:  # OpenAI's older names for tools
        args["tools"] = [{"type": "function", "function": f} for f in functions]
        if function_call is not None:
            args["tool_choice"] = function_call if isinstance(function_call, str) else \
                {"type": "function", "function": function_call}
    budget = args.pop("reasoning_budget", None)
    if budget is not None:
        args["thinking_budget_tokens"] = budget
    body = _body("create_chat_completion", ChatCompletionRequest, args, extra)
    body["messages"] = list(body.get("messages") or [])
    req = _validated(ChatCompletionRequest, body)
    if req.unsupported():
        raise bad_request(f"not supported: {', '.join(req.unsupported())}")
    jobs = api_of(eng).chat_jobs(req)
    _name(jobs.info, req)
    if not req.stream:
        return jobs.response(run_whole(eng, jobs.gens))
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return run_stream(eng, jobs.gens[0], jobs.chunks(include_usage, usage_on_finish=True))


def completion(eng: Any, args: dict[str, Any], extra: dict[str, Any]) -> Any:
    """``Engine.create_completion``: the OpenAI completion response (dict), or its chunks."""
    body = _body("create_completion", OAICompletionRequest, dict(args), extra)
    if isinstance(body.get("prompt"), tuple):
        body["prompt"] = list(body["prompt"])
    req = _validated(OAICompletionRequest, body)
    jobs = api_of(eng).completion_jobs(req, req.prompt, stream=req.stream)
    _name(jobs.info, req)
    if not req.stream:
        return jobs.response(run_whole(eng, jobs.gens))
    return run_stream(eng, jobs.gens[0], jobs.chunks())


def _name(info: Any, req: Any) -> None:
    # llama-cpp-python answers with the model name the call gave (the server: its own)
    if req.model:
        info.model = req.model

