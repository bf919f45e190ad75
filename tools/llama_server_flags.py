#!/usr/bin/env python3
"""llama-server's flags, read from a llama.cpp tree's ``common/arg.cpp``.

    python tools/llama_server_flags.py PATH/TO/llama.cpp > tests/data/llama_server_flags.txt

Each ``add_opt(common_arg(...))`` whose examples include the server (or the common
set, unless the server is excluded) is one line, tab-separated:

    spellings    negated spellings    value hint(s)    environment variable

with ``-`` for an empty field and spellings comma-separated. A flag defined twice (``-np``
has a server and a non-server definition) keeps its first server definition. Preset-only
options are left out: they are not command-line flags. The test that walks the list
(``tests/test_server_flags.py``) and the docs table (``tools/server_flags_doc.py``) read
the committed file, so the tree is needed only to regenerate it.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

HEADER = "# llama-server's flags: spellings\tnegated\tvalue\tenv (tools/llama_server_flags.py, {source})\n"


def _skip_literal(src: str, j: int) -> int:
    """Past the string or char literal starting at src[j] (a raw string R"(...)" too)."""
    if src[j] == "'":  # '"', '\\''
        return src.index("'", j + 3 if src[j + 1] == "\\" else j + 2) + 1
    if src[j - 1] == "R" and src[j + 1] == "(":
        return src.index(')"', j) + 2
    j += 1
    while src[j] != '"':
        j += 2 if src[j] == "\\" else 1
    return j + 1


def _scan(src: str, j: int, stop: str) -> int:
    """From src[j], the index of the first character of ``stop`` at bracket depth 0
    (a closing bracket that ends the enclosing one counts as depth 0's), literals skipped."""
    depth = 0
    while j < len(src):
        c = src[j]
        if c in "\"'":
            j = _skip_literal(src, j)
            continue
        if depth == 0 and c in stop:
            return j
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        j += 1
    return j


def _calls(src: str) -> list[tuple[str, str]]:
    """(the arguments, the method chain) of every ``add_opt(common_arg(ARGS)CHAIN);``."""
    out = []
    for m in re.finditer(r"\badd_opt\(common_arg\(", src):
        end_args = _scan(src, m.end(), ")")
        end_call = _scan(src, end_args + 1, ")")
        out.append((src[m.end():end_args], src[end_args + 1:end_call]))
    return out


def _strip_comments(src: str) -> str:
    """src without // and /* */ comments (an apostrophe in one would open a char literal)."""
    out, j = [], 0
    while j < len(src):
        c = src[j]
        if c in "\"'":
            k = _skip_literal(src, j)
            out.append(src[j:k])
            j = k
        elif src.startswith("//", j):
            j = src.find("\n", j)
            j = len(src) if j < 0 else j
        elif src.startswith("/*", j):
            j = src.index("*/", j) + 2
        else:
            out.append(c)
            j += 1
    return "".join(out)


def _split_top(s: str) -> list[str]:
    """s split at its top-level commas (literals, brackets and lambdas kept whole)."""
    parts, j = [], 0
    while j <= len(s):
        k = _scan(s, j, ",")
        parts.append(s[j:k].strip())
        j = k + 1
    return parts


def _strings(s: str) -> list[str]:
    return re.findall(r'"((?:[^"\\]|\\.)*)"', s)


def _examples(chain: str, name: str, named: dict[str, list[str]]) -> list[str] | None:
    m = re.search(r"\.%s\((\{[^}]*\}|\w+)\)" % name, chain)
    if m is None:
        return None
    arg = m.group(1)
    return named[arg] if not arg.startswith("{") else re.findall(r"LLAMA_EXAMPLE_\w+", arg)


def parse(src: str) -> list[tuple[list[str], list[str], list[str], str]]:
    """(spellings, negated spellings, value hints, env) of every server flag, in order."""
    named = {m.group(1): re.findall(r"LLAMA_EXAMPLE_\w+", m.group(2))
             for m in re.finditer(r"initializer_list<enum llama_example>\s+(\w+)\s*=\s*\{([^}]*)\}", src)}
    rows, seen = [], set()
    for arg_text, chain in _calls(src):
        args = _split_top(arg_text)
        if ".set_preset_only()" in chain:
            continue
        examples = _examples(chain, "set_examples", named) or ["LLAMA_EXAMPLE_COMMON"]
        excludes = _examples(chain, "set_excludes", named) or []
        if not {"LLAMA_EXAMPLE_SERVER", "LLAMA_EXAMPLE_COMMON"} & set(examples) or "LLAMA_EXAMPLE_SERVER" in excludes:
            continue
        names = _strings(args[0])
        neg: list[str] = []
        hints: list[str] = []
        if len(args) == 4 and args[1].startswith("{"):  # (args, args_neg, help, handler(bool))
            neg = _strings(args[1])
        elif len(args) == 4:  # (args, value_hint, help, handler); a hint computed: its expression
            hints = _strings(args[1]) or [args[1]]
        elif len(args) == 5:  # (args, value_hint, value_hint_2, help, handler)
            hints = _strings(args[1]) + _strings(args[2])
        env_m = re.search(r'\.set_env\("([^"]+)"\)', chain)
        if names[0] in seen:
            continue
        seen.update(names)
        rows.append((names, neg, hints, env_m.group(1) if env_m else ""))
    return rows


def render(rows: list[tuple[list[str], list[str], list[str], str]], source: str) -> str:
    lines = [HEADER.format(source=source)]
    for names, neg, hints, env in rows:
        lines.append("\t".join([",".join(names), ",".join(neg) or "-", " ".join(hints) or "-", env or "-"]) + "\n")
    return "".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    tree = Path(argv[0])
    src = _strip_comments((tree / "common" / "arg.cpp").read_text(encoding="utf-8"))
    # the header names the sdist the tree came from (llama_cpp_python-X.Y.Z/vendor/llama.cpp)
    source = next((p for p in tree.resolve().parts if p.startswith("llama_cpp_python-")), tree.name)
    sys.stdout.write(render(parse(src), f"{source}: common/arg.cpp"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
