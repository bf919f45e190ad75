"""The training corpus of the default model and its byte-level BPE tokenizer.

Pure Python (no torch, no ``regex``): the training script uses it to build the
corpus and the vocabulary and to tokenize the training text, and the tests use it
to check that llama.cpp tokenizes that text exactly the same way.

Corpus recipe (:func:`corpus_files`): the ``*.py`` files directly under the
running CPython's standard library directory (``sysconfig.get_paths()["stdlib"]``),
sorted by name, without the machine-specific ``_sysconfigdata*`` modules and
without files larger than ``max_file_bytes``; whole files are taken in that
order until ``budget_bytes`` is reached. The exact files depend on the CPython
version (the shipped model was trained on 3.11); :func:`corpus_digest` names the
text that was used.

Tokenizer: llama.cpp's ``gpt2`` tokenizer model with the ``gpt-2`` pre-tokenizer
(the GPT-2 split regex ``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+|
?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``), which :func:`pretokenize` reimplements
the way llama.cpp's ``unicode_regex_split_custom_gpt2`` does (same whitespace
set, same letter and number classes), then byte-level BPE merges applied by
rank inside each piece (:class:`BPETokenizer`).
"""
from __future__ import annotations

import hashlib
import heapq
import sysconfig
import unicodedata
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from ..tiny import bytes_to_unicode

#: llama.cpp's ``tokenizer.ggml.pre`` value for the GPT-2 split.
TOKENIZER_PRE = "gpt-2"

#: Corpus recipe of the shipped model.
CORPUS_BUDGET_BYTES = 450_000
CORPUS_MAX_FILE_BYTES = 24_000

# llama.cpp's unicode_set_whitespace (unicode-data.cpp): what its \s matches
_WHITESPACE = frozenset(
    [0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680]
    + list(range(0x2000, 0x200B))
    + [0x2028, 0x2029, 0x202F, 0x205F, 0x3000]
)

_W, _L, _N, _O = 1, 2, 3, 4  # whitespace, letter, number, other


def _kind(ch: str) -> int:
    cp = ord(ch)
    if cp < 128:
        return _ASCII_KIND[cp]
    if cp in _WHITESPACE:
        return _W
    cat = unicodedata.category(ch)[0]
    return _L if cat == "L" else _N if cat == "N" else _O


def _ascii_kind(cp: int) -> int:
    if cp in _WHITESPACE:
        return _W
    ch = chr(cp)
    if ch.isalpha():
        return _L
    if ch.isdigit():
        return _N
    return _O


_ASCII_KIND = [_ascii_kind(cp) for cp in range(128)]


def pretokenize(text: str) -> list[str]:
    """Split ``text`` the way llama.cpp's GPT-2 pre-tokenizer does."""
    out: list[str] = []
    n = len(text)
    kinds = [_kind(c) for c in text]
    pos = 0
    while pos < n:
        c = text[pos]
        # 's|'t|'re|'ve|'m|'ll|'d
        if c == "'" and pos + 1 < n:
            c1 = text[pos + 1]
            if c1 in "stmd":
                out.append(text[pos : pos + 2])
                pos += 2
                continue
            if pos + 2 < n and c1 + text[pos + 2] in ("re", "ve", "ll"):
                out.append(text[pos : pos + 3])
                pos += 3
                continue
        k2 = (kinds[pos + 1] if pos + 1 < n else 0) if c == " " else kinds[pos]
        if k2 in (_L, _N, _O):
            # <space>?\p{L}+ | <space>?\p{N}+ | <space>?[^\s\p{L}\p{N}]+
            start = pos
            pos += c == " "
            while pos < n and kinds[pos] == k2:
                pos += 1
            out.append(text[start:pos])
            continue
        nw = 0
        while pos + nw < n and kinds[pos + nw] == _W:
            nw += 1
        if nw > 1 and pos + nw < n:  # \s+(?!\S)
            out.append(text[pos : pos + nw - 1])
            pos += nw - 1
            continue
        if nw > 0:  # \s+
            out.append(text[pos : pos + nw])
            pos += nw
            continue
        out.append(text[pos])  # no match (a lone space at the very end is caught above)
        pos += 1
    return out


# ---------------------------------------------------------------------------
# corpus
# ---------------------------------------------------------------------------


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(budget_bytes: int = CORPUS_BUDGET_BYTES, max_file_bytes: int = CORPUS_MAX_FILE_BYTES,
                 root: Path | None = None) -> list[Path]:
    """The corpus's files, in order (see the module docstring for the recipe)."""
    root = stdlib_dir() if root is None else root
    out: list[Path] = []
    total = 0
    for p in sorted(root.glob("*.py"), key=lambda p: p.name):
        if p.name.startswith("_sysconfigdata"):
            continue
        size = len(p.read_bytes())
        if size > max_file_bytes:
            continue
        if total + size > budget_bytes:
            break
        out.append(p)
        total += size
    return out


#: Directories of the standard library the heads' data leaves out: tests, installed
#: third-party packages, caches, and two of data rather than code (codec tables,
#: pydoc's topic texts).
HEAD_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "encodings", "pydoc_data"}
)


def head_corpus_files(exclude: Iterable[str] = (), root: Path | None = None) -> list[Path]:
    """The heads' data (the default model's phase 2): every ``*.py`` of the standard
    library, packages included, sorted by path, without :data:`HEAD_EXCLUDED_DIRS`,
    the ``config-*`` directory, the ``_sysconfigdata*`` modules and the files named
    in ``exclude`` (paths relative to the library, ``/``-separated: the held-out
    evaluation modules, ``stepmtp.models.OUT_OF_CORPUS_FILES``)."""
    root = stdlib_dir() if root is None else root
    skip = set(exclude)
    out: list[Path] = []
    for p in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = p.relative_to(root)
        if rel.as_posix() in skip or p.name.startswith("_sysconfigdata"):
            continue
        if any(d in HEAD_EXCLUDED_DIRS or d.startswith("config-") for d in rel.parts[:-1]):
            continue
        out.append(p)
    return out


def read_corpus(files: Iterable[Path]) -> list[tuple[str, str]]:
    """``[(file name, text)]``; texts are decoded as UTF-8 with newlines kept as they are."""
    return [(p.name, p.read_bytes().decode("utf-8")) for p in files]


def corpus_digest(docs: Sequence[tuple[str, str]]) -> str:
    h = hashlib.sha256()
    for name, text in docs:
        h.update(name.encode() + b"\0" + text.encode("utf-8") + b"\0")
    return h.hexdigest()


# ---------------------------------------------------------------------------
# BPE
# ---------------------------------------------------------------------------

_B2U = bytes_to_unicode()


def _to_symbols(piece: str) -> tuple[str, ...]:
    return tuple(_B2U[b] for b in piece.encode("utf-8"))


def train_bpe(texts: Iterable[str], n_tokens: int) -> tuple[list[str], list[str]]:
    """Learn byte-level BPE merges until there are ``n_tokens`` distinct tokens.

    Returns ``(tokens, merges)``: ids ``0..255`` are the byte tokens (id == byte
    value, in GPT-2's printable spelling), then one token per merge in merge order
    (a merge whose result is already a token adds none). Pairs are ranked by count,
    ties broken by the pair's strings, so the result never depends on hash order.
    """
    words: Counter[str] = Counter()
    for text in texts:
        words.update(pretokenize(text))
    seqs: list[list[str]] = []
    freqs: list[int] = []
    for w in sorted(words):
        seqs.append(list(_to_symbols(w)))
        freqs.append(words[w])

    pair_count: Counter[tuple[str, str]] = Counter()
    where: dict[tuple[str, str], set[int]] = {}
    for i, s in enumerate(seqs):
        for a, b in zip(s, s[1:]):
            pair_count[(a, b)] += freqs[i]
            where.setdefault((a, b), set()).add(i)
    heap = [(-c, p) for p, c in pair_count.items()]
    heapq.heapify(heap)

    tokens = [_B2U[b] for b in range(256)]
    known = set(tokens)
    merges: list[str] = []
    while len(tokens) < n_tokens:
        if not heap:
            raise ValueError(f"corpus too small: {len(tokens)} of {n_tokens} tokens")
        negc, pair = heapq.heappop(heap)
        if pair_count.get(pair, 0) != -negc or negc == 0:
            continue  # stale entry
        a, b = pair
        merged = a + b
        merges.append(f"{a} {b}")
        if merged not in known:
            known.add(merged)
            tokens.append(merged)
        changed: set[tuple[str, str]] = set()
        for i in sorted(where.pop(pair, ())):
            s, f = seqs[i], freqs[i]
            for x, y in zip(s, s[1:]):
                pair_count[(x, y)] -= f
                changed.add((x, y))
            j, out = 0, []
            while j < len(s):
                if j + 1 < len(s) and s[j] == a and s[j + 1] == b:
                    out.append(merged)
                    j += 2
                else:
                    out.append(s[j])
                    j += 1
            seqs[i] = out
            for x, y in zip(out, out[1:]):
                pair_count[(x, y)] += f
                changed.add((x, y))
                where.setdefault((x, y), set()).add(i)
        for p in changed:
            c = pair_count.get(p, 0)
            if c > 0:
                heapq.heappush(heap, (-c, p))
            else:
                pair_count.pop(p, None)
    return tokens, merges


@dataclass
class BPETokenizer:
    """Byte-level BPE over :func:`pretokenize` pieces, as llama.cpp's BPE session applies it."""

    tokens: list[str]
    merges: list[str]
    bos_id: int | None = None

    def __post_init__(self) -> None:
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(self.merges)}
        self._cache: dict[str, list[int]] = {}

    def _bpe(self, piece: str) -> list[int]:
        got = self._cache.get(piece)
        if got is not None:
            return got
        sym = list(_to_symbols(piece))
        ranks = self.ranks
        while len(sym) > 1:
            best, best_i = None, -1
            for i in range(len(sym) - 1):
                r = ranks.get((sym[i], sym[i + 1]))
                if r is not None and (best is None or r < best):
                    best, best_i = r, i
            if best is None:
                break
            a, b = sym[best_i], sym[best_i + 1]
            # merge every occurrence of this pair, left to right
            out, i = [], 0
            while i < len(sym):
                if i + 1 < len(sym) and sym[i] == a and sym[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(sym[i])
                    i += 1
            sym = out
        ids = [self.ids[s] for s in sym]
        self._cache[piece] = ids
        return ids

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        out: list[int] = [self.bos_id] if add_bos and self.bos_id is not None else []
        for piece in pretokenize(text):
            out.extend(self._bpe(piece))
        return out

    def decode(self, ids: Iterable[int]) -> str:
        u2b = {u: b for b, u in _B2U.items()}
        data = bytearray()
        for i in ids:
            t = self.tokens[i]
            if t.startswith("<|") and t.endswith("|>"):
                continue
            data.extend(u2b[ch] for ch in t)
        return data.decode("utf-8", errors="replace")
