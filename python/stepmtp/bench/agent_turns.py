"""``--matrix --agent``: agents' turns, which copy their context, through the servers.

An agent's turn often writes what its context already holds. Four kinds of turns,
built from modules of Python's standard library (the text the bundled model knows),
each a prompt the model continues at temperature 0 for ``n_predict`` tokens:

* ``copy``: a module the model has just read, then its first lines again, the one
  change a different header comment: the model rewrites the file;
* ``echo``: a tool's output (the module's ``def`` and ``class`` lines, numbered, as a
  search tool prints them), then its first lines again: the model echoes it;
* ``again``: each copy and echo prompt sent a second time, as an agent's retried or
  repeated turn: the text it wrote the first time is now in no prompt, only in what a
  server kept of its earlier requests;
* ``summary``: a module, then the start of a comment about it: nothing to copy.

Every entry's server is started once (as ``--matrix`` does) and the prompts are sent
one client at a time, the entries taking turns prompt by prompt (each prompt's first
time to every entry, then its second time to every entry), so every prompt is new to
each server the first time. The figure is generation tokens per second from the
servers' own ``timings`` (``predicted_n`` over ``predicted_ms``: the prompt's decoding
aside, as agents' prompts are mostly cached), per kind; and per kind the ratios paired
prompt by prompt (geometric mean ± standard error). At temperature 0 every stepmtp
entry must write ``off``'s texts (exit 3 otherwise).
"""
from __future__ import annotations

import math
import re
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .matrix import MATRIX_CTX, Entry, running_servers
from .runners import completion

__all__ = ["KINDS", "Turn", "agent_prompts", "run_agent", "agent_markdown", "check_agent_texts"]

KINDS = ("copy", "echo", "again", "summary")

#: the modules the turns are made from (any Python has them)
MODULES = ("bisect", "heapq", "fnmatch", "shlex", "textwrap", "colorsys", "keyword", "string",
           "glob", "genericpath", "copy", "numbers", "graphlib", "dis")
#: characters of a module a prompt holds (the bench model was trained on 1024 positions:
#: a prompt of ~600 tokens leaves room for the turn)
CHARS = 1600


@dataclass(frozen=True)
class Turn:
    kind: str  # copy, echo, summary (again: a copy or echo sent a second time)
    name: str
    prompt: str


def _module_text(name: str) -> str:
    # read from the standard library's directory: Python 3.11+ freezes some modules
    # (genericpath among them), whose import spec then names no file
    path = Path(sysconfig.get_paths()["stdlib"]) / f"{name}.py"
    if not path.is_file():
        raise RuntimeError(f"agent turns: the standard library's {name}.py is not here")
    text = path.read_text()
    cut = text.rfind("\n", 0, CHARS)
    return text[: cut + 1 if cut > 0 else CHARS]


def agent_prompts(n_each: int = 4) -> list[Turn]:
    """``n_each`` turns of each kind (copy, echo, summary), each from its own module."""
    mods = list(MODULES)
    if 3 * n_each > len(mods):
        raise ValueError(f"at most {len(mods) // 3} turns of each kind")
    turns = []
    for i in range(n_each):
        m = mods[3 * i]
        text = _module_text(m)
        lines = text.splitlines(keepends=True)
        head = "".join(lines[:6])
        turns.append(Turn("copy", m, f"# {m}.py\n{text}\n\n# {m}.py, rewritten\n{head}"))
        m = mods[3 * i + 1]
        text = _module_text(m)
        hits = [f"{m}.py:{k + 1}: {ln.strip()}" for k, ln in enumerate(text.splitlines())
                if re.match(r"\s*(def|class|import|from) ", ln)] or text.splitlines()[:20]
        out = "\n".join(hits)
        turns.append(Turn("echo", m, f"# $ grep -n 'def\\|class\\|import' {m}.py\n{out}\n\n"
                                     f"# the output again:\n{hits[0]}\n"))
        m = mods[3 * i + 2]
        text = _module_text(m)
        turns.append(Turn("summary", m, f"# {m}.py\n{text}\n\n# What {m} does, in short:\n#"))
    return turns


@dataclass
class Result:
    """One request's outcome."""

    tokens: int
    gen_ms: float
    drafted: int
    accepted: int
    text: str

    @property
    def tok_s(self) -> float:
        return 1e3 * self.tokens / self.gen_ms if self.gen_ms > 0 else 0.0


@dataclass
class AgentRun:
    """Every entry's results, by kind and turn name."""

    results: dict[str, dict[str, dict[str, Result]]] = field(default_factory=dict)  # entry -> kind -> name

    def add(self, entry: str, kind: str, name: str, r: Result) -> None:
        self.results.setdefault(entry, {}).setdefault(kind, {})[name] = r

    def tok_s(self, entry: str, kind: str) -> float | None:
        rs = list(self.results.get(entry, {}).get(kind, {}).values())
        ms = sum(r.gen_ms for r in rs)
        return 1e3 * sum(r.tokens for r in rs) / ms if ms > 0 else None

    def accept(self, entry: str, kind: str) -> float | None:
        rs = list(self.results.get(entry, {}).get(kind, {}).values())
        d = sum(r.drafted for r in rs)
        return sum(r.accepted for r in rs) / d if d else None

    def paired(self, entry: str, to: str, kind: str) -> tuple[float, float, int] | None:
        """Geometric mean of the per-turn tok/s ratios, its standard error, the count."""
        a, b = self.results.get(entry, {}).get(kind, {}), self.results.get(to, {}).get(kind, {})
        logs = [math.log(a[n].tok_s / b[n].tok_s) for n in a if n in b and a[n].tok_s > 0 and b[n].tok_s > 0]
        if not logs:
            return None
        mean = sum(logs) / len(logs)
        se = math.sqrt(sum((x - mean) ** 2 for x in logs) / (len(logs) - 1) / len(logs)) if len(logs) > 1 else 0.0
        return math.exp(mean), math.exp(mean) * se, len(logs)

    def to_dict(self) -> dict[str, Any]:
        return {e: {k: {"tok_s": self.tok_s(e, k), "accept": self.accept(e, k),
                        "turns": {n: vars(r) for n, r in by.items()}} for k, by in kinds.items()}
                for e, kinds in self.results.items()}


def _complete(url: str, prompt: str, n_predict: int, timeout: float) -> Result:
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "stream": False}
    o = completion(url, body, timeout)
    t = o.get("timings") or {}
    return Result(int(t.get("predicted_n", 0)), float(t.get("predicted_ms", 0.0)), int(t.get("draft_n", 0)),
                  int(t.get("draft_n_accepted", 0)), o.get("content", ""))


def run_agent(turns: Sequence[Turn], entries: Sequence[Entry], model: Path, *, n_predict: int = 256,
              llama_server: Path | None = None, threads: int | None = None, n_ctx: int = MATRIX_CTX,
              timeout: float = 1800.0, progress: bool = True) -> AgentRun:
    """Every turn to every entry (see the module), each entry's server started once."""
    run = AgentRun()
    names = [e.name for e in entries]
    with running_servers(entries, model, llama_server, threads, n_ctx, timeout) as servers:
        for i, t in enumerate(turns):
            order = names[i % len(names):] + names[: i % len(names)]
            sends = [(t.kind, 0)] + ([("again", 1)] if t.kind in ("copy", "echo") else [])
            for kind, _ in sends:
                for name in order:
                    r = _complete(servers[name].url, t.prompt, n_predict, timeout)
                    run.add(name, kind, f"{t.kind}:{t.name}", r)
                    if progress:
                        acc = f", accepted {r.accepted}/{r.drafted}" if r.drafted else ""
                        print(f"agent: {kind:7s} {t.name:12s} {name}: {r.tok_s:.1f} tok/s{acc}", file=sys.stderr)
    return run


def agent_markdown(run: AgentRun, entries: Sequence[Entry]) -> str:
    names = [e.name for e in entries]
    lines = ["| generation tok/s (x MTP off; acceptance) | " + " | ".join(KINDS) + " |",
             "|---|" + "---:|" * len(KINDS)]
    for n in names:
        row = []
        for k in KINDS:
            v, off, acc = run.tok_s(n, k), run.tok_s("off", k), run.accept(n, k)
            if v is None:
                row.append("")
                continue
            cell = f"{v:.1f}"
            extra = [f"{v / off:.2f}x"] if off and n != "off" else []
            extra += [f"{acc:.2f}"] if acc is not None else []
            row.append(cell + (f" ({'; '.join(extra)})" if extra else ""))
        lines.append(f"| `{n}` | " + " | ".join(row) + " |")
    cpp = [n for n in ("cpp-mtp", "cpp-ngram") if n in names]
    pairs = [(n, "off") for n in names if n != "off" and not n.startswith("cpp")] + \
            [(n, c) for n in names if not n.startswith("cpp") and n != "off" for c in cpp]
    if pairs:
        lines += ["", "| paired (per turn) | " + " | ".join(KINDS) + " |", "|---|" + "---:|" * len(KINDS)]
        for a, b in pairs:
            row = []
            for k in KINDS:
                p = run.paired(a, b, k)
                row.append(f"{p[0]:.3f} ± {p[1]:.3f}" if p else "")
            lines.append(f"| `{a}` x `{b}` | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def check_agent_texts(run: AgentRun, entries: Sequence[Entry]) -> list[str]:
    """At temperature 0 every stepmtp entry writes ``off``'s text for every turn."""
    bad = []
    off = run.results.get("off", {})
    for e in entries:
        if e.cpp or e.name == "off":
            continue
        for kind, by in run.results.get(e.name, {}).items():
            for name, r in by.items():
                ref = off.get(kind, {}).get(name)
                if ref is not None and r.text != ref.text:
                    bad.append(f"agent {kind} {name}: {e.name}'s text differs from off's")
    return bad

