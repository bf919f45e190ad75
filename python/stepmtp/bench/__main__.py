"""``python -m stepmtp.bench``: acceptance and tokens per second of the MTP heads, and a
regression gate on them.

Runs a prompt set (the change's nine categories, 192 tokens each, temperature 0 by
default) in-process, against a server URL, or against servers it starts itself; prints
per prompt ``pred= draft= acc= rate= tok/s=`` and the aggregate JSON in the change's
layout; with ``--compare`` runs several configurations interleaved prompt by prompt and
reports ratios; with ``--baseline`` compares with a committed baseline and exits
non-zero on a regression.

Exit status: 0 ok, 1 regression against the baseline, 2 usage error, 3 the
configurations' outputs differ at temperature 0, 130 interrupted.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from . import gate as G
from . import harness as H
from . import report as R
from .harness import BenchRun, run_bench
from ..llama import QUANT_TYPES
from .model import BENCH_MODEL_MB, DEFAULT_MODEL, MODEL_NAMES, bench_model, bench_weights, file_sha256, resolve_model
from .prompts import load_prompts
from .runners import (COMPARE_CONFIGS, COMPARE_CPP_CONFIGS, COMPARE_SETS, BenchConfig, EngineRunner, Runner, ServerRunner,
                      URLRunner, find_llama_server, parse_configs)

PROG = "python -m stepmtp.bench"

@dataclass(frozen=True)
class RPCConfig(BenchConfig):
    """An in-process configuration whose offloaded layers are on the --rpc servers."""

    @property
    def label(self) -> str:
        return "rpc-" + super().label

    @property
    def family(self) -> str:
        return "rpc"

    def describe(self) -> str:
        return super().describe() + ", layers on the RPC servers"


#: settings a baseline carries, so that --baseline FILE alone reruns them
BASELINE_SETTINGS = ("model", "bench_model_mb", "bench_weights", "prompts", "categories", "limit", "n_predict", "configs",
                     "threads", "ctx_size", "repeat", "warmup")
BUILTIN = {"model": None, "bench_model_mb": None, "bench_weights": None, "prompts": None, "categories": None, "limit": None,
           "n_predict": None, "configs": None, "threads": None, "ctx_size": 2048, "repeat": 1, "warmup": 1}


def build_parser() -> argparse.ArgumentParser:
    summary = __doc__.split("\n\n")[0].replace("\n", " ").split(": ", 1)[1]
    ap = argparse.ArgumentParser(prog=PROG, description=summary[0].upper() + summary[1:],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    g = ap.add_argument_group("model")
    g.add_argument("-m", "--model", default=None,
                   help=f"target GGUF, or {' / '.join(MODEL_NAMES)} (default: {DEFAULT_MODEL})")
    g.add_argument("-md", "--spec-draft-model", dest="mtp_model", help="a separate MTP-only GGUF with the heads")
    g.add_argument("--bench-model", dest="bench_model_mb", nargs="?", type=float, const=BENCH_MODEL_MB,
                   default=None, metavar="MB",
                   help="run on a variant of the model with Step-3.5-Flash's cost shape (same predictions, "
                        f"weight-bound decode; stepmtp.bench.flash), made once and cached (default: {BENCH_MODEL_MB} "
                        "MB read per decode)")
    g.add_argument("--bench-weights", dest="bench_weights", default=None, metavar="TYPE", type=str.upper,
                   choices=sorted(QUANT_TYPES),
                   help="the bench model's weights quantized to TYPE by llama.cpp's own quantizer (Q8_0, Q4_0, "
                        "Q4_K_M, IQ4_XS, ...), made once and cached (default: F16)")
    g = ap.add_argument_group("prompts")
    g.add_argument("--prompts", default=None, metavar="FILE", help="prompt set, JSON or JSONL (default: the "
                   "package's prompts/default.json)")
    g.add_argument("--categories", default=None, help="comma-separated categories to run (default: all)")
    g.add_argument("--limit", type=int, default=None, help="run the first N prompts only")
    g.add_argument("-n", "--n-predict", type=int, default=None, help="tokens per prompt (default: the set's)")
    g = ap.add_argument_group("where")
    g.add_argument("--url", help="a running llama-server-compatible server (its own settings apply)")
    g.add_argument("--server", action="store_true",
                   help="start `python -m stepmtp.server` for each configuration instead of running in-process")
    g.add_argument("--llama-server", metavar="PATH", default=None,
                   help="the vendored C++ llama-server (single-block MTP) to compare with; 'auto': the one "
                        "installed with the package. --compare adds it by itself when installed")
    g.add_argument("--no-llama-server", action="store_true", help="--compare without the C++ llama-server")
    g.add_argument("--api-key", help="for --url")
    g.add_argument("--rpc", metavar="SERVERS", default=None,
                   help="RPC servers (host:port,...) holding the in-process engine's offloaded layers "
                        "(llama-server's --rpc); the configurations are labelled rpc-*")
    g.add_argument("--rpc-vs-local", action="store_true",
                   help="with --rpc: also run each configuration locally, interleaved in the same run")
    g.add_argument("--batch-invariant", action="store_true",
                   help="the target in batch-invariant mode (--spec-batch-invariant): on a GPU backend the "
                        "texts must then agree as on the CPU (exit 3 otherwise)")
    g.add_argument("-ngl", "--n-gpu-layers", dest="ngl", default=None,
                   help="layers offloaded to the GPU or the --rpc servers: a number or 'all' "
                        "(default: all with --rpc, else none)")
    g = ap.add_argument_group("placement and KV cache (llama-server's flags, for every configuration)")
    for names, meta in ((("-ctk", "--cache-type-k"), "TYPE"), (("-ctv", "--cache-type-v"), "TYPE"),
                        (("-ctkd", "--cache-type-k-draft"), "TYPE"), (("-ctvd", "--cache-type-v-draft"), "TYPE")):
        g.add_argument(*names, metavar=meta, default=None)
    g.add_argument("-ncmoe", "--n-cpu-moe", metavar="N", type=int, default=None)
    g.add_argument("-ot", "--override-tensor", metavar="PATTERN=BUFT,...", action="append", default=[])
    g.add_argument("-cmoe", "--cpu-moe", action="store_true")
    g.add_argument("--no-mmap", action="store_true")
    g = ap.add_argument_group("configurations")
    g.add_argument("--mode", "--mtp-mode", dest="mode", choices=["chain", "single", "none"], default="chain")
    g.add_argument("--spec-draft-n-max", dest="n_max", type=int, default=3)
    g.add_argument("--schedule", choices=["fused", "reference"], default="fused")
    g.add_argument("--compare", nargs="?", const="schedules", default=None, choices=sorted(COMPARE_SETS),
                   help=f"run a set of configurations interleaved, and compare: schedules (the default: "
                        f"{', '.join(COMPARE_CONFIGS)}, and {', '.join(COMPARE_CPP_CONFIGS)} with a llama-server), "
                        f"verify ({', '.join(COMPARE_SETS['verify'])}), adaptive "
                        f"({', '.join(COMPARE_SETS['adaptive'])})")
    g.add_argument("--configs", default=None,
                   help="comma-separated configurations, e.g. none,single-2,chain-3,chain-3-ref,cpp-single-2")
    g = ap.add_argument_group("matrix")
    g.add_argument("--matrix", action="store_true",
                   help="MTP against no MTP through the server at its default flags: temperatures x concurrent "
                        "clients, each entry a server of its own (see stepmtp.bench.matrix); a table, a heat-map "
                        "(--chart, or bench.png with --out) and JSON")
    g.add_argument("--temps", default="0,0.7,1", help="--matrix: the rows' temperatures (default 0,0.7,1)")
    g.add_argument("--clients", default="1,2,4,8", help="--matrix: the columns' concurrent clients (default 1,2,4,8)")
    g.add_argument("--entries", default="",
                   help="--matrix: the servers, of off, mtp, mtp-noctx, n1, n2, n3, n3-raw, cpp-off, cpp-mtp, cpp-ngram "
                        "(default: off,mtp,n1,n2,n3, and cpp-off,cpp-mtp with --llama-server)")
    g.add_argument("--agent", action="store_true",
                   help="--matrix: also the agents' turns (copy, echo, the same turn again, a summary; see "
                        "stepmtp.bench.agent_turns), each entry's generation tok/s; --temps '' for these alone")
    g.add_argument("--agent-turns", type=int, default=4, metavar="N",
                   help="--agent: turns of each kind (default 4)")
    g = ap.add_argument_group("speed")
    g.add_argument("--speed", action="store_true",
                   help="prompt and plain decoding speed through the servers (see stepmtp.bench.speed): a fresh "
                        "prompt's tokens/s, and N clients' generation tokens/s for each N of --clients, every "
                        "figure paired with the C++ llama-server's (cpp-off) with --llama-server PATH; --entries "
                        "picks the servers (default off, and cpp-off with --llama-server)")
    g.add_argument("--prompt-tokens", type=int, default=4096, metavar="N",
                   help="--speed: the fresh prompt's length in tokens (default 4096)")
    g.add_argument("--verify-costs", action="store_true",
                   help="what a decode of k = 1, 2, 3, 4, 8, 16, 32, 63 rows of one sequence costs in one-row "
                        "decodes, with our kernels and with llama.cpp's own (GGML_CPU_ROW_INVARIANT_ROWS=0), each "
                        "in fresh processes (see stepmtp.bench.verify_costs)")
    g = ap.add_argument_group("run")
    g.add_argument("--parallel", type=int, default=None, metavar="N",
                   help="throughput of N concurrent clients on N slots against 1 client on 1 slot, per "
                        "configuration, in the same run (in-process, or servers with --server)")
    g.add_argument("--repeat", type=int, default=None, help="run each prompt N times and keep the best times (default 1)")
    g.add_argument("--warmup", type=int, default=None, help="short warm-up requests per configuration (default 1)")
    g.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all usable)")
    g.add_argument("-c", "--ctx-size", type=int, default=None, help="context size (default 2048)")
    g.add_argument("--no-progress", action="store_true", help="no progress on stderr")
    g.add_argument("-q", "--quiet", action="store_true", help="no per-prompt blocks, no progress")
    g = ap.add_argument_group("output")
    g.add_argument("--out", metavar="DIR", help="write bench.json, bench.md and bench.png there")
    g.add_argument("--json", metavar="FILE", help="the machine-readable results ('-': stdout)")
    g.add_argument("--markdown", metavar="FILE", help="the comparison table")
    g.add_argument("--chart", metavar="FILE", help="the PNG chart (needs matplotlib: pip install 'stepmtp[bench]')")
    g = ap.add_argument_group("regression gate")
    g.add_argument("--baseline", metavar="FILE",
                   help="compare with this baseline (its settings are the defaults); non-zero exit on regression")
    g.add_argument("--update-baseline", action="store_true", help="write this run as the baseline")
    g.add_argument("--tolerance", type=float, default=None,
                   help=f"speed ratios may fall this much (relative) below the baseline's "
                        f"(default: the baseline's, else {G.DEFAULT_TOLERANCE})")
    return ap


def _settings(args: argparse.Namespace, baseline: dict[str, Any] | None) -> dict[str, Any]:
    """Explicit flags, else the baseline's settings, else the built-in defaults."""
    base = (baseline or {}).get("settings") or {}
    out = {}
    for k in BASELINE_SETTINGS:
        v = getattr(args, k)
        out[k] = v if v is not None else base.get(k, BUILTIN[k])
    return out


def _configs(args: argparse.Namespace, s: dict[str, Any], llama_server: Path | None) -> list[BenchConfig]:
    if args.url:
        return [BenchConfig(mode="none", n_max=0, backend="url")]
    if s["configs"]:
        cfgs = parse_configs(s["configs"])
    elif args.compare:
        cfgs = parse_configs(COMPARE_SETS[args.compare])
        if llama_server is not None and args.compare == "schedules":
            cfgs += parse_configs(COMPARE_CPP_CONFIGS)
    else:
        cfgs = [BenchConfig(mode=args.mode, n_max=args.n_max if args.mode != "none" else 0,
                            schedule=args.schedule)]
    if args.server:
        out = []
        for c in cfgs:
            if c.backend == "engine":
                c = dataclasses.replace(c, backend="server")
            out.append(c)
        cfgs = out
    return cfgs


def _model_info(spec: str | None, path: Path, bench_mb: float | None) -> dict[str, Any]:
    info: dict[str, Any] = {"name": Path(spec).name if spec and spec not in MODEL_NAMES else (spec or DEFAULT_MODEL),
                            "path": str(path), "size_bytes": path.stat().st_size, "sha256": file_sha256(path)}
    if bench_mb:
        weights = next((q for q in QUANT_TYPES if path.stem.endswith("-" + q)), "F16")
        info["name"] += f" (widened to {bench_mb:.0f} MB, {weights})"
        info["bench_model_mb"] = bench_mb
    try:
        import gguf

        r = gguf.GGUFReader(str(path))
        if "general.name" in r.fields:
            info["description"] = str(r.fields["general.name"].contents())
    except Exception:  # noqa: BLE001 - informative only
        pass
    return info


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    baseline = None
    if args.baseline and Path(args.baseline).is_file():
        try:
            baseline = G.load_baseline(args.baseline)
        except (ValueError, json.JSONDecodeError) as e:
            ap.error(str(e))
    elif args.baseline and not args.update_baseline:
        ap.error(f"{args.baseline}: no such baseline (make it with --update-baseline)")
    if args.update_baseline and not args.baseline:
        ap.error("--update-baseline needs --baseline FILE")
    if args.rpc and (args.url or args.server):
        ap.error("--rpc applies to the in-process engine (not --url or --server)")
    if args.rpc_vs_local and not args.rpc:
        ap.error("--rpc-vs-local needs --rpc SERVERS")
    from ..placement import PlacementError

    try:
        place_kw, place_argv = _placement(args)
    except PlacementError as e:
        ap.error(f"{e.flag}: {e.detail}")
    local_kw: dict[str, Any] = {**place_kw, **({} if args.ngl is None else {"n_gpu_layers": args.ngl})}
    rpc_kw: dict[str, Any] = {**place_kw, "rpc": args.rpc, "n_gpu_layers": "all" if args.ngl is None else args.ngl}
    if args.batch_invariant:
        local_kw["batch_invariant"] = rpc_kw["batch_invariant"] = True
    if args.url and (args.compare or args.configs or args.server):
        ap.error("--url runs the server as it is configured: no --compare, --configs or --server with it")
    s = _settings(args, baseline)
    quiet = args.quiet
    progress = not (args.quiet or args.no_progress)

    # SIGTERM unwinds like Ctrl-C, so servers we started are stopped
    def _term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)

    llama_server: Path | None = None
    if args.llama_server and args.llama_server != "auto":
        llama_server = Path(args.llama_server)
        if not llama_server.is_file():
            ap.error(f"--llama-server {llama_server}: no such file")
    elif (args.llama_server == "auto" or args.compare == "schedules") and not args.no_llama_server and not args.url:
        llama_server = find_llama_server()
        if llama_server is None and args.llama_server == "auto":
            ap.error("--llama-server auto: no llama-server installed with the package (build it with "
                     "CMAKE_ARGS=\"-DSTEPMTP_BUILD_SERVER=on\" pip install .)")
        if llama_server is not None and progress and not s["configs"]:
            print(f"bench: comparing with the C++ llama-server {llama_server}", file=sys.stderr)
    try:
        cfgs = _configs(args, s, llama_server)
        prompts = load_prompts(s["prompts"]).select(
            [c for c in s["categories"].split(",") if c] if s["categories"] else None, s["limit"], s["n_predict"])
    except (ValueError, OSError) as e:
        ap.error(str(e))
    if not len(prompts):
        ap.error("no prompt to run")
    if any(c.backend == "llama-server" for c in cfgs) and llama_server is None:
        llama_server = find_llama_server()
        if llama_server is None:
            ap.error("a cpp-* configuration needs --llama-server PATH")

    if args.parallel is not None:
        return _parallel(args, s, cfgs, prompts, progress)
    if args.verify_costs:
        return _verify_costs(args, s, progress)
    if args.speed:
        return _speed(args, s, llama_server, progress)
    if args.matrix:
        return _matrix(args, s, prompts, llama_server, progress)

    runners: list[Runner] = []
    model_info: dict[str, Any] = {}
    if args.url:
        runners = [URLRunner(args.url, api_key=args.api_key)]
        model_info = {"name": args.url}
    else:
        path = _model_path(s, progress)
        if path is None:
            return 2
        model_info = _model_info(s["model"], path, s["bench_model_mb"])
        for c in cfgs:
            if c.backend == "engine":
                engine_kw = dict(mtp_model=args.mtp_model, n_ctx=s["ctx_size"], n_threads=s["threads"])
                if not args.rpc or args.rpc_vs_local:
                    runners.append(EngineRunner(c, path, engine_kw=local_kw, **engine_kw))
                if args.rpc:
                    runners.append(EngineRunner(RPCConfig(**asdict(c)), path, engine_kw=rpc_kw, **engine_kw))
            else:
                runners.append(ServerRunner(c, path, mtp_model=args.mtp_model, n_ctx=s["ctx_size"],
                                            n_threads=s["threads"], llama_server=llama_server,
                                            batch_invariant=args.batch_invariant, placement_args=place_argv))
    settings = {**s, "configs": [c.label for c in cfgs], "backend": "url" if args.url else
                ("server" if args.server else "engine"), "mtp_model": args.mtp_model,
                "llama_server": str(llama_server) if llama_server else None, "temperature": 0.0,
                "batch_invariant": args.batch_invariant}
    if args.rpc:
        settings.update(rpc=args.rpc, rpc_vs_local=args.rpc_vs_local, n_gpu_layers=rpc_kw["n_gpu_layers"])
    if place_argv:
        settings["placement"] = place_argv
    try:
        run = run_bench(prompts, runners, repeat=s["repeat"], warmup=s["warmup"], settings=settings,
                        progress=progress)
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted (servers stopped)", file=sys.stderr)
        return 130
    except RuntimeError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    run.model = model_info
    run.environment = R.environment(s["threads"])
    return report(run, args, baseline)


def _placement(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """The placement and KV flags as Engine keywords and as the servers' flags."""
    from ..placement import Placement, check_kv_types

    kw: dict[str, Any] = {}
    argv: list[str] = []
    for flag, key in (("-ctk", "type_k"), ("-ctv", "type_v"), ("-ctkd", "type_k_draft"), ("-ctvd", "type_v_draft")):
        v = getattr(args, key.replace("type", "cache_type"))
        if v is not None:
            kw[key] = v
            argv += [flag, v]
    for v in args.override_tensor:
        argv += ["-ot", v]
    if args.override_tensor:
        kw["override_tensor"] = ",".join(args.override_tensor)
    if args.cpu_moe:
        kw["cpu_moe"] = True
        argv += ["-cmoe"]
    if args.n_cpu_moe is not None:
        kw["n_cpu_moe"] = args.n_cpu_moe
        argv += ["-ncmoe", str(args.n_cpu_moe)]
    if args.no_mmap:
        kw["use_mmap"] = False
        argv += ["--no-mmap"]
    # a bad value fails now, naming the flag, not at the first configuration's start
    t = {k: kw.get(k, "f16") for k in ("type_k", "type_v", "type_k_draft", "type_v_draft")}
    check_kv_types({"target": (t["type_k"], t["type_v"]), "draft": (t["type_k_draft"], t["type_v_draft"])}, None)
    Placement.of(**{k: v for k, v in kw.items() if k in ("override_tensor", "cpu_moe", "n_cpu_moe")}).check_names(
        defer_rpc=bool(args.rpc))
    return kw, argv


def _model_path(s: dict[str, Any], progress: bool) -> Path | None:
    """The model file to run (widened when asked); None after saying why not."""
    try:
        path = resolve_model(s["model"])
        if s["bench_model_mb"]:
            path = bench_model(path, s["bench_model_mb"], quiet=not progress)
            if s.get("bench_weights"):
                path = bench_weights(path, s["bench_weights"], quiet=not progress)
    except (FileNotFoundError, ValueError) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return None
    return path


def _parallel(args: argparse.Namespace, s: dict[str, Any], cfgs: list[BenchConfig], prompts: Any,
              progress: bool) -> int:
    from . import parallel as P

    if args.parallel < 2:
        print(f"{PROG}: --parallel needs N >= 2", file=sys.stderr)
        return 2
    if args.url or args.baseline or any(c.backend == "llama-server" for c in cfgs):
        print(f"{PROG}: --parallel runs stepmtp engines or servers (no --url, --baseline or cpp-* configurations)",
              file=sys.stderr)
        return 2
    path = _model_path(s, progress)
    if path is None:
        return 2
    runs, code = _guarded(lambda: P.run_parallel(list(prompts.prompts), cfgs, path, args.parallel,
                                                 mtp_model=args.mtp_model, n_ctx=s["ctx_size"],
                                                 n_threads=s["threads"], repeat=s["repeat"], server=args.server,
                                                 progress=progress))
    if code is not None:
        return code
    md = P.markdown(runs)
    print(md)
    doc = {"parallel": args.parallel, "model": _model_info(s["model"], path, s["bench_model_mb"]),
           "settings": {k: s[k] for k in ("ctx_size", "threads", "repeat", "n_predict", "limit")},
           "backend": "server" if args.server else "engine", "runs": [r.to_dict() for r in runs]}
    if args.json:
        text = json.dumps(doc, indent=2) + "\n"
        sys.stdout.write(text) if args.json == "-" else Path(args.json).write_text(text)
    if args.markdown:
        Path(args.markdown).write_text(md)
    bad = P.same_texts(runs)
    if bad:
        print(f"{PROG}: outputs differ between 1 and {args.parallel} clients for {', '.join(bad)}", file=sys.stderr)
        return 3
    return 0


def _guarded(run: Any) -> tuple[Any, int | None]:
    """``run()``'s result, or the exit code after saying why it stopped: Ctrl-C (the
    servers it started are stopped on the way out) or a RuntimeError (a server's)."""
    try:
        return run(), None
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted (servers stopped)", file=sys.stderr)
        return None, 130
    except RuntimeError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return None, 2


def _machine(env: dict[str, Any], model: str) -> str:
    """The end of a table's caption: the CPU, the threads and the model."""
    return f"{env.get('cpu_model')}, {env.get('n_threads')} threads; model {model}"


def _emit(args: argparse.Namespace, md: str, doc: dict[str, Any], name: str) -> None:
    """The Markdown on stdout; the JSON and Markdown where --json / --markdown / --out say."""
    print(md)
    outs = {"json": args.json, "markdown": args.markdown}
    if args.out:
        d = Path(args.out)
        d.mkdir(parents=True, exist_ok=True)
        outs = {k: v or str(d / f"{name}.{'md' if k == 'markdown' else k}") for k, v in outs.items()}
    if outs["json"]:
        text = json.dumps(doc, indent=2) + "\n"
        sys.stdout.write(text) if outs["json"] == "-" else Path(outs["json"]).write_text(text)
    if outs["markdown"]:
        Path(outs["markdown"]).write_text(md)


def _own_servers(args: argparse.Namespace, s: dict[str, Any], llama_server: Path | None, mode: str,
                 entries: str, progress: bool) -> tuple[list[Any], list[int], Path] | None:
    """A mode that starts its own servers: its entries, --clients and the model's path;
    None after saying why not."""
    from . import matrix as X

    if args.url or args.baseline or args.configs or args.compare or args.rpc:
        print(f"{PROG}: {mode} starts its own servers (no --url, --baseline, --configs, --compare or --rpc)",
              file=sys.stderr)
        return None
    try:
        picked = X.parse_entries(entries, llama_server is not None)
        clients = [int(n) for n in args.clients.split(",") if n.strip()]
    except ValueError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return None
    path = _model_path(s, progress)
    return None if path is None else (picked, clients, path)


def _speed(args: argparse.Namespace, s: dict[str, Any], llama_server: Path | None, progress: bool) -> int:
    from . import speed as S

    got = _own_servers(args, s, llama_server, "--speed",
                       args.entries or ("off,cpp-off" if llama_server is not None else "off"), progress)
    if got is None:
        return 2
    entries, clients, path = got
    n_predict = s["n_predict"] or 128
    run, code = _guarded(lambda: S.run_speed(entries, path, prompt_tokens=args.prompt_tokens, clients=clients,
                                             n_predict=n_predict, repeat=s["repeat"], llama_server=llama_server,
                                             threads=s["threads"], progress=progress))
    if code is not None:
        return code
    env = R.environment(s["threads"])
    reference = "cpp-off" if any(e.name == "cpp-off" for e in entries) else "off"
    model = _model_info(s["model"], path, s["bench_model_mb"])
    md = (f"{S.speed_markdown(run, entries, reference)}\nprompt {args.prompt_tokens} tokens; decode {n_predict} "
          f"tokens a client at temperature 0; {s['repeat']} repetitions; {_machine(env, model['name'])}\n")
    doc = {"speed": run.figures, "cells": run.cells, "reference": reference,
           "entries": {e.name: {"flags": list(e.flags), "cpp": e.cpp} for e in entries}, "model": model,
           "settings": {"prompt_tokens": args.prompt_tokens, "n_predict": n_predict, "clients": clients,
                        "repeat": s["repeat"], "threads": s["threads"]}, "environment": env}
    _emit(args, md, doc, "speed")
    return 0


def _verify_costs(args: argparse.Namespace, s: dict[str, Any], progress: bool) -> int:
    from . import verify_costs as V

    path = _model_path(s, progress)
    if path is None:
        return 2
    doc, code = _guarded(lambda: V.run_verify_costs(path, threads=s["threads"], progress=progress))
    if code is not None:
        return code
    env = R.environment(s["threads"])
    model = _model_info(s["model"], path, s["bench_model_mb"])
    doc.update(model=model, environment=env)
    md = f"{V.verify_costs_markdown(doc)}\n{_machine(env, model['name'])}\n"
    _emit(args, md, doc, "verify-costs")
    return 0


def _matrix(args: argparse.Namespace, s: dict[str, Any], prompts: Any, llama_server: Path | None,
            progress: bool) -> int:
    from . import matrix as X

    try:
        temps = [float(t) for t in args.temps.split(",") if t.strip()]
    except ValueError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    got = _own_servers(args, s, llama_server, "--matrix", args.entries, progress)
    if got is None:
        return 2
    entries, clients, path = got
    from . import agent_turns as A

    def run() -> tuple[list[Any], dict[str, Any], Any]:
        cells, props = X.run_matrix(list(prompts.prompts), entries, path, temps=temps, clients=clients,
                                    repeat=s["repeat"], llama_server=llama_server, threads=s["threads"],
                                    progress=progress) if temps and clients else ([], {})
        agent = A.run_agent(A.agent_prompts(args.agent_turns), entries, path, llama_server=llama_server,
                            threads=s["threads"], progress=progress) if args.agent else None
        return cells, props, agent

    got, code = _guarded(run)
    if code is not None:
        return code
    cells, props, agent = got
    env = R.environment(s["threads"])
    model = _model_info(s['model'], path, s['bench_model_mb'])['name']
    md = (f"{X.markdown(cells, entries)}\n{len(prompts)} prompts x {prompts.prompts[0].n_predict} tokens, best of "
          f"{s['repeat']}; {_machine(env, model)}\n") if cells else ""
    if agent is not None:
        md += (f"\n### Agents' turns\n\n{A.agent_markdown(agent, entries)}\n{args.agent_turns} turns of each kind "
               f"x 256 tokens at temperature 0, one client; generation tok/s from the servers' timings; "
               f"{_machine(env, model)}\n")
    doc = {"matrix": [c.to_dict() for c in cells], "entries": {e.name: {"flags": list(e.flags), "cpp": e.cpp,
                                                                      "what": e.what} for e in entries},
           "servers": props, "model": _model_info(s["model"], path, s["bench_model_mb"]),
           "agent": agent.to_dict() if agent is not None else None,
           "settings": {k: s[k] for k in ("n_predict", "limit", "categories", "threads", "repeat")},
           "environment": env}
    _emit(args, md, doc, "matrix")
    chart = args.chart or (str(Path(args.out) / "matrix.png") if args.out else None)
    if chart and cells:
        why = X.write_heatmap(cells, entries, chart)
        if why:
            print(f"bench: {why}", file=sys.stderr)
    bad = X.check_texts(cells, entries)
    if agent is not None:
        bad += A.check_agent_texts(agent, entries)
    if bad:
        print(f"{PROG}: texts differ:\n  " + "\n  ".join(bad), file=sys.stderr)
        return 3
    return 0


def report(run: BenchRun, args: argparse.Namespace, baseline: dict[str, Any] | None) -> int:
    quiet = args.quiet
    if not quiet:
        for c in run.configs:
            print(R.config_block(c))
            print()
    md = R.markdown(run)
    if len(run.configs) > 1 or quiet:
        print(md)
    doc = R.to_json(run)
    outs: list[tuple[str, str]] = []
    if args.out:
        d = Path(args.out)
        d.mkdir(parents=True, exist_ok=True)
        outs = [("json", str(d / "bench.json")), ("markdown", str(d / "bench.md")), ("chart", str(d / "bench.png"))]
    for kind in ("json", "markdown", "chart"):
        if getattr(args, kind):
            outs = [o for o in outs if o[0] != kind] + [(kind, getattr(args, kind))]
    for kind, dest in outs:
        if kind == "json":
            text = json.dumps(doc, indent=2) + "\n"
            if dest == "-":
                sys.stdout.write(text)
            else:
                Path(dest).write_text(text)
        elif kind == "markdown":
            Path(dest).write_text(md)
        else:
            why = R.write_chart(run, dest)
            if why:
                print(f"bench: {why}", file=sys.stderr)
                continue
        if dest != "-":
            print(f"bench: wrote {dest}", file=sys.stderr)

    status = 0
    if run.mismatches and gpu_backend() and not run.settings.get("batch_invariant"):
        # a GPU's kernels round a row differently with the rows a decode carries: a
        # verify and a one-row decode may pick different near-ties, so texts may part
        # without anything being wrong; report how far they agree instead of failing
        print("\nagreement at temperature 0 (a GPU backend: kernels differ by batch size):", file=sys.stderr)
        for lab, a in H.agreement(run).items():
            until = a["tokens_until_difference"] or a["chars_until_difference"]
            unit = "tokens" if a["tokens_until_difference"] else "chars"
            print(f"  {lab}: {a['identical']:.0%} of prompts identical; the others part after "
                  f"{', '.join(map(str, until)) or '-'} {unit}", file=sys.stderr)
    elif run.mismatches:
        bar = "!" * 78
        print(f"\n{bar}\nMISMATCH: at temperature 0 the configurations produced different text:", file=sys.stderr)
        for m in run.mismatches:
            print(f"  {m.category}: {m.label} differs from {m.reference} from character {m.at}", file=sys.stderr)
        print(bar, file=sys.stderr)
        status = 3
    for c in run.configs:
        if c.unstable:
            print(f"bench: WARNING {c.label}: repeats disagreed on {', '.join(c.unstable)}", file=sys.stderr)

    if args.baseline:
        if baseline is not None:
            rep = G.check(run, baseline, args.tolerance)
            print(rep.text())
            if not rep.ok and not args.update_baseline:
                return 1
        if args.update_baseline:
            tol = args.tolerance if args.tolerance is not None else (baseline or {}).get("tolerance",
                                                                                       G.DEFAULT_TOLERANCE)
            G.save_baseline(args.baseline, G.make_baseline(run, tol))
            print(f"bench: baseline written to {args.baseline}", file=sys.stderr)
            return status
    return status


def gpu_backend() -> bool:
    """A GPU (CUDA, Metal, ...) runs the model: llama.cpp's local GPU devices (its
    ``llama_supports_gpu_offload`` is also true on a CPU build with RPC)."""
    from .. import system_info

    return bool(system_info().get("gpus"))


if __name__ == "__main__":
    sys.exit(main())
