"""llama-server's n-gram drafters, by their ``--spec-type`` names and settings.

Each is a context proposer (``drafters.Proposer``): it proposes the tokens that
followed an earlier occurrence of the text just written. Their settings and defaults
are llama-server's (``--spec-ngram-*``, ``-lcs`` / ``-lcd``). What differs: llama-server
verifies the first drafter's draft as it is and never asks the MTP heads when an n-gram
drafter proposed something; here every proposal goes to the plan, which costs its rows
against the heads' drafts and takes the length that pays (so a 64-token proposal on a
CPU may be verified 24 tokens at a time), and a proposal is accepted by rejection
sampling when the request samples. Where llama.cpp's code does something its
documentation does not describe, we follow the documentation (noted per class).

* ``ngram-simple``: the most recent earlier occurrence of the last ``size_n`` tokens;
  its next ``size_m`` tokens (at least ``size_n`` of them).
* ``ngram-map-k``: the first occurrence of the last ``size_n`` tokens (a map from each
  n-gram to where it first occurred); its next tokens, as many as that key's last draft
  had accepted (``size_m`` at first).
* ``ngram-map-k4v``: the same, but up to four continuations are counted per n-gram
  (each occurrence once), and a continuation is proposed once the n-gram was seen
  ``min_hits`` times and it occurred at least twice as often as the others together.
* ``ngram-mod``: one pool of (hash of ``n_match`` tokens -> next token), 4M entries
  (16 MB), shared by the sequences of a pool; a draft chains lookups token by token,
  between ``n_min`` and ``n_max`` tokens (none when fewer than ``n_min`` resolve). The
  pool is cleared when a quarter of it is used, and after five drafts in a row
  accepted less than a quarter.
* ``ngram-cache``: counts of the tokens that followed each 1- to 4-gram of the sequence,
  with llama.cpp's lookup caches (``-lcs`` static, ``-lcd`` dynamic: files written by
  llama-lookup-create / llama-lookup, read at start), at most 8 tokens.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .context import ContextPool, ContextProposal

__all__ = ["NGRAM_TYPES", "NgramConfig", "make_ngram", "read_lookup_cache"]

NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")


@dataclass(frozen=True)
class NgramConfig:
    """llama-server's n-gram settings (``--spec-ngram-*``, ``-lcs``, ``-lcd``), its defaults."""

    simple_size_n: int = 12
    simple_size_m: int = 48
    simple_min_hits: int = 1
    map_k_size_n: int = 12
    map_k_size_m: int = 48
    map_k_min_hits: int = 1
    map_k4v_size_n: int = 12
    map_k4v_size_m: int = 48
    map_k4v_min_hits: int = 1
    mod_n_match: int = 24
    mod_n_min: int = 48
    mod_n_max: int = 64
    lookup_cache_static: str | None = None
    lookup_cache_dynamic: str | None = None


def _proposal(tokens: list[int], match: int, share: float = 1.0) -> ContextProposal | None:
    if not tokens:
        return None
    return ContextProposal(list(tokens), [match] * len(tokens), [share] * len(tokens))


class _Grams:
    """Where each n-gram of a growing token list occurs (positions of its first token)."""

    def __init__(self, tokens: list[int], n: int, first_only: bool = False) -> None:
        self.tokens, self.n, self.first_only = tokens, n, first_only
        self.at: dict[tuple[int, ...], list[int]] = {}
        self.upto = 0  # n-grams starting before this are indexed

    def update(self, end: int) -> None:
        """Index the n-grams that start before ``end``."""
        t, n = self.tokens, self.n
        for j in range(self.upto, end):
            key = tuple(t[j : j + n])
            lst = self.at.get(key)
            if lst is None:
                self.at[key] = [j]
            elif not self.first_only:
                lst.append(j)
        self.upto = max(self.upto, end)


class NgramSimple:
    """``ngram-simple`` (see the module). llama.cpp scans the whole history every
    round; an index of the n-grams gives the same occurrence."""

    name = "ngram-simple"

    def __init__(self, size_n: int, size_m: int) -> None:
        self.n, self.m = size_n, size_m

    def begin(self, tokens: list[int], pool: ContextPool | None) -> _Grams:
        return _Grams(tokens, self.n)

    def propose(self, g: _Grams, cap: int) -> ContextProposal | None:
        t, n = g.tokens, self.n
        L = len(t) - 1  # the history before id_last
        if L <= n + self.m + 1:
            return None
        g.update(L - n)
        for j in reversed(g.at.get(tuple(t[L - n + 1 :]), ())):
            if 1 <= j <= L - n - 1:
                copy = min(self.m, L - (j + n))
                if copy < n:
                    return None
                return _proposal(t[j + n : j + n + min(copy, cap)], n)
        return None

    def accepted(self, g: _Grams, n_drafted: int, n_accepted: int) -> None:
        pass

    def finish(self, g: _Grams) -> None:
        pass


class _MapState:
    def __init__(self, tokens: list[int], n: int) -> None:
        self.grams = _Grams(tokens, n, first_only=True)
        self.n_acc: dict[tuple[int, ...], int] = {}  # per key: the length its next draft may have
        self.counts: dict[tuple[int, ...], dict[tuple[int, ...], int]] = {}  # k4v: continuations
        self.counted: dict[tuple[int, ...], int] = {}  # k4v: occurrences counted up to
        self.hits: dict[tuple[int, ...], int] = {}
        self.last: tuple[int, ...] | None = None


class NgramMap:
    """``ngram-map-k`` and ``ngram-map-k4v`` (see the module). Differences from
    llama.cpp's code, which its documentation does not describe: a key whose draft was
    all rejected drafts one token next time, not none for good; k4v counts each
    occurrence once and copies the continuation it counted (llama.cpp copies the
    first occurrence's); ``min_hits`` counts lookups of the key, as llama.cpp."""

    def __init__(self, name: str, size_n: int, size_m: int, min_hits: int, values: bool) -> None:
        self.name, self.n, self.m, self.min_hits, self.values = name, size_n, size_m, min_hits, values

    def begin(self, tokens: list[int], pool: ContextPool | None) -> _MapState:
        return _MapState(tokens, self.n)

    def propose(self, st: _MapState, cap: int) -> ContextProposal | None:
        t, n, m = st.grams.tokens, self.n, self.m
        L = len(t) - 1
        st.last = None
        if L < 2 * n + m:
            return None
        st.grams.update(L - n - m)  # n-grams followed by m tokens and one more
        key = tuple(t[L - n + 1 :])
        where = st.grams.at.get(key)
        if not where:
            return None
        st.last = key
        length = min(m, st.n_acc.get(key, m), cap)
        if not self.values:
            j = where[0]
            return _proposal(t[j + n : j + n + length], n)
        st.hits[key] = st.hits.get(key, 0) + 1
        if st.hits[key] < self.min_hits:
            return None
        counts = st.counts.setdefault(key, {})
        # every occurrence of the key not counted yet (the map keeps the first: look again)
        done = st.counted.get(key, 0)
        for j in range(done, L - n - m):
            if tuple(t[j : j + n]) == key:
                val = tuple(t[j + n : j + n + m])
                if val in counts or len(counts) < 4:
                    counts[val] = counts.get(val, 0) + 1
        st.counted[key] = max(done, L - n - m)
        if not counts:
            return None
        best = max(counts, key=counts.__getitem__)
        rest = sum(counts.values()) - counts[best]
        if rest > 0 and counts[best] < 2 * rest:
            return None
        return _proposal(list(best[:length]), n, counts[best] / sum(counts.values()))

    def accepted(self, st: _MapState, n_drafted: int, n_accepted: int) -> None:
        if st.last is not None and n_drafted:
            st.n_acc[st.last] = max(1, n_accepted)

    def finish(self, st: _MapState) -> None:
        pass


class _ModPool:
    """ngram-mod's pool: 4M entries of (hash of n tokens -> the token after them)."""

    SIZE = 4 * 1024 * 1024
    EMPTY = -1

    def __init__(self) -> None:
        self.entries = np.full(self.SIZE, self.EMPTY, dtype=np.int32)
        self.used = 0

    @staticmethod
    def index(tokens: list[int], i: int, n: int) -> int:
        h = 0
        for tok in tokens[i : i + n]:
            h = (h * 6364136223846793005 + tok) & 0xFFFFFFFFFFFFFFFF
        return h % _ModPool.SIZE

    def add(self, tokens: list[int], i: int, n: int) -> None:
        k = self.index(tokens, i, n)
        if self.entries[k] == self.EMPTY:
            self.used += 1
        self.entries[k] = tokens[i + n]

    def reset(self) -> None:
        self.entries.fill(self.EMPTY)
        self.used = 0


class _ModState:
    def __init__(self, tokens: list[int], pool: _ModPool) -> None:
        self.tokens, self.pool = tokens, pool
        self.i_last = 0
        self.n_last = 0
        self.n_low = 0


class NgramMod:
    """``ngram-mod`` (see the module): one pool per context pool key (the server's API
    keys), 16 MB each."""

    name = "ngram-mod"
    OCCUPANCY = 0.25

    def __init__(self, n_match: int, n_min: int, n_max: int) -> None:
        self.n, self.n_min, self.n_max = n_match, n_min, n_max
        self._pools: dict[int, _ModPool] = {}

    def _pool(self, key: ContextPool | None) -> _ModPool:
        if key is None:  # no sharing: the sequence's own
            return _ModPool()
        return self._pools.setdefault(id(key), _ModPool())

    def begin(self, tokens: list[int], pool: ContextPool | None) -> _ModState:
        st = _ModState(tokens, self._pool(pool))
        S, n = len(tokens) - 1, self.n  # the prompt (its last token is id_last's place)
        if S < n:
            return st
        for i in range(0, S - n):
            st.pool.add(tokens, i, n)
        st.i_last = S - n
        if st.pool.used > self.OCCUPANCY * _ModPool.SIZE:
            st.pool.reset()
        return st

    def propose(self, st: _ModState, cap: int) -> ContextProposal | None:
        t, n, pool = st.tokens, self.n, st.pool
        L = len(t) - 1
        st.n_last = 0
        if L < n:
            return None
        if st.i_last + 32 < L:
            for i in range(st.i_last, L - n):
                pool.add(t, i, n)
            st.i_last = L - n
        window = list(t[L - n + 1 :])
        draft: list[int] = []
        for i in range(self.n_max):
            tok = int(pool.entries[pool.index(window, len(window) - n, n)])
            if tok == _ModPool.EMPTY:
                if i < self.n_min:
                    return None
                break
            draft.append(tok)
            window.append(tok)
        st.n_last = len(draft)
        return _proposal(draft[:cap], n)

    def accepted(self, st: _ModState, n_drafted: int, n_accepted: int) -> None:
        if not st.n_last:
            return
        if n_accepted < 0.25 * st.n_last:
            st.n_low += 1
            if st.n_low >= 5:
                st.pool.reset()
                st.n_low = 0
                st.i_last = 0
        else:
            st.n_low = 0

    def finish(self, st: _ModState) -> None:
        pass


# -- ngram-cache ------------------------------------------------------------------

NGRAM_MIN, NGRAM_MAX, NGRAM_STATIC = 1, 4, 2
#: (minimum samples, minimum percent of them) per n-gram size 1..4
LAX = ((2, 66), (2, 50), (1, 50), (1, 50))
STRICT = ((4, 75), (3, 66), (2, 66), (2, 66))
Cache = dict[tuple[int, ...], dict[int, int]]


def read_lookup_cache(path: str | Path) -> Cache:
    """A llama.cpp lookup cache file (llama-lookup-create / llama-lookup): records of an
    n-gram (4 int32, -1 padded), a count of following tokens, then (token, count) pairs;
    native-endian int32, no header. ValueError naming the file on a malformed one."""
    data = Path(path).read_bytes()
    out: Cache = {}
    i, n = 0, len(data)
    try:
        while i < n:
            gram = struct.unpack_from("=4i", data, i)
            (k,) = struct.unpack_from("=i", data, i + 16)
            i += 20
            if k <= 0:
                raise ValueError("a record with no tokens")
            pairs = struct.unpack_from(f"={2 * k}i", data, i)
            i += 8 * k
            key = tuple(x for x in gram if x != -1)
            d = out.setdefault(key, {})
            for tok, c in zip(pairs[::2], pairs[1::2]):
                if c <= 0:
                    raise ValueError("a count of zero or less")
                d[tok] = d.get(tok, 0) + c
    except (struct.error, ValueError) as e:
        raise ValueError(f"{path}: not a llama.cpp lookup cache ({e})") from None
    return out


class _CacheState:
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.context: Cache = {}
        self.upto = 0  # tokens counted as the continuation of their n-grams


class NgramCache:
    """``ngram-cache`` (see the module). llama.cpp counts only the n-grams inside each
    batch of new tokens (those crossing into the previous batch are never counted);
    here every n-gram ending in a new token is."""

    name = "ngram-cache"
    N_DRAFT = 8

    def __init__(self, static: str | None, dynamic: str | None) -> None:
        self.static = read_lookup_cache(static) if static else {}
        self.dynamic = read_lookup_cache(dynamic) if dynamic else {}

    def begin(self, tokens: list[int], pool: ContextPool | None) -> _CacheState:
        return _CacheState(tokens)

    def _update(self, st: _CacheState) -> None:
        t = st.tokens
        for i in range(max(st.upto, 1), len(t)):
            for k in range(NGRAM_MIN, min(NGRAM_MAX, i) + 1):
                d = st.context.setdefault(tuple(t[i - k : i]), {})
                d[t[i]] = d.get(t[i], 0) + 1
        st.upto = len(t)

    def _try(self, cache: Cache, seq: list[int], part_static: dict[int, int], rule) -> int:
        for k in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
            if len(seq) < k:
                continue
            part = cache.get(tuple(seq[-k:]))
            if not part:
                continue
            best, score, total = -1, -1, 0
            for tok, c in part.items():
                total += c
                s = c * (100 * part_static[tok] if tok in part_static else 1)
                if s > score:
                    best, score = tok, s
            min_n, pct = rule[k - 1]
            if total >= min_n and 100 * part[best] >= pct * total:
                return best
        return -1

    def propose(self, st: _CacheState, cap: int) -> ContextProposal | None:
        self._update(st)
        seq = list(st.tokens)
        if len(seq) < 2:
            return None
        draft: list[int] = []
        while len(draft) < min(self.N_DRAFT, cap):
            part_static = self.static.get(tuple(seq[-NGRAM_STATIC:]), {})
            tok = self._try(st.context, seq, part_static, LAX)
            if tok < 0:
                tok = self._try(self.dynamic, seq, part_static, STRICT)
            if tok < 0 and part_static:
                top = max(part_static, key=part_static.__getitem__)
                total = sum(part_static.values())
                tok = top if total >= 2 and 100 * part_static[top] >= 50 * total else -1
            if tok < 0:
                break
            draft.append(tok)
            seq.append(tok)
        return _proposal(draft, 4)

    def accepted(self, st: _CacheState, n_drafted: int, n_accepted: int) -> None:
        pass

    def finish(self, st: _CacheState) -> None:
        pass


def make_ngram(name: str, cfg: NgramConfig | None):
    cfg = cfg or NgramConfig()
    if name == "ngram-simple":
        return NgramSimple(cfg.simple_size_n, cfg.simple_size_m)
    if name == "ngram-map-k":
        return NgramMap(name, cfg.map_k_size_n, cfg.map_k_size_m, cfg.map_k_min_hits, values=False)
    if name == "ngram-map-k4v":
        return NgramMap(name, cfg.map_k4v_size_n, cfg.map_k4v_size_m, cfg.map_k4v_min_hits, values=True)
    if name == "ngram-mod":
        return NgramMod(cfg.mod_n_match, cfg.mod_n_min, cfg.mod_n_max)
    if name == "ngram-cache":
        return NgramCache(cfg.lookup_cache_static, cfg.lookup_cache_dynamic)
    raise ValueError(f"unknown n-gram drafter {name!r}")
