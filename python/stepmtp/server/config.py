"""What the server was started with: one dataclass the command line fills and the
app reads, and how it turns into an Engine."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ..api.defaults import DEFAULT_SEED, RequestDefaults
from ..drafters.ngram import NgramConfig

if TYPE_CHECKING:
    from ..engine import Engine
    from ..placement import Placement

SpecType = Literal["draft-mtp", "none"]
MTPMode = Literal["chain", "single"]


def default_model_path() -> Path:
    """The model served when no ``-m`` is given: the bundled trained model."""
    from ..models import default_model_path as bundled

    return bundled()


@dataclass(frozen=True)
class Cors:
    """--cors-*: what a response's CORS headers say (llama-server's rules)."""

    origins: str = "*"
    methods: str = "GET, POST, DELETE, OPTIONS"
    headers: str = "*"
    credentials: bool = True

    def allow_origin(self, origin: str | None) -> str | None:
        """The Access-Control-Allow-Origin for a request's Origin (None: no header)."""
        if self.credentials and self.origins == "*":
            return origin or ""  # any origin, credentials allowed: the caller's reflected
        if self.origins == "localhost":
            from urllib.parse import urlsplit

            host = urlsplit(origin or "").hostname
            return origin if host in ("localhost", "127.0.0.1", "::1") else None
        return self.origins


@dataclass(frozen=True)
class LogConfig:
    """--log-*, -lv."""

    disable: bool = False
    file: str | None = None
    jsonl: bool = False
    colors: bool | None = None
    verbosity: int = 3
    prefix: bool = True
    timestamps: bool = True


@dataclass
class ServerConfig(RequestDefaults):
    """The server's settings, named after llama-server's flags (a request's defaults
    and bounds in ``RequestDefaults``)."""

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
    #: --spec-type's llama-server n-gram drafters (ngram-simple, ..., ngram-cache)
    ngram_types: tuple[str, ...] = ()
    #: their settings (--spec-ngram-*, -lcs, -lcd)
    ngram: NgramConfig = field(default_factory=NgramConfig)
    #: draft from the context beside the heads (--no-spec-context: off)
    spec_context: bool = True
    #: earlier requests' tokens kept per pool (per API key) to draft from (0: none,
    #: --spec-ngram-shared off)
    context_pool: int = 1 << 18
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
    host: str = "127.0.0.1"
    port: int = 8080
    api_keys: list[str] = field(default_factory=list)
    #: -a/--alias, in the order given
    aliases: list[str] = field(default_factory=list)
    #: -hf / -hff: the model by name on the Hugging Face Hub (user/repo[:quant], a file of it)
    hf_repo: str | None = None
    hf_file: str | None = None
    #: -hfd / -hffd: the draft (MTP heads) model by name (default with -hf: a heads file beside the model)
    hf_repo_draft: str | None = None
    hf_file_draft: str | None = None
    #: -hft / HF_TOKEN: the hub's access token (None: huggingface_hub's, HF_TOKEN)
    hf_token: str | None = None
    #: -mu: the model at a URL
    model_url: str | None = None
    #: --offline: models from the hub's cache only (as HF_HUB_OFFLINE=1)
    offline: bool = False
    verbose: bool = False
    #: request limits past RequestDefaults' (past them: 413 for the body, 503 for the queue)
    max_body_bytes: int = 32 << 20
    #: requests waiting for a slot at most (-1: no bound)
    max_queue: int = 256
    #: --tags: the model's tags, listed by /models
    tags: list[str] = field(default_factory=list)
    #: bounds of one template rendering (seconds, characters of output)
    template_timeout: float = 5.0
    template_max_chars: int = 4 << 20
    #: -to: read/write timeout of a connection (s)
    timeout: int = 3600
    #: --threads-http: threads for the requests' blocking work (-1: anyio's default)
    threads_http: int = -1
    #: --api-prefix: the path every route is served under ("" none)
    api_prefix: str = ""
    #: --path: a folder served at / (None: the chat page)
    static_path: str | None = None
    #: --props: POST /props allowed
    endpoint_props: bool = False
    #: --warmup / --no-warmup: a one-token decode before the server is ready
    warmup: bool = True
    #: --reuse-port: SO_REUSEPORT on the listening socket
    reuse_port: bool = False
    #: --cors-*
    cors: Cors = field(default_factory=Cors)
    #: --ssl-key-file, --ssl-cert-file: HTTPS
    ssl_key_file: str | None = None
    ssl_cert_file: str | None = None
    #: --sse-ping-interval: a comment into a stream silent this long (s; <= 0: never)
    sse_ping_interval: int = 30
    #: --ui-config: /props' ui_settings
    ui_config: dict[str, Any] = field(default_factory=dict)
    #: --log-*, -lv
    log: LogConfig = field(default_factory=LogConfig)
    #: llama_model_params / llama_context_params fields the flags set (--override-kv, -lm,
    #: --no-repack, --no-host, --check-tensors; rope / YaRN, -nkvo, --no-op-offload)
    model_params: dict[str, Any] = field(default_factory=dict)
    context_params: dict[str, Any] = field(default_factory=dict)
    #: --kv-unified-per-slot (0: unset)
    kv_unified_per_slot: int = 0
    #: --lora / --lora-scaled: (path, scale) per adapter, ids in this order
    lora: list[tuple[str, float]] = field(default_factory=list)
    lora_init_without_apply: bool = False
    #: --control-vector / --control-vector-scaled, --control-vector-layer-range
    control_vectors: list[tuple[str, float]] = field(default_factory=list)
    control_vector_layers: tuple[int, int] | None = None
    #: --sleep-idle-seconds: the model is freed after this long without a request (-1: never)
    sleep_idle_seconds: int = -1
    #: -C / -Cr: the CPUs the process runs on (None: as started); --prio: its priority
    cpus: frozenset[int] | None = None
    prio: int = 0

    # -- derived ------------------------------------------------------------------

    @property
    def speculative(self) -> bool:
        """Whether the MTP heads draft."""
        return self.spec_type == "draft-mtp"

    @property
    def spec_types(self) -> str:
        """--spec-type as llama-server reports it (``speculative.types``)."""
        return ",".join([*self.ngram_types, *(["draft-mtp"] if self.speculative else [])]) or "none"

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

    def fetch_models(self) -> None:
        """-hf / -hfd / -mu: the models fetched (into the hub's cache: ``hub``), then ``model``
        and ``mtp_model`` point at their local files (llama-server's common_params_handle_models)."""
        if not (self.hf_repo or self.model_url or self.hf_repo_draft or self.hf_file_draft):
            return
        from .. import hub

        kw: dict[str, Any] = dict(token=self.hf_token or None, offline=True if self.offline else None)
        named = bool(self.mtp_model or self.hf_repo_draft or self.hf_file_draft)
        if self.hf_repo:
            # llama-server: with -hf, -m names the file in the repository
            got = hub.resolve(self.hf_repo, self.hf_file or self.model, mtp=self.speculative and not named, **kw)
            self.model = str(got.model)
            if got.mtp is not None:
                self.mtp_model = str(got.mtp)
        elif self.model_url:
            self.model = str(hub.fetch_url(self.model_url, self.model, token=self.hf_token or None))
        if self.speculative and not self.mtp_model and (self.hf_repo_draft or self.hf_file_draft):
            repo = self.hf_repo_draft or self.hf_repo
            if repo is None:
                raise hub.HubError("-hffd names a file of a repository: give the repository too (-hfd or -hf)")
            self.mtp_model = str(hub.resolve_heads(repo, self.hf_file_draft, **kw))

    def model_path(self) -> Path:
        return Path(self.model) if self.model else default_model_path()

    def model_name(self, path: Path | None = None) -> str:
        """What responses call the model: llama-server takes the first alias (its
        aliases are a sorted set), else the -hf repository, else the -m path as given."""
        if self.aliases:
            return sorted(self.aliases)[0]
        if self.hf_repo:
            return self.hf_repo
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
            context=self.spec_context,
            ngram=self.ngram_types,
            ngram_config=self.ngram,
            pool_tokens=self.context_pool,
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
            model_params=self.model_params or None,
            context_params=self.context_params or None,
            lora=self.lora,
            lora_init_without_apply=self.lora_init_without_apply,
            control_vectors=self.control_vectors,
            control_vector_layers=self.control_vector_layers,
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
