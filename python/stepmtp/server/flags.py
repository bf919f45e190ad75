"""llama-server's flags past the ones ``cli`` implements with the server: what each
of the others does here.

Every flag of llama-server's ``--help`` (``tests/data/llama_server_flags.txt``, read
from its ``common/arg.cpp`` by ``tools/llama_server_flags.py``) is one of three
things, so that a llama-server command line never stops at an unknown flag:

- implemented: it does what it does in llama-server (``cli`` and ``add_llama_flags``
  below, its value in ``ServerConfig``);
- ``ACCEPTED``: taken, with the reason it changes nothing here (shown by ``--help``);
- ``REFUSED``: an error at start naming why (a feature this server lacks, where
  running on without it would serve something else than was asked for).

``tools/server_flags_doc.py`` writes docs/server.md's table of the differences from the
same tables; a test keeps the two equal.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

from .argtypes import ArgError, _choice, _float, _int, _json_object, _on_off_auto

__all__ = ["ACCEPTED", "REFUSED", "Compat", "add_compat_flags"]

_TEXT_ONLY = "Step-3.5-Flash takes text only: no multimodal projector is loaded, media parts are a 400"
_NO_THREADPOOL = ("the graph runs on ggml's OpenMP team, not on a llama.cpp threadpool: there is no poll "
                  "loop or per-thread pinning to set")
_ONE_THREAD_SET = "prompts, generation and the heads' drafts decode on the same threads here: -C/-Cr/--prio place them"
_ONE_MODEL = "this server serves one model (-m, -hf): llama-server's router mode is not here"
_NO_EMBED = "this server generates text: embeddings and reranking are not served (those endpoints answer 501)"
_NO_TOOLS = "this server runs no tools or MCP servers of its own: tool calls go back to the client"
_PRESET = "a llama-server preset for another model (it downloads that model): this server runs Step-3.5/3.7-Flash"


@dataclass(frozen=True)
class Compat:
    """A llama-server flag taken without effect (``ACCEPTED``) or refused (``REFUSED``)."""

    names: tuple[str, ...]
    #: the value's metavar; None: a switch (no value)
    value: str | None
    reason: str
    env: str | None = None


def _c(names: str, value: str | None, reason: str, env: str | None = None) -> Compat:
    return Compat(tuple(names.split()), value, reason, env)


#: taken, changing nothing here: (spellings, value, why)
ACCEPTED: tuple[Compat, ...] = (
    _c("--metrics", None, "/metrics is always on", "LLAMA_ARG_ENDPOINT_METRICS"),
    _c("-bs --backend-sampling --backend_sampling", None,
       "sampling runs here in Python, on every row a round verifies; the output is what backend sampling gives",
       "LLAMA_ARG_BACKEND_SAMPLING"),
    _c("--spec-draft-backend-sampling --no-spec-draft-backend-sampling", None,
       "the heads' drafts are sampled here in Python, as every row is", "LLAMA_ARG_SPEC_DRAFT_BACKEND_SAMPLING"),
    _c("--media-path", "PATH", _TEXT_ONLY),
    _c("-cb --cont-batching", None, "slots are always batched together here", "LLAMA_ARG_CONT_BATCHING"),
    _c("-nocb --no-cont-batching", None,
       "slots are always batched together here (one decode per round); -np 1 serves one request at a time"),
    _c("--poll", "<0...100>", _NO_THREADPOOL),
    _c("--cpu-strict", "<0|1>", _NO_THREADPOOL + "; -C/-Cr set the process's CPUs"),
    _c("-Cb --cpu-mask-batch", "M", _ONE_THREAD_SET),
    _c("-Crb --cpu-range-batch", "lo-hi", _ONE_THREAD_SET),
    _c("--cpu-strict-batch", "<0|1>", _NO_THREADPOOL),
    _c("--prio-batch", "N", _ONE_THREAD_SET),
    _c("--poll-batch", "<0|1>", _NO_THREADPOOL),
    _c("--spec-draft-cpu-mask -Cd --cpu-mask-draft", "M", _ONE_THREAD_SET),
    _c("--spec-draft-cpu-range -Crd --cpu-range-draft", "lo-hi", _ONE_THREAD_SET),
    _c("--spec-draft-cpu-strict --cpu-strict-draft", "<0|1>", _NO_THREADPOOL),
    _c("--spec-draft-prio --prio-draft", "N", _ONE_THREAD_SET),
    _c("--spec-draft-poll --poll-draft", "<0|1>", _NO_THREADPOOL),
    _c("--spec-draft-cpu-mask-batch -Cbd --cpu-mask-batch-draft", "M", _ONE_THREAD_SET),
    _c("--spec-draft-cpu-strict-batch --cpu-strict-batch-draft", "<0|1>", _NO_THREADPOOL),
    _c("--spec-draft-prio-batch --prio-batch-draft", "N", _ONE_THREAD_SET),
    _c("--spec-draft-poll-batch --poll-batch-draft", "<0|1>", _NO_THREADPOOL),
    _c("--spec-draft-threads -td --threads-draft", "N",
       "the heads decode on the target's threads (-t), between its decodes, never beside them"),
    _c("--spec-draft-threads-batch -tbd --threads-batch-draft", "N",
       "the heads decode on the target's threads (-tb), between its decodes, never beside them"),
    _c("--keep", "N", "no context shift here (llama-server's default): a generation stops at the context's end, "
                      "so no tokens are kept or discarded"),
    _c("--no-context-shift", None, "the default, here and in llama-server"),
    _c("-cms --checkpoint-min-step", "N",
       "checkpoints are taken at each prompt's end and before its latest user message (--ctx-checkpoints), "
       "not every N tokens", "LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT"),
    _c("--cache-idle-slots", None, "already so: a slot's prompt goes to --cache-ram's memory when another "
                                   "request takes the slot", "LLAMA_ARG_CACHE_IDLE_SLOTS"),
    _c("--no-cache-idle-slots", None, "not switchable here: --cache-ram 0 keeps no prompts in host memory"),
    _c("--perf --no-perf", None, "timings are always measured: every response carries them", "LLAMA_ARG_PERF"),
    _c("--spm-infill", None, "/infill is not served here (501)"),
    _c("--pooling", "{none,mean,cls,last,rank}", _NO_EMBED, "LLAMA_ARG_POOLING"),
    _c("--embd-normalize", "N", _NO_EMBED),
    _c("-dt --defrag-thold", "N", "deprecated in llama-server too, with no effect there either",
       "LLAMA_ARG_DEFRAG_THOLD"),
    _c("--mmproj-auto", None, _TEXT_ONLY, "LLAMA_ARG_MMPROJ_AUTO"),
    _c("--no-mmproj --no-mmproj-auto", None, "text only, always"),
    _c("--mmproj-offload --no-mmproj-offload", None, _TEXT_ONLY, "LLAMA_ARG_MMPROJ_OFFLOAD"),
    _c("-mmdev --mmproj-device", "DEVICE", _TEXT_ONLY, "MTMD_BACKEND_DEVICE"),
    _c("--image-min-tokens", "N", _TEXT_ONLY, "LLAMA_ARG_IMAGE_MIN_TOKENS"),
    _c("--image-max-tokens", "N", _TEXT_ONLY, "LLAMA_ARG_IMAGE_MAX_TOKENS"),
    _c("--mtmd-batch-max-tokens", "N", _TEXT_ONLY, "LLAMA_ARG_MTMD_BATCH_MAX_TOKENS"),
    _c("--video-fps", "N", _TEXT_ONLY, "LLAMA_ARG_VIDEO_FPS"),
    _c("--video-timestamp-interval", "N", _TEXT_ONLY, "LLAMA_ARG_VIDEO_TIMESTAMP_INTERVAL"),
    _c("--video-ffmpeg-dir", "DIR", _TEXT_ONLY, "LLAMA_ARG_VIDEO_FFMPEG_DIR"),
    _c("-lzm --lazy-mode", "MODE", "the pinned llama.cpp keeps every tensor resident; Step-3.5-Flash has no "
                                   "per-layer embeddings to read on demand", "LLAMA_ARG_LAZY_MODE"),
    _c("-fit --fit", "[on|off]", "-ngl auto is llama.cpp's own fit to free device memory; unset flags are not "
                                 "adjusted beyond it", "LLAMA_ARG_FIT"),
    _c("-fitt --fit-target", "MiB0,MiB1,MiB2,...", "no --fit pass here (see --fit)", "LLAMA_ARG_FIT_TARGET"),
    _c("-fitc --fit-ctx", "N", "no --fit pass here (see --fit)", "LLAMA_ARG_FIT_CTX"),
    _c("--no-ui-mcp-proxy --no-webui-mcp-proxy", None, "no MCP proxy here, always"),
    _c("-no-ag --no-agent", None, "no built-in agent here, always"),
    _c("--models-max", "N", _ONE_MODEL, "LLAMA_ARG_MODELS_MAX"),
    _c("--models-autoload --no-models-autoload", None, _ONE_MODEL, "LLAMA_ARG_MODELS_AUTOLOAD"),
    _c("--cache-reuse", "N", "no KV shifting for Step-3.5: llama.cpp's llama_memory_can_shift is false for step35 "
                             "(per-layer RoPE dimensions), so llama-server ignores it for this model too; here a "
                             "cell's index also follows its position (patches 0008, 0014, 0018) and a shifted key "
                             "is rotated again, not the bits a fresh decode gives. A prompt reuses its cached "
                             "prefix (and --cache-ram's)", "LLAMA_ARG_CACHE_REUSE"),
    _c("--log-prompts-dir", "PATH", "a debugging aid of llama-server's: prompts are not written to files here"),
    _c("--spec-draft-p-split --draft-p-split", "P", "the heads draft one chain: there is no draft tree to split",
       "LLAMA_ARG_SPEC_DRAFT_P_SPLIT"),
)

#: an error at start: (spellings, value, why)
REFUSED: tuple[Compat, ...] = (
    _c("-mm --mmproj", "FILE", _TEXT_ONLY, "LLAMA_ARG_MMPROJ"),
    _c("-mmu --mmproj-url", "URL", _TEXT_ONLY, "LLAMA_ARG_MMPROJ_URL"),
    _c("--context-shift", None, "context shift is not implemented: a generation stops at the end of the context "
                                "(llama-server's default, --no-context-shift)", "LLAMA_ARG_CONTEXT_SHIFT"),
    _c("--embedding --embeddings", None, _NO_EMBED, "LLAMA_ARG_EMBEDDINGS"),
    _c("--rerank --reranking", None, _NO_EMBED, "LLAMA_ARG_RERANKING"),
    _c("-dr --docker-repo", "[<repo>/]<model>[:quant]",
       "models from Docker Hub are not fetched here: use -hf, -mu or -m", "LLAMA_ARG_DOCKER_REPO"),
    _c("--ui-mcp-proxy --webui-mcp-proxy", None, _NO_TOOLS, "LLAMA_ARG_UI_MCP_PROXY"),
    _c("--tools", "TOOL1,TOOL2,...", _NO_TOOLS, "LLAMA_ARG_TOOLS"),
    _c("--tools-runtime", "OPTION", _NO_TOOLS, "LLAMA_ARG_TOOLS_RUNTIME"),
    _c("--mcp-servers-config", "PATH", _NO_TOOLS, "LLAMA_ARG_MCP_SERVERS_CONFIG"),
    _c("--mcp-servers-json", "JSON", _NO_TOOLS, "LLAMA_ARG_MCP_SERVERS_JSON"),
    _c("-ag --agent", None, _NO_TOOLS, "LLAMA_ARG_AGENT"),
    _c("--models-dir", "PATH", _ONE_MODEL, "LLAMA_ARG_MODELS_DIR"),
    _c("--models-preset", "PATH", _ONE_MODEL, "LLAMA_ARG_MODELS_PRESET"),
    _c("--spec-synth-len", "L", "llama-server's synthetic acceptance (benchmarking its drafter) is not here",
       "LLAMA_ARG_SPEC_SYNTH_LEN"),
    _c("--spec-synth-rates", "P0,P1,...", "llama-server's synthetic acceptance (benchmarking its drafter) is not "
                                          "here", "LLAMA_ARG_SPEC_SYNTH_RATES"),
    *(_c(p, None, _PRESET) for p in (
        "--embd-gemma-default", "--fim-qwen-1.5b-default", "--fim-qwen-3b-default", "--fim-qwen-7b-default",
        "--fim-qwen-7b-spec", "--fim-qwen-14b-spec", "--fim-qwen-30b-default", "--gpt-oss-20b-default",
        "--gpt-oss-120b-default", "--vision-gemma-4b-default", "--vision-gemma-12b-default")),
)


class _Refuse(argparse.Action):
    """A llama-server flag this server refuses: an error naming why, as the command line is read."""

    def __init__(self, option_strings: list[str], dest: str, reason: str = "", **kw: Any) -> None:
        self.reason = reason
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, values: Any,
                 option: str | None = None) -> None:
        parser.error(f"{option}: not supported by this server: {self.reason}")


def add_compat_flags(ap: argparse.ArgumentParser, add: Any) -> None:
    """``ACCEPTED`` and ``REFUSED`` as argparse groups (``add``: cli's, which records
    the environment variable)."""
    g = ap.add_argument_group("llama-server's, accepted with no effect here (why)")
    for c in ACCEPTED:
        dest = "_compat_" + c.names[0].lstrip("-").replace("-", "_")
        kw: dict[str, Any] = dict(action="store_true") if c.value is None else dict(metavar=c.value)
        if c.value and " " in c.value:  # START END: two values
            kw.update(metavar=tuple(c.value.split()), nargs=len(c.value.split()))
        add(g, *c.names, dest=dest, env=c.env, help=c.reason, **kw)
    g = ap.add_argument_group("llama-server's, refused at start (why)")
    for c in REFUSED:
        dest = "_refused_" + c.names[0].lstrip("-").replace("-", "_")
        add(g, *c.names, dest=dest, env=c.env, action=_Refuse, reason=c.reason, nargs=0 if c.value is None else None,
            metavar=c.value, help=c.reason)


# -- implemented here (past cli's): their parsing and ServerConfig fields ----------------


def _logit_bias(v: str) -> tuple[int, float]:
    """-l: TOKEN_ID(+/-)BIAS, as llama.cpp reads it (``15043+1``, ``15043-inf``)."""
    import re

    m = re.fullmatch(r"\s*(-?\d+)\s*([+-])(.+)", v)
    if m is None:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID(+/-)BIAS, e.g. 15043+1, got {v!r}")
    try:
        bias = float(m.group(3))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID(+/-)BIAS, e.g. 15043+1, got {v!r}") from None
    return int(m.group(1)), -bias if m.group(2) == "-" else bias


def _cpus(v: str, *, mask: bool) -> frozenset[int]:
    """-C (a hex mask, CPU 0 its lowest bit) or -Cr (lo-hi, inclusive), as llama.cpp reads them."""
    try:
        if mask:
            bits = int(v[2:] if v.lower().startswith("0x") else v, 16)
            return frozenset(i for i in range(bits.bit_length()) if bits >> i & 1)
        lo, _, hi = v.partition("-")
        a, b = int(lo) if lo else 0, int(hi) if hi else (os.cpu_count() or 1) - 1
        if a > b:
            raise ValueError
        return frozenset(range(a, b + 1))
    except ValueError:
        raise argparse.ArgumentTypeError("invalid cpumask" if mask else "invalid range") from None


def _prio(v: str) -> int:
    n = int(v)
    if not -1 <= n <= 3:
        raise argparse.ArgumentTypeError("invalid value: low(-1), normal(0), medium(1), high(2), realtime(3)")
    return n


#: -lm: llama.cpp's llama_load_mode values; auto: llama.cpp's (mmap)
LOAD_MODES = {"auto": None, "none": 0, "mmap": 1, "mlock": 2, "mmap+mlock": 3, "dio": 4}

#: --rope-scaling: llama.cpp's enum values
ROPE_SCALING = {"none": 0, "linear": 1, "yarn": 2}


def _kv_override(v: str) -> list[tuple[str, str, Any]]:
    """--override-kv KEY=TYPE:VALUE,... (types int, float, bool, str), as llama.cpp parses it."""
    out = []
    for item in (x for x in v.split(",") if x):
        key, eq, rest = item.partition("=")
        kind, colon, val = rest.partition(":")
        if not eq or not colon or len(key) >= 128:
            raise argparse.ArgumentTypeError(f"malformed KV override '{item}'")
        try:
            if kind == "int":
                parsed: Any = int(val)
            elif kind == "float":
                parsed = float(val)
            elif kind == "bool" and val in ("true", "false"):
                parsed = val == "true"
            elif kind == "str" and len(val) < 128:
                parsed = val
            else:
                raise ValueError
        except ValueError:
            raise argparse.ArgumentTypeError(f"Invalid type for KV override: {item}") from None
        out.append((key, kind, parsed))
    return out


def _files(v: str) -> list[tuple[str, float]]:
    """--lora / --control-vector: FNAME,... (scale 1 each)."""
    return [(f, 1.0) for f in v.split(",") if f]


def _scaled_files(v: str) -> list[tuple[str, float]]:
    """--lora-scaled / --control-vector-scaled: FNAME:SCALE,..., as llama.cpp reads them
    (exactly one colon per item)."""
    out = []
    for item in (x for x in v.split(",") if x):
        parts = item.split(":")
        try:
            if len(parts) != 2:
                raise ValueError
            out.append((parts[0], float(parts[1])))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected FNAME:SCALE, got {item!r}") from None
    return out


def _sleep_seconds(v: str) -> int:
    n = int(v)
    if n == 0 or n < -1:
        raise argparse.ArgumentTypeError("invalid value: cannot be 0 or less than -1")
    return n


def add_llama_flags(ap: argparse.ArgumentParser, add: Any) -> None:
    """llama-server's flags implemented here past cli's groups."""
    on_off = _on_off_auto
    g = ap.add_argument_group("sampling and output defaults (a request's own values win)")
    add(g, "-r", "--reverse-prompt", metavar="PROMPT", dest="reverse_prompt", action="append", default=[],
        help="stop strings of a request that gives none (repeatable)")
    add(g, "-e", "--escape", dest="escape", action="store_const", const=True, default=True,
        help="read \\n, \\r, \\t, \\', \\\", \\\\ in -r's strings as those characters (default: true)")
    add(g, "--no-escape", dest="escape", action="store_const", const=False, help="-r's strings as given")
    add(g, "-sp", "--special", dest="special", action="store_true",
        help="special tokens output as their text (default: false; a chat format's markers always are)")
    add(g, "--ignore-eos", dest="ignore_eos", action="store_true",
        help="ignore end of stream tokens and continue generating, for a request that does not say")
    add(g, "-l", "--logit-bias", metavar="TOKEN_ID(+/-)BIAS", dest="logit_bias", type=_logit_bias, action="append",
        default=[], help="a token's logit changed, e.g. 15043+1 or 15043-inf, for a request with no logit_bias")
    add(g, "--grammar", metavar="GRAMMAR", dest="grammar", help="BNF-like (GBNF) grammar constraining a request "
                                                                "that gives no grammar or schema")
    add(g, "--grammar-file", metavar="FNAME", dest="grammar_file", help="a file holding --grammar's grammar")
    add(g, "-j", "--json-schema", metavar="SCHEMA", dest="json_schema",
        help="a JSON schema constraining a request that gives no grammar or schema, e.g. '{}' for any object")
    add(g, "-jf", "--json-schema-file", metavar="FILE", dest="json_schema_file",
        help="a file holding -j's JSON schema")
    add(g, "--cache-prompt", dest="cache_prompt", action="store_const", const=True, default=True,
        env="LLAMA_ARG_CACHE_PROMPT", help="a request's cache_prompt default: reuse the slot's KV (default: enabled)")
    add(g, "--no-cache-prompt", dest="cache_prompt", action="store_const", const=False,
        help="a request decodes its whole prompt unless it says cache_prompt: true")
    add(g, "--reasoning-effort", metavar="LEVEL", dest="reasoning_effort", env="LLAMA_ARG_REASONING_EFFORT",
        help="the chat template's reasoning_effort: 'default' keeps the template's, else a level such as low, "
             "medium, high (default: default)")
    add(g, "--reasoning-preserve", dest="reasoning_preserve", action="store_const", const=True, default=None,
        env="LLAMA_ARG_REASONING_PRESERVE",
        help="the template's preserve_reasoning: earlier turns' reasoning kept in the prompt, for templates "
             "that read it (default: the template's)")
    add(g, "--no-reasoning-preserve", dest="reasoning_preserve", action="store_const", const=False,
        help="preserve_reasoning false")
    add(g, "--skip-chat-parsing", dest="skip_chat_parsing", action="store_const", const=True, default=False,
        env="LLAMA_ARG_SKIP_CHAT_PARSING",
        help="chat output all in content: reasoning and tool calls not parsed out (default: disabled)")
    add(g, "--no-skip-chat-parsing", dest="skip_chat_parsing", action="store_const", const=False,
        help="parse reasoning and tool calls out of chat output")
    add(g, "--prefill-assistant", dest="prefill_assistant", action="store_const", const=True, default=True,
        env="LLAMA_ARG_PREFILL_ASSISTANT", help="a chat whose last message is the assistant's: the answer continues "
                                                "it (default: enabled)")
    add(g, "--no-prefill-assistant", dest="prefill_assistant", action="store_const", const=False,
        help="a last assistant message is a whole message; the answer is a new one")

    g = ap.add_argument_group("HTTP")
    add(g, "-to", "--timeout", metavar="N", dest="timeout", type=_int, default=3600, env="LLAMA_ARG_TIMEOUT",
        help="read/write timeout in seconds: a request body not received, or a response not taken, in this "
             "long ends the connection; an idle kept-alive connection closes after it (default: 3600)")
    add(g, "--threads-http", metavar="N", dest="threads_http", type=_int, default=-1,
        env="LLAMA_ARG_THREADS_HTTP", help="threads for the requests' blocking work (tokenizing, templates) "
                                           "(default: -1, anyio's 40)")
    add(g, "--api-prefix", metavar="PREFIX", dest="api_prefix", default="", env="LLAMA_ARG_API_PREFIX",
        help="prefix path the server serves from, without the trailing slash (default: none)")
    add(g, "--path", metavar="PATH", dest="static_path", default="", env="LLAMA_ARG_STATIC_PATH",
        help="a folder of static files served at / instead of the chat page (default: none)")
    add(g, "--props", dest="endpoint_props", action="store_true", env="LLAMA_ARG_ENDPOINT_PROPS",
        help="enable changing global properties via POST /props (default: disabled)")
    add(g, "--warmup", dest="warmup", action="store_const", const=True, default=True,
        help="a one-token decode before the server is ready, so the first request pays no first-run costs "
             "(default: enabled)")
    add(g, "--no-warmup", dest="warmup", action="store_const", const=False, help="no warm-up decode")
    add(g, "--reuse-port", dest="reuse_port", action="store_true", env="LLAMA_ARG_REUSE_PORT",
        help="allow several sockets to bind the same port (SO_REUSEPORT)")
    add(g, "--cors-origins", metavar="ORIGINS", dest="cors_origins", default="*", env="LLAMA_ARG_CORS_ORIGINS",
        help="comma-separated list of allowed origins for CORS; 'localhost': the Origin header reflected only "
             "if it is localhost; '*' with credentials: any Origin reflected (default: *)")
    add(g, "--cors-methods", metavar="METHODS", dest="cors_methods", default="GET, POST, DELETE, OPTIONS",
        env="LLAMA_ARG_CORS_METHODS", help="allowed methods for CORS (default: GET, POST, DELETE, OPTIONS)")
    add(g, "--cors-headers", metavar="HEADERS", dest="cors_headers", default="*", env="LLAMA_ARG_CORS_HEADERS",
        help="allowed headers for CORS (default: *)")
    add(g, "--cors-credentials", dest="cors_credentials", action="store_const", const=True, default=True,
        env="LLAMA_ARG_CORS_CREDENTIALS", help="allow credentials for CORS (default: enabled)")
    add(g, "--no-cors-credentials", dest="cors_credentials", action="store_const", const=False,
        help="no credentials for CORS")
    add(g, "--ssl-key-file", metavar="FNAME", dest="ssl_key_file", env="LLAMA_ARG_SSL_KEY_FILE",
        help="a PEM-encoded SSL private key: HTTPS")
    add(g, "--ssl-cert-file", metavar="FNAME", dest="ssl_cert_file", env="LLAMA_ARG_SSL_CERT_FILE",
        help="a PEM-encoded SSL certificate: HTTPS")
    add(g, "--sse-ping-interval", metavar="N", dest="sse_ping_interval", type=_int, default=30,
        env="LLAMA_ARG_SSE_PING_INTERVAL",
        help="a stream silent this many seconds gets an SSE comment (':'), so clients do not time out "
             "(-1 = disabled, default: 30)")
    add(g, "--ui-config", "--webui-config", metavar="JSON", dest="ui_config", type=_json_object,
        env="LLAMA_ARG_UI_CONFIG", help="settings for a web UI, a JSON object, served as /props' ui_settings")
    add(g, "--ui-config-file", "--webui-config-file", metavar="PATH", dest="ui_config_file",
        env="LLAMA_ARG_UI_CONFIG_FILE", help="a file holding --ui-config's JSON")

    g = ap.add_argument_group("logging")
    add(g, "--log-disable", dest="log_disable", action="store_true", help="no log")
    add(g, "--log-file", metavar="FNAME", dest="log_file", env="LLAMA_ARG_LOG_FILE",
        help="log to this file too")
    add(g, "--log-jsonl", dest="log_jsonl", action="store_const", const=True, default=False,
        env="LLAMA_ARG_LOG_JSONL", help="log lines as JSON objects (default: disabled)")
    add(g, "--no-log-jsonl", dest="log_jsonl", action="store_const", const=False, help="plain log lines")
    add(g, "--log-colors", metavar="[on|off|auto]", dest="log_colors", type=on_off, default=None,
        env="LLAMA_ARG_LOG_COLORS", help="colored log levels; auto: when the log goes to a terminal (default: auto)")
    add(g, "-lv", "--verbosity", "--log-verbosity", metavar="N", dest="verbosity", type=_int, default=3,
        env="LLAMA_ARG_LOG_VERBOSITY", help="log messages up to this level: 0 generic output, 1 error, 2 warning, "
                                            "3 info, 4 trace, 5 debug (default: 3)")
    add(g, "--log-prefix", dest="log_prefix", action="store_const", const=True, default=True,
        env="LLAMA_ARG_LOG_PREFIX", help="the level and the logger's name before each line (default: enabled)")
    add(g, "--no-log-prefix", dest="log_prefix", action="store_const", const=False, help="the message alone")
    add(g, "--log-timestamps", dest="log_timestamps", action="store_const", const=True, default=True,
        env="LLAMA_ARG_LOG_TIMESTAMPS", help="the time before each line (default: enabled)")
    add(g, "--no-log-timestamps", dest="log_timestamps", action="store_const", const=False, help="no time")

    g = ap.add_argument_group("model and context parameters")
    add(g, "--override-kv", metavar="KEY=TYPE:VALUE,...", dest="override_kv", type=_kv_override, action="append",
        default=[], help="override model metadata by key (types int, float, bool, str), e.g. "
                         "tokenizer.ggml.add_bos_token=bool:false")
    add(g, "--rope-scaling", metavar="{none,linear,yarn}", dest="rope_scaling", type=_choice(*ROPE_SCALING),
        env="LLAMA_ARG_ROPE_SCALING_TYPE", help="RoPE frequency scaling method (default: the model's)")
    for flag, dest, env, what in (
            ("--rope-scale", "rope_scale", "LLAMA_ARG_ROPE_SCALE", "RoPE context scaling factor: expands the "
                                                                  "context by a factor of N"),
            ("--rope-freq-base", "rope_freq_base", "LLAMA_ARG_ROPE_FREQ_BASE", "RoPE base frequency"),
            ("--rope-freq-scale", "rope_freq_scale", "LLAMA_ARG_ROPE_FREQ_SCALE",
             "RoPE frequency scaling factor: expands the context by a factor of 1/N"),
            ("--yarn-ext-factor", "yarn_ext_factor", "LLAMA_ARG_YARN_EXT_FACTOR", "YaRN extrapolation mix factor"),
            ("--yarn-attn-factor", "yarn_attn_factor", "LLAMA_ARG_YARN_ATTN_FACTOR", "YaRN attention scale"),
            ("--yarn-beta-slow", "yarn_beta_slow", "LLAMA_ARG_YARN_BETA_SLOW", "YaRN high correction dim"),
            ("--yarn-beta-fast", "yarn_beta_fast", "LLAMA_ARG_YARN_BETA_FAST", "YaRN low correction dim")):
        add(g, flag, metavar="N", dest=dest, type=_float, env=env, help=f"{what} (default: the model's)")
    add(g, "--yarn-orig-ctx", metavar="N", dest="yarn_orig_ctx", type=_int, env="LLAMA_ARG_YARN_ORIG_CTX",
        help="YaRN original context size of the model (default: the model's training context)")
    add(g, "-kvo", "--kv-offload", dest="kv_offload", action="store_const", const=True, default=True,
        env="LLAMA_ARG_KV_OFFLOAD", help="KV cache offloading to the GPU (default: enabled)")
    add(g, "-nkvo", "--no-kv-offload", dest="kv_offload", action="store_const", const=False,
        help="the KV cache and its attention in host memory")
    add(g, "--op-offload", dest="op_offload", action="store_const", const=True, default=True,
        help="offload host tensor operations to the device (default: true)")
    add(g, "--no-op-offload", dest="op_offload", action="store_const", const=False,
        help="host tensors' operations stay on the host")
    add(g, "--repack", dest="repack", action="store_const", const=True, default=True, env="LLAMA_ARG_REPACK",
        help="weight repacking: extra buffer types (default: enabled)")
    add(g, "-nr", "--no-repack", dest="repack", action="store_const", const=False, help="no weight repacking")
    add(g, "--no-host", dest="no_host", action="store_true", env="LLAMA_ARG_NO_HOST",
        help="bypass host buffer allowing extra buffers to be used")
    add(g, "--check-tensors", dest="check_tensors", action="store_true",
        help="check model tensor data for invalid values at the load")
    add(g, "-lm", "--load-mode", metavar="MODE", dest="load_mode", type=_choice(*LOAD_MODES),
        env="LLAMA_ARG_LOAD_MODE", help="auto (mmap), none, mmap, mlock, mmap+mlock, dio (direct I/O) "
                                        "(default: auto; --mmap, --no-mmap, --mlock as before)")
    add(g, "--kv-unified-per-slot", metavar="N", dest="kv_unified_per_slot", type=_int, default=0,
        env="LLAMA_ARG_KV_UNIFIED_PER_SLOT",
        help="without -c, the shared KV cache is sized to slots x N (a slot is not stopped at N tokens)")

    g = ap.add_argument_group("adapters (on the target: the heads draft, the target verifies with them)")
    # one list for both spellings: an adapter's id is its place on the command line
    add(g, "--lora", metavar="FNAME", dest="lora", type=_files, action="append", default=[],
        help="a LoRA adapter (comma-separated: several), scale 1")
    add(g, "--lora-scaled", metavar="FNAME:SCALE,...", dest="lora", type=_scaled_files, action="append",
        help="a LoRA adapter with its scale (comma-separated: several)")
    add(g, "--lora-init-without-apply", dest="lora_init_without_apply", action="store_true",
        help="load the LoRA adapters with scale 0: POST /lora-adapters or a request's lora turns them on")
    add(g, "--control-vector", metavar="FNAME", dest="control_vectors", type=_files, action="append", default=[],
        help="a control vector (comma-separated: several, added together)")
    add(g, "--control-vector-scaled", metavar="FNAME:SCALE,...", dest="control_vectors", type=_scaled_files,
        action="append", help="a control vector times SCALE (comma-separated: several)")
    add(g, "--control-vector-layer-range", metavar=("START", "END"), nargs=2, dest="control_vector_layers",
        type=_int, help="the layers the control vectors are added to, inclusive (default: all)")

    g = ap.add_argument_group("sleeping")
    add(g, "--sleep-idle-seconds", metavar="SECONDS", dest="sleep_idle_seconds", type=_sleep_seconds, default=-1,
        help="after this many seconds without a request the model is freed, and loaded again for the next "
             "one; /health, /props, /metrics and /v1/models answer meanwhile (default: -1, never)")

    g = ap.add_argument_group("CPU placement (the process's: threads inherit it)")
    add(g, "-C", "--cpu-mask", metavar="M", dest="cpu_mask", type=lambda v: _cpus(v, mask=True),
        help="CPU affinity mask, arbitrarily long hex; with -Cr, the CPUs of both (default: all)")
    add(g, "-Cr", "--cpu-range", metavar="lo-hi", dest="cpu_range", type=lambda v: _cpus(v, mask=False),
        help="range of CPUs for affinity, inclusive")
    add(g, "--prio", metavar="N", dest="prio", type=_prio, default=0,
        help="process priority: low(-1), normal(0), medium(1), high(2), realtime(3) as nice 5, 0, -5, -10, -20 "
             "(default: 0, unchanged)")


def _escapes(s: str) -> str:
    """llama.cpp's string_process_escapes: \\n, \\r, \\t, \\', \\", \\\\ (others kept as written)."""
    out, i = [], 0
    table = {"n": "\n", "r": "\r", "t": "\t", "'": "'", '"': '"', "\\": "\\"}
    while i < len(s):
        if s[i] == "\\" and i + 1 < len(s) and s[i + 1] in table:
            out.append(table[s[i + 1]])
            i += 2
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def _read(path: str, flag: str) -> str:

    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ArgError(f"{flag}: failed to read '{path}': {e}") from None


def llama_config(a: argparse.Namespace) -> dict[str, Any]:
    """``add_llama_flags``' values as ServerConfig fields; ArgError for a bad one."""
    import json

    from .config import Cors, LogConfig

    grammar: tuple[str, Any] | None = None
    gbnf = _read(a.grammar_file, "--grammar-file") if a.grammar_file else a.grammar
    schema_text = _read(a.json_schema_file, "-jf") if a.json_schema_file else a.json_schema
    if schema_text is not None:  # llama-server: the schema wins over a grammar
        try:
            grammar = ("json_schema", json.loads(schema_text))
        except ValueError as e:
            raise ArgError(f"invalid value for -j/--json-schema: not valid JSON: {e}") from None
    elif gbnf:
        grammar = ("gbnf", gbnf)
    kwargs: dict[str, Any] = {}
    if a.reasoning_effort not in (None, "default"):
        kwargs["reasoning_effort"] = a.reasoning_effort
    if a.reasoning_preserve is not None:
        kwargs["preserve_reasoning"] = a.reasoning_preserve
    ui_config = a.ui_config
    if a.ui_config_file:
        try:
            ui_config = json.loads(_read(a.ui_config_file, "--ui-config-file"))
        except ValueError as e:
            raise ArgError(f"--ui-config-file: not valid JSON: {e}") from None
    if a.api_prefix.endswith("/") or (a.api_prefix and not a.api_prefix.startswith("/")):
        raise ArgError(f"invalid value for --api-prefix: '{a.api_prefix}' (e.g. /v2: a leading slash, "
                       "no trailing one)")
    if a.static_path and not os.path.isdir(a.static_path):
        raise ArgError(f"--path: not a directory: {a.static_path}")
    if bool(a.ssl_key_file) != bool(a.ssl_cert_file):
        raise ArgError("--ssl-key-file and --ssl-cert-file go together")
    for flag, f in (("--ssl-key-file", a.ssl_key_file), ("--ssl-cert-file", a.ssl_cert_file),
                    ("--log-file's folder", os.path.dirname(a.log_file) if a.log_file else None)):
        if f and not os.path.exists(f):
            raise ArgError(f"{flag}: no such file: {f}")
    if a.timeout <= 0:
        raise ArgError(f"invalid value for -to/--timeout: {a.timeout}")
    if a.kv_unified_per_slot < 0:
        raise ArgError(f"invalid value for --kv-unified-per-slot: {a.kv_unified_per_slot}")
    model_params: dict[str, Any] = {}
    if a.load_mode and LOAD_MODES[a.load_mode] is not None:
        model_params["load_mode"] = LOAD_MODES[a.load_mode]
    if not a.repack:
        model_params["use_extra_bufts"] = False
    if a.no_host:
        model_params["no_host"] = True
    if a.check_tensors:
        model_params["check_tensors"] = True
    overrides = [kv for group in a.override_kv for kv in group]
    if overrides:
        model_params["kv_overrides"] = overrides
    context_params: dict[str, Any] = {}
    if a.rope_scaling is not None:
        context_params["rope_scaling_type"] = ROPE_SCALING[a.rope_scaling]
    if a.rope_scale is not None:  # llama.cpp: --rope-scale N is --rope-freq-scale 1/N
        context_params["rope_freq_scale"] = 1.0 / a.rope_scale
    for name in ("rope_freq_base", "rope_freq_scale", "yarn_ext_factor", "yarn_attn_factor", "yarn_beta_slow",
                 "yarn_beta_fast", "yarn_orig_ctx"):
        if getattr(a, name) is not None:
            context_params[name] = getattr(a, name)
    if not a.kv_offload:
        context_params["offload_kqv"] = False
    if not a.op_offload:
        context_params["op_offload"] = False
    for flag, items in (("--lora", a.lora), ("--control-vector", a.control_vectors)):
        for f, _ in (x for group in items for x in group):
            if not os.path.isfile(f):
                raise ArgError(f"{flag}: no such file: {f}")
    cpus = None
    if a.cpu_mask is not None or a.cpu_range is not None:
        cpus = (a.cpu_mask or frozenset()) | (a.cpu_range or frozenset())
    return dict(
        stop=[_escapes(s) if a.escape else s for s in a.reverse_prompt],
        special=a.special, ignore_eos=a.ignore_eos, logit_bias=list(a.logit_bias), grammar=grammar,
        cache_prompt=a.cache_prompt, skip_chat_parsing=a.skip_chat_parsing, prefill_assistant=a.prefill_assistant,
        template_kwargs=kwargs,
        timeout=a.timeout, threads_http=a.threads_http, api_prefix=a.api_prefix, static_path=a.static_path or None,
        endpoint_props=a.endpoint_props, warmup=a.warmup, reuse_port=a.reuse_port,
        cors=Cors(a.cors_origins, a.cors_methods, a.cors_headers, a.cors_credentials),
        ssl_key_file=a.ssl_key_file, ssl_cert_file=a.ssl_cert_file, sse_ping_interval=a.sse_ping_interval,
        ui_config=ui_config or {},
        log=LogConfig(disable=a.log_disable, file=a.log_file, jsonl=a.log_jsonl, colors=a.log_colors,
                      verbosity=a.verbosity, prefix=a.log_prefix, timestamps=a.log_timestamps),
        model_params=model_params, context_params=context_params, kv_unified_per_slot=a.kv_unified_per_slot,
        cpus=cpus, prio=a.prio,
        lora=[x for group in a.lora for x in group], lora_init_without_apply=a.lora_init_without_apply,
        control_vectors=[x for group in a.control_vectors for x in group],
        control_vector_layers=tuple(a.control_vector_layers) if a.control_vector_layers else None,
        sleep_idle_seconds=a.sleep_idle_seconds,
    )
