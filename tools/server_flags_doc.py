#!/usr/bin/env python3
"""docs/server.md's table of llama-server's flags that differ here, from the flag list
(``tests/data/llama_server_flags.txt``) and ``stepmtp.server.flags``' tables.

    python tools/server_flags_doc.py          # rewrite the table in docs/server.md
    python tools/server_flags_doc.py --check  # exit 1 if the committed table differs

The table sits between ``<!-- flags:begin -->`` and ``<!-- flags:end -->``; a test
(``tests/test_server_flags.py``) runs the check, so the docs cannot drift from the code.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLAGS = ROOT / "tests" / "data" / "llama_server_flags.txt"
DOC = ROOT / "docs" / "server.md"
BEGIN, END = "<!-- flags:begin -->", "<!-- flags:end -->"


def table() -> str:
    from stepmtp.server.flags import ACCEPTED, REFUSED

    what = {n: ("accepted, no effect", c.reason) for c in ACCEPTED for n in c.names}
    what.update({n: ("refused at start", c.reason) for c in REFUSED for n in c.names})
    lines = ["| llama-server flag | here | why |", "|---|---|---|"]
    n_all = n_same = 0
    for line in FLAGS.read_text().splitlines():
        if line.startswith("#"):
            continue
        names, neg = line.split("\t")[:2]
        spellings = names.split(",") + ([] if neg == "-" else neg.split(","))
        n_all += len(spellings)
        groups: dict[tuple[str, str], list[str]] = {}
        for s in spellings:
            if s in what:
                groups.setdefault(what[s], []).append(s)
            else:
                n_same += 1
        for (kind, why), flags in groups.items():
            lines.append(f"| {', '.join(f'`{s}`' for s in flags)} | {kind} | {why.replace('|', '/')} |")
    head = (f"Of llama-server's {n_all} flag spellings (0.3.36's `--help`), {n_same} do here what they do "
            f"there; the others:\n\n")
    return head + "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    text = DOC.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    new = text[:start] + "\n" + table() + text[end:]
    if argv == ["--check"]:
        return 0 if new == text else 1
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "python"))
    raise SystemExit(main(sys.argv[1:]))
