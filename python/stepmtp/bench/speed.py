"""``--speed``: prompt and plain decoding speed through the servers, paired.

What a user's server spends most of its time on besides drafting: reading a fresh
prompt, and decoding one token at a time for one or several clients. Every entry's
server (``off`` is ours at default flags; ``cpp-off`` the C++ llama-server's) is started
once and warmed up, then each repetition sends every entry, in turn (the order rotating
from repetition to repetition, so that drift falls on each alike):

* ``prompt``: a fresh prompt of ``prompt_tokens`` tokens (text of Python's standard
  library, a slice no earlier request held, ``cache_prompt`` off) and one token to
  generate; the figure is the server's own ``timings.prompt_per_second``;
* ``decode-N``: N clients at once, each a short fresh prompt and ``n_predict`` tokens at
  temperature 0; the figure is generated tokens over the wall time of the N requests.

Each cell's ratio to the reference entry is taken repetition by repetition and given
as the geometric mean ± its standard error, so that one slow moment of a shared
machine moves one pair, not the table.
"""
from __future__ import annotations

import math
import sys
import sysconfig
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from .matrix import Entry, running_servers
from .runners import _http, completion, run_clients

__all__ = ["SpeedRun", "corpus_tokens", "run_speed", "speed_markdown"]

#: the standard library's modules the prompts are cut from (plain text the bench model knows)
MODULES = ("argparse", "typing", "inspect", "dataclasses", "pathlib", "subprocess", "threading", "tarfile",
           "zipfile", "shutil", "logging/__init__", "email/message", "json/decoder", "http/client", "ftplib",
           "smtplib", "calendar", "textwrap", "difflib", "pickle")


def corpus_tokens(url: str, n: int) -> list[int]:
    """At least ``n`` token ids of standard-library text, tokenized by the server at ``url``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out: list[int] = []
    for name in MODULES:
        path = root / f"{name}.py"
        if not path.is_file():
            continue
        status, resp = _http(url + "/tokenize", {"content": path.read_text(errors="replace")}, timeout=120)
        if status != 200:
            raise RuntimeError(f"{url}/tokenize: HTTP {status}: {resp}")
        out += [t if isinstance(t, int) else t["id"] for t in resp["tokens"]]
        if len(out) >= n:
            break
    if len(out) < n:
        raise RuntimeError(f"speed: the standard library gave {len(out)} tokens, {n} were asked for")
    return out


def _arch(model: Path) -> str:
    import gguf

    return str(gguf.GGUFReader(str(model)).fields["general.architecture"].contents())


def _complete(url: str, prompt: list[int], n_predict: int, timeout: float) -> dict[str, Any]:
    return completion(url, {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "cache_prompt": False,
                            "stream": False}, timeout)


def _decode(url: str, prompts: Sequence[list[int]], n_predict: int, timeout: float) -> float:
    """Generated tokens per second of ``prompts`` sent at once, over their wall time."""
    outs, wall = run_clients(len(prompts), [lambda p=p: _complete(url, p, n_predict, timeout) for p in prompts], url)
    tokens = sum(int((o.get("timings") or {}).get("predicted_n", o.get("tokens_predicted", 0))) for o in outs)
    return tokens / wall if wall > 0 else 0.0


@dataclass
class SpeedRun:
    """Every cell's figures, by cell and entry, one per repetition."""

    cells: list[str]
    figures: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    def add(self, cell: str, entry: str, value: float) -> None:
        self.figures.setdefault(cell, {}).setdefault(entry, []).append(value)

    def best(self, cell: str, entry: str) -> float | None:
        v = self.figures.get(cell, {}).get(entry)
        return max(v) if v else None

    def paired(self, cell: str, a: str, b: str) -> tuple[float, float] | None:
        """Geometric mean of a/b repetition by repetition, and its standard error."""
        va, vb = self.figures.get(cell, {}).get(a), self.figures.get(cell, {}).get(b)
        if not va or not vb:
            return None
        logs = [math.log(x / y) for x, y in zip(va, vb) if x > 0 and y > 0]
        if not logs:
            return None
        m = sum(logs) / len(logs)
        se = (math.sqrt(sum((x - m) ** 2 for x in logs) / (len(logs) - 1) / len(logs)) if len(logs) > 1
              else float("nan"))
        return math.exp(m), math.exp(m) * se


def run_speed(entries: Sequence[Entry], model: Path, *, prompt_tokens: int = 4096, clients: Sequence[int] = (1, 4, 8),
              n_predict: int = 128, repeat: int = 3, llama_server: Path | None = None, threads: int | None = None,
              timeout: float = 1800.0, progress: bool = True) -> SpeedRun:
    """Every cell for every entry, ``repeat`` times (see the module)."""
    cells = ["prompt"] + [f"decode-{c}" for c in clients]
    run = SpeedRun(cells)
    names = [e.name for e in entries]
    n_ctx = max(8192, 2 * (prompt_tokens + 64))
    # llama-server caps a slot's context at the model's training context (the bench
    # model's is 1024): every server is told a longer one, the same for each
    entries = [replace(e, flags=(*e.flags, "--override-kv", f"{_arch(model)}.context_length=int:{n_ctx}"))
               for e in entries]
    short = 32  # the decode cells' prompt length: their time is the decoding's
    need = repeat * (prompt_tokens + short * sum(clients) * len(entries)) + prompt_tokens
    with running_servers(entries, model, llama_server, threads, n_ctx, timeout) as servers:
        corpus = corpus_tokens(servers[names[0]].url, need)
        pos = 0

        def take(n: int) -> list[int]:
            nonlocal pos
            if pos + n > len(corpus):
                pos = 0
            pos += n
            return corpus[pos - n:pos]

        for k in range(repeat):
            order = names[k % len(names):] + names[: k % len(names)]
            prompt = take(prompt_tokens)  # the same fresh prompt to every entry, new to each
            for name in order:
                t = _complete(servers[name].url, prompt, 1, timeout).get("timings") or {}
                pps = float(t.get("prompt_per_second") or 0.0)
                if not pps and t.get("prompt_ms"):
                    pps = 1000.0 * float(t.get("prompt_n", 0)) / float(t["prompt_ms"])
                run.add("prompt", name, pps)
                if progress:
                    print(f"speed: {k + 1}/{repeat} prompt of {len(prompt)} tokens {name}: {pps:.1f} tok/s",
                          file=sys.stderr)
            for c in clients:
                prompts = [take(short) for _ in range(c)]
                for name in order:
                    v = _decode(servers[name].url, prompts, n_predict, timeout)
                    run.add(f"decode-{c}", name, v)
                    if progress:
                        print(f"speed: {k + 1}/{repeat} decode, {c} client{'s' * (c > 1)} {name}: {v:.1f} tok/s",
                              file=sys.stderr)
    return run


def speed_markdown(run: SpeedRun, entries: Sequence[Entry], reference: str) -> str:
    """The best figure of each cell, and each entry's paired ratio to ``reference``."""
    names = [e.name for e in entries]
    head = "| entry | " + " | ".join(run.cells) + " |\n|---|" + "---:|" * len(run.cells)
    lines = ["best of the repetitions, tok/s (prompt: prompt tokens/s; decode-N: generated tokens/s of N clients)\n",
             head]
    for n in names:
        lines.append(f"| `{n}` | " + " | ".join(f"{run.best(c, n):.1f}" if run.best(c, n) else "–"
                                               for c in run.cells) + " |")
    lines += ["", f"paired with `{reference}` repetition by repetition: geometric mean ± standard error\n", head]
    for n in names:
        if n == reference:
            continue
        row = []
        for c in run.cells:
            p = run.paired(c, n, reference)
            row.append("–" if p is None else f"{p[0]:.3f}" + (f" ± {p[1]:.3f}" if p[1] == p[1] else ""))
        lines.append(f"| `{n}` x `{reference}` | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"
