"""``python -m stepmtp.server``: llama-server's command line, serving with the MTP heads.

The flags are llama-server's (``vendor/llama.cpp/common/arg.cpp``), with its
spellings, aliases, defaults and ``LLAMA_ARG_*`` environment variables, so a
llama-server command runs with ``llama-server`` replaced by
``python -m stepmtp.server``. Added: ``--spec-mtp-mode chain|single``.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

from ..sampling import DEFAULT_SAMPLERS, SamplingParams, parse_samplers
from .argtypes import ArgError, _choice, _float, _int, _json_object, _on_off, _on_off_auto
from .config import ServerConfig

PROG = "python -m stepmtp.server"

log = logging.getLogger("stepmtp.server")


from ..drafters.ngram import NGRAM_TYPES, NgramConfig


# -- value types (errors name the flag through argparse) -----------------------


def _layers(v: str) -> int | str:
    """-ngl: a number, 'auto' or 'all'."""
    if v in ("auto", "all"):
        return v
    n = _int(v)
    return n


def _csv(v: str) -> list[str]:
    return [x.strip() for x in v.split(",") if x.strip()]


def _rpc_servers(v: str) -> list[str]:
    from ..rpc import parse_servers

    try:
        servers = parse_servers(v)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not servers:
        raise argparse.ArgumentTypeError("no RPC servers specified")
    return servers


SPEC_TYPES_LLAMA = ("none", "draft-simple", "draft-eagle3", "draft-mtp", "ngram-simple", "ngram-map-k",
                    "ngram-map-k4v", "ngram-mod", "ngram-cache")


def _spec_types(v: str) -> list[str]:
    out = []
    for t in _csv(v):
        if t not in SPEC_TYPES_LLAMA:
            raise argparse.ArgumentTypeError(f"unknown speculative decoding type {t!r} "
                                             f"(llama-server knows {', '.join(SPEC_TYPES_LLAMA)})")
        if t in ("draft-simple", "draft-eagle3"):
            raise argparse.ArgumentTypeError(f"{t!r} is not supported by this server: it drafts with the "
                                             "model's MTP heads (draft-mtp) and from the context (ngram-*)")
        out.append(t)
    return out


def _ngram_size(what: str, lo: int = 1) -> Any:
    """llama-server's n-gram sizes: an integer in [lo, 1024], its message otherwise."""
    def parse(v: str) -> int:
        n = _int(v)
        if not lo <= n <= 1024:
            raise argparse.ArgumentTypeError(f"{what} must be between {lo} and 1024 inclusive")
        return n
    return parse


def _min_hits(v: str) -> int:
    n = _int(v)
    if n < 1:
        raise argparse.ArgumentTypeError("ngram min hits must be at least 1")
    return n


class _Removed(argparse.Action):
    """A flag llama-server removed: its message, as llama-server's."""

    def __init__(self, option_strings: list[str], dest: str, use: str = "", **kw: Any) -> None:
        self.use = use
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, values: Any,
                 option: str | None = None) -> None:
        parser.error(f"{option}: the argument has been removed. {self.use}")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n(see `{self.prog} --help`)\n")


class _Append(argparse.Action):
    """Values of a repeatable comma-separated flag, accumulated (--spec-type, --api-key, -a)."""

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        cur = getattr(ns, self.dest, None)
        cur = [] if cur is None or cur is self.default else list(cur)
        setattr(ns, self.dest, cur + list(values))


def _truthy(v: str) -> bool | None:
    """llama-server's reading of a flag's environment variable: on / off, or None."""
    if v in ("on", "enabled", "true", "1"):
        return True
    if v in ("off", "disabled", "false", "0"):
        return False
    return None


class _Overrides(argparse.Action):
    """-ot, -cmoe, -ncmoe (and the draft's -otd, -cmoed, -ncmoed): tensor buffer
    overrides kept in one list in the order given, after the environment's, as
    llama-server keeps them: a tensor goes where the first pattern found in its name says."""

    def __init__(self, *args: Any, kind: str, draft: bool = False, **kw: Any) -> None:
        self.kind, self.draft = kind, draft
        super().__init__(*args, **kw)

    def pairs(self, value: Any) -> list[tuple[str, str]]:
        from ..placement import moe_overrides, parse_overrides

        if self.kind == "ot":
            return parse_overrides(value, self.draft)
        if self.kind == "cmoe":
            return moe_overrides(cpu_moe=True, draft=self.draft)
        if self.kind == "ncffn":  # llama-server's LLM_FFN_DENSE_REGEX, the first N layers'
            n = _int(value)
            if n < 0:
                raise argparse.ArgumentTypeError("invalid value")
            return [(rf"blk\.{i}\.ffn_(up|down|gate)\.", "CPU") for i in range(n)]
        return moe_overrides(n_cpu_moe=_int(value), draft=self.draft)

    def from_env(self, raw: str, current: Any) -> list[tuple[str, str]]:
        new = self.pairs(raw) if self.kind != "cmoe" else (self.pairs(None) if _truthy(raw) else [])
        return list(current or []) + new

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        from ..placement import PlacementError

        try:
            new = self.pairs(values)
        except PlacementError as e:
            raise argparse.ArgumentError(self, e.detail) from None
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentError(self, str(e)) from None
        setattr(ns, self.dest, list(getattr(ns, self.dest) or []) + new)


def _kv_cache_type(v: str) -> str:
    from ..placement import KV_TYPES

    if v not in KV_TYPES:
        raise argparse.ArgumentTypeError(f"unsupported cache type {v!r} (allowed: {', '.join(KV_TYPES)})")
    return v


#: ours: (flag, metavar, ServerConfig field, default, what it bounds)
LIMIT_FLAGS = (
    ("--max-body-size", "BYTES", "max_body_bytes", 32 << 20, "largest request body; larger: 413"),
    ("--max-prompts", "N", "max_prompts", 64, "prompts in one request at most"),
    ("--max-stop", "N", "max_stop", 32, "stop strings in one request at most"),
    ("--max-stop-length", "N", "max_stop_len", 1024, "characters of one stop string at most"),
    ("--max-logit-bias", "N", "max_logit_bias", 4096, "logit_bias entries in one request at most"),
    ("--max-n-probs", "N", "max_n_probs", 100, "n_probs / top_logprobs at most"),
    ("--max-queue", "N", "max_queue", 256, "requests waiting for a slot at most, -1 for no bound; past it: 503"),
)

#: environment variable (llama-server's names) -> the flag it sets (its first spelling)
ENV: dict[str, str] = {}


def add(group: argparse._ArgumentGroup, *names: str, env: str | tuple[str, ...] | None = None, **kw: Any) -> None:
    """A flag, and the llama-server environment variable(s) it can come from."""
    envs = (env,) if isinstance(env, str) else tuple(env or ())
    if envs:
        kw["help"] = (kw.get("help") or "") + f" (env: {', '.join(envs)})"
    action = group.add_argument(*names, **kw)
    for e in envs:
        ENV[e] = action.option_strings[0]


def _context_flags(ap: argparse.ArgumentParser) -> None:
    """Drafting from the context: ours, and llama-server's n-gram drafters' settings."""
    g = ap.add_argument_group("speculative decoding from the context (n-grams)")
    add(g, "--spec-context", dest="spec_context", action="store_const", const=True, default=True,
        help="with draft-mtp, also draft continuations of the text found earlier in the slot's tokens and in "
             "earlier requests' (the plan chooses them or the heads' drafts each round; default: on)")
    add(g, "--no-spec-context", dest="spec_context", action="store_const", const=False,
        help="the heads' drafts alone")
    add(g, "--spec-ngram-shared", metavar="on|off", dest="ngram_shared", type=_on_off, default=True,
        help="keep earlier requests' tokens to draft from, one pool per API key (off: each request drafts "
             "from its own tokens alone; default: on)")
    add(g, "--spec-context-pool", metavar="N", dest="context_pool", type=_int, default=1 << 18,
        help="tokens of earlier requests kept per pool (~160 bytes each with their index; default: 262144)")
    add(g, "--spec-default", dest="spec_default", action="store_true",
        help="llama-server's default n-gram drafting: ngram-mod with n-match 24, n-min 48, n-max 64")
    for kind, what in (("simple", "ngram-simple"), ("map-k", "ngram-map-k"), ("map-k4v", "ngram-map-k4v")):
        dest = kind.replace("-", "_")
        add(g, f"--spec-ngram-{kind}-size-n", metavar="N", dest=f"{dest}_size_n", default=12,
            type=_ngram_size("ngram size N"), help=f"{what}: the n-gram looked up (default: 12)")
        add(g, f"--spec-ngram-{kind}-size-m", metavar="N", dest=f"{dest}_size_m", default=48,
            type=_ngram_size("ngram size M"), help=f"{what}: the tokens drafted after it (default: 48)")
        add(g, f"--spec-ngram-{kind}-min-hits", metavar="N", dest=f"{dest}_min_hits", default=1, type=_min_hits,
            help=f"{what}: lookups of the n-gram before it drafts (default: 1)")
    add(g, "--spec-ngram-mod-n-match", metavar="N", dest="mod_n_match", default=24,
        type=_ngram_size("ngram size N"), help="ngram-mod: the n-gram looked up (default: 24)")
    add(g, "--spec-ngram-mod-n-min", metavar="N", dest="mod_n_min", default=48, type=_ngram_size("ngram n-min", 0),
        help="ngram-mod: fewer tokens found than this and it drafts none (default: 48)")
    add(g, "--spec-ngram-mod-n-max", metavar="N", dest="mod_n_max", default=64, type=_ngram_size("ngram n-max", 0),
        help="ngram-mod: tokens drafted at most (default: 64)")
    add(g, "-lcs", "--lookup-cache-static", metavar="FNAME", dest="lookup_cache_static",
        help="ngram-cache: a static lookup cache (llama-lookup-create's), read at start")
    add(g, "-lcd", "--lookup-cache-dynamic", metavar="FNAME", dest="lookup_cache_dynamic",
        help="ngram-cache: a dynamic lookup cache (llama-lookup's), read at start")
    for names, use, env in (
            (("--draft", "--draft-n", "--draft-max"), "use --spec-draft-n-max or --spec-ngram-mod-n-max",
             "LLAMA_ARG_DRAFT_MAX"),
            (("--draft-min", "--draft-n-min"), "use --spec-draft-n-min or --spec-ngram-mod-n-min", "LLAMA_ARG_DRAFT_MIN"),
            (("--spec-ngram-size-n",), "use the respective --spec-ngram-*-size-n", None),
            (("--spec-ngram-size-m",), "use the respective --spec-ngram-*-size-m", None),
            (("--spec-ngram-min-hits",), "use the respective --spec-ngram-*-min-hits", None)):
        action = g.add_argument(*names, action=_Removed, use=use, help=argparse.SUPPRESS)
        if env:
            ENV[env] = action.option_strings[0]


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog=PROG,
        description="llama-server's HTTP API (/completion, /v1/completions, /v1/chat/completions, /tokenize, "
                    "/detokenize, /props, /v1/models, /health, /metrics) over stepmtp: Step-3.5/3.7-Flash with "
                    "its MTP heads chained as speculative decoding. The flags are llama-server's.",
        epilog="Without -m, the bundled default model is served. Each flag can also come from llama-server's "
               "environment variable (shown as env), the command line winning.",
        allow_abbrev=False,
    )
    g = ap.add_argument_group("general")
    g.add_argument("--usage", action="help", help="as -h")
    g.add_argument("--version", dest="version", action="store_true", help="show version and build info and exit")
    g.add_argument("-cl", "--cache-list", dest="cache_list", action="store_true",
                   help="show the GGUF models in the Hugging Face Hub's cache (-hf's downloads) and exit")
    g.add_argument("--completion-bash", dest="completion_bash", action="store_true",
                   help="print a source-able bash completion script for this command's flags and exit")

    g = ap.add_argument_group("model")
    add(g, "-m", "--model", metavar="FNAME", dest="model", env="LLAMA_ARG_MODEL",
        help="model path (default: the bundled default model)")
    add(g, "-a", "--alias", metavar="STRING", dest="alias", type=_csv, action=_Append, default=[],
        env="LLAMA_ARG_ALIAS", help="model name aliases, comma-separated (the API's model id)")

    g = ap.add_argument_group("speculative decoding (the MTP heads)")
    add(g, "--spec-type", metavar="none|draft-mtp|ngram-*", dest="spec_type", type=_spec_types, action=_Append, default=[],
        env="LLAMA_ARG_SPEC_TYPE",
        help="comma-separated: draft-mtp: draft with the model's MTP heads (and from the context, "
             "--no-spec-context aside); ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod, ngram-cache: "
             "llama-server's n-gram drafters; none: plain decoding (default: none, as llama-server)")
    add(g, "--spec-mtp-mode", metavar="chain|single", dest="mtp_mode", choices=["chain", "single"], default="chain",
        help="chain: head i drafts step i (n-max capped at the head count); single: head 0 for every step, "
             "the behaviour before chaining (default: chain)")
    add(g, "--spec-schedule", metavar="fused|reference", dest="schedule", choices=["fused", "reference"],
        default="fused", help="fused: each head's draft decode also processes the accepted rows; reference: "
                              "the change's schedule, a process decode per head per round (default: fused)")
    add(g, "--spec-verify", metavar="auto|exact|rejection", dest="verify", choices=["auto", "exact", "rejection"],
        default="auto", help="verification above temperature 0: rejection sampling or exact match "
                             "(default: auto = rejection)")
    add(g, "--spec-adaptive", dest="adaptive", action="store_const", const=True, default=True,
        help="choose each slot's draft length every round (0, or n-min..n-max) from the acceptance under its "
             "sampling settings and the measured cost of the whole round (default: on)")
    add(g, "--no-spec-adaptive", dest="adaptive", action="store_const", const=False,
        help="draft n-max every round (as does --spec-draft-n-min equal to --spec-draft-n-max)")
    add(g, "--spec-batch-invariant", dest="batch_invariant", action="store_true",
        help="compute each row of a verify as a one-row decode would, so that at temperature 0 speculative "
             "output equals plain decoding's on GPU backends too (costs time; the CPU needs no such mode)")
    add(g, "--spec-draft-model", "-md", "--model-draft", metavar="FNAME", dest="mtp_model",
        env="LLAMA_ARG_SPEC_DRAFT_MODEL", help="a separate MTP-only GGUF with the heads (default: from -m)")
    add(g, "--spec-draft-n-max", metavar="N", dest="n_max", type=_int, default=3, env="LLAMA_ARG_SPEC_DRAFT_N_MAX",
        help="tokens drafted per round at most (default: 3)")
    add(g, "--spec-draft-n-min", metavar="N", dest="n_min", type=_int, default=0, env="LLAMA_ARG_SPEC_DRAFT_N_MIN",
        help="a round drafting fewer than this drafts none (default: 0)")
    add(g, "--spec-draft-p-min", "--draft-p-min", metavar="P", dest="p_min", type=_float, default=0.0,
        env="LLAMA_ARG_SPEC_DRAFT_P_MIN", help="drafting stops at a token less likely than this (default: 0.00)")
    add(g, "--spec-draft-vocab", metavar="N", dest="draft_vocab", type=_int, default=-1,
        env="LLAMA_ARG_SPEC_DRAFT_VOCAB",
        help="the heads draft among the first N token ids, widened while the target's tokens "
             "fall outside (default: -1, a quarter of the vocabulary, at least 2048; 0: all)")
    add(g, "--spec-draft-ngl", "-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft", metavar="N",
        dest="ngl_draft", type=_layers, env="LLAMA_ARG_N_GPU_LAYERS_DRAFT",
        help="draft model layers in VRAM: a number, 'auto' or 'all' (default: as -ngl)")
    _context_flags(ap)

    g = ap.add_argument_group("context and compute")
    add(g, "-c", "--ctx-size", metavar="N", dest="ctx_size", type=_int, default=0, env="LLAMA_ARG_CTX_SIZE",
        help="context size (default: 0, the model's)")
    add(g, "-np", "--parallel", metavar="N", dest="parallel", type=_int, default=-1, env="LLAMA_ARG_N_PARALLEL",
        help="server slots: generations decoded together, batched (default: -1, auto: 4 slots and a unified KV "
             "cache, as llama-server)")
    add(g, "-kvu", "--kv-unified", dest="kv_unified", action="store_const", const=True, default=None,
        env="LLAMA_ARG_KV_UNIFIED", help="one KV cache shared by all slots, each may use all of -c "
                                         "(default: on when -np is auto)")
    add(g, "-no-kvu", "--no-kv-unified", dest="kv_unified", action="store_const", const=False,
        help="split -c evenly between the slots")
    add(g, "-sps", "--slot-prompt-similarity", metavar="SIMILARITY", dest="slot_prompt_similarity", type=_float,
        default=0.1, help="how much of a request's prompt a slot's cached prompt must share for the request to "
                          "go to that slot, else the least recently used one (default: 0.10, 0.0 = disabled)")
    add(g, "--swa-full", dest="swa_full", action="store_true", env="LLAMA_ARG_SWA_FULL",
        help="use full-size SWA cache (default: false, the window plus one ubatch of cells)")
    add(g, "-ctxcp", "--ctx-checkpoints", "--swa-checkpoints", metavar="N", dest="ctx_checkpoints", type=_int,
        default=32, env="LLAMA_ARG_CTX_CHECKPOINTS",
        help="max number of context checkpoints to create per slot (default: 32): the sliding-window cells "
             "at a prompt's end, so a later prompt that leaves the cache there goes on from it")
    add(g, "-cram", "--cache-ram", metavar="N", dest="cache_ram", type=_int, default=8192,
        env="LLAMA_ARG_CACHE_RAM", help="MiB of host memory for prompts slots lose (another conversation takes "
                                        "the slot), restored for a request that shares more with them; -1: no "
                                        "limit, 0: disabled (default: 8192)")
    add(g, "--slot-save-path", metavar="PATH", dest="slot_save_path", default=None,
        help="where POST /slots/{id}?action=save|restore keeps slot files (default: disabled)")
    add(g, "-b", "--batch-size", metavar="N", dest="batch_size", type=_int, default=2048, env="LLAMA_ARG_BATCH",
        help="logical maximum batch size (default: 2048)")
    add(g, "-ub", "--ubatch-size", metavar="N", dest="ubatch_size", type=_int, default=512, env="LLAMA_ARG_UBATCH",
        help="physical maximum batch size (default: 512)")
    add(g, "-t", "--threads", metavar="N", dest="threads", type=_int, env="LLAMA_ARG_THREADS",
        help="CPU threads for generation (default: all this process may use)")
    add(g, "-tb", "--threads-batch", metavar="N", dest="threads_batch", type=_int,
        help="CPU threads for prompt processing (default: same as --threads)")
    add(g, "-ngl", "--gpu-layers", "--n-gpu-layers", metavar="N", dest="ngl", type=_layers, default="auto",
        env="LLAMA_ARG_N_GPU_LAYERS", help="layers in VRAM: a number, 'auto' or 'all' (default: auto)")
    add(g, "--rpc", metavar="SERVERS", dest="rpc", type=_rpc_servers, default=None, env="LLAMA_ARG_RPC",
        help="comma-separated list of RPC servers (host:port), for the model and the draft (MTP) model; "
             "their devices count as GPUs for -ngl / --spec-draft-ngl (see python -m stepmtp.rpc_server)")
    add(g, "-fa", "--flash-attn", metavar="on|off|auto", dest="flash_attn", type=_on_off_auto, default=None,
        env="LLAMA_ARG_FLASH_ATTN", help="flash attention (default: auto)")

    _placement_flags(ap)

    g = ap.add_argument_group("sampling (a request's own values win)")
    d = SamplingParams()
    add(g, "--temp", "--temperature", metavar="N", env="LLAMA_ARG_TEMPERATURE", dest="temp", type=_float, default=d.temperature,
        help=f"temperature (default: {d.temperature:.2f})")
    add(g, "--top-k", metavar="N", env="LLAMA_ARG_TOP_K", dest="top_k", type=_int, default=d.top_k, help=f"top-k (default: {d.top_k})")
    add(g, "--top-p", metavar="N", env="LLAMA_ARG_TOP_P", dest="top_p", type=_float, default=d.top_p, help=f"top-p (default: {d.top_p})")
    add(g, "--min-p", metavar="N", env="LLAMA_ARG_MIN_P", dest="min_p", type=_float, default=d.min_p, help=f"min-p (default: {d.min_p})")
    add(g, "--repeat-penalty", metavar="N", env="LLAMA_ARG_REPEAT_PENALTY", dest="repeat_penalty", type=_float, default=d.repeat_penalty,
        help=f"repetition penalty (default: {d.repeat_penalty:.1f}, 1.0 = disabled)")
    add(g, "--repeat-last-n", metavar="N", dest="repeat_last_n", type=_int, default=d.repeat_last_n,
        help=f"tokens the penalties look at (default: {d.repeat_last_n}, 0 = disabled, -1 = all)")
    add(g, "--presence-penalty", metavar="N", env="LLAMA_ARG_PRESENCE_PENALTY", dest="presence_penalty", type=_float, default=d.presence_penalty,
        help="presence penalty (default: 0.0)")
    add(g, "--frequency-penalty", metavar="N", env="LLAMA_ARG_FREQUENCY_PENALTY", dest="frequency_penalty", type=_float, default=d.frequency_penalty,
        help="frequency penalty (default: 0.0)")
    add(g, "--top-nsigma", "--top-n-sigma", metavar="N", dest="top_n_sigma", type=_float, default=d.top_n_sigma,
        help=f"top-n-sigma (default: {d.top_n_sigma:.2f}, -1.0 = disabled)")
    add(g, "--typical", "--typical-p", metavar="N", dest="typical_p", type=_float, default=d.typical_p,
        help=f"locally typical sampling, p (default: {d.typical_p:.2f}, 1.0 = disabled)")
    add(g, "--xtc-probability", metavar="N", dest="xtc_probability", type=_float, default=d.xtc_probability,
        help=f"XTC probability (default: {d.xtc_probability:.2f}, 0.0 = disabled)")
    add(g, "--xtc-threshold", metavar="N", dest="xtc_threshold", type=_float, default=d.xtc_threshold,
        help=f"XTC threshold (default: {d.xtc_threshold:.2f}, 1.0 = disabled)")
    add(g, "--dynatemp-range", metavar="N", dest="dynatemp_range", type=_float, default=d.dynatemp_range,
        help=f"dynamic temperature range (default: {d.dynatemp_range:.2f}, 0.0 = disabled)")
    add(g, "--dynatemp-exp", metavar="N", dest="dynatemp_exponent", type=_float, default=d.dynatemp_exponent,
        help=f"dynamic temperature exponent (default: {d.dynatemp_exponent:.2f})")
    add(g, "--samplers", metavar="SAMPLERS", dest="samplers", default=None,
        help=f"the samplers, in order, separated by ';' (default: {';'.join(DEFAULT_SAMPLERS)})")
    add(g, "--sampler-seq", "--sampling-seq", metavar="SEQUENCE", dest="sampler_seq", default=None,
        help="the samplers as letters (default: edskypmxt)")
    add(g, "--mirostat", metavar="N", dest="mirostat", type=_int, default=0,
        help="only 0 (disabled) is supported here")
    add(g, "--dry-multiplier", metavar="N", dest="dry_multiplier", type=_float, default=0.0,
        help="only 0.0 (DRY disabled) is supported here")
    for flag, kind in (("--mirostat-lr", _float), ("--mirostat-ent", _float), ("--dry-base", _float),
                       ("--dry-allowed-length", _int), ("--dry-penalty-last-n", _int),
                       ("--adaptive-target", _float), ("--adaptive-decay", _float)):
        add(g, flag, metavar="N", dest="_" + flag.strip("-").replace("-", "_"), type=kind,
            help="accepted; no effect while mirostat, DRY and adaptive-p are off")
    add(g, "--dry-sequence-breaker", metavar="STRING", dest="_dry_sequence_breaker", action="append",
        help="accepted; no effect while DRY is off")
    add(g, "-s", "--seed", metavar="SEED", dest="seed", type=_int, default=-1,
        help="RNG seed (default: -1, a random seed)")
    add(g, "-n", "--predict", "--n-predict", metavar="N", dest="n_predict", type=_int, default=-1,
        env="LLAMA_ARG_N_PREDICT", help="tokens to predict for a request that says nothing (default: -1, no limit)")

    g = ap.add_argument_group("server")
    add(g, "--host", metavar="HOST", dest="host", default="127.0.0.1", env="LLAMA_ARG_HOST",
        help="address to listen on (default: 127.0.0.1)")
    add(g, "--port", metavar="PORT", dest="port", type=_int, default=8080, env="LLAMA_ARG_PORT",
        help="port to listen on (default: 8080)")
    add(g, "--api-key", metavar="KEY", dest="api_key", type=_csv, action=_Append, default=[], env="LLAMA_API_KEY",
        help="API keys, comma-separated: requests then need 'Authorization: Bearer KEY' or 'X-Api-Key: KEY' "
             "(/health and /v1/models stay public) (default: none)")
    add(g, "--api-key-file", metavar="FNAME", dest="api_key_file", env="LLAMA_ARG_API_KEY_FILE",
        help="file of API keys, one a line, '#' comments (default: none)")
    add(g, "-v", "--verbose", "--log-verbose", dest="verbose", action="store_true",
        help="llama.cpp's log too, and every message (-lv's highest level)")

    g = ap.add_argument_group("request limits (ours: a request past one gets a 4xx, a full queue a 503)")
    for flag, meta, dest, default, what in LIMIT_FLAGS:
        add(g, flag, metavar=meta, dest=dest, type=_int, default=default, help=f"{what} (default: {default})")

    add(g, "--ui", "--webui", dest="ui", action="store_const", const=True, default=True, env="LLAMA_ARG_UI",
        help="a chat page at / (default: enabled)")
    add(g, "--no-ui", "--no-webui", dest="ui", action="store_const", const=False, help="no chat page at /")

    g = ap.add_argument_group("chat template")
    add(g, "--jinja", dest="use_jinja", action="store_const", const=True, default=True, env="LLAMA_ARG_JINJA",
        help="render the chat template with jinja (default: enabled)")
    add(g, "--no-jinja", dest="use_jinja", action="store_const", const=False,
        help="llama.cpp's built-in templates instead of jinja (the model's template is matched to one)")
    add(g, "--chat-template", metavar="JINJA_TEMPLATE", dest="chat_template", env="LLAMA_ARG_CHAT_TEMPLATE",
        help="a jinja chat template, or a built-in template's name (chatml, llama3, ...) (default: the model's, "
             "else chatml)")
    add(g, "--chat-template-file", metavar="JINJA_TEMPLATE_FILE", dest="chat_template_file",
        env="LLAMA_ARG_CHAT_TEMPLATE_FILE", help="a file holding the chat template")
    add(g, "--chat-template-kwargs", metavar="STRING", dest="chat_template_kwargs", type=_json_object,
        env="LLAMA_ARG_CHAT_TEMPLATE_KWARGS",
        help="extra template variables, a JSON object, e.g. '{\"enable_thinking\": false}' (a request's "
             "chat_template_kwargs win)")
    add(g, "--reasoning-format", metavar="FORMAT", dest="reasoning_format", choices=["none", "deepseek", "auto"],
        default="auto", env="LLAMA_ARG_THINK",
        help="none: thoughts stay in message.content; deepseek / auto: they go to message.reasoning_content "
             "(default: auto)")
    add(g, "-rea", "--reasoning", metavar="on|off|auto", dest="reasoning", type=_on_off_auto, default=None,
        env="LLAMA_ARG_REASONING",
        help="thinking in the chat: on / off set the template's enable_thinking, auto leaves the template's "
             "default (default: auto)")
    add(g, "--reasoning-budget", metavar="N", dest="reasoning_budget", type=_int, default=-1,
        env="LLAMA_ARG_THINK_BUDGET", help="token budget for thinking: -1 unrestricted, 0 no thinking, N > 0: after "
                                           "N tokens of a think block its end is forced (default: -1)")
    add(g, "--reasoning-budget-message", metavar="MESSAGE", dest="reasoning_budget_message", default="",
        env="LLAMA_ARG_THINK_BUDGET_MESSAGE",
        help="text forced before the end of thinking when the budget runs out (default: none)")
    add(g, "--template-timeout", metavar="S", dest="template_timeout", type=_float, default=5.0,
        help="ours: a chat template rendering longer than this is stopped, a 400 (default: 5)")
    add(g, "--template-max-chars", metavar="N", dest="template_max_chars", type=_int, default=4 << 20,
        help="ours: a rendered prompt longer than this is a 400 (default: 4194304)")

    _hub_flags(ap)
    _compat_flags(ap)
    return ap


def _hub_flags(ap: argparse.ArgumentParser) -> None:
    """llama-server's models by name (Hugging Face Hub) and by URL, fetched by huggingface_hub."""
    g = ap.add_argument_group("models from the Hugging Face Hub (into its cache; HF_ENDPOINT, HF_HOME, "
                              "HF_HUB_OFFLINE apply)")
    add(g, "-hf", "-hfr", "--hf-repo", metavar="<user>/<model>[:quant]", dest="hf_repo", env="LLAMA_ARG_HF_REPO",
        help="the model's repository; quant is optional, case-insensitive, default Q4_K_M, else Q8_0, else the "
             "first model file; every shard of a split model is fetched; with --spec-type draft-mtp a file of "
             "MTP heads beside it (mtp- in its name) is the draft model unless one is named")
    add(g, "-hff", "--hf-file", metavar="FILE", dest="hf_file", env="LLAMA_ARG_HF_FILE",
        help="the model's file in the repository (overrides the quant in --hf-repo)")
    add(g, "-hfd", "-hfrd", "--hf-repo-draft", "--spec-draft-hf", metavar="<user>/<model>[:quant]",
        dest="hf_repo_draft", env="LLAMA_ARG_SPEC_DRAFT_HF_REPO",
        help="as --hf-repo, for the draft (MTP heads) model")
    add(g, "-hffd", "--hf-file-draft", metavar="FILE", dest="hf_file_draft", env="LLAMA_ARG_HF_FILE_DRAFT",
        help="the draft (MTP heads) model's file in --hf-repo-draft's repository (or --hf-repo's)")
    add(g, "-hft", "--hf-token", metavar="TOKEN", dest="hf_token", env="HF_TOKEN",
        help="Hugging Face access token, for private and gated repositories (default: HF_TOKEN)")
    add(g, "--offline", dest="offline", action="store_true", env=("LLAMA_ARG_OFFLINE", "LLAMA_OFFLINE"),
        help="no network: models from the hub's cache only (as HF_HUB_OFFLINE=1)")
    add(g, "-mu", "--model-url", metavar="MODEL_URL", dest="model_url", env="LLAMA_ARG_MODEL_URL",
        help="the model at a URL (every shard of a split one), saved as -m or in LLAMA_CACHE "
             "(default ~/.cache/llama.cpp); a hub URL goes to the hub's cache")


def _placement_flags(ap: argparse.ArgumentParser) -> None:
    """llama-server's buffer placement, devices and KV cache types, the draft's set too."""
    g = ap.add_argument_group("placement and KV cache (llama-server's; the GPU ones do nothing on a CPU build)")
    add(g, "-ot", "--override-tensor", metavar="<tensor name pattern>=<buffer type>,...", dest="tensor_overrides",
        action=_Overrides, kind="ot", default=[], env="LLAMA_ARG_OVERRIDE_TENSOR",
        help="override tensor buffer type, e.g. 'exps=CPU' (the first pattern found in a tensor's name wins)")
    add(g, "-cmoe", "--cpu-moe", dest="tensor_overrides", action=_Overrides, kind="cmoe", nargs=0,
        env="LLAMA_ARG_CPU_MOE", help="keep all Mixture of Experts (MoE) weights in the CPU")
    add(g, "-ncmoe", "--n-cpu-moe", metavar="N", dest="tensor_overrides", action=_Overrides, kind="ncmoe",
        env="LLAMA_ARG_N_CPU_MOE", help="keep the Mixture of Experts (MoE) weights of the first N layers in the CPU")
    add(g, "-ncffn", "--n-cpu-ffn", metavar="N", dest="tensor_overrides", action=_Overrides, kind="ncffn",
        env="LLAMA_ARG_N_CPU_FFN", help="keep the dense FFN weights of the first N layers in the CPU")
    add(g, "-ctk", "--cache-type-k", metavar="TYPE", dest="cache_type_k", type=_kv_cache_type, default="f16",
        env="LLAMA_ARG_CACHE_TYPE_K", help="KV cache data type for K: f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, "
                                           "q5_0, q5_1 (default: f16)")
    add(g, "-ctv", "--cache-type-v", metavar="TYPE", dest="cache_type_v", type=_kv_cache_type, default="f16",
        env="LLAMA_ARG_CACHE_TYPE_V", help="KV cache data type for V, as -ctk; a quantized V needs flash "
                                           "attention (-fa auto or on) (default: f16)")
    add(g, "--mmap", dest="use_mmap", action="store_const", const=True, default=True, env="LLAMA_ARG_MMAP",
        help="memory-map the model (default: enabled)")
    add(g, "--no-mmap", dest="use_mmap", action="store_const", const=False,
        help="read the model into memory instead (slower load, may reduce pageouts without --mlock)")
    add(g, "--mlock", dest="use_mlock", action="store_true", env="LLAMA_ARG_MLOCK",
        help="force the system to keep the model in RAM rather than swapping or compressing")
    add(g, "--numa", metavar="TYPE", dest="numa", type=_choice("distribute", "isolate", "numactl"), default=None,
        env="LLAMA_ARG_NUMA", help="NUMA optimizations: distribute (spread execution evenly over all nodes), "
                                   "isolate (threads on the node execution started on), numactl (the CPU map "
                                   "numactl gives)")
    add(g, "-dev", "--device", metavar="<dev1,dev2,..>", dest="devices", env="LLAMA_ARG_DEVICE",
        help="comma-separated list of devices to offload to (none = don't offload); see --list-devices")
    add(g, "--list-devices", dest="list_devices", action="store_true", help="print the available devices and exit")
    add(g, "-sm", "--split-mode", metavar="{none,layer,row,tensor}", dest="split_mode",
        type=_choice("none", "layer", "row", "tensor"), default="layer", env="LLAMA_ARG_SPLIT_MODE",
        help="how to split the model across GPUs: none (one GPU), layer (layers and KV, default), row (weights "
             "by rows), tensor (weights and KV, experimental)")
    add(g, "-ts", "--tensor-split", metavar="N0,N1,N2,...", dest="tensor_split", env="LLAMA_ARG_TENSOR_SPLIT",
        help="fraction of the model to offload to each GPU, comma-separated proportions, e.g. 3,1")
    add(g, "-mg", "--main-gpu", metavar="INDEX", dest="main_gpu", type=_int, default=0, env="LLAMA_ARG_MAIN_GPU",
        help="the GPU for the whole model (-sm none), or for intermediate results and KV (-sm row) (default: 0)")
    add(g, "--spec-draft-type-k", "-ctkd", "--cache-type-k-draft", metavar="TYPE", dest="cache_type_k_draft",
        type=_kv_cache_type, default="f16", env="LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_K",
        help="KV cache data type for K of every MTP head context (default: f16)")
    add(g, "--spec-draft-type-v", "-ctvd", "--cache-type-v-draft", metavar="TYPE", dest="cache_type_v_draft",
        type=_kv_cache_type, default="f16", env="LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_V",
        help="KV cache data type for V of every MTP head context (default: f16)")
    add(g, "--spec-draft-override-tensor", "-otd", "--override-tensor-draft",
        metavar="<tensor name pattern>=<buffer type>,...", dest="tensor_overrides_draft", action=_Overrides,
        kind="ot", draft=True, default=[], help="override tensor buffer type for the draft (MTP) model")
    add(g, "--spec-draft-cpu-moe", "-cmoed", "--cpu-moe-draft", dest="tensor_overrides_draft", action=_Overrides,
        kind="cmoe", draft=True, nargs=0, env="LLAMA_ARG_SPEC_DRAFT_CPU_MOE",
        help="keep all MoE weights of the draft (MTP) model in the CPU")
    add(g, "--spec-draft-n-cpu-moe", "--spec-draft-ncmoe", "-ncmoed", "--n-cpu-moe-draft", metavar="N",
        dest="tensor_overrides_draft", action=_Overrides, kind="ncmoe", draft=True,
        env="LLAMA_ARG_SPEC_DRAFT_N_CPU_MOE",
        help="keep the MoE weights of the first N layers of the draft (MTP) model in the CPU")
    add(g, "--spec-draft-device", "-devd", "--device-draft", metavar="<dev1,dev2,..>", dest="devices_draft",
        help="comma-separated list of devices to offload the draft (MTP) model to (none = don't offload)")


def _compat_flags(ap: argparse.ArgumentParser) -> None:
    """llama-server's flags that change nothing here, accepted so its command lines run."""
    from .flags import add_compat_flags, add_llama_flags

    add_llama_flags(ap, add)
    g = ap.add_argument_group("model tags and endpoints")
    add(g, "--tags", metavar="STRING", dest="_tags", env="LLAMA_ARG_TAGS",
        help="model tags, informational (not used)")
    add(g, "--slots", dest="endpoint_slots", action="store_const", const=True, default=True,
        env="LLAMA_ARG_ENDPOINT_SLOTS", help="expose the slots monitoring endpoint (default: enabled)")
    add(g, "--no-slots", dest="endpoint_slots", action="store_const", const=False,
        help="disable the slots monitoring endpoint")
    add_compat_flags(ap, add)


def _normalize(argv: Sequence[str]) -> list[str]:
    """llama-server reads --long_option as --long-option."""
    out = []
    for a in argv:
        if a.startswith("--") and len(a) > 2:
            name, eq, val = a.partition("=")
            a = name.replace("_", "-") + eq + val
        out.append(a)
    return out


def _env_defaults(ap: argparse.ArgumentParser) -> None:
    from ..placement import PlacementError
    from .flags import _Refuse

    actions = {a.option_strings[0]: a for a in ap._actions if a.option_strings}
    for env, flag in ENV.items():
        raw = os.environ.get(env)
        a = actions[flag]
        # llama-server: LLAMA_ARG_NO_X set (to anything) turns a switch with a --no- form off
        neg = env.replace("LLAMA_ARG_", "LLAMA_ARG_NO_", 1)
        if raw is None and neg != env and a.nargs == 0 and isinstance(a.const, bool) and neg in os.environ:
            raw = "0" if a.const else "1"
        if raw is None:
            continue
        if isinstance(a, (_Refuse, _Removed)):
            if a.nargs == 0 and _truthy(raw) is False:
                continue
            a(ap, argparse.Namespace(), raw, f"{flag} (environment variable {env})")
        try:
            val: Any
            if isinstance(a, _Overrides):
                val = a.from_env(raw, ap.get_default(a.dest))
            elif a.nargs == 0:  # a flag: set by on / true / 1 / enabled, the other way by off / ...
                on = _truthy(raw)
                if on is None:
                    raise argparse.ArgumentTypeError(f"expected on or off, got {raw!r}")
                val = a.const if on else (not a.const if isinstance(a.const, bool) else ap.get_default(a.dest))
            else:
                val = a.type(raw) if a.type else raw  # type: ignore[operator]
        except (argparse.ArgumentTypeError, PlacementError) as e:
            ap.error(f"environment variable {env}: {getattr(e, 'detail', e)}")
        ap.set_defaults(**{a.dest: val})


def parse_args(argv: Sequence[str] | None = None) -> ServerConfig:
    """The command line as a ServerConfig; exits with a message (status 2) on a bad flag."""
    ap = build_parser()
    _env_defaults(ap)
    args = ap.parse_args(_normalize(sys.argv[1:] if argv is None else argv))
    if args.version or args.cache_list or args.completion_bash:
        print(_info(ap, args))
        ap.exit(0)
    if args.list_devices:
        from ..placement import list_devices

        print("Available devices:")
        for name, desc, total, free in list_devices():
            print(f"  {name}: {desc} ({total >> 20} MiB, {free >> 20} MiB free)")
        ap.exit(0)
    try:
        return _to_config(args)
    except ArgError as e:
        ap.error(str(e))


def _info(ap: argparse.ArgumentParser, a: argparse.Namespace) -> str:
    """--version, --cache-list, --completion-bash: what they print."""
    if a.version:
        from .. import __version__

        return f"version: stepmtp {__version__}\nbuilt with the llama.cpp of {_pinned_llama()}"
    if a.cache_list:
        from ..hub import cached_models

        models = cached_models()
        return "\n".join([f"number of models in cache: {len(models)}",
                          *(f"{i + 1:4d}. {m}" for i, m in enumerate(models))])
    flags = sorted(s for act in ap._actions for s in act.option_strings)
    return ("_stepmtp_server() {\n"
            '    local cur="${COMP_WORDS[COMP_CWORD]}"\n'
            f'    COMPREPLY=( $(compgen -W "{" ".join(flags)}" -- "$cur") )\n'
            "}\n"
            "complete -o default -F _stepmtp_server stepmtp-server")


def _pinned_llama() -> str:
    """The llama.cpp the package was built with, as the build recorded it."""
    import json
    from importlib import resources

    try:
        info = json.loads(resources.files("stepmtp").joinpath("_build_info.json").read_text())
    except (OSError, ValueError):
        return "an unrecorded tree"
    return str(info.get("llama_cpp") or info.get("sdist") or info)


def _to_config(a: argparse.Namespace) -> ServerConfig:
    def check(ok: bool, msg: str) -> None:
        if not ok:
            raise ArgError(msg)

    spec = a.spec_type or ["none"]
    check(a.parallel != 0, "invalid value for -np/--parallel: 0")
    check(a.ctx_size >= 0, f"invalid value for -c/--ctx-size: {a.ctx_size}")
    check(0.0 <= a.slot_prompt_similarity <= 1.0, f"invalid value for -sps: {a.slot_prompt_similarity}")
    check(a.cache_ram >= -1, f"invalid value for --cache-ram: {a.cache_ram}")
    if a.slot_save_path is not None:
        check(Path(a.slot_save_path).is_dir(), f"--slot-save-path: not a directory: {a.slot_save_path}")
    check(a.batch_size >= 1, f"invalid value for -b/--batch-size: {a.batch_size}")
    check(a.ubatch_size >= 1, f"invalid value for -ub/--ubatch-size: {a.ubatch_size}")
    check(a.n_max >= 0, f"invalid value for --spec-draft-n-max: {a.n_max}")
    check(a.n_min >= 0, f"invalid value for --spec-draft-n-min: {a.n_min}")
    check(0.0 <= a.p_min <= 1.0, f"--spec-draft-p-min must be in [0, 1], got {a.p_min}")
    check(a.context_pool >= 0, f"invalid value for --spec-context-pool: {a.context_pool}")
    for f, flag in ((a.lookup_cache_static, "-lcs"), (a.lookup_cache_dynamic, "-lcd")):
        check(f is None or Path(f).is_file(), f"{flag}: no such file: {f}")
    check(a.draft_vocab >= -1, f"--spec-draft-vocab must be -1 (auto), 0 (all) or a token count, got {a.draft_vocab}")
    check(0 <= a.port <= 65535, f"invalid value for --port: {a.port}")
    check(a.n_predict >= -1, f"invalid value for -n/--predict: {a.n_predict}")
    for flag, v in (("-t/--threads", a.threads), ("-tb/--threads-batch", a.threads_batch)):
        check(v is None or v >= -1, f"invalid value for {flag}: {v}")
    for flag, v in (("-ngl", a.ngl), ("--spec-draft-ngl", a.ngl_draft)):
        check(not isinstance(v, int) or v >= -2, f"invalid value for {flag}: {v}")
    from ..llama import shard_paths

    # -m names a model's first shard: llama.cpp loads the others from its name
    # (with -hf, -m is the repository's file; with -mu, where the download goes)
    local_model = None if a.hf_repo or a.model_url else a.model
    for what, fname in (("model", local_model), ("draft (MTP) model", a.mtp_model)):
        for shard in shard_paths(fname) if fname is not None else ():
            check(shard.is_file(), f"{what} file not found: {shard}")
    placement, placement_draft = _placement(a)
    chat_template = a.chat_template
    if a.chat_template_file:
        try:
            chat_template = Path(a.chat_template_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ArgError(f"failed to read the chat template file '{a.chat_template_file}': {e}") from None
    check(a.reasoning_budget >= -1, f"invalid value for --reasoning-budget: {a.reasoning_budget}")
    check(a.template_timeout > 0, f"invalid value for --template-timeout: {a.template_timeout}")
    for flag, _, dest, _, _ in LIMIT_FLAGS:
        v = getattr(a, dest)
        low = -1 if dest == "max_queue" else (0 if dest in ("max_logit_bias", "max_n_probs") else 1)
        check(v >= low, f"invalid value for {flag}: {v}")
    check(a.template_max_chars > 0, f"invalid value for --template-max-chars: {a.template_max_chars}")
    keys = list(a.api_key)
    if a.api_key_file:
        try:
            lines = Path(a.api_key_file).read_text().splitlines()
        except OSError as e:
            raise ArgError(f"failed to open file '{a.api_key_file}': {e.strerror}") from None
        keys += [ln for ln in lines if ln and not ln.startswith("#")]
    check(a.mirostat == 0, f"--mirostat {a.mirostat}: mirostat is not supported by this server")
    check(a.dry_multiplier == 0.0, f"--dry-multiplier {a.dry_multiplier}: DRY is not supported by this server")
    order = DEFAULT_SAMPLERS
    if a.samplers is not None:
        order = parse_samplers(a.samplers)
    if a.sampler_seq is not None:
        order = parse_samplers(a.sampler_seq, chars=True)
    try:
        sampling = SamplingParams(
            temperature=max(0.0, a.temp), top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
            repeat_penalty=a.repeat_penalty, repeat_last_n=a.repeat_last_n,
            presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty,
            typical_p=a.typical_p, top_n_sigma=a.top_n_sigma, xtc_probability=a.xtc_probability,
            xtc_threshold=a.xtc_threshold, dynatemp_range=a.dynatemp_range, dynatemp_exponent=a.dynatemp_exponent,
            samplers=order,
        )
    except ValueError as e:
        raise ArgError(f"invalid sampling flag: {e}") from None

    def threads(v: int | None) -> int | None:
        return None if v is None or v <= 0 else v

    from .flags import llama_config

    extra = llama_config(a)
    template_kwargs = extra.pop("template_kwargs")

    return ServerConfig(
        model=a.model,
        mtp_model=a.mtp_model,
        spec_type="draft-mtp" if "draft-mtp" in spec else "none",
        ngram_types=tuple(t for t in NGRAM_TYPES if t in spec or (t == "ngram-mod" and a.spec_default)),
        spec_context=a.spec_context,
        context_pool=a.context_pool if a.ngram_shared else 0,
        ngram=NgramConfig(
            simple_size_n=a.simple_size_n, simple_size_m=a.simple_size_m, simple_min_hits=a.simple_min_hits,
            map_k_size_n=a.map_k_size_n, map_k_size_m=a.map_k_size_m, map_k_min_hits=a.map_k_min_hits,
            map_k4v_size_n=a.map_k4v_size_n, map_k4v_size_m=a.map_k4v_size_m, map_k4v_min_hits=a.map_k4v_min_hits,
            mod_n_match=24 if a.spec_default else a.mod_n_match, mod_n_min=48 if a.spec_default else a.mod_n_min,
            mod_n_max=64 if a.spec_default else a.mod_n_max,
            lookup_cache_static=a.lookup_cache_static, lookup_cache_dynamic=a.lookup_cache_dynamic),
        mtp_mode=a.mtp_mode,
        schedule=a.schedule,
        verify=a.verify,
        adaptive=a.adaptive,
        batch_invariant=a.batch_invariant,
        n_max=a.n_max,
        n_min=a.n_min,
        p_min=a.p_min,
        draft_vocab=a.draft_vocab,
        # --kv-unified-per-slot N without -c: llama-server sizes the shared cache N per slot
        n_ctx=a.ctx_size or a.kv_unified_per_slot * _slots(a),
        n_batch=a.batch_size,
        n_ubatch=a.ubatch_size,
        n_parallel=a.parallel,
        kv_unified=a.kv_unified,
        endpoint_slots=a.endpoint_slots,
        n_threads=threads(a.threads),
        n_threads_batch=threads(a.threads_batch),
        n_gpu_layers=a.ngl,
        n_gpu_layers_draft=a.ngl_draft,
        rpc=a.rpc or [],
        flash_attn=a.flash_attn,
        placement=placement,
        placement_draft=placement_draft,
        cache_type_k=a.cache_type_k,
        cache_type_v=a.cache_type_v,
        cache_type_k_draft=a.cache_type_k_draft,
        cache_type_v_draft=a.cache_type_v_draft,
        use_mmap=a.use_mmap,
        use_mlock=a.use_mlock,
        numa=a.numa,
        seed=a.seed,
        n_predict=a.n_predict,
        sampling=sampling,
        host=a.host,
        port=a.port,
        api_keys=keys,
        aliases=list(a.alias),
        verbose=a.verbose,
        slot_prompt_similarity=a.slot_prompt_similarity,
        slot_save_path=a.slot_save_path,
        ui=a.ui,
        cache_ram_mib=a.cache_ram,
        swa_full=a.swa_full,
        ctx_checkpoints=a.ctx_checkpoints,
        use_jinja=a.use_jinja,
        reasoning_format=a.reasoning_format,
        reasoning_budget=a.reasoning_budget,
        reasoning_budget_message=a.reasoning_budget_message,
        chat_template=chat_template or None,
        chat_template_kwargs={**({"enable_thinking": a.reasoning} if a.reasoning is not None else {}),
                              **template_kwargs, **(a.chat_template_kwargs or {})},
        tags=[t for t in (a._tags or "").split(",") if t],
        template_timeout=a.template_timeout,
        template_max_chars=a.template_max_chars,
        **{dest: getattr(a, dest) for _, _, dest, _, _ in LIMIT_FLAGS},
        **_hub_config(a),
        **extra,
    )


def _slots(a: argparse.Namespace) -> int:
    """The slot count -np gives (ServerConfig.total_slots' rule)."""
    return ServerConfig(n_parallel=a.parallel, n_batch=a.batch_size, n_max=a.n_max,
                        spec_type="draft-mtp" if "draft-mtp" in (a.spec_type or []) else "none").total_slots


def _hub_config(a: argparse.Namespace) -> dict[str, Any]:
    """The -hf flags' ServerConfig fields."""
    if a.hf_file_draft and not (a.hf_repo_draft or a.hf_repo):
        raise ArgError("-hffd/--hf-file-draft names a file of a repository: give -hfd or -hf too")
    return dict(hf_repo=a.hf_repo, hf_file=a.hf_file, hf_repo_draft=a.hf_repo_draft, hf_file_draft=a.hf_file_draft,
                hf_token=a.hf_token, model_url=a.model_url, offline=a.offline)


def _placement(a: argparse.Namespace) -> tuple[Any, Any]:
    """The target's and the draft model's Placement; a buffer type or device no
    device here has is an error now, as in llama-server (an RPC server's: at the load,
    once connected)."""
    from ..placement import Placement, PlacementError, check_kv_types

    try:
        out = []
        for draft in (False, True):
            pl = Placement.of(override_tensor=a.tensor_overrides_draft if draft else a.tensor_overrides,
                              devices=a.devices_draft if draft else a.devices, split_mode=a.split_mode,
                              tensor_split=a.tensor_split, main_gpu=a.main_gpu, draft=draft)
            pl.check_names(defer_rpc=bool(a.rpc))
            out.append(pl)
        check_kv_types({"target": (a.cache_type_k, a.cache_type_v),
                        "draft": (a.cache_type_k_draft, a.cache_type_v_draft)}, a.flash_attn)
    except PlacementError as e:
        raise ArgError(f"invalid value for {e.flag}: {e.detail}") from None
    return out[0], out[1]


def setup_logging(verbose: bool, lc: Any = None) -> None:
    """The log as the flags say (-v, --log-*, -lv: ``flags.LogConfig``)."""
    from .config import LogConfig
    from .logs import handlers, level

    lc = lc or LogConfig()
    root = logging.getLogger()
    root.handlers[:] = handlers(lc)
    root.setLevel(level(lc, verbose))
    # llama-server -v prints llama.cpp's debug lines too (where each tensor went, ...): load time only
    logging.getLogger("stepmtp.llama").setLevel(logging.DEBUG if verbose else logging.WARNING)
    logging.getLogger("gguf").setLevel(logging.WARNING)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True


def main(argv: Sequence[str] | None = None, *, engine_factory: Callable[..., Any] | None = None) -> int:
    cfg = parse_args(argv)
    setup_logging(cfg.verbose, cfg.log)
    from .host import place_process

    place_process(cfg.cpus, cfg.prio)
    # generation runs in a worker thread that holds the GIL between llama.cpp calls:
    # a shorter switch interval lets the event loop answer (and stream) without
    # waiting out the default 5 ms
    sys.setswitchinterval(0.001)

    import uvicorn

    from .app import ServerState, create_app

    state = ServerState(cfg, engine_factory)
    app = create_app(cfg, state=state)
    if cfg.hf_repo or cfg.model_url or cfg.hf_repo_draft:
        if not sys.stderr.isatty():  # a log line per file, not bars, in a log
            from ..hub import quiet_progress

            quiet_progress()
    elif cfg.model is None:
        log.info("no -m given: serving the bundled default model")
    if cfg.mtp_model and not cfg.speculative:
        log.warning("--spec-draft-model is ignored without --spec-type draft-mtp")
    class Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            state.begin_shutdown()  # streams end now rather than at the grace period's end
            await super().shutdown(sockets)

    server = Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_config=None,
                                   timeout_graceful_shutdown=5, access_log=True,
                                   # -to: an idle kept-alive connection waits this long, as httplib's read timeout
                                   timeout_keep_alive=cfg.timeout,
                                   ssl_keyfile=cfg.ssl_key_file, ssl_certfile=cfg.ssl_cert_file))

    def fatal() -> None:
        server.should_exit = True

    state.on_fatal = fatal
    from .host import listen_socket

    try:
        server.run(sockets=[listen_socket(cfg.host, cfg.port, reuse_port=cfg.reuse_port)] if cfg.reuse_port else None)
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled, once shut down
        return 130
    if state.exit_code:
        return state.exit_code
    return 0 if server.started else 1
