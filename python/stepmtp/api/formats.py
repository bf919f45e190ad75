"""Response bodies in llama-server's shapes (tools/server/server-task.cpp):
native /completion results and stream chunks, OpenAI completions and chat
(whole and streamed), timings, usage, and SSE framing."""
from __future__ import annotations

import functools
import json
import math
import secrets
import string
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from ..slots import Completion
from ..sampling import SamplingParams, TokenProbs
from ..stats import GenStats

_ALNUM = string.digits + string.ascii_uppercase + string.ascii_lowercase


def random_id(prefix: str) -> str:
    """llama-server's ids: a prefix and 32 random letters and digits."""
    return prefix + "".join(secrets.choice(_ALNUM) for _ in range(32))


def completion_id() -> str:
    """llama-server's gen_chatcmplid(), used for completions and chat alike."""
    return random_id("chatcmpl-")


def _finite(x: float) -> float | None:
    # JSON has no inf/nan; llama-server's nlohmann writes them as null
    return x if math.isfinite(x) else None


def sse(obj: Any) -> str:
    """One server-sent event as llama-server writes it."""
    return "data: " + dumps(obj) + "\n\n"


SSE_DONE = "data: [DONE]\n\n"


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


@dataclass
class Settings:
    """A request's settings once resolved (what generation_settings reports)."""

    sampling: SamplingParams
    seed: int  # as llama-server shows it: 4294967295 for random
    n_predict: int
    stop: list[str]
    stream: bool
    ignore_eos: bool = False
    logit_bias: list[tuple[int, float | None]] = field(default_factory=list)
    spec_type: str = "none"
    n_max: int = 3
    n_min: int = 0
    p_min: float = 0.0
    mtp_mode: str = "chain"
    n_probs: int = 0
    post_sampling_probs: bool = False
    chat_format: str = "Content-only"
    reasoning_format: str = "none"
    #: the request's own LoRA scales (id -> scale; empty: the server's)
    lora: dict[int, float] = field(default_factory=dict)
    #: every streamed chunk carries the timings so far (llama-server's timings_per_token)
    timings_per_token: bool = False


def generation_settings(s: Settings) -> dict[str, Any]:
    """task_params::to_json(): llama-server's keys, with the values this server used
    (the samplers it lacks at their disabled values)."""
    p = s.sampling
    return {
        "seed": s.seed,
        "temperature": p.temperature,
        "dynatemp_range": p.dynatemp_range,
        "dynatemp_exponent": p.dynatemp_exponent,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "min_p": p.min_p,
        "top_n_sigma": p.top_n_sigma,
        "xtc_probability": p.xtc_probability,
        "xtc_threshold": p.xtc_threshold,
        "typical_p": p.typical_p,
        "repeat_last_n": p.repeat_last_n,
        "repeat_penalty": p.repeat_penalty,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "dry_multiplier": 0.0,
        "dry_base": 1.75,
        "dry_allowed_length": 2,
        "dry_penalty_last_n": -1,
        "dry_sequence_breakers": ["\n", ":", "\"", "*"],
        "mirostat": 0,
        "mirostat_tau": 5.0,
        "mirostat_eta": 0.1,
        "stop": list(s.stop),
        "max_tokens": s.n_predict,
        "n_predict": s.n_predict,
        "n_keep": 0,
        "n_discard": 0,
        "ignore_eos": s.ignore_eos,
        "stream": s.stream,
        "logit_bias": [{"bias": b, "token": t} for t, b in s.logit_bias],  # None: -inf, as nlohmann writes it
        "n_probs": s.n_probs,
        "min_keep": p.min_keep,
        "grammar": "",
        "grammar_lazy": False,
        "grammar_triggers": [],
        "preserved_tokens": [],
        "chat_format": s.chat_format,
        "reasoning_format": s.reasoning_format,
        "reasoning_in_content": False,
        "generation_prompt": "",
        "samplers": list(p.samplers),
        "speculative.types": s.spec_type,
        "speculative.n_max": s.n_max,
        "speculative.n_min": s.n_min,
        "speculative.p_min": s.p_min,
        "speculative.mtp_mode": s.mtp_mode if "draft-mtp" in s.spec_type else "none",
        "timings_per_token": s.timings_per_token,
        "post_sampling_probs": s.post_sampling_probs,
        "backend_sampling": False,
        "lora": [{"id": i, "scale": x} for i, x in sorted(s.lora.items())],
    }


def timings(st: GenStats, predicted_n: int) -> dict[str, Any]:
    """result_timings::to_json(): draft_n / draft_n_accepted only when something was drafted."""
    # prompt_n: the tokens decoded; cache_n: those reused from the slot's KV
    prompt_n, prompt_ms, pred_ms = st.n_prompt - st.n_prompt_cached, st.t_prompt_ms, st.t_gen_ms
    t: dict[str, Any] = {
        "cache_n": st.n_prompt_cached,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": _finite(prompt_ms / prompt_n) if prompt_n else None,
        "prompt_per_second": _finite(1e3 / prompt_ms * prompt_n) if prompt_ms > 0 else None,
        "predicted_n": predicted_n,
        "predicted_ms": pred_ms,
        "predicted_per_token_ms": _finite(pred_ms / predicted_n) if predicted_n else None,
        "predicted_per_second": _finite(1e3 / pred_ms * predicted_n) if pred_ms > 0 else None,
    }
    if st.n_drafted > 0:
        t["draft_n"] = st.n_drafted
        t["draft_n_accepted"] = st.n_accepted
    return t


def mtp_info(st: GenStats, mode: str, n_heads: int, n_draft: int) -> dict[str, Any]:
    """This server's extra field: what the MTP heads did, per draft depth."""
    return {
        "mode": mode,
        "n_heads": n_heads,
        "n_draft": n_draft,
        "rounds": st.n_rounds,
        "draft_n": st.n_drafted,
        "draft_n_accepted": st.n_accepted,
        "accept_rate": st.accept_rate,
        "draft_n_per_depth": list(st.drafted_per_depth),
        "draft_n_accepted_per_depth": list(st.accepted_per_depth),
        # of draft_n, the drafts copied from the context (the depths count the heads')
        "draft_n_context": st.n_drafted_context,
        "draft_n_accepted_context": st.n_accepted_context,
    }


@dataclass
class ResultInfo:
    """What every final response needs besides the Completion."""

    model: str
    n_ctx: int
    settings: Settings
    mtp_mode: str
    n_heads: int
    n_draft: int
    prompt_text: str = ""
    id: str = ""
    created: int = 0
    #: token id -> its bytes (for token probabilities)
    piece: Callable[[int], bytes] | None = None


def chunk_timings(res: dict[str, Any], ch: Any, info: "ResultInfo") -> dict[str, Any]:
    """``res`` with the timings so far when the request asked for them per token."""
    if info.settings.timings_per_token and getattr(ch, "stats", None) is not None:
        res["timings"] = chunk_stats_timings(ch)
    return res


def chunk_stats_timings(ch: Any) -> dict[str, Any]:
    """``timings`` as of a streamed chunk (its request's statistics, its generation time)."""
    return timings(replace(ch.stats, t_gen_ms=ch.t_gen_ms), ch.n_decoded)


def n_decoded(c: Completion) -> int:
    """llama-server's n_decoded: tokens sampled, the end-of-generation token included."""
    return c.stats.n_predicted if c.stats.n_predicted else len(c.tokens)


def pieces_text(model: Any, tokens: list[int]) -> str:
    """llama-server's /detokenize (tokens_to_str): each token's piece, special tokens
    written out, joined; not llama_detokenize, whose clean-up of a vocabulary's
    spaces ("clean_up_tokenization_spaces", on for GPT-2-style ones) turns
    "France ?" into "France?"."""
    return b"".join(model.token_to_piece(t, special=True) for t in tokens).decode("utf-8", "replace")


def truncated(c: Completion, info: ResultInfo) -> bool:
    """The context filled before n_predict (or an end) was reached."""
    return c.stop_type == "limit" and not 0 < info.settings.n_predict <= len(c.tokens)


def oai_finish_reason(c: Completion) -> str:
    return "stop" if c.stop_type in ("eos", "word") else "length"


# -- token probabilities ------------------------------------------------------------

#: what llama-server writes for log(0) (JSON has no -inf)
LOG_ZERO = -3.4028234663852886e38


def _token_json(piece: bytes, tok: int, p: float, post: bool) -> dict[str, Any]:
    return {"id": tok, "token": piece.decode("utf-8", "ignore"), "bytes": list(piece),
            ("prob" if post else "logprob"): p if post else (math.log(p) if p > 0 else LOG_ZERO)}


def probs_json(probs: list[TokenProbs], info: ResultInfo) -> list[dict[str, Any]]:
    """completion_token_output::probs_vector_to_json(): each token with its
    probability and the top tokens' ("logprob"/"top_logprobs", or after the sampling
    chain "prob"/"top_probs")."""
    piece = info.piece or (lambda t: b"")
    out = []
    for tp in probs:
        d = _token_json(piece(tp.token), tp.token, tp.p, tp.post)
        d["top_probs" if tp.post else "top_logprobs"] = [_token_json(piece(t), t, p, tp.post) for t, p in tp.top]
        out.append(d)
    return out


def native_final(c: Completion, info: ResultInfo, *, index: int = 0, stream: bool = False,
                 return_tokens: bool = False) -> dict[str, Any]:
    """server_task_result_cmpl_final::to_json_non_oaicompat() (+ "mtp")."""
    nd = n_decoded(c)
    res = {
        "index": index,
        "content": "" if stream else c.text,
        "tokens": [] if stream or not return_tokens else list(c.tokens),
        "id_slot": c.slot,
        "stop": True,
        "model": info.model,
        "tokens_predicted": nd,
        "tokens_evaluated": len(c.prompt_tokens),
        "generation_settings": generation_settings(info.settings),
        "prompt": info.prompt_text,
        "has_new_line": "\n" in c.text,
        "truncated": truncated(c, info),
        "stop_type": c.stop_type,
        "stopping_word": c.stopping_word,
        "tokens_cached": len(c.prompt_tokens) + len(c.tokens),
        "timings": timings(c.stats, nd),
        "mtp": mtp_info(c.stats, info.mtp_mode, info.n_heads, info.n_draft),
    }
    if c.probs and not stream:
        res["completion_probabilities"] = probs_json(c.probs, info)
    return res


def native_partial(text: str, tokens: list[int], n_decoded_so_far: int, n_prompt: int,
                   index: int = 0, probs: list[TokenProbs] | None = None,
                   info: ResultInfo | None = None) -> dict[str, Any]:
    """server_task_result_cmpl_partial::to_json_non_oaicompat()."""
    res = {
        "index": index,
        "content": text,
        "tokens": tokens,
        "stop": False,
        "id_slot": 0,
        "tokens_predicted": n_decoded_so_far,
        "tokens_evaluated": n_prompt,
    }
    if probs and info is not None:
        res["completion_probabilities"] = probs_json(probs, info)
    return res


def usage(results: list[Completion]) -> dict[str, Any]:
    completion = sum(n_decoded(c) for c in results)
    prompt = sum(len(c.prompt_tokens) for c in results)
    return {
        "completion_tokens": completion,
        "prompt_tokens": prompt,
        "total_tokens": completion + prompt,
        "prompt_tokens_details": {"cached_tokens": sum(c.stats.n_prompt_cached for c in results)},
    }


@functools.lru_cache(maxsize=1)
def build_info() -> str:
    """llama_build_info(): "b<build>-<commit>" of the llama.cpp inside (the sdist carries
    no build number: 0)."""
    from ..binding import llama_cpp_commit

    return f"b0-{llama_cpp_commit() or 'unknown'}"


def _envelope(info: ResultInfo, obj: str) -> dict[str, Any]:
    return {
        "created": info.created or int(time.time()),
        "model": info.model,
        "system_fingerprint": build_info(),
        "object": obj,
        "id": info.id,
    }


def oai_completion(results: list[Completion], info: ResultInfo) -> dict[str, Any]:
    """to_json_oaicompat(), several results merged into one choices list as llama-server does."""
    res: dict[str, Any] = {
        "choices": [
            {"text": c.text, "index": i, "logprobs": _oai_logprobs(c.probs, info),
             "finish_reason": oai_finish_reason(c)}
            for i, c in enumerate(results)
        ],
    }
    res.update(_envelope(info, "text_completion"))
    res["usage"] = usage(results)
    res["timings"] = timings(results[0].stats, n_decoded(results[0]))
    res["mtp"] = mtp_info(results[0].stats, info.mtp_mode, info.n_heads, info.n_draft)
    return res


def _oai_logprobs(probs: list[TokenProbs], info: ResultInfo) -> dict[str, Any] | None:
    return {"content": probs_json(probs, info)} if probs else None


def oai_completion_chunk(text: str, info: ResultInfo, *, index: int = 0,
                         probs: list[TokenProbs] | None = None) -> dict[str, Any]:
    res: dict[str, Any] = {"choices": [{"text": text, "index": index, "logprobs": _oai_logprobs(probs or [], info),
                                        "finish_reason": None}]}
    res.update(_envelope(info, "text_completion"))
    return res


def oai_completion_final_chunk(c: Completion, info: ResultInfo) -> dict[str, Any]:
    """The stream's last event: the final result with its text already sent."""
    res: dict[str, Any] = {"choices": [{"text": "", "index": 0, "logprobs": None,
                                        "finish_reason": oai_finish_reason(c)}]}
    res.update(_envelope(info, "text_completion"))
    res["usage"] = usage([c])
    res["timings"] = timings(c.stats, n_decoded(c))
    res["mtp"] = mtp_info(c.stats, info.mtp_mode, info.n_heads, info.n_draft)
    return res


def chat_finish_reason(c: Completion, message: dict[str, Any]) -> str:
    """"tool_calls" when the model ended after calling tools, else as oai_finish_reason."""
    reason = oai_finish_reason(c)
    return "tool_calls" if reason == "stop" and message.get("tool_calls") else reason


def oai_chat(results: list[Completion], info: ResultInfo,
             messages: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """to_json_oaicompat_chat(); ``messages``: each result's parsed assistant message."""
    msgs = messages or [{"role": "assistant", "content": c.text} for c in results]
    res: dict[str, Any] = {
        "choices": [
            {"finish_reason": chat_finish_reason(c, m), "index": i, "message": m,
             **({"logprobs": _oai_logprobs(c.probs, info)} if c.probs else {})}
            for i, (c, m) in enumerate(zip(results, msgs))
        ],
    }
    res.update(_envelope(info, "chat.completion"))
    res["usage"] = usage(results)
    res["timings"] = timings(results[0].stats, n_decoded(results[0]))
    res["mtp"] = mtp_info(results[0].stats, info.mtp_mode, info.n_heads, info.n_draft)
    return res


def oai_chat_chunk(delta: dict[str, Any], info: ResultInfo, finish_reason: str | None = None,
                   probs: list[TokenProbs] | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"finish_reason": finish_reason, "index": 0, "delta": delta}
    if probs:
        choice["logprobs"] = _oai_logprobs(probs, info)
    res: dict[str, Any] = {"choices": [choice]}
    res.update(_envelope(info, "chat.completion.chunk"))
    return res


def oai_chat_final_chunks(c: Completion, info: ResultInfo, include_usage: bool,
                          finish_reason: str | None = None) -> list[dict[str, Any]]:
    """to_json_oaicompat_chat_stream(): the finish chunk, the usage chunk when asked
    for (empty choices), timings on the last."""
    out = [oai_chat_chunk({}, info, finish_reason or oai_finish_reason(c))]
    if include_usage:
        u: dict[str, Any] = {"choices": []}
        u.update(_envelope(info, "chat.completion.chunk"))
        u["usage"] = usage([c])
        out.append(u)
    out[-1]["timings"] = timings(c.stats, n_decoded(c))
    out[-1]["mtp"] = mtp_info(c.stats, info.mtp_mode, info.n_heads, info.n_draft)
    return out
