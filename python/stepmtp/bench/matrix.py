"""``--matrix``: MTP against no MTP where users run it, through the server at its default flags.

Rows are sampling temperatures, columns the number of concurrent clients; in each
cell every *entry* (a server with its own flags, started afresh for each cell of each pass,
so that nothing an earlier cell wrote can be drafted from) runs the whole prompt
set, and the cell's figure is the aggregate tokens per second (generated tokens / wall
time, prompts included). The entries take turns group by group: ``clients`` prompts
sent at once to one entry, the same prompts to the next, and so on, the entries' order
rotating from group to group; an entry's pass is its groups' tokens over their wall
times summed, and each entry keeps its best pass. A shared machine's speed drifts
10-40% within minutes (the 2-core VM this was built on), and whole passes in turns
(half a minute each) gave each entry a different minute: the same code's ratio to
``off`` moved by 0.1-0.2 from run to run. Groups in turns put every entry within
seconds of the others. A group ends when its last request does, as a batch of an
agent's parallel calls would; the next group's clients start together. Besides the
best passes' ratios, each cell has the ratios group by group (``Cell.paired``: their
geometric mean and its standard error over every repeat's groups), which say whether a
ratio near 1 is above or below it, where two best passes cannot.

Every server gets ``-m MODEL -c 4096`` (the bench-size model's own context, 1024
positions, would be shared by the 4 slots of ``-np`` auto), ``-t`` when given, and,
entry by entry:

* ``off``: no more (llama-server's default, no drafting);
* ``mtp``: ``... --spec-type draft-mtp`` and nothing else: the draft length the server
  chooses by itself each round;
* ``n1`` .. ``n3``: a fixed draft length (``--spec-draft-n-max N --spec-draft-n-min N``),
  drafts drawn as the default's are;
* ``n3-raw``: ``--no-spec-adaptive``, the default before the draft length was chosen:
  3 drafts every round, drawn from the heads' distribution as it is (the acceptance
  before ``sampling.DraftShaper``);
* ``cpp-off``, ``cpp-mtp``: the C++ llama-server (``--llama-server PATH``), plain and with
  its MTP drafting at n-max 3.

Requests are ``POST /completion`` with the temperature of the row, llama-server's other
sampling defaults, no seed (as agents send them; a request with a seed is verified by
exact match, so that its text is plain sampling's), and no prompt cache (each prompt
decoded in full, by every entry alike). At temperature 0 each text must equal ``off``'s, and under
load each text must equal the text the same entry wrote for one client: exit 3 when not.
"""
from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from .prompts import Prompt
from .runners import ServerProcess, _http, completion, run_clients

__all__ = ["Entry", "Cell", "Run", "turns", "ENTRIES", "parse_entries", "run_matrix", "running_servers", "markdown", "write_heatmap", "check_texts"]

DEFAULT_TEMPS = (0.0, 0.7, 1.0)
DEFAULT_CLIENTS = (1, 2, 4, 8)


@dataclass(frozen=True)
class Entry:
    """A server and the flags it runs with, beyond ``-m`` (and ``-t`` when given)."""

    name: str
    flags: tuple[str, ...]
    cpp: bool = False
    what: str = ""

    @property
    def mtp(self) -> bool:
        return "draft-mtp" in self.flags


def _fixed(n: int) -> Entry:
    return Entry(f"n{n}", ("--spec-type", "draft-mtp", "--spec-draft-n-max", str(n), "--spec-draft-n-min", str(n)),
                 what=f"MTP, {n} drafted every round")


ENTRIES: dict[str, Entry] = {
    "off": Entry("off", (), what="no MTP (the server's default)"),
    "mtp": Entry("mtp", ("--spec-type", "draft-mtp"), what="MTP at default flags (the draft length chosen each round)"),
    **{f"n{n}": _fixed(n) for n in (1, 2, 3)},
    "n3-raw": Entry("n3-raw", ("--spec-type", "draft-mtp", "--no-spec-adaptive"),
                    what="MTP n-max 3 as it was: every round 3 drafts, drawn from the heads' own distribution"),
    "mtp-noctx": Entry("mtp-noctx", ("--spec-type", "draft-mtp", "--no-spec-context"),
                       what="MTP at default flags without context drafting (the heads alone)"),
    "ngram": Entry("ngram", ("--spec-type", "ngram-mod,draft-mtp", "--spec-draft-n-max", "3"),
                   what="llama-server's line for its n-gram drafter before MTP n-max 3, on this server"),
    "cpp-off": Entry("cpp-off", (), cpp=True, what="C++ llama-server, no MTP"),
    "cpp-ngram": Entry("cpp-ngram", ("--spec-type", "ngram-mod,draft-mtp", "--spec-draft-n-max", "3"), cpp=True,
                       what="C++ llama-server (MTP3 merged), its n-gram drafter before MTP n-max 3"),
    "cpp-mtp": Entry("cpp-mtp", ("--spec-type", "draft-mtp", "--spec-draft-n-max", "3"), cpp=True,
                     what="C++ llama-server (MTP3 merged), MTP n-max 3"),
}
DEFAULT_ENTRIES = ("off", "mtp", "n1", "n2", "n3")


def parse_entries(text: str, cpp: bool) -> list[Entry]:
    names = [n.strip() for n in text.split(",") if n.strip()] if text else list(DEFAULT_ENTRIES)
    if cpp and not text:
        names += ["cpp-off", "cpp-mtp"]
    bad = [n for n in names if n not in ENTRIES]
    if bad:
        raise ValueError(f"unknown matrix entries {', '.join(bad)} (known: {', '.join(ENTRIES)})")
    if any(ENTRIES[n].cpp for n in names) and not cpp:
        raise ValueError("cpp-* entries need --llama-server PATH")
    if "off" not in names:
        names.insert(0, "off")
    return [ENTRIES[n] for n in dict.fromkeys(names)]


@dataclass
class Run:
    """One entry's pass over the prompt set in one cell."""

    wall_s: float
    tokens: int
    drafted: int
    accepted: int
    texts: list[str]

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @classmethod
    def joined(cls, parts: Sequence["Run"]) -> "Run":
        """One pass from its groups, run one after another."""
        return cls(sum(r.wall_s for r in parts), sum(r.tokens for r in parts), sum(r.drafted for r in parts),
                   sum(r.accepted for r in parts), [t for r in parts for t in r.texts])


def turns(n_prompts: int, clients: int, names: Sequence[str]) -> list[tuple[str, range]]:
    """A cell's pass in the order it runs: (entry, the prompts it is sent at once), every
    entry a group's prompts in turn, the order rotating from group to group."""
    order, out = list(names), []
    for i in range(0, n_prompts, clients):
        group = range(i, min(i + clients, n_prompts))
        out += [(n, group) for n in order]
        order = order[1:] + order[:1]
    return out


@dataclass
class Cell:
    temperature: float
    clients: int
    #: entry name -> its passes, one per repeat, each its groups' runs in the order they
    #: ran: the same indices are the same prompts, sent within seconds to each entry (``turns``)
    passes: dict[str, list[list[Run]]] = field(default_factory=dict)

    def joined(self, name: str) -> list[Run]:
        """The entry's passes, each joined into one run."""
        return [Run.joined(p) for p in self.passes.get(name, [])]

    @property
    def runs(self) -> dict[str, list[Run]]:
        return {n: self.joined(n) for n in self.passes}

    def best(self, name: str) -> Run | None:
        rs = self.joined(name)
        return max(rs, key=lambda r: r.tok_s) if rs else None

    def tok_s(self, name: str) -> float | None:
        b = self.best(name)
        return b.tok_s if b else None

    def ratio(self, name: str, to: str = "off") -> float | None:
        a, b = self.tok_s(name), self.tok_s(to)
        return a / b if a and b else None

    def paired(self, name: str, to: str = "off") -> tuple[float, float, int] | None:
        """The geometric mean of ``name``'s tok/s over ``to``'s, group by group, its
        standard error (of the log, about the relative error) and the groups it is of.
        The best passes' ratio compares two maxima of noisy passes, which moved by 0.05-0.1
        from run to run on the 2-core VM; the groups were sent to both within seconds."""
        a, b = self.passes.get(name) or [], self.passes.get(to) or []
        logs = [math.log(x.tok_s / y.tok_s) for pa, pb in zip(a, b) for x, y in zip(pa, pb)
                if x.tok_s > 0 and y.tok_s > 0]
        if not logs:
            return None
        m = sum(logs) / len(logs)
        se = (sum((v - m) ** 2 for v in logs) / (len(logs) - 1) / len(logs)) ** 0.5 if len(logs) > 1 else float("nan")
        return math.exp(m), se, len(logs)

    def accept(self, name: str) -> float | None:
        rs = self.joined(name)
        d = sum(r.drafted for r in rs)
        return sum(r.accepted for r in rs) / d if d else None

    def to_dict(self) -> dict[str, Any]:
        def paired(n: str, to: str) -> dict[str, Any] | None:
            p = self.paired(n, to)
            return {"ratio": p[0], "se": p[1] if p[1] == p[1] else None, "groups": p[2]} if p else None

        return {"temperature": self.temperature, "clients": self.clients,
                "entries": {n: {"tok_s": self.tok_s(n), "x_off": self.ratio(n), "accept": self.accept(n),
                                "paired_x_off": paired(n, "off"),
                                **({"paired_x_cpp_mtp": paired(n, "cpp-mtp")}
                                   if "cpp-mtp" in self.runs and n != "cpp-mtp" else {}),
                                "runs": [{"wall_s": r.wall_s, "tokens": r.tokens, "drafted": r.drafted,
                                          "accepted": r.accepted} for r in rs]}
                            for n, rs in self.runs.items()}}


def _request(url: str, p: Prompt, temperature: float, timeout: float) -> dict[str, Any]:
    return completion(url, {"prompt": p.prompt, "n_predict": p.n_predict, "temperature": temperature,
                            "cache_prompt": False, "stream": False}, timeout)


def _drive(url: str, prompts: Sequence[Prompt], temperature: float, clients: int, timeout: float) -> Run:
    outs, wall = run_clients(clients, [lambda p=p: _request(url, p, temperature, timeout) for p in prompts], url)
    tokens = drafted = accepted = 0
    texts = []
    for o in outs:
        t = o.get("timings") or {}
        tokens += int(t.get("predicted_n", o.get("tokens_predicted", 0)))
        drafted += int(t.get("draft_n", 0))
        accepted += int(t.get("draft_n_accepted", 0))
        texts.append(o.get("content", ""))
    return Run(wall, tokens, drafted, accepted, texts)


#: the servers' context: the bench-size model was trained on 1024 positions, which the
#: default -c 0 would give to all 4 slots together; a real model's slots have room to spare
MATRIX_CTX = 4096


def _argv(e: Entry, model: Path, llama_server: Path | None, threads: int | None, n_ctx: int) -> list[str]:
    exe = [str(llama_server)] if e.cpp else [sys.executable, "-m", "stepmtp.server"]
    return [*exe, "-m", str(model), "-c", str(n_ctx), *(["-t", str(threads)] if threads else []), *e.flags]


def run_matrix(prompts: Sequence[Prompt], entries: Sequence[Entry], model: Path, *,
               temps: Sequence[float] = DEFAULT_TEMPS, clients: Sequence[int] = DEFAULT_CLIENTS,
               repeat: int = 1, llama_server: Path | None = None, threads: int | None = None,
               n_ctx: int = MATRIX_CTX, timeout: float = 1800.0,
               progress: bool = True) -> tuple[list[Cell], dict[str, Any]]:
    """Every cell of temps x clients; the cells and what each server reported of itself
    (``/props``). Every cell of every pass gets fresh servers: the prompts repeat from
    cell to cell and pass to pass, and a server that drafts from earlier requests (ours
    by default, the C++ server's ngram-mod) would copy the text it wrote for them, where
    the matrix measures text seen for the first time."""
    cells = [Cell(t, c) for t in temps for c in clients]
    props: dict[str, Any] = {}
    names = [e.name for e in entries]
    for k in range(repeat):
        first = names[k % len(names):] + names[: k % len(names)]  # who starts moves on each pass
        for cell in cells:
            with running_servers(entries, model, llama_server, threads, n_ctx, timeout, props) as servers:
                parts: dict[str, list[Run]] = {n: [] for n in names}
                for name, group in turns(len(prompts), cell.clients, first):
                    parts[name].append(_drive(servers[name].url, [prompts[i] for i in group], cell.temperature,
                                              cell.clients, timeout))
            for name in names:
                cell.passes.setdefault(name, []).append(parts[name])
                run = Run.joined(parts[name])
                if progress:
                    acc = f", accept {run.accepted / run.drafted:.2f}" if run.drafted else ""
                    print(f"matrix: pass {k + 1}/{repeat} t={cell.temperature:g} clients={cell.clients} "
                          f"{name}: {run.tok_s:.1f} tok/s{acc}", file=sys.stderr)
    return cells, props


#: the warm-up request's prompt: none of the bench's, so that a server's pool holds
#: nothing of them
WARM_UP = Prompt("warm-up", "The quick brown fox jumps over the lazy dog.\n", 8)


@contextlib.contextmanager
def running_servers(entries: Sequence[Entry], model: Path, llama_server: Path | None, threads: int | None,
                    n_ctx: int, timeout: float, props: dict[str, Any] | None = None
                    ) -> Iterator[dict[str, ServerProcess]]:
    """Every entry's server, started and warmed up (buffers allocated, pages faulted
    in), by entry name; all closed when the block ends. ``props`` gets each one's
    ``/props`` the first time."""
    servers: dict[str, ServerProcess] = {}
    try:
        for e in entries:
            s = servers[e.name] = ServerProcess(_argv(e, model, llama_server, threads, n_ctx), label=e.name)
            s.start()
            if props is not None and e.name not in props:
                status, p = _http(s.url + "/props", timeout=30)
                props[e.name] = {"argv": s.argv, "props": p if status == 200 else None}
            _request(s.url, WARM_UP, 0.0, timeout)
        yield servers
    finally:
        for s in servers.values():
            s.close()


def check_texts(cells: Sequence[Cell], entries: Sequence[Entry]) -> list[str]:
    """What went wrong with the texts: at temperature 0 every stepmtp entry must write
    ``off``'s texts; under load every entry its own one-client texts (at temperature 0)."""
    bad = []
    for c in cells:
        if c.temperature > 0:
            continue
        ref = c.best("off")
        for e in entries:
            b = c.best(e.name)
            if b is None or e.cpp:
                continue
            for rs in c.runs[e.name]:
                if ref is not None and rs.texts != ref.texts:
                    bad.append(f"t=0 clients={c.clients}: {e.name} differs from off")
                    break
        alone = next((x for x in cells if x.temperature == c.temperature and x.clients == 1), None)
        if alone is None or c.clients == 1:
            continue
        for e in entries:
            if e.cpp or e.name not in c.runs or e.name not in alone.runs:
                continue
            if c.best(e.name).texts != alone.best(e.name).texts:
                bad.append(f"t=0 clients={c.clients}: {e.name} differs from its one-client texts")
    return bad


def markdown(cells: Sequence[Cell], entries: Sequence[Entry]) -> str:
    temps = sorted({c.temperature for c in cells})
    clients = sorted({c.clients for c in cells})
    by = {(c.temperature, c.clients): c for c in cells}
    lines = []
    cpp = "cpp-mtp" in {e.name for e in entries}
    for t in temps:
        lines.append(f"**temperature {t:g}**: aggregate tok/s (x `off`; acceptance)\n")
        lines.append("| entry | " + " | ".join(f"{n} client{'s' if n > 1 else ''}" for n in clients) + " |")
        lines.append("|---|" + "---:|" * len(clients))
        for e in entries:
            row = []
            for n in clients:
                c = by.get((t, n))
                v = c.tok_s(e.name) if c else None
                if v is None:
                    row.append("–")
                    continue
                r, a = c.ratio(e.name), c.accept(e.name)
                txt = f"{v:.1f}"
                if e.name != "off" and r is not None:
                    txt += f" ({r:.2f}x" + (f"; {a:.2f}" if a is not None else "") + ")"
                row.append(txt)
            lines.append(f"| `{e.name}` | " + " | ".join(row) + " |")
        if cpp:
            row = []
            for n in clients:
                c = by.get((t, n))
                r = c.ratio("mtp", "cpp-mtp") if c else None
                row.append(f"{r:.2f}x" if r else "–")
            lines.append("| `mtp` x `cpp-mtp` | " + " | ".join(row) + " |")
        lines.append("")
        # the same ratios group by group (``Cell.paired``): what the noise leaves of them
        pairs = [(e.name, "off") for e in entries if e.name != "off"] + ([("mtp", "cpp-mtp")] if cpp else [])
        lines.append(f"temperature {t:g}, paired: geometric mean of the groups' ratios ± standard error\n")
        lines.append("| ratio | " + " | ".join(f"{n} client{'s' if n > 1 else ''}" for n in clients) + " |")
        lines.append("|---|" + "---:|" * len(clients))
        for a, b in pairs:
            row = []
            for n in clients:
                c = by.get((t, n))
                p = c.paired(a, b) if c else None
                row.append("–" if p is None else f"{p[0]:.3f}" + (f" ± {p[1]:.3f}" if p[1] == p[1] else ""))
            lines.append(f"| `{a}` x `{b}` | " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


def write_heatmap(cells: Sequence[Cell], entries: Sequence[Entry], path: str | Path) -> str | None:
    """A PNG: per temperature, entries x clients, coloured by tok/s relative to ``off``
    (red below 1, blue above); None when written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import TwoSlopeNorm
    except ImportError:
        return "no heat-map: matplotlib is not installed (pip install 'stepmtp[bench]')"
    temps = sorted({c.temperature for c in cells})
    clients = sorted({c.clients for c in cells})
    by = {(c.temperature, c.clients): c for c in cells}
    names = [e.name for e in entries if e.name != "off"]
    fig, axes = plt.subplots(1, len(temps), figsize=(3.2 * len(temps) + 1, 0.5 * len(names) + 1.6), squeeze=False)
    norm = TwoSlopeNorm(vmin=0.5, vcenter=1.0, vmax=1.5)
    im = None
    for ax, t in zip(axes[0], temps):
        grid = [[(by[(t, n)].ratio(m) if (t, n) in by else None) or float("nan") for n in clients] for m in names]
        im = ax.imshow(grid, cmap="RdBu", norm=norm, aspect="auto")
        ax.set_xticks(range(len(clients)), [str(n) for n in clients])
        ax.set_yticks(range(len(names)), names)
        ax.set_xlabel("concurrent clients")
        ax.set_title(f"temperature {t:g}")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if v == v:
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=axes[0].tolist(), label="aggregate tok/s / MTP off")
    # above the panels' own titles (at the default height they overlap)
    fig.suptitle("stepmtp.server at default flags: tok/s relative to MTP off", y=1.04)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return None
