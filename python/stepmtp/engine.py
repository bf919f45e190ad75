"""The public API: load a Step3.5 model and its MTP heads, generate text.

>>> from stepmtp import Engine
>>> with Engine("model.gguf", mode="chain", n_max=3) as eng:
...     out = eng.generate("def fib(n):", n_predict=64, temperature=0)
...     print(out.text, out.stats.accept_rate)
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Iterator, Mapping, Sequence

from .budget import ReasoningBudget
from .llama import Context, LlamaError, Model, default_threads
from .drafters.ngram import NgramConfig
from .mtp import MTPDriver, Mode, Schedule, SpecConfig, Verify
from .placement import Placement, check_kv_types, numa_init
from .sampling import SamplingParams
from .slots import Chunk, Completion, Request, Slots, StopType

__all__ = ["Engine", "Completion", "Chunk", "SpecConfig", "SamplingParams", "StopType"]

log = logging.getLogger("stepmtp.engine")

class SlotBusy(ValueError):
    """The slot is generating: it cannot be saved, restored or erased now."""


class Engine:
    """A Step3.5 model with its MTP heads, ready to generate.

    Args:
        model: the target GGUF (trunk, with the MTP blocks embedded or not).
        mtp_model: a separate MTP-only GGUF with the heads (llama-server's
            ``--spec-draft-model``); by default the heads come from ``model``.
        mode, n_max, n_min, p_min, schedule, verify, adaptive, draft_vocab: speculation
            (see ``SpecConfig``); or pass ``spec``.
        context, ngram, ngram_config, context_max, pool_tokens: drafting from the context
            (``SpecConfig``): ours beside the heads (on by default; ``context=False``
            turns it off), llama-server's n-gram drafters by their ``--spec-type`` names
            (``ngram=("ngram-mod",)``), the longest context draft, the tokens of earlier
            requests kept to draft from (per ``pool`` of a request).
        n_ctx: context size (0: the model's). n_batch, n_ubatch: as ``-b``/``-ub``.
        n_threads, n_threads_batch: CPU threads (default: all this process may use).
        n_gpu_layers, n_gpu_layers_draft: layers offloaded, ``"all"`` for all; default
            ``"auto"``, as llama-server's ``-ngl``: every layer when the build has a GPU
            backend (or RPC servers are given), none on a CPU-only build.
        rpc: RPC servers for the target and the draft (MTP) model, ``"host:port,..."``
            (llama-server's ``--rpc``); they count as GPUs for ``n_gpu_layers``.
        type_k, type_v: the target's KV cache types (``-ctk``, ``-ctv``): ``"f16"``
            (default), ``"q8_0"``, ... (``placement.KV_TYPES``); a quantized V needs
            flash attention (``flash_attn`` None or True).
        type_k_draft, type_v_draft: every MTP head context's (``-ctkd``, ``-ctvd``;
            default ``"f16"``, as llama-server's, whatever the target's).
        override_tensor: tensor buffer overrides (``-ot``), ``"pattern=buffer type,..."``
            or a list of such strings or of pairs; the first pattern found in a
            tensor's name places it (``"exps=CPU"``: the experts in host memory).
        cpu_moe, n_cpu_moe: every layer's MoE experts on the CPU (``-cmoe``), or the first
            n layers' (``-ncmoe``); after ``override_tensor``'s patterns.
        override_tensor_draft, cpu_moe_draft, n_cpu_moe_draft, devices_draft: the same for
            a separate ``mtp_model`` (``-otd``, ``-cmoed``, ``-ncmoed``, ``-devd``); heads
            in ``model`` are placed with its own tensors, by the options above.
        devices: devices to offload to (``-dev``), ``"CUDA0,CUDA1"`` or a list, ``"none"``
            for none; default: every GPU (and the RPC servers').
        split_mode, tensor_split, main_gpu: across several GPUs (``-sm none|layer|row|tensor``,
            ``-ts 3,1``, ``-mg``); also for ``mtp_model``.
        use_mmap, use_mlock: memory-map the model files (``--no-mmap``: read them into
            buffers), lock them in RAM (``--mlock``); for ``mtp_model`` too.
        numa: ggml's NUMA strategy for the process (``--numa distribute|isolate|numactl``).
        model_params, context_params: llama_model_params / llama_context_params fields by
            name (``llama_params.apply``): the server's --override-kv (``kv_overrides``: a
            list of (key, "int"|"float"|"bool"|"str", value)), -lm, --no-repack,
            --check-tensors; rope / YaRN, -nkvo, --no-op-offload. The context's apply to
            the heads' contexts too.
        n_parallel: slots (llama-server's ``-np``): this many generations decode
            together, batched into the same decodes; calls from several threads
            (``generate``, ``stream``) share the rounds.
        kv_unified: one KV cache shared by all slots, each slot may use all of
            ``n_ctx`` (llama-server's ``-kvu``); False splits ``n_ctx`` evenly.
            Default: split (with one slot both are the same cache, and a unified
            one makes llama.cpp check all 256 possible sequences on every decode:
            0.1 ms a decode, a sixth of one on the bundled model).
        swa_full: a full-size cache for the sliding-window layers (llama-server's
            ``--swa-full``); default: trimmed, as llama-server's (a window and a ubatch a sequence).
        ctx_checkpoints: context checkpoints kept per slot with a trimmed
            sliding-window cache (llama-server's ``--ctx-checkpoints``): a later
            prompt that leaves the cached tokens near an earlier prompt's end goes
            on from there instead of from the start.
        slot_prompt_similarity: a request goes to the free slot whose cached prompt
            shares the most with its own when that is more than this share of it
            (llama-server's ``-sps``), else to the least recently used free slot.
        cache_ram_mib: host memory for prompts a slot is about to lose (another
            conversation takes the slot, a full shared cache evicts it), copied back
            into a slot for a later request that shares more with them (llama-server's
            ``--cache-ram``); 0: none kept, -1: no bound.
        batch_invariant: the target computes each row of a decode as a decode of that
            row alone would (llama-server's ``--spec-batch-invariant``; patch 0012), so
            at temperature 0 speculative output equals plain decoding's on a backend
            whose kernels depend on the batch's size (CUDA, Metal). On the CPU rows
            already are (patches 0009, 0010): there it only costs time.
        lora: LoRA adapters on the target, (path, scale) each (llama-server's ``--lora``,
            ``--lora-scaled``); a request's ``lora`` or ``set_lora`` changes the scales.
        lora_init_without_apply: the adapters load with scale 0 (``--lora-init-without-apply``).
        control_vectors: control vectors added to the target's layers, (path, strength)
            each (``--control-vector``, ``--control-vector-scaled``), over the layers
            ``control_vector_layers`` (start, end), inclusive; default 1 to the last.
            Adapters change the target only: the heads draft, the target verifies, so at
            temperature 0 the text is plain decoding's with the same adapters.
        seed: default seed of the samplers (a request's own seed wins).
        progress: show loading progress on stderr.
        debug: check the driver's invariant (pending_h == h_tgt(pos(id_last) - 1))
            every round; slow. Also on with the environment variable STEPMTP_DEBUG=1.
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        mtp_model: str | os.PathLike[str] | None = None,
        mode: Mode = "chain",
        n_max: int = 3,
        n_min: int = 0,
        p_min: float = 0.0,
        schedule: Schedule = "fused",
        verify: Verify = "auto",
        adaptive: bool = True,
        draft_vocab: int = -1,
        context: bool = True,
        ngram: Sequence[str] = (),
        ngram_config: "NgramConfig | None" = None,
        context_max: int = 62,
        pool_tokens: int = 1 << 18,
        spec: SpecConfig | None = None,
        n_ctx: int = 4096,
        n_batch: int = 2048,
        n_ubatch: int = 512,
        n_threads: int | None = None,
        n_threads_batch: int | None = None,
        n_gpu_layers: int | str = "auto",
        n_gpu_layers_draft: int | str | None = None,
        rpc: str | Sequence[str] | None = None,
        type_k: str = "f16",
        type_v: str = "f16",
        type_k_draft: str = "f16",
        type_v_draft: str = "f16",
        override_tensor: str | Sequence[str | tuple[str, str]] | None = None,
        cpu_moe: bool = False,
        n_cpu_moe: int = 0,
        override_tensor_draft: str | Sequence[str | tuple[str, str]] | None = None,
        cpu_moe_draft: bool = False,
        n_cpu_moe_draft: int = 0,
        devices: str | Sequence[str] | None = None,
        devices_draft: str | Sequence[str] | None = None,
        split_mode: str = "layer",
        tensor_split: str | Sequence[float] | None = None,
        main_gpu: int = 0,
        use_mmap: bool = True,
        use_mlock: bool = False,
        numa: str | None = None,
        n_parallel: int = 1,
        kv_unified: bool = False,
        swa_full: bool = False,
        ctx_checkpoints: int = 32,
        slot_prompt_similarity: float = 0.1,
        cache_ram_mib: int = 0,
        seed: int = -1,
        flash_attn: bool | None = None,
        batch_invariant: bool = False,
        progress: bool = False,
        debug: bool = False,
        model_params: Mapping[str, Any] | None = None,
        context_params: Mapping[str, Any] | None = None,
        lora: Sequence[tuple[str | os.PathLike[str], float]] = (),
        lora_init_without_apply: bool = False,
        control_vectors: Sequence[tuple[str | os.PathLike[str], float]] = (),
        control_vector_layers: tuple[int, int] | None = None,
    ) -> None:
        self.spec = spec or SpecConfig(mode=mode, n_max=n_max, n_min=n_min, p_min=p_min, schedule=schedule,
                                       verify=verify, adaptive=adaptive, draft_vocab=draft_vocab,
                                       context=context, ngram=tuple(ngram), ngram_config=ngram_config,
                                       context_max=context_max, pool_tokens=pool_tokens)
        self.seed = seed
        if isinstance(n_parallel, bool) or not isinstance(n_parallel, int) or n_parallel < 1:
            raise ValueError(f"n_parallel must be a positive integer, not {n_parallel!r}")
        self.n_parallel = n_parallel
        # every placement and KV option checked before anything loads
        #: KV cache types (K, V) of the target's context and of the heads'
        self.kv_types = {"target": (type_k, type_v), "draft": (type_k_draft, type_v_draft)}
        check_kv_types(self.kv_types, flash_attn)
        place = Placement.of(override_tensor=override_tensor, cpu_moe=cpu_moe, n_cpu_moe=n_cpu_moe,
                             devices=devices, split_mode=split_mode, tensor_split=tensor_split, main_gpu=main_gpu)
        place_draft = Placement.of(override_tensor=override_tensor_draft, cpu_moe=cpu_moe_draft,
                                   n_cpu_moe=n_cpu_moe_draft, devices=devices_draft, split_mode=split_mode,
                                   tensor_split=tensor_split, main_gpu=main_gpu, draft=True)
        for pl in (place, place_draft):
            pl.check_names(defer_rpc=rpc is not None)
        if mtp_model is None and (place_draft.override_tensor or place_draft.devices is not None):
            log.warning("the draft placement options (-otd, -cmoed, -ncmoed, -devd) apply to a separate MTP "
                        "model (mtp_model): the heads in %s are placed with its own tensors", model)
        numa_init(numa)
        load_kw: dict[str, Any] = dict(progress=progress, rpc=rpc, use_mmap=use_mmap, use_mlock=use_mlock,
                                       llama_params=model_params)
        self._lock = threading.Lock()
        self._closed = False
        #: the request handling of create_chat_completion / create_completion (api.inprocess), made on first use
        self._api: Any = None
        self.model = Model(model, n_gpu_layers=n_gpu_layers, placement=place, **load_kw)
        self.draft_model: Model | None = None
        self.target: Context | None = None
        #: one draft (MTP) context per head, bound to its block (None: a head these
        #: settings never decode)
        self.drafts: list[Context | None] = []
        try:
            threads = n_threads or default_threads()
            ctx_kw: dict[str, Any] = dict(
                n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_threads=threads,
                n_threads_batch=n_threads_batch or threads, flash_attn=flash_attn, n_seq_max=n_parallel,
                llama_params=context_params,
            )
            self.target = Context(self.model, kv_unified=bool(kv_unified), swa_full=swa_full, type_k=type_k,
                                  type_v=type_v, **ctx_kw)
            if batch_invariant:
                # every verify: each slot's id_last and drafts
                self.target.batch_invariant = max(2, n_parallel * (self.spec.n_max + 1))
            from .adapters import Adapters

            #: LoRA adapters and control vector of the target (empty: none)
            self.adapters = Adapters(self.model, [(os.fspath(p), float(x)) for p, x in lora],
                                     init_without_apply=lora_init_without_apply,
                                     control_vectors=[(os.fspath(p), float(x)) for p, x in control_vectors],
                                     layer_range=control_vector_layers)
            self.adapters.attach(self.target)
            if batch_invariant and self.adapters.loras:
                # patch 0012 splits the weights' products row by row, not an adapter's
                log.warning("LoRA adapters with the batch-invariant target: the adapters' products are computed "
                            "for the whole batch, so on a GPU speculative text at temperature 0 may part from "
                            "plain decoding's")
            if self.spec.mode != "none":
                if mtp_model is not None:
                    ngl = n_gpu_layers if n_gpu_layers_draft is None else n_gpu_layers_draft
                    self.draft_model = Model(mtp_model, n_gpu_layers=ngl, placement=place_draft, **load_kw)
                    if self.draft_model.n_vocab != self.model.n_vocab:
                        raise ValueError(
                            f"{mtp_model}: vocabulary of {self.draft_model.n_vocab} tokens, "
                            f"the target has {self.model.n_vocab}"
                        )
                    if self.draft_model.n_embd != self.model.n_embd:
                        raise ValueError(
                            f"{mtp_model}: hidden rows of width {self.draft_model.n_embd}, "
                            f"the target's are {self.model.n_embd}"
                        )
                else:
                    self.draft_model = self.model
                # a context per head, its KV that head's layer alone, laid out as the
                # target's (llama-server's one MTP stream holds the same cells)
                self.draft_model.check_mtp()
                used = MTPDriver.heads_used(self.spec, self.draft_model.n_mtp_blocks)
                ctx_kw.update(n_ctx=self.target.n_ctx, type_k=type_k_draft, type_v=type_v_draft)
                self.drafts = [None] * self.draft_model.n_mtp_blocks
                for k in used:
                    # a draft decode outputs one row per sequence: a compute buffer
                    # for that many logits rows, not n_batch
                    self.drafts[k] = Context(self.draft_model, mtp=True, mtp_block=k, kv_unified=bool(kv_unified),
                                             swa_full=swa_full, n_outputs_max=n_parallel, **ctx_kw)
            debug = debug or os.environ.get("STEPMTP_DEBUG", "") not in ("", "0")
            self.driver = MTPDriver(self.target, self.drafts, self.spec, n_seq=n_parallel, debug=debug,
                                    cache_ram=cache_ram_mib << 20 if cache_ram_mib > 0 else cache_ram_mib,
                                    checkpoints=ctx_checkpoints)
            self.slots = Slots(self.driver, self.model, n_parallel, similarity=slot_prompt_similarity,
                               adapters=self.adapters)
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_pretrained(cls, repo_id: str, filename: str | None = None, *, mtp_repo_id: str | None = None,
                        mtp_filename: str | None = None, token: str | None = None,
                        cache_dir: str | os.PathLike[str] | None = None, local_files_only: bool = False,
                        **engine_kwargs: Any) -> "Engine":
        """An engine on a model of the Hugging Face Hub, as llama-cpp-python's
        ``Llama.from_pretrained`` (and llama-server's ``-hf``) load one: ``repo_id`` is
        ``user/repo`` or ``user/repo:QUANT``; ``filename`` a file's name, a glob
        (``"*Q8_0*.gguf"``) or a quant; without either, Q4_K_M, else Q8_0, else the first
        model. Every shard of a split model is fetched, into the hub's cache (offline
        once there: ``local_files_only`` or ``HF_HUB_OFFLINE=1``). The MTP heads come
        from ``mtp_repo_id`` / ``mtp_filename`` when given, else from a heads file
        beside the model (``mtp-`` in its name) when the repository has one, else from
        the model itself. ``token``: for private or gated repositories (default:
        ``HF_TOKEN``). The other keywords are ``Engine``'s. Failures raise
        ``hub.HubError`` naming what to do."""
        from .hub import resolve, resolve_heads

        spec = engine_kwargs.get("spec")
        mode = spec.mode if spec is not None else engine_kwargs.get("mode", "chain")
        mtp = mode != "none" and engine_kwargs.get("mtp_model") is None
        named = mtp_repo_id is not None or mtp_filename is not None
        hub_kw: dict[str, Any] = dict(token=token, cache_dir=cache_dir, offline=True if local_files_only else None)
        got = resolve(repo_id, filename, mtp=mtp and not named, **hub_kw)
        if mtp and named:
            engine_kwargs["mtp_model"] = resolve_heads(mtp_repo_id or repo_id, mtp_filename, **hub_kw)
        elif got.mtp is not None:
            engine_kwargs["mtp_model"] = got.mtp
        return cls(got.model, **engine_kwargs)

    # -- lifetime ---------------------------------------------------------------

    def close(self) -> None:
        """Free the model and contexts. Waits for a step another thread is running;
        afterwards every call raises LlamaError ("the engine is closed")."""
        if self._closed:
            return
        with self._lock:
            self._closed = True
            for ctx in (*self.drafts, self.target):
                if ctx is not None:
                    ctx.close()
            if self.draft_model is not None and self.draft_model is not self.model:
                self.draft_model.close()
            self.model.close()

    def unusable(self) -> str | None:
        """Why the engine cannot generate any more (closed, an RPC server of its model
        lost), or None."""
        if self._closed:
            return "the engine is closed"
        for m in (self.model, self.draft_model):
            if m is not None and m.rpc is not None and m.rpc.lost():
                return f"lost the connection to RPC server {', '.join(m.rpc.lost())}: restart the server"
        return None

    def _check_open(self) -> None:
        if self._closed:
            raise LlamaError("the engine is closed")

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- text -------------------------------------------------------------------

    def memory(self) -> dict[str, dict[str, int]]:
        """Bytes in llama.cpp's buffers, as it accounts them: ``target`` and ``draft``
        (all heads' contexts), each ``kv`` (KV cache), ``compute``, ``output``."""
        self._check_open()
        return self.driver.memory()

    @property
    def n_ctx(self) -> int:
        """Positions one generation may use (all of -c, or its share per slot)."""
        return self.target.n_ctx_seq

    @property
    def n_heads(self) -> int:
        return self.driver.n_heads

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        self._check_open()
        return self.model.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        self._check_open()
        return self.model.detokenize(tokens)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True,
                            template: str | None = None, variables: dict[str, Any] | None = None,
                            **kwargs: Any) -> str:
        """Render chat messages with the GGUF's jinja chat template (chatml when it has
        none, as llama-server). ``variables`` and ``kwargs`` are extra names for the
        template (``enable_thinking=False``, ...); they never replace the template."""
        from .chat import render_chat

        return render_chat(self.model, messages, add_generation_prompt=add_generation_prompt,
                           template=template, variables={**(variables or {}), **kwargs})

    # -- generation ---------------------------------------------------------------

    def warmup(self) -> None:
        """llama-server's warm-up: a one-token prompt decoded and one token sampled, so the
        first request does not pay the first decode's costs (buffers, kernels, pages of
        the weights); in a pool of its own, so no request drafts from it."""
        self.generate([max(self.model.bos, 0)], n_predict=1, cache_prompt=False, pool=object())

    def generate(self, prompt: str | Sequence[int], *, n_predict: int = -1, stop: Sequence[str] = (),
                 sampling: SamplingParams | None = None, verify: Verify | None = None,
                 cache_prompt: bool = True, n_probs: int = 0, post_sampling_probs: bool = False,
                 grammar: Any = None, mask_drafts: bool = True, reasoning_budget: "ReasoningBudget | None" = None,
                 pool: object = None, lora: Mapping[int, float] | None = None, **sampling_kw: Any) -> Completion:
        """Generate a completion. ``sampling_kw`` are SamplingParams fields
        (temperature, top_k, top_p, min_p, seed, repeat_penalty, ...); ``verify``
        overrides the engine's verification (exact, rejection, auto) for this request.
        ``cache_prompt``: reuse the KV of the longest prefix the slot still holds from
        its previous request (llama-server's default); the output is the same.
        ``n_probs``: report each token's probability and the n most likely tokens'
        (``Completion.probs``, ``Chunk.probs``), from the target's raw logits, or after
        the sampling chain with ``post_sampling_probs``; accepted drafts get the
        probabilities plain decoding would report for them.
        ``grammar``: constrained decoding, a ``grammar.Constraint`` or ``(kind, spec)``
        with kind ``json_schema``, ``json_object``, ``gbnf``, ``lark`` or ``regex``;
        every target row is masked, and the heads' rows too (``mask_drafts``), so
        what the grammar forces is drafted and accepted.
        ``reasoning_budget``: llama-server's ``--reasoning-budget`` (``budget.ReasoningBudget``),
        counted from the prompt's open think block if it ends in one; not with a grammar.
        ``pool``: the pool of earlier requests' tokens context drafting reads and adds
        to (any hashable key; the server's: its API key): requests of one pool may
        learn, through timing, what another wrote.
        ``lora``: this request's LoRA scales, adapter id -> scale (llama-server's
        request ``lora``: the adapters it does not name are off); default: the
        engine's (``set_lora``)."""
        gen = self._generate(self._request(prompt, n_predict, stop, sampling, sampling_kw, verify, cache_prompt,
                                           n_probs, post_sampling_probs, grammar=grammar,
                                           mask_drafts=mask_drafts, reasoning_budget=reasoning_budget, pool=pool,
                                           lora=lora))
        while True:
            try:
                next(gen)
            except StopIteration as done:
                return done.value

    def stream(self, prompt: str | Sequence[int], *, n_predict: int = -1, stop: Sequence[str] = (),
               sampling: SamplingParams | None = None, verify: Verify | None = None,
               cache_prompt: bool = True, n_probs: int = 0, post_sampling_probs: bool = False,
               grammar: Any = None, mask_drafts: bool = True, reasoning_budget: "ReasoningBudget | None" = None,
               preserve_tokens: Sequence[int] = (), return_progress: bool = False, n_before_user: int = 0,
               pool: object = None, lora: Mapping[int, float] | None = None,
               **sampling_kw: Any) -> Iterator[Chunk]:
        """Generate, yielding pieces of text as tokens are accepted. The generator's
        return value (``StopIteration.value``) is the Completion. The arguments after
        ``reasoning_budget`` are ``submit``'s."""
        return self._generate(self._request(prompt, n_predict, stop, sampling, sampling_kw, verify, cache_prompt,
                                            n_probs, post_sampling_probs, preserve_tokens, grammar=grammar,
                                            mask_drafts=mask_drafts, return_progress=return_progress,
                                            reasoning_budget=reasoning_budget, n_before_user=n_before_user,
                                            pool=pool, lora=lora))

    def _request(self, prompt: str | Sequence[int], n_predict: int, stop: Sequence[str],
                 sampling: SamplingParams | None, sampling_kw: dict[str, Any],
                 verify: Verify | None = None, cache_prompt: bool = True, n_probs: int = 0,
                 post_sampling_probs: bool = False, preserve_tokens: Sequence[int] = (),
                 grammar: Any = None, mask_drafts: bool = True, return_progress: bool = False,
                 reasoning_budget: "ReasoningBudget | None" = None, n_before_user: int = 0,
                 pool: object = None, lora: Mapping[int, float] | None = None) -> Request:
        self._check_open()
        verify = verify or self.spec.verify
        if verify not in ("auto", "exact", "rejection"):
            raise ValueError(f"unknown verification {verify!r} (auto, exact, rejection)")
        if isinstance(n_predict, bool) or not isinstance(n_predict, int) or n_predict < -1:
            raise ValueError(f"n_predict must be -1 (no limit), 0 (prompt only) or positive, not {n_predict!r}")
        params = sampling or SamplingParams()
        if sampling_kw:
            params = params.with_(**sampling_kw)
        if params.seed is None or params.seed < 0:
            params = params.with_(seed=None if self.seed < 0 else self.seed)
        if isinstance(prompt, str):
            prompt_tokens = self.tokenize(prompt)
        else:
            prompt_tokens = [int(t) for t in prompt]
            for t in prompt_tokens:
                self.model._check_token(t)
        if not prompt_tokens:
            raise ValueError("the prompt is empty")
        if isinstance(stop, str):
            stop = [stop]
        # auto: rejection sampling above temperature 0, but exact match for a request with
        # a seed: each token is then drawn as plain sampling draws it (one draw from the
        # seeded generator per token, whatever the drafts), so a seed's text is plain
        # sampling's, the same every time, as llama-server's, though draft lengths follow
        # the machine's timings; rejection sampling accepts more, and its text depends on them
        seeded = params.seed is not None and params.seed >= 0
        rejection = (verify == "rejection" or (verify == "auto" and not seeded)) and not params.greedy \
            and self.driver.speculate
        if isinstance(n_probs, bool) or not isinstance(n_probs, int) or n_probs < 0:
            raise ValueError(f"n_probs must be a non-negative integer, not {n_probs!r}")
        constraint = None
        if grammar is not None:
            from .grammar import Constraint

            c = grammar if isinstance(grammar, Constraint) else Constraint.compile(self.model, *grammar)
            constraint = c.start()
        if reasoning_budget is not None:
            if constraint is not None:
                raise ValueError("a reasoning budget and a grammar in one request are not supported")
            constraint = reasoning_budget.start_state(self.model, self._open_think_block(prompt_tokens,
                                                                                         reasoning_budget))
        req = Request(prompt_tokens, n_predict, list(stop), params, rejection, cache_prompt=cache_prompt,
                      n_probs=n_probs, post_probs=post_sampling_probs, preserved=frozenset(preserve_tokens),
                      constraint=constraint, mask_drafts=mask_drafts, return_progress=return_progress,
                      pool_key=pool, lora=lora)
        req.state.n_before_user = n_before_user
        return req

    def _open_think_block(self, prompt_tokens: list[int], budget: "ReasoningBudget") -> str:
        """The prompt's tail from its last start tag, when no end tag follows it (the
        generation starts inside a think block), else nothing."""
        tail = self.model.detokenize(prompt_tokens[-64:], unparse_special=True)
        at = tail.rfind(budget.start)
        return tail[at:] if at >= 0 and budget.end not in tail[at:] else ""

    # -- llama-cpp-python's calls: OpenAI's shapes, the server's request handling --------

    def create_chat_completion(
        self, messages: Sequence[dict[str, Any]], functions: Sequence[dict[str, Any]] | None = None,
        function_call: str | dict[str, Any] | None = None, tools: Sequence[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None, temperature: float = 0.2, top_p: float = 0.95,
        top_k: int = 40, min_p: float = 0.05, typical_p: float = 1.0, stream: bool = False,
        stop: str | Sequence[str] | None = None, seed: int | None = None,
        response_format: dict[str, Any] | None = None, max_tokens: int | None = None,
        presence_penalty: float = 0.0, frequency_penalty: float = 0.0, repeat_penalty: float = 1.0,
        tfs_z: float = 1.0, mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
        model: str | None = None, logits_processor: Any = None, grammar: str | None = None,
        logit_bias: dict[int, float] | None = None, logprobs: bool | None = None, top_logprobs: int | None = None,
        *, reasoning_format: str | None = None, reasoning_budget: int | None = None,
        chat_template_kwargs: dict[str, Any] | None = None, parallel_tool_calls: bool | None = None,
        **fields: Any,
    ) -> Any:
        """An OpenAI chat completion, as llama-cpp-python's ``Llama.create_chat_completion``
        takes and returns it (its keywords and defaults), answered by the same code as
        the server's ``/v1/chat/completions``: the GGUF's chat template, Step's tool
        calls parsed into ``tool_calls`` (``tool_choice`` "required" or a function forces
        a call that follows its parameters' schema), the thinking in
        ``reasoning_content``, ``response_format`` json_object / json_schema enforced.

        Returns the response dict (``choices``, ``usage``, ``timings``, ``mtp``: the
        drafted and accepted counts), or with ``stream=True`` an iterator of chunk dicts
        (deltas of ``reasoning_content``, ``content`` and ``tool_calls``; the last chunk
        carries ``usage``, ``timings`` and ``mtp``).

        Ours besides llama-cpp-python's: ``reasoning_format`` ("auto": thinking in
        ``reasoning_content``, "none": left in ``content``), ``reasoning_budget``
        (tokens of thinking before its end is forced; 0: none), ``chat_template_kwargs``
        (template variables, e.g. ``{"enable_thinking": False}``),
        ``parallel_tool_calls``; and by name any other field of the server's request
        (``n_probs``, ``ignore_eos``, ``stream_options``, ``reasoning_effort``, ...).
        Bad input raises ``api.errors.InvalidRequest`` (a ValueError) naming it.
        """
        from .api.inprocess import chat_completion

        return chat_completion(self, dict(
            messages=messages, functions=functions, function_call=function_call, tools=tools,
            tool_choice=tool_choice, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
            typical_p=typical_p, stream=stream, stop=stop, seed=seed, response_format=response_format,
            max_tokens=max_tokens, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
            repeat_penalty=repeat_penalty, tfs_z=tfs_z, mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau,
            mirostat_eta=mirostat_eta, model=model, logits_processor=logits_processor, grammar=grammar,
            logit_bias=logit_bias, logprobs=logprobs, top_logprobs=top_logprobs,
            reasoning_format=reasoning_format, reasoning_budget=reasoning_budget,
            chat_template_kwargs=chat_template_kwargs, parallel_tool_calls=parallel_tool_calls), fields)

    def create_completion(
        self, prompt: str | Sequence[int], suffix: str | None = None, max_tokens: int | None = 16,
        temperature: float = 0.8, top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0,
        logprobs: int | None = None, echo: bool = False, stop: str | Sequence[str] | None = None,
        frequency_penalty: float = 0.0, presence_penalty: float = 0.0, repeat_penalty: float = 1.0,
        top_k: int = 40, stream: bool = False, seed: int | None = None, tfs_z: float = 1.0,
        mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1, model: str | None = None,
        stopping_criteria: Any = None, logits_processor: Any = None, grammar: str | None = None,
        logit_bias: dict[int, float] | None = None, **fields: Any,
    ) -> Any:
        """An OpenAI text completion, as llama-cpp-python's ``Llama.create_completion``
        takes and returns it, answered by the same code as the server's
        ``/v1/completions``: the response dict, or chunk dicts with ``stream=True`` (the
        last with ``usage``, ``timings`` and ``mtp``). ``logprobs=N``: each token's and
        the N most likely tokens' log-probabilities, in llama-server's shape
        (``{"content": [...]}``). ``suffix`` and ``echo`` are refused. Other server
        request fields by name (``n_probs``, ``ignore_eos``, ``json_schema``, ...)."""
        from .api.inprocess import completion

        return completion(self, dict(
            prompt=prompt, suffix=suffix, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
            min_p=min_p, typical_p=typical_p, logprobs=logprobs, echo=echo or None, stop=stop,
            frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, repeat_penalty=repeat_penalty,
            top_k=top_k, stream=stream, seed=seed, tfs_z=tfs_z, mirostat_mode=mirostat_mode,
            mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta, model=model, stopping_criteria=stopping_criteria,
            logits_processor=logits_processor, grammar=grammar, logit_bias=logit_bias), fields)

    __call__ = create_completion

    def submit(self, prompt: str | Sequence[int], *, n_predict: int = -1, stop: Sequence[str] = (),
               sampling: SamplingParams | None = None, verify: Verify | None = None,
               cache_prompt: bool = True, n_probs: int = 0, post_sampling_probs: bool = False,
               preserve_tokens: Sequence[int] = (), grammar: Any = None, mask_drafts: bool = True,
               return_progress: bool = False, n_before_user: int = 0,
               reasoning_budget: "ReasoningBudget | None" = None, pool: object = None,
               lora: Mapping[int, float] | None = None, **sampling_kw: Any) -> Request:
        """Queue a generation without driving it, for a program that schedules many
        from one thread (the server): ``step()`` makes progress on every queued and
        running one; the returned request's ``chunks`` fill up as tokens are accepted
        and ``done`` turns true with ``completion`` (or ``error``) set. ``cancel``
        drops it. Same arguments as ``generate``; ``preserve_tokens``: special tokens
        whose text the output keeps (a chat format's markers, for its parser);
        ``return_progress``: a progress chunk (``Chunk.progress``) after each prompt
        decode, as llama-server's; ``n_before_user``: a chat prompt's tokens before
        its latest user message, where llama-server stops a decode of the prompt
        (the same pieces give the same logits)."""
        req = self._request(prompt, n_predict, stop, sampling, sampling_kw, verify, cache_prompt,
                            n_probs, post_sampling_probs, preserve_tokens, grammar, mask_drafts,
                            return_progress, reasoning_budget, n_before_user, pool, lora)
        self.slots.submit(req)
        return req

    def step(self) -> None:
        """One scheduling step for every submitted request (see ``submit``): admit
        waiting ones, one MTP round for all generating slots, one prompt chunk."""
        with self._lock:
            self._check_open()
            self.slots.step()

    def cancel(self, req: Request) -> None:
        """Stop a submitted request and free its slot now (it ends with ``Cancelled``)."""
        with self._lock:
            if not self._closed and not req.done:
                self.slots.drop(req)

    # -- slot files (llama-server's /slots/{id}?action=save|restore|erase) ----------

    def _idle_slot(self, slot: int) -> None:
        self._check_open()
        if not 0 <= slot < self.n_parallel:
            raise ValueError(f"no slot {slot} (slots 0..{self.n_parallel - 1})")
        if self.slots.slots[slot] is not None:
            raise SlotBusy(f"slot {slot} is busy")

    def save_slot(self, slot: int, path: str | os.PathLike[str]) -> tuple[int, int]:
        """Write what an idle slot's KV holds (its last prompt and output, the heads'
        state beside it); (tokens, bytes)."""
        from pathlib import Path

        with self._lock:
            self._idle_slot(slot)
            return self.driver.save_cache(slot, Path(path))

    def restore_slot(self, slot: int, path: str | os.PathLike[str]) -> tuple[int, int]:
        """Load a slot file into an idle slot: the next request sharing its prefix
        reuses it; (tokens, bytes)."""
        from pathlib import Path

        with self._lock:
            self._idle_slot(slot)
            return self.driver.restore_cache(slot, Path(path), self.adapters.key())

    def erase_slot(self, slot: int) -> int:
        """Forget what an idle slot holds; the tokens it held."""
        with self._lock:
            self._idle_slot(slot)
            n = len(self.driver.cached_tokens(slot))
            self.driver.release(slot)
            return n

    # -- LoRA adapters (llama-server's /lora-adapters) ----------------------------------

    def set_lora(self, lora: Mapping[int, float]) -> None:
        """The scales of requests that do not give their own (adapter id -> scale; the
        adapters not named are off). Requests already submitted keep theirs; a slot's
        cached prompt serves only requests with the scales it was computed with."""
        with self._lock:
            self._check_open()
            self.adapters.set_scales(lora)

    @property
    def busy(self) -> bool:
        """Some submitted request is waiting for a slot or generating."""
        return bool(self.slots.waiting) or self.slots.n_busy > 0

    def generate_many(self, prompts: Sequence[str | Sequence[int]], *, n_predict: int = -1,
                      stop: Sequence[str] = (), sampling: SamplingParams | None = None,
                      verify: Verify | None = None, cache_prompt: bool = True,
                      **sampling_kw: Any) -> list[Completion]:
        """Generate completions of several prompts together, ``n_parallel`` at a time
        (batched into the same decodes); same arguments as ``generate``."""
        reqs = [self._request(p, n_predict, stop, sampling, sampling_kw, verify, cache_prompt) for p in prompts]
        try:
            for r in reqs:
                self.slots.submit(r)
            while not all(r.done for r in reqs):
                with self._lock:
                    self._check_open()
                    self.slots.step()
        finally:
            with self._lock:
                if not self._closed:
                    for r in reqs:
                        if not r.done:
                            self.slots.drop(r)
        for r in reqs:
            if r.error is not None:
                raise r.error
        return [r.completion for r in reqs]

    def _generate(self, req: Request) -> Iterator[Chunk]:
        """Submit ``req`` and step the slots until it is done, yielding its chunks
        as they come; other threads' requests are stepped along with it."""
        slots = self.slots
        slots.submit(req)
        try:
            while True:
                while req.chunks:
                    yield req.chunks.popleft()
                if req.done:
                    break
                with self._lock:
                    self._check_open()
                    if not req.chunks and not req.done:
                        slots.step()
            if req.error is not None:
                raise req.error
            return req.completion
        finally:
            if not req.done:
                with self._lock:
                    if not self._closed:  # a closed engine's KV is gone with it
                        slots.drop(req)
