"""What the server was started with: one dataclass the command line fills and the
app reads, and how it turns into an Engine."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ..sampling import SamplingParams

if TYPE_CHECKING:
    from ..engine import Engine
    from ..placement import Placement

#: llama.cpp's LLAMA_DEFAULT_SEED: "a random seed", as llama-server reports it
DEFAULT_SEED = 0xFFFFFFFF

SpecType = Literal["draft-mtp", "none"]
MTPMode = Literal["chain", "single"]


def default_model_path() -> Path:
    """The model served when no ``-m`` is given: the bundled trained model."""
    from ..models import default_model_path as bundled

    return bundled()


@dataclass
class ServerConfig:
    """The server's settings, named after llama-server's flags."""

    #: -m; None: the bundled default model (``default_model_path``)
    model: str | None = None
    #: --spec-draft-model: a separate MTP-only GGUF with the heads
    mtp_model: str | None = None
    #: --spec-type: "draft-mtp" (the MTP heads draft) or "none" (plain decoding)
    spec_type: SpecType = "none"
    #: --spec-mtp-mode: "chain" (head i drafts step i) or "single" (head 0 looped)
    mtp_mode: MTPMode = "chain"
    n_max: int = 3
    n_min: int = 0
    p_min: float = 0.0
    #: --spec-draft-vocab: the heads draft among the first N token ids (-1: auto, 0: all)
    draft_vocab: int = -1
    #: --spec-schedule: "fused" (process inside the next draft decodes) or "reference"
    schedule: str = "fused"
    #: --spec-verify: "auto" (rejection sampling above temperature 0), "exact", "rejection"
    verify: str = "auto"
    #: choose the draft length each round (--no-spec-adaptive, or n-min = n-max: a fixed one)
    adaptive: bool = True
    #: --spec-batch-invariant: each row of a target decode computed as if alone
    batch_invariant: bool = False
    #: -c; 0: the model's training context
    n_ctx: int = 0
    n_batch: int = 2048
    n_ubatch: int = 512
    #: -np as given (-1: auto: 4 slots sharing a unified KV cache, as llama-server)
    n_parallel: int = -1
    #: -kvu / -no-kvu; None: unified when -np is auto (llama-server's default)
    kv_unified: bool | None = None
    #: -sps: a request goes to the idle slot sharing at least this share of its prompt
    slot_prompt_similarity: float = 0.1
    #: --cache-ram: MiB of host memory for prompts slots lose (-1 no bound, 0 none)
    cache_ram_mib: int = 8192
    #: --swa-full: a full-size sliding-window cache (default: window + ubatch)
    swa_full: bool = False
    #: --ctx-checkpoints: context checkpoints per slot (a trimmed sliding-window cache)
    ctx_checkpoints: int = 32
    #: --slot-save-path: where slot files go (None: slot actions disabled)
    slot_save_path: str | None = None
    #: --ui / --no-ui: the chat page at /
    ui: bool = True
    #: --slots / --no-slots: the /slots endpoint
    endpoint_slots: bool = True
    n_threads: int | None = None
    n_threads_batch: int | None = None
    n_gpu_layers: int | str = "auto"
    n_gpu_layers_draft: int | str | None = None
    #: --rpc: RPC servers (host:port) holding offloaded layers of the model and the draft model
    rpc: list[str] = field(default_factory=list)
    flash_attn: bool | None = None
    #: -ot / -cmoe / -ncmoe, -dev, -sm, -ts, -mg: where the model goes (None: llama.cpp's defaults)
    placement: Placement | None = None
    #: -otd / -cmoed / -ncmoed, -devd (with -sm, -ts, -mg): where a separate MTP model goes
    placement_draft: Placement | None = None
    #: -ctk / -ctv: the target's KV cache types; -ctkd / -ctvd: every MTP head context's
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    cache_type_k_draft: str = "f16"
    cache_type_v_draft: str = "f16"
    #: --mmap / --no-mmap, --mlock
    use_mmap: bool = True
    use_mlock: bool = False
    #: --numa: distribute, isolate, numactl (None: ggml's default)
    numa: str | None = None
    #: --seed; -1 (or 4294967295): random
    seed: int = -1
    #: -n: n_predict of a request that gives none; -1: no limit
    n_predict: int = -1
    #: default sampling of a request (--temp, --top-k, ...)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    host: str = "127.0.0.1"
    port: int = 8080
    api_keys: list[str] = field(default_factory=list)
    #: -a/--alias, in the order given
    aliases: list[str] = field(default_factory=list)
    verbose: bool = False
    #: --jinja / --no-jinja: jinja templates, or llama.cpp's built-in ones
    use_jinja: bool = True
    #: --chat-template / --chat-template-file: a jinja template or a built-in name; None: the model's
    chat_template: str | None = None
    #: --chat-template-kwargs: template variables for every request (a request's own win)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    #: most top tokens a request may ask probabilities for (n_probs, top_logprobs)
    max_n_probs: int = 100
    #: request limits (past them: 413 for the body, 400 for the rest, 503 for the queue)
    max_body_bytes: int = 32 << 20
    max_prompts: int = 64
    max_stop: int = 32
    max_stop_len: int = 1024
    max_logit_bias: int = 4096
    #: requests waiting for a slot at most (-1: no bound)
    max_queue: int = 256
    #: --tags: the model's tags, listed by /models
    tags: list[str] = field(default_factory=list)
    #: --reasoning-format: none (all in content), deepseek / auto (thoughts in reasoning_content)
    reasoning_format: str = "auto"
    #: --reasoning-budget: -1 no limit, 0 no thinking (the opened <think> is closed in the prompt)
    reasoning_budget: int = -1
    reasoning_budget_message: str = ""
    #: bounds of one template rendering (seconds, characters of output)
    template_timeout: float = 5.0
    template_max_chars: int = 4 << 20

    # -- derived ------------------------------------------------------------------

    @property
    def speculative(self) -> bool:
        return self.spec_type == "draft-mtp"

    @property
    def engine_mode(self) -> str:
        return self.mtp_mode if self.speculative else "none"

    @property
    def total_slots(self) -> int:
        """Slots, as llama-server counts them (-np; auto: 4, fewer when a small -b could
        not carry every slot's verify rows in one decode: each needs n-max + 2)."""
        if self.n_parallel > 0:
            return self.n_parallel
        return max(1, min(4, self.n_batch // (self.n_max + 2))) if self.speculative else 4

    @property
    def unified_kv(self) -> bool:
        if self.kv_unified is not None:
            return self.kv_unified
        return self.n_parallel < 0

    @property
    def seed_u32(self) -> int:
        return DEFAULT_SEED if self.seed < 0 else self.seed & 0xFFFFFFFF

    def chat_template_source(self) -> str | None:
        """The jinja template to render instead of the model's (None: the model's)."""
        if self.chat_template == "chatml":
            from ..chat import CHATML_TEMPLATE

            return CHATML_TEMPLATE
        return self.chat_template

    def model_path(self) -> Path:
        return Path(self.model) if self.model else default_model_path()

    def model_name(self, path: Path | None = None) -> str:
        """What responses call the model: llama-server takes the first alias (its
        aliases are a sorted set), else the -m path as given."""
        if self.aliases:
            return sorted(self.aliases)[0]
        return self.model if self.model else str(path or self.model_path())

    def load_engine(self, path: Path | None = None) -> "Engine":
        from ..engine import Engine

        path = path or self.model_path()
        return Engine(
            path,
            mtp_model=self.mtp_model if self.speculative else None,
            mode=self.engine_mode,  # type: ignore[arg-type]
            n_max=self.n_max,
            n_min=self.n_min,
            p_min=self.p_min,
            draft_vocab=self.draft_vocab,
            schedule=self.schedule,  # type: ignore[arg-type]
            verify=self.verify,  # type: ignore[arg-type]
            adaptive=self.adaptive,
            n_ctx=self.n_ctx,
            n_batch=self.n_batch,
            n_ubatch=self.n_ubatch,
            n_threads=self.n_threads,
            n_threads_batch=self.n_threads_batch,
            n_gpu_layers=self.n_gpu_layers,
            n_gpu_layers_draft=self.n_gpu_layers_draft,
            rpc=self.rpc or None,
            n_parallel=self.total_slots,
            kv_unified=self.unified_kv,
            slot_prompt_similarity=self.slot_prompt_similarity,
            cache_ram_mib=self.cache_ram_mib,
            swa_full=self.swa_full,
            ctx_checkpoints=self.ctx_checkpoints,
            seed=self.seed if 0 <= self.seed < DEFAULT_SEED else -1,
            flash_attn=self.flash_attn,
            batch_invariant=self.batch_invariant,
            type_k=self.cache_type_k,
            type_v=self.cache_type_v,
            type_k_draft=self.cache_type_k_draft,
            type_v_draft=self.cache_type_v_draft,
            use_mmap=self.use_mmap,
            use_mlock=self.use_mlock,
            numa=self.numa,
            **self._placement_kw(),
        )

    def _placement_kw(self) -> dict[str, Any]:
        """The Engine keywords of the two placements (the overrides as they were
        given, in their order: -cmoe / -ncmoe already among them)."""
        out: dict[str, Any] = {}
        for pl, sfx in ((self.placement, ""), (self.placement_draft, "_draft")):
            if pl is not None:
                out.update({"override_tensor" + sfx: list(pl.override_tensor), "devices" + sfx: pl.devices})
        pl = self.placement or self.placement_draft
        if pl is not None:
            out.update(split_mode=pl.split_mode, tensor_split=list(pl.tensor_split) or None, main_gpu=pl.main_gpu)
        return out
