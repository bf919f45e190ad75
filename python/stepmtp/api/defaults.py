"""What a request that leaves a setting out falls back on: the server's flags
(``ServerConfig`` extends this), or the engine's own for calls in the process."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..sampling import SamplingParams

#: llama.cpp's LLAMA_DEFAULT_SEED: "a random seed", as llama-server reports it
DEFAULT_SEED = 0xFFFFFFFF


@dataclass
class RequestDefaults:
    """A request's defaults and bounds, named after llama-server's flags."""

    #: --seed; -1 (or 4294967295): random
    seed: int = -1
    #: -n: n_predict of a request that gives none; -1: no limit
    n_predict: int = -1
    #: default sampling of a request (--temp, --top-k, ...)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    #: --jinja / --no-jinja: jinja templates, or llama.cpp's built-in ones
    use_jinja: bool = True
    #: --chat-template / --chat-template-file: a jinja template or a built-in name; None: the model's
    chat_template: str | None = None
    #: --chat-template-kwargs: template variables for every request (a request's own win)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    #: most top tokens a request may ask probabilities for (n_probs, top_logprobs)
    max_n_probs: int = 100
    #: request limits (past them: a 400)
    max_prompts: int = 64
    max_stop: int = 32
    max_stop_len: int = 1024
    max_logit_bias: int = 4096
    #: --reasoning-format: none (all in content), deepseek / auto (thoughts in reasoning_content)
    reasoning_format: str = "auto"
    #: --reasoning-budget: -1 no limit, 0 no thinking (the opened <think> is closed in the prompt)
    reasoning_budget: int = -1
    reasoning_budget_message: str = ""
    #: -r: the stop strings of a request that gives none
    stop: list[str] = field(default_factory=list)
    #: --ignore-eos: a request's ignore_eos when it does not say
    ignore_eos: bool = False
    #: -l: (token, bias) of a request that gives no logit_bias (None: -inf)
    logit_bias: list[tuple[int, float]] = field(default_factory=list)
    #: --grammar / -j: (kind, spec) constraining a request that gives none ("gbnf" / "json_schema")
    grammar: tuple[str, Any] | None = None
    #: -sp: every special token's text in the output (not only a chat format's markers)
    special: bool = False
    #: --no-cache-prompt: a request's cache_prompt when it does not say
    cache_prompt: bool = True
    #: --skip-chat-parsing: chat output all in content (no reasoning or tool-call parsing)
    skip_chat_parsing: bool = False
    #: --no-prefill-assistant: a chat's last assistant message is a whole message, not the
    #: start of the answer
    prefill_assistant: bool = True

    @property
    def seed_u32(self) -> int:
        return DEFAULT_SEED if self.seed < 0 else self.seed & 0xFFFFFFFF

    def chat_template_source(self) -> str | None:
        """The jinja template to render instead of the model's (None: the model's)."""
        if self.chat_template == "chatml":
            from ..chat import CHATML_TEMPLATE

            return CHATML_TEMPLATE
        return self.chat_template
