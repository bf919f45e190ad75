"""``GET /metrics``: llama-server's Prometheus metrics, plus the MTP heads' own.

llama-server's names and meanings are kept (``llamacpp:*``); what it has no
metric for is under ``stepmtp:*``: drafted and accepted tokens (in total and per
draft depth), rounds, requests finished and cancelled.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from ..engine import Completion
from ..stats import MAX_DEPTH, GenStats


@dataclass
class _Totals:
    n_prompt_tokens: int = 0
    t_prompt_ms: float = 0.0
    n_predicted: int = 0
    t_predicted_ms: float = 0.0
    n_decode: int = 0
    n_tokens_max: int = 0
    n_drafted: int = 0
    n_accepted: int = 0
    n_drafted_context: int = 0
    n_accepted_context: int = 0
    drafted_per_depth: list[int] = field(default_factory=lambda: [0] * MAX_DEPTH)
    accepted_per_depth: list[int] = field(default_factory=lambda: [0] * MAX_DEPTH)
    n_rounds: int = 0
    n_requests: int = 0
    n_cancelled: int = 0
    n_errors: int = 0


class Metrics:
    """Counters updated by the worker thread, read by ``/metrics``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._t = _Totals()
        self.t_start = int(time.time())

    def record(self, completion: Completion | None, *, cancelled: bool = False, failed: bool = False) -> None:
        with self._lock:
            t = self._t
            if cancelled:
                t.n_cancelled += 1
            elif failed:
                t.n_errors += 1
            if completion is None:
                return
            st: GenStats = completion.stats
            t.n_requests += 1
            t.n_prompt_tokens += st.n_prompt
            t.t_prompt_ms += st.t_prompt_ms
            t.n_predicted += st.n_predicted
            t.t_predicted_ms += st.t_gen_ms
            t.n_decode += st.n_target_decodes + st.n_draft_decodes
            t.n_tokens_max = max(t.n_tokens_max, len(completion.prompt_tokens) + len(completion.tokens))
            t.n_drafted += st.n_drafted
            t.n_accepted += st.n_accepted
            t.n_drafted_context += st.n_drafted_context
            t.n_accepted_context += st.n_accepted_context
            for d in range(min(MAX_DEPTH, len(st.drafted_per_depth))):
                t.drafted_per_depth[d] += st.drafted_per_depth[d]
                t.accepted_per_depth[d] += st.accepted_per_depth[d]
            t.n_rounds += st.n_rounds

    def render(self, *, processing: int, deferred: int) -> str:
        with self._lock:
            t = _Totals(**{k: (list(v) if isinstance(v, list) else v) for k, v in vars(self._t).items()})
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, value: float | int,
                   labels: list[tuple[str, float | int]] | None = None) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            if labels is None:
                out.append(f"{name} {_num(value)}")
            else:
                for label, v in labels:
                    out.append(f"{name}{{{label}}} {_num(v)}")

        # llama-server's, same names, types and help
        metric("llamacpp:prompt_tokens_total", "counter", "Number of prompt tokens processed.", t.n_prompt_tokens)
        metric("llamacpp:prompt_seconds_total", "counter", "Prompt process time", t.t_prompt_ms / 1e3)
        metric("llamacpp:tokens_predicted_total", "counter", "Number of generation tokens processed.", t.n_predicted)
        metric("llamacpp:tokens_predicted_seconds_total", "counter", "Predict process time", t.t_predicted_ms / 1e3)
        metric("llamacpp:n_decode_total", "counter", "Total number of llama_decode() calls", t.n_decode)
        metric("llamacpp:n_tokens_max", "counter", "Largest observed n_tokens.", t.n_tokens_max)
        metric("llamacpp:prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s.",
               1e3 * t.n_prompt_tokens / t.t_prompt_ms if t.t_prompt_ms > 0 else 0.0)
        metric("llamacpp:predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s.",
               1e3 * t.n_predicted / t.t_predicted_ms if t.t_predicted_ms > 0 else 0.0)
        metric("llamacpp:requests_processing", "gauge", "Number of requests processing.", processing)
        metric("llamacpp:requests_deferred", "gauge", "Number of requests deferred.", deferred)
        metric("llamacpp:n_busy_slots_per_decode", "gauge", "Average number of busy slots per llama_decode() call",
               1.0 if t.n_decode else 0.0)
        # the MTP heads
        metric("stepmtp:draft_tokens_total", "counter", "Tokens drafted (by the MTP heads and from the context).",
               t.n_drafted)
        metric("stepmtp:draft_tokens_context_total", "counter", "Of those, tokens drafted from the context.",
               t.n_drafted_context)
        metric("stepmtp:draft_tokens_accepted_context_total", "counter",
               "Drafted tokens from the context the target accepted.", t.n_accepted_context)
        metric("stepmtp:draft_tokens_accepted_total", "counter", "Drafted tokens the target accepted.", t.n_accepted)
        metric("stepmtp:draft_accept_rate", "gauge", "Accepted / drafted tokens since the start.",
               t.n_accepted / t.n_drafted if t.n_drafted else 0.0)
        metric("stepmtp:draft_tokens_by_depth_total", "counter",
               "Rounds whose heads drafted at least d tokens (depth d = the d-th draft token of a round).",
               0, [(f'depth="{d + 1}"', v) for d, v in enumerate(t.drafted_per_depth)])
        metric("stepmtp:draft_tokens_accepted_by_depth_total", "counter",
               "Rounds whose first d drafts were all accepted.",
               0, [(f'depth="{d + 1}"', v) for d, v in enumerate(t.accepted_per_depth)])
        metric("stepmtp:mtp_rounds_total", "counter", "Speculative rounds (draft, verify, accept).", t.n_rounds)
        metric("stepmtp:requests_total", "counter", "Generations finished.", t.n_requests)
        metric("stepmtp:requests_cancelled_total", "counter",
               "Generations stopped because the client went away.", t.n_cancelled)
        metric("stepmtp:requests_failed_total", "counter", "Generations that failed in the engine.", t.n_errors)
        return "\n".join(out) + "\n"


def _num(v: float | int) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, int):
        return str(v)
    return repr(float(v))
