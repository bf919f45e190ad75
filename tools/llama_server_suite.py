#!/usr/bin/env python3
"""Run llama-server's own pytest suite against ``python -m stepmtp.server``.

The yardstick of "a llama-server client cannot tell us apart": the vendored
``vendor/llama.cpp/tools/server/tests`` (conftest.py, utils.py, unit/test_*.py),
which starts the ``llama-server`` binary and talks HTTP to it.  This script

* copies that directory into a temp dir (vendor/ is never modified), laid out
  as ``<tmp>/llama.cpp/tools/server/tests`` with ``models/`` and ``tools/mtmd``
  linked beside it, so the tests' ``../../../models/templates/*.jinja`` and
  ``../../../tools`` paths resolve;
* points ``LLAMA_SERVER_BIN_PATH`` (read by utils.py) at a wrapper
  ``<tmp>/bin/llama-server`` that execs ``python -P -m stepmtp.server``, adding
  ``--spec-type draft-mtp`` (MTP drafting on for every server) and dropping the
  llama-server flags our parser does not know (each drop is logged with the
  test that caused it and reported at the end; ``--strict-flags`` passes them
  through, so such a server exits at start);
* appends to the copied conftest.py: every model a test would download
  (``--hf-repo``/``--hf-file``/``--model-url``/``-m``) becomes a local step35
  GGUF, ``download_file()`` of a ``.gguf`` (test_speculative's draft model)
  returns the MTP-only half of it (``stepmtp.models.split_model``), the
  ``ServerPreset.load_all()`` pre-download is skipped, ``-t 1`` is added where
  the test sets no thread count, and ports 8080..8099 are moved to a free range
  (the machine is shared);
* runs pytest on each chosen test file in turn (``-m "not slow"`` like
  tests.sh unless ``--slow``), with a per-test timeout (pytest-timeout), and
  prints passed / failed / skipped / errors per file with a one-line reason per
  failure, plus the flags that were dropped.

Needs the suite's requirements in the venv: ``pip install pytest-timeout wget
aiohttp prometheus-client`` (pytest, requests, openai, numpy are usually there).

Usage::

    . .venv/bin/activate
    python tools/llama_server_suite.py                      # the default files
    python tools/llama_server_suite.py --files test_basic,test_tokenize -k "not slot"
    python tools/llama_server_suite.py --extra              # also the report-only files
    python tools/llama_server_suite.py --json out.json --junit-dir junit/
    python tools/llama_server_suite.py --model tiny         # write_agree_model() instead
    python tools/llama_server_suite.py --keep -v            # keep the temp dir, show pytest's output
    python tools/llama_server_suite.py --any-text           # text regexes of the original models always pass
    python tools/llama_server_suite.py --np-auto            # every server with -np auto (the tests' -np dropped)

Default files: test_basic, test_completion, test_chat_completion, test_template,
test_tokenize, test_tool_call, test_security; ``--extra`` adds test_compat_anthropic,
test_compat_oai_responses, test_slot_save, test_speculative.  Exit status: 0 when nothing failed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENDOR = ROOT / "vendor" / "llama.cpp"
TESTS = VENDOR / "tools" / "server" / "tests"

DEFAULT_FILES = ["test_basic", "test_completion", "test_chat_completion", "test_template", "test_tokenize",
                 "test_tool_call", "test_security"]
EXTRA_FILES = ["test_compat_anthropic", "test_compat_oai_responses", "test_slot_save", "test_speculative"]

#: llama-server flags that take no value (for dropping ones our parser lacks);
#: any other unknown flag takes the next argument as its value
BOOL_FLAGS = {
    "--offline", "--embedding", "--embeddings", "--reranking", "--rerank", "--context-shift",
    "--no-context-shift", "--no-ui", "--no-webui", "--no-models-autoload", "--no-cache-idle-slots",
    "--ui-mcp-proxy", "--backend-sampling", "--cont-batching", "--no-cont-batching", "--metrics",
    "--slots", "--no-slots", "--kv-unified", "--jinja", "--no-jinja", "--verbose",
}

WRAPPER = r'''#!@PYTHON@
"""llama-server -> python -m stepmtp.server, written by tools/llama_server_suite.py."""
import json, os, sys

KNOWN = set(json.loads(@KNOWN@))
BOOL = set(json.loads(@BOOL@))
STRICT = @STRICT@
NP_AUTO = @NP_AUTO@
LOG = @LOG@


def is_num(s):
    try:
        float(s)
        return True
    except ValueError:
        return False


args, out, dropped = sys.argv[1:], [], []
i = 0
while i < len(args):
    a = args[i]
    if NP_AUTO and a.split("=", 1)[0] in ("-np", "--parallel"):  # the server's default slots
        i += 1 if "=" in a else 2
        continue
    if a.startswith("-") and not is_num(a) and KNOWN and not STRICT:
        name = a.split("=", 1)[0]
        norm = name.replace("_", "-") if name.startswith("--") else name
        if norm not in KNOWN:
            n = 1
            if "=" not in a and norm not in BOOL and i + 1 < len(args) and (
                    not args[i + 1].startswith("-") or is_num(args[i + 1])):
                n = 2
            dropped.append(args[i:i + n])
            i += n
            continue
    out.append(a)
    i += 1
if not any(a.split("=", 1)[0] == "--spec-type" for a in out):
    out += ["--spec-type", "draft-mtp"]
with open(LOG, "a") as f:
    f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0],
                        "argv": out, "dropped": dropped}) + "\n")
os.execv(sys.executable, [sys.executable, "-P", "-m", "stepmtp.server", *out])
'''

CONFTEST_ADDITION = r'''

# ---- added by stepmtp tools/llama_server_suite.py: local models, free ports, -t 1 ----
import utils as _suite_utils

_SUITE_MODEL = os.environ["STEPMTP_SUITE_MODEL"]
_SUITE_DRAFT = os.environ.get("STEPMTP_SUITE_DRAFT") or _SUITE_MODEL
_SUITE_PORT_BASE = int(os.environ["STEPMTP_SUITE_PORT_BASE"])
_SUITE_THREADS = int(os.environ.get("STEPMTP_SUITE_THREADS", "1"))
_suite_orig_start = _suite_utils.ServerProcess.start


def _suite_start(self, *args, **kwargs):
    if self.model_hf_repo or self.model_hf_file or self.model_url or self.model_file:
        self.model_hf_repo = self.model_hf_file = self.model_url = None
        self.model_file = _SUITE_MODEL
    if 8080 <= int(self.server_port) < 8100:
        self.server_port = _SUITE_PORT_BASE + int(self.server_port) - 8080
    if self.n_threads is None:
        self.n_threads = _SUITE_THREADS
    return _suite_orig_start(self, *args, **kwargs)


def _suite_download_file(url, output_file_path=None):
    if url.split("?")[0].endswith(".gguf"):
        return _SUITE_DRAFT
    raise RuntimeError(f"no network: cannot download {url}")


_suite_utils.ServerProcess.start = _suite_start
if os.environ.get("STEPMTP_SUITE_ANY_TEXT") == "1":
    # --any-text: every match_regex() on generated text passes, to reach the checks behind it
    _suite_utils.match_regex = lambda regex, text: True
_suite_utils.download_file = _suite_download_file
download_file = _suite_download_file


@pytest.fixture(scope="module", autouse=True)
def do_something():
    # upstream pre-downloads every preset's model here; ours are local
    yield
'''


def free_port_base(n: int = 20) -> int:
    for _ in range(200):
        # below Linux's ephemeral ports (32768 on): a client's connection could take
        # one of ours mid-run, and every later server of the file failed to bind
        base = random.randrange(20000, 32000, 20)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range found")


def known_flags() -> list[str]:
    """Every option string our server's parser takes, less those it refuses (a preset's
    --embedding is dropped, as an unknown flag is, not refused); empty if it can't be
    imported: drop nothing."""
    try:
        from stepmtp.server.cli import build_parser
        from stepmtp.server.flags import _Refuse
    except Exception as e:  # the server is being edited: run without dropping
        print(f"warning: cannot import stepmtp.server.cli ({e}); no flag is dropped", file=sys.stderr)
        return []
    return sorted({s for a in build_parser()._actions if not isinstance(a, _Refuse) for s in a.option_strings})


def local_models(choice: str, tmp: Path) -> tuple[Path, Path]:
    """(model, its MTP-only half for --model-draft)."""
    from stepmtp.models import default_model_path, split_model

    if choice == "bundled":
        model = default_model_path()
    elif choice == "tiny":
        from stepmtp.tiny import write_agree_model

        model = write_agree_model(tmp / "models-local", seed=0)[0]
    else:
        model = Path(choice).resolve()
    try:
        draft = split_model(model, tmp / "models-split")["mtp"]
    except Exception as e:
        print(f"warning: cannot split {model} ({e}); the draft model is the model itself", file=sys.stderr)
        draft = model
    return model, draft


def prepare(tmp: Path, args: argparse.Namespace) -> tuple[Path, dict[str, str]]:
    tree = tmp / "llama.cpp"
    tests = tree / "tools" / "server" / "tests"
    shutil.copytree(TESTS, tests, ignore=shutil.ignore_patterns("__pycache__", "tmp", ".pytest_cache"))
    (tree / "models").symlink_to(VENDOR / "models")
    (tree / "tools" / "mtmd").symlink_to(VENDOR / "tools" / "mtmd")
    (tests / "tmp").mkdir(exist_ok=True)
    with open(tests / "conftest.py", "a") as f:
        f.write(CONFTEST_ADDITION)

    bindir = tmp / "bin"
    bindir.mkdir()
    log = tmp / "server-argv.jsonl"
    wrapper = bindir / "llama-server"
    text = WRAPPER
    for key, val in (("@PYTHON@", sys.executable), ("@KNOWN@", repr(json.dumps(known_flags()))),
                     ("@BOOL@", repr(json.dumps(sorted(BOOL_FLAGS)))), ("@STRICT@", repr(args.strict_flags)),
                     ("@NP_AUTO@", repr(args.np_auto)),
                     ("@LOG@", repr(str(log)))):
        text = text.replace(key, val)
    wrapper.write_text(text)
    wrapper.chmod(0o755)

    model, draft = local_models(args.model, tmp)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_") and k not in (
        "LLAMA_API_KEY", "PORT", "DEBUG", "DEBUG_EXTERNAL", "N_GPU_LAYERS", "SLOW_TESTS")}
    env.update({
        "LLAMA_SERVER_BIN_PATH": str(wrapper),
        "LLAMA_CACHE": str(tests / "tmp"),
        "STEPMTP_SUITE_MODEL": str(model),
        "STEPMTP_SUITE_DRAFT": str(draft),
        "STEPMTP_SUITE_PORT_BASE": str(free_port_base()),
        "STEPMTP_SUITE_THREADS": str(args.threads),
        "PYTHONDONTWRITEBYTECODE": "1",
    })
    if args.slow:
        env["SLOW_TESTS"] = "1"
    if args.any_text:
        env["STEPMTP_SUITE_ANY_TEXT"] = "1"
    print(f"suite copy: {tests}\nmodel: {model}\ndraft (--model-draft): {draft}", flush=True)
    return tests, env


def one_line(text: str, limit: int = 300) -> str:
    """pytest's message on one line: "assert False | where False = match_regex(...)"."""
    lines = [ln.strip().lstrip("+").strip() for ln in (text or "").splitlines() if ln.strip()]
    return " | ".join(lines[:3])[:limit]


def server_error(out: str) -> str:
    """The server's own complaint, when it died at start."""
    for ln in out.splitlines():
        if "stepmtp.server: error:" in ln or "Traceback" in ln or " ERROR " in ln:
            return ln.strip()[:200]
    return ""


def parse_junit(path: Path) -> list[dict]:
    results = []
    if not path.is_file():
        return results
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "")
        outcome, reason = "passed", ""
        out = "".join((e.text or "") for e in case.iter() if e.tag in ("system-out", "system-err"))
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                reason = one_line(el.get("message") or el.text or "")
                if outcome in ("failed", "error") and ("died with return code" in reason or "did not start" in reason):
                    reason += " | " + server_error(out)
                break
        results.append({"name": name, "outcome": outcome, "reason": reason, "time": float(case.get("time", 0))})
    return results


def run_file(name: str, tests: Path, env: dict, args: argparse.Namespace, junit_dir: Path) -> dict:
    junit = junit_dir / f"{name}.xml"
    cmd = [sys.executable, "-m", "pytest", f"unit/{name}.py", "-p", "no:cacheprovider", "-o", "junit_logging=all",
           f"--timeout={args.timeout}", f"--junitxml={junit}", "-q", "-rN"]
    if not args.slow:
        cmd += ["-m", "not slow"]
    if args.k:
        cmd += ["-k", args.k]
    cmd += args.pytest_args
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=tests, env=env, stdout=None if args.verbose else subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    results = parse_junit(junit)
    if not results and proc.returncode not in (0, 5):
        tail = (proc.stdout or "").strip().splitlines()[-5:]
        results = [{"name": "<collection>", "outcome": "error", "reason": " / ".join(tail)[:300], "time": 0.0}]
    counts = Counter(r["outcome"] for r in results)
    return {"file": name, "seconds": round(time.time() - t0, 1), "returncode": proc.returncode,
            "counts": {k: counts.get(k, 0) for k in ("passed", "failed", "skipped", "error")}, "tests": results}


def dropped_flags(log: Path) -> dict[str, list[str]]:
    """flag -> the tests that passed it (and had it dropped)."""
    out: dict[str, list[str]] = defaultdict(list)
    if log.is_file():
        for line in log.read_text().splitlines():
            rec = json.loads(line)
            for d in rec["dropped"]:
                out[" ".join(d)].append(rec["test"])
    return dict(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", help="comma-separated test files (test_x or unit/test_x.py); default: the default set")
    ap.add_argument("--extra", action="store_true", help="also " + ", ".join(EXTRA_FILES))
    ap.add_argument("-k", help="pytest -k expression, passed through")
    ap.add_argument("--model", default="bundled",
                    help="bundled (stepmtp.models.default_model_path()), tiny (stepmtp.tiny.write_agree_model) "
                         "or a GGUF path (default: bundled)")
    ap.add_argument("--timeout", type=int, default=120, help="per-test timeout in seconds (default: 120)")
    ap.add_argument("--threads", type=int, default=1, help="-t for servers whose test sets none (default: 1)")
    ap.add_argument("--slow", action="store_true", help="also the tests marked slow (SLOW_TESTS=1)")
    ap.add_argument("--any-text", action="store_true",
                    help="make match_regex() (the checks of the original models' text) always pass, to see "
                         "what fails behind them")
    ap.add_argument("--np-auto", action="store_true",
                    help="every server at its default slot count (-np auto), as users run it: the tests' "
                         "--parallel / -np are dropped")
    ap.add_argument("--strict-flags", action="store_true",
                    help="pass llama-server flags our server does not know through (it then exits at start)")
    ap.add_argument("--json", type=Path, help="write the summary as JSON here")
    ap.add_argument("--junit-dir", type=Path, help="keep pytest's JUnit XML files here (one per test file)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir")
    ap.add_argument("-v", "--verbose", action="store_true", help="show pytest's output")
    ap.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments")
    args = ap.parse_args(argv)

    files = [Path(f.strip()).stem for f in args.files.split(",")] if args.files else list(DEFAULT_FILES)
    if args.extra:
        files += [f for f in EXTRA_FILES if f not in files]
    for f in files:
        if not (TESTS / "unit" / f"{f}.py").is_file():
            ap.error(f"no such test file: {TESTS / 'unit' / f}.py")

    tmp = Path(tempfile.mkdtemp(prefix="llama-server-suite-"))
    try:
        tests, env = prepare(tmp, args)
        junit_dir = args.junit_dir.resolve() if args.junit_dir else tmp / "junit"
        junit_dir.mkdir(parents=True, exist_ok=True)
        summary = []
        for f in files:
            print(f"== {f} ...", flush=True)
            res = run_file(f, tests, env, args, junit_dir)
            summary.append(res)
            c = res["counts"]
            print(f"== {f}: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped, "
                  f"{c['error']} errors ({res['seconds']} s)", flush=True)
            for r in res["tests"]:
                if r["outcome"] in ("failed", "error"):
                    print(f"   {r['outcome'].upper():6} {r['name']}: {r['reason']}", flush=True)
        drops = dropped_flags(tmp / "server-argv.jsonl")

        tot = Counter()
        print("\n== summary")
        for res in summary:
            tot.update(res["counts"])
            c = res["counts"]
            n = sum(c.values())
            print(f"  {res['file']:24} {c['passed']:4}/{n:<4} passed  {c['failed']:4} failed  "
                  f"{c['skipped']:4} skipped  {c['error']:4} errors")
        n = sum(tot.values())
        print(f"  {'total':24} {tot['passed']:4}/{n:<4} passed  {tot['failed']:4} failed  "
              f"{tot['skipped']:4} skipped  {tot['error']:4} errors")
        if drops:
            print("\n== llama-server flags our server rejects (dropped by the wrapper), by tests passing them")
            for flag, who in sorted(drops.items(), key=lambda kv: -len(set(kv[1]))):
                print(f"  {flag:40} {len(set(who))} tests, e.g. {sorted(set(who))[0]}")
        if args.json:
            args.json.write_text(json.dumps({"model": env["STEPMTP_SUITE_MODEL"], "files": summary,
                                             "totals": dict(tot), "dropped_flags": drops}, indent=1))
        return 0 if tot["failed"] == 0 and tot["error"] == 0 else 1
    finally:
        if args.keep:
            print(f"kept: {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
