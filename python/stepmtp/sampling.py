"""Token sampling in numpy, with llama.cpp's settings and order.

The target's sampler (``Sampler``) applies llama.cpp's chain, in llama-server's order
(``samplers``, by default: logit bias, repetition penalties, top-n-sigma, top-k,
typical-p, top-p, min-p, XTC, temperature with its dynamic range), then a seeded draw;
at temperature <= 0 it is greedy (argmax after the bias and penalties) unless a sampler
before the temperature can drop the most likely token (typical-p, XTC) or dynamic
temperature widens it. Draft tokens are picked
as llama-server's MTP drafter does (``draft_pick``): the most likely token, with its
probability among the 10 best, which ``p_min`` is compared against; or, for
rejection sampling, drawn from the head's distribution under the request's own
settings (``Sampler.dense``), and verified by ``verify_rejection``.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import numpy as np

__all__ = ["SamplingParams", "Sampler", "TokenProbs", "DraftShaper", "draft_pick", "verify_rejection", "raw_probs",
           "DEFAULT_SAMPLERS", "parse_samplers"]

DRAFT_TOP_K = 10

#: llama-server's default sampler order (``--samplers``); "dry" is a no-op here (DRY
#: is refused when turned on)
DEFAULT_SAMPLERS: tuple[str, ...] = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
                                     "temperature")
#: the names llama.cpp knows but this sampler does not implement
UNSUPPORTED_SAMPLERS = ("infill", "adaptive_p")
_CANONICAL = (*DEFAULT_SAMPLERS, *UNSUPPORTED_SAMPLERS)
_CHARS = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p", "p": "top_p", "m": "min_p",
          "x": "xtc", "t": "temperature", "i": "infill", "a": "adaptive_p"}
_ALIASES = {**{c: c for c in _CANONICAL}, **{c.replace("_", "-"): c for c in _CANONICAL if "_" in c},
            **{c.replace("_", ""): c for c in _CANONICAL if "_" in c},
            "nucleus": "top_p", "temp": "temperature", "typ": "typ_p"}


def parse_samplers(value: "str | Sequence[str]", *, chars: bool = False) -> tuple[str, ...]:
    """llama.cpp's sampler order from names (a list, or one string of names separated by
    ``;`` as ``--samplers`` takes; aliases such as ``top-k``, ``topk``, ``nucleus``,
    ``temp`` accepted, any case) or, ``chars``, from a string of its one-letter codes
    (``"edskypmxt"``, as ``--sampler-seq`` and a request's ``samplers`` string).
    Unknown names are dropped, as llama.cpp drops them (with a warning there)."""
    if isinstance(value, str):
        if chars:
            return tuple(_CHARS[c] for c in value if c in _CHARS)
        value = value.split(";")
    return tuple(_ALIASES[n.strip().lower()] for n in value if isinstance(n, str) and n.strip().lower() in _ALIASES)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings with llama-server's names and defaults."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None  # None or -1: a random seed
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    typical_p: float = 1.0
    top_n_sigma: float = -1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    min_keep: int = 0
    samplers: tuple[str, ...] = DEFAULT_SAMPLERS

    def __post_init__(self) -> None:
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError("top_p must be in [0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be in [0, 1]")
        if self.repeat_penalty <= 0:
            raise ValueError("repeat_penalty must be > 0")
        if self.repeat_last_n < -1:
            raise ValueError("repeat_last_n must be >= -1")
        if self.min_keep < 0:
            raise ValueError("min_keep must be >= 0")
        bad = [n for n in self.samplers if n not in DEFAULT_SAMPLERS]
        if bad:
            raise ValueError(f"samplers: {', '.join(sorted(set(bad)))} not supported (supported: "
                             f"{', '.join(DEFAULT_SAMPLERS)})")
        object.__setattr__(self, "samplers", tuple(self.samplers))

    @property
    def penalizes(self) -> bool:
        """Whether repetition penalties change the logits."""
        return ((self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0)
                and self.repeat_last_n != 0 and "penalties" in self.samplers)

    @property
    def greedy(self) -> bool:
        """Temperature <= 0 picks the argmax of the biased, penalised logits: what the chain
        keeps ends at a temperature that keeps only its best token, and nothing before it
        drops the best token (typical-p and XTC can) or sees the logits before the
        penalties do."""
        if self.temperature > 0.0 or self.dynatemp_range > 0.0 or "temperature" not in self.samplers:
            return False
        active = self.active_filters()
        if any(n in ("typ_p", "xtc") for n in active):
            return False
        return not (self.penalizes and active and self.samplers.index(active[0]) < self.samplers.index("penalties"))

    def active_filters(self) -> tuple[str, ...]:
        """The filtering stages of ``samplers`` these settings turn on, in order (the
        others pass every candidate through)."""
        on = {"top_n_sigma": self.top_n_sigma > 0, "top_k": self.top_k > 0, "typ_p": self.typical_p < 1.0,
              "top_p": self.top_p < 1.0, "min_p": self.min_p > 0.0,
              "xtc": self.xtc_probability > 0.0 and self.xtc_threshold <= 0.5}
        return tuple(n for n in self.samplers if on.get(n))

    def with_(self, **kw: object) -> "SamplingParams":
        return replace(self, **kw)


#: penalty windows longer than this (or the whole history, repeat_last_n = -1) keep
#: their token counts up to date as the history grows, instead of recounting the
#: window for every sampled row
DENSE_WINDOW = 2048


class Sampler:
    """Samples the target's tokens for one sequence.

    ``history`` passed to ``sample`` (and the others) is the sequence's tokens so far
    (prompt and generated), which the repetition penalties look at: one list that only
    grows. ``extra`` are tokens after it that are not part of it yet (the drafts
    before the row being verified); passing them apart keeps a row's cost
    independent of the history's length.
    """

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        seed = params.seed
        self.rng = np.random.default_rng(None if seed is None or seed < 0 else seed)
        p = params
        self._penalize = p.penalizes
        self._greedy = p.greedy  # asked per row: computed once
        self._filters = frozenset(p.active_filters())
        self._short = self._short_chain(p)
        # long windows: counts per token of history[synced - W : synced]
        self._dense = self._penalize and (p.repeat_last_n == -1 or p.repeat_last_n > DENSE_WINDOW)
        self._counts: np.ndarray | None = None
        self._synced = 0

    @property
    def penalizes(self) -> bool:
        """Whether the history changes the distribution (repetition penalties)."""
        return self._penalize

    @property
    def greedy(self) -> bool:
        """Whether every row is sampled by its argmax (``SamplingParams.greedy``)."""
        return self._greedy

    @property
    def plain_argmax(self) -> bool:
        """Whether ``sample`` is the raw row's argmax: greedy, no bias, no penalties."""
        return self._greedy and not self._penalize and not self.params.logit_bias

    def _sync(self, history: Sequence[int], n_vocab: int) -> np.ndarray:
        """The long window's counts, brought up to ``history``'s end."""
        W = self.params.repeat_last_n
        L = len(history)
        if self._counts is None or L < self._synced or self._counts.shape[0] != n_vocab:
            self._counts = np.zeros(n_vocab, dtype=np.float32)
            self._synced = max(0, L - W) if W > 0 else 0
        c = self._counts
        for j in range(self._synced, L):
            t = history[j]
            if 0 <= t < n_vocab:
                c[t] += 1
            if W > 0 and j >= W:
                old = history[j - W]
                if 0 <= old < n_vocab:
                    c[old] -= 1
        self._synced = L
        return c

    def _apply(self, logits: np.ndarray, ids: np.ndarray, cnt: np.ndarray) -> np.ndarray:
        p = self.params
        out = logits.copy()
        sel = out[ids]
        sel = np.where(sel <= 0, sel * p.repeat_penalty, sel / p.repeat_penalty)
        sel -= cnt * p.frequency_penalty + (cnt > 0) * p.presence_penalty
        out[ids] = sel
        return out

    def _penalties(self, logits: np.ndarray, history: Sequence[int], extra: Sequence[int]) -> np.ndarray:
        W = self.params.repeat_last_n
        k = len(extra)
        if not self._dense:
            # a short window: count it (its tokens: the end of history, then extra)
            win = list(extra[-W:]) if k >= W else [*history[max(0, len(history) - (W - k)):], *extra]
            if not win:
                return logits
            counts = Counter(int(t) for t in win)
            ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
            cnt = np.fromiter(counts.values(), dtype=np.float32, count=len(counts))
            return self._apply(logits, ids, cnt)
        n_vocab = logits.shape[0]
        c = self._sync(history, n_vocab)
        # extra shifts the window by k: its tokens in, (for a bounded window) the k oldest out
        L = len(history)
        moved = [(int(t), 1.0) for t in extra if 0 <= t < n_vocab]
        if W > 0:
            moved += [(int(history[j]), -1.0) for j in range(max(0, L - W), max(0, L - W + k))
                      if 0 <= history[j] < n_vocab]
        for t, d in moved:
            c[t] += d
        try:
            # over the whole vocabulary at once: a long window holds a good part of it,
            # and gathering tens of thousands of ids costs more than a dense pass
            p = self.params
            has = c > 0
            out = np.where(logits <= 0, logits * p.repeat_penalty, logits / p.repeat_penalty)
            if p.frequency_penalty or p.presence_penalty:
                out -= c * p.frequency_penalty + has * p.presence_penalty
            return np.where(has, out, logits).astype(logits.dtype, copy=False)
        finally:
            for t, d in moved:
                c[t] -= d

    def _bias(self, logits: np.ndarray) -> np.ndarray:
        if not self.params.logit_bias:
            return logits
        logits = logits.copy()
        for t, b in self.params.logit_bias.items():
            if 0 <= t < logits.shape[0]:
                logits[t] += b
        return logits

    def transform(self, logits: np.ndarray, history: Sequence[int] = (), extra: Sequence[int] = ()) -> np.ndarray:
        """Logits after the bias and the penalties, in llama.cpp's order (what greedy
        picks the argmax of)."""
        logits = self._bias(logits)
        if self._penalize:
            logits = self._penalties(logits, history, extra)
        return logits

    def distribution(self, logits: np.ndarray, history: Sequence[int] = (),
                     extra: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """The candidates and their probabilities after the whole chain, in the order of
        ``params.samplers`` (as llama.cpp's stages: each filter or scaling sees what the
        ones before it left)."""
        p = self.params
        biased = self._bias(logits)
        if self._short and p.top_k < biased.shape[0]:
            return self._short_distribution(biased)
        ids: np.ndarray | None = None  # None: the whole vocabulary, in token order
        vals = biased
        for stage in p.samplers:
            if stage == "penalties":
                if self._penalize:
                    pen = self._penalties(biased, history, extra)
                    vals = pen if ids is None else pen[ids]
                continue
            keep = _STAGES[stage](self, vals) if stage in self._filters else None
            if keep is not None:
                ids = keep if ids is None else ids[keep]
                vals = vals[keep]
            if stage == "temperature":
                vals = self._temperature(vals)
        if ids is None:
            ids = np.arange(vals.shape[0])
        return ids, _softmax(vals)

    @staticmethod
    def _short_chain(p: SamplingParams) -> bool:
        """Whether the settings' chain is llama-server's default one in effect: top-k
        first, then top-p and min-p (either, both or neither, in that order), then a
        fixed temperature, and nothing else that changes a row."""
        active = p.active_filters()
        if p.penalizes or p.dynatemp_range > 0.0 or p.temperature <= 0.0 or not active or active[0] != "top_k" \
                or "temperature" not in p.samplers:
            return False
        rest = active[1:]
        if rest not in ((), ("top_p",), ("min_p",), ("top_p", "min_p")):
            return False
        return all(p.samplers.index(n) < p.samplers.index("temperature") for n in active)

    def _short_distribution(self, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``distribution`` for the default chain (``_short_chain``), the same numbers
        from the same operations on the same values: after top-k the candidates are in
        order, most likely first, so top-p and min-p each keep a prefix, found without
        sorting again. Right after a decode (Python's caches cold) a row of the bench
        model's took 0.42 ms through the general chain and takes 0.37 here (medians of
        100 each, alternating): four clients' rows are 7% of a round at temperature 1."""
        p = self.params
        ids = _by_value(vals, largest(vals, p.top_k))
        vals = vals[ids]
        if p.top_p < 1.0:
            cum = np.cumsum(_softmax(vals))
            # the first place where the sum reaches top_p (it never falls), min_keep at least
            last = max(int(np.searchsorted(cum, p.top_p, side="left")), p.min_keep - 1) + 1
            if last < vals.shape[0]:
                ids, vals = ids[:last], vals[:last]
        if p.min_p > 0.0:
            floor = vals[0] + np.log(p.min_p)  # p_i >= min_p * p_max (vals[0]: the max)
            kept = int(np.count_nonzero(vals >= floor))  # a prefix: vals fall
            if not (kept and kept >= p.min_keep):
                kept = max(1, min(p.min_keep, vals.shape[0]))
            ids, vals = ids[:kept], vals[:kept]
        return ids, _softmax(self._temperature(vals))

    # -- the chain's filters (run when ``params.active_filters`` has them): each returns
    # -- the indices (into vals) it keeps, or None for all of them ----------------------

    def _top_n_sigma(self, vals: np.ndarray) -> np.ndarray | None:
        n = self.params.top_n_sigma
        if vals.shape[0] <= 1:
            return None
        fin = vals[np.isfinite(vals)].astype(np.float64)
        if not fin.size:
            return None
        return np.flatnonzero(vals >= fin.max() - n * fin.std())

    def _top_k(self, vals: np.ndarray) -> np.ndarray | None:
        k = min(self.params.top_k, vals.shape[0])
        return _by_value(vals, largest(vals, k) if k < vals.shape[0] else np.arange(k))

    def _typical(self, vals: np.ndarray) -> np.ndarray | None:
        p = self.params
        probs = _softmax(vals)
        surprise = -np.log(np.maximum(probs, 1e-300))
        by = np.argsort(np.abs(surprise - (probs * surprise).sum()), kind="stable")  # |surprise - entropy|
        cum = np.cumsum(probs[by])
        i = np.arange(by.shape[0])
        hit = np.flatnonzero((cum > p.typical_p) & (i >= p.min_keep - 1))
        last = int(hit[0]) + 1 if hit.size else by.shape[0]
        return by[:last]

    def _top_p(self, vals: np.ndarray) -> np.ndarray | None:
        p = self.params
        order, probs = _sorted_softmax(vals)
        cum = np.cumsum(probs)
        i = np.arange(order.shape[0])
        hit = np.flatnonzero((cum >= p.top_p) & (i + 1 >= p.min_keep))
        last = int(hit[0]) + 1 if hit.size else order.shape[0]
        return order[:last]

    def _min_p(self, vals: np.ndarray) -> np.ndarray | None:
        p = self.params
        if not vals.shape[0]:
            return None
        floor = vals.max() + np.log(p.min_p)  # p_i >= min_p * p_max
        keep = np.flatnonzero(vals >= floor)
        if keep.size and keep.size >= p.min_keep:
            return keep
        order = np.argsort(-vals, kind="stable")  # too few: the best min_keep
        return order[: max(1, min(p.min_keep, order.shape[0]))]

    def _xtc(self, vals: np.ndarray) -> np.ndarray | None:
        p = self.params
        if vals.shape[0] < 2:
            return None
        if self.rng.random() > p.xtc_probability:
            return None
        order, probs = _sorted_softmax(vals)
        above = int(np.count_nonzero(np.cumprod(probs >= p.xtc_threshold)))
        last = above - 1  # the least likely of the tokens above the threshold stays
        if last > 0 and order.shape[0] - last >= p.min_keep:
            return order[last:]
        return None

    def _temperature(self, vals: np.ndarray) -> np.ndarray:
        p = self.params
        t = p.temperature
        if p.dynatemp_range > 0.0:
            if vals.shape[0] <= 1:
                return vals
            lo, hi = max(0.0, t - p.dynatemp_range), t + p.dynatemp_range
            probs = _softmax(vals)
            nz = probs[probs > 0]
            ent = -(nz * np.log(nz)).sum()
            t = lo + (hi - lo) * (ent / np.log(vals.shape[0])) ** p.dynatemp_exponent
        if t <= 0.0:
            out = np.full_like(vals, -np.inf)
            j = int(np.argmax(vals))
            out[j] = vals[j]
            return out
        return vals / t

    def sample(self, logits: np.ndarray, history: Sequence[int] = (), extra: Sequence[int] = ()) -> int:
        """One token from a row of logits."""
        if self._greedy:
            return int(np.argmax(self.transform(logits, history, extra)))
        ids, probs = self.distribution(logits, history, extra)
        return int(ids[self.draw(probs)])

    def dense(self, logits: np.ndarray, history: Sequence[int] = (), extra: Sequence[int] = ()) -> np.ndarray:
        """The whole chain's distribution over the vocabulary (float64, sums to 1);
        one-hot at the argmax when greedy."""
        out = np.zeros(logits.shape[0], dtype=np.float64)
        if self._greedy:
            out[int(np.argmax(self.transform(logits, history, extra)))] = 1.0
        else:
            ids, probs = self.distribution(logits, history, extra)
            out[ids] = probs
        return out

    def draw(self, probs: np.ndarray) -> int:
        """An index drawn from a probability vector (need not be normalised). Summed over
        its nonzero entries alone: a dense row of the vocabulary is mostly zeros after the
        chain's filters, and the sums at the nonzero entries are the whole row's (adding
        0.0 changes no bit), so the index drawn is the same, at a fraction of the time
        (a draft's q row and a rejection's residual, 128k entries: 0.5 ms a draw)."""
        u = self.rng.random()
        nz = np.flatnonzero(probs > 0)  # (a float row's own nonzero(): 25x slower)
        if nz.shape[0] == 0:
            return len(probs) - 1  # as the whole row's sum would have it: all zeros
        c = np.cumsum(probs[nz])
        return int(nz[min(np.searchsorted(c, u * c[-1], side="right"), len(c) - 1)])


#: ``largest`` looks at every SKETCH_STRIDE-th entry first
SKETCH_STRIDE = 64


def largest(vals: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest entries of ``vals`` (0 < k <= its length; NaN never
    among them), in no order. The k-th largest is at least the threshold the entries
    above it pass, so any threshold that ``k`` or more entries pass keeps the same
    top k: one is read off a strided sketch of the row (the sketch's (k/stride + 8)-th
    largest, which ~k + 8 x stride entries pass), and only those are partitioned. A full
    partition of the vocabulary (128k logits) took 0.4-0.6 ms, the row's top-k stage
    at every sampled token (5% of a decode on the bench model; llama.cpp's own takes a
    tenth of that); this takes ~0.08 ms. A row the threshold finds too few in (a flat
    or masked one) is partitioned whole, as before."""
    n = vals.shape[0]
    if k >= n:
        return np.flatnonzero(~np.isnan(vals)) if vals.dtype.kind == "f" else np.arange(n)
    sketch = vals[::SKETCH_STRIDE]
    j = k // SKETCH_STRIDE + 8
    if j < sketch.shape[0] // 4:
        thr = np.partition(sketch, sketch.shape[0] - j)[sketch.shape[0] - j]
        cand = np.flatnonzero(vals >= thr)
        if k <= cand.shape[0] < n // 4:
            if cand.shape[0] == k:
                return cand
            return cand[np.argpartition(-vals[cand], k - 1)[:k]]
    return np.argpartition(-vals, k - 1)[:k]


def _by_value(vals: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``ids`` from the largest value of ``vals`` down, equal values by index."""
    ids = np.sort(ids)
    return ids[np.argsort(-vals[ids], kind="stable")]


def _softmax(vals: np.ndarray) -> np.ndarray:
    """Probabilities of ``vals`` (float64, summing to 1; uniform where every value is
    -inf): the chain's last step, and top-p's cumulative sums."""
    v = vals.astype(np.float64)
    m = v.max() if v.shape[0] else 0.0
    probs = np.exp(v - m) if np.isfinite(m) else np.ones_like(v)
    return probs / probs.sum()


def _sorted_softmax(vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indices of vals from the most likely down, and their softmax probabilities."""
    order = np.argsort(-vals, kind="stable")
    return order, _softmax(vals[order])


_STAGES: dict[str, Callable[[Sampler, np.ndarray], "np.ndarray | None"]] = {
    "top_n_sigma": Sampler._top_n_sigma, "top_k": Sampler._top_k, "typ_p": Sampler._typical,
    "top_p": Sampler._top_p, "min_p": Sampler._min_p, "xtc": Sampler._xtc,
}


def verify_rejection(sampler: Sampler, p_row: Callable[[int], np.ndarray], drafts: Sequence[int],
                     q_rows: np.ndarray, bonus: Callable[[], int]) -> list[int]:
    """Speculative sampling: accept draft i with probability min(1, p_i(d_i) / q_i(d_i));
    at the first rejection draw from the normalised residual max(0, p_i - q_i); when
    every draft is accepted, draw a bonus token from p_n. The tokens returned are
    distributed exactly as sampling from p token by token.

    ``p_row(i)`` (i < n) is the target's distribution at row i (``Sampler.dense``;
    asked for only while the drafts before it are accepted), ``q_rows[i]`` the
    distribution draft i was drawn from, ``bonus()`` the token after every draft was
    accepted, sampled from row n as plain decoding samples (over the chain's kept
    tokens: a draw over a dense row of the vocabulary cost ~1% of a round on the bench
    model, in every round that drafted nothing).
    """
    out: list[int] = []
    n = len(drafts)
    for i in range(n):
        p, q, d = p_row(i), q_rows[i], drafts[i]
        if sampler.rng.random() * q[d] < p[d]:
            out.append(d)
            continue
        # the residual is zero wherever p is: computed on p's support alone (a dense
        # row of the vocabulary took 1.2 ms), drawn as the whole row would be
        ids = np.flatnonzero(p > 0)
        resid = np.maximum(p[ids] - q[ids], 0.0)
        out.append(int(ids[sampler.draw(resid)]) if resid.sum() > 0 else sampler.draw(p))
        return out
    out.append(bonus())
    return out


class DraftShaper:
    """Which distribution to draw a draft from, per draft depth, for rejection sampling.

    Verification accepts a draft drawn from q with probability min(1, p/q), which
    accepts on average sum_x min(p(x), q(x)): the closer q is to the target's p, the
    more. Any q drawn up front keeps the output exactly p's, so q may be chosen among
    transforms of the head's distribution (after the request's sampling chain, ``q0``):
    its powers q0^k, renormalised (k = 1: q0 itself; k > 1 sharper, as a head less sure
    than the target wants; k < 1 flatter; k = inf: its most likely token alone). For
    every verified draft row the target's p is at hand, so each candidate's acceptance
    on that row, sum_x min(p(x), q0^k(x)), is computed exactly, not only the one drawn
    from; the depth's candidate with the best running mean is used. The choice depends
    on past rows only, never on the row being verified, so the output stays exactly
    the target's distribution.
    """

    #: the candidate powers (inf: the head's argmax alone, drafted with probability 1)
    POWERS = (0.7, 0.85, 1.0, 1.25, 1.5, 2.0, 3.0, float("inf"))
    #: per row observed, how much a depth's running means still count
    DECAY = 0.99

    def __init__(self, n_depth: int) -> None:
        self.score = np.zeros((max(1, n_depth), len(self.POWERS)))
        self.seen = np.zeros(max(1, n_depth))
        self.choice = [self.POWERS.index(1.0)] * max(1, n_depth)

    def power(self, depth: int) -> float:
        return self.POWERS[self.choice[min(depth, len(self.choice) - 1)]]

    def shape(self, q0: np.ndarray, depth: int, out: np.ndarray) -> None:
        """``out`` <- the distribution to draft depth ``depth`` from, given the head's ``q0``."""
        k = self.power(depth)
        if k == 1.0:
            out[:] = q0
            return
        out[:] = 0.0
        if k == float("inf"):
            out[int(np.argmax(q0))] = 1.0
            return
        idx = np.flatnonzero(q0)
        v = np.log(q0[idx]) * k
        w = np.exp(v - v.max())
        out[idx] = w / w.sum()

    def acceptance(self, p: np.ndarray, q0: np.ndarray) -> np.ndarray:
        """Each candidate's acceptance on one row: sum_x min(p(x), q(x))."""
        idx = np.flatnonzero(q0)
        pq, lq = p[idx], np.log(q0[idx])
        out = np.empty(len(self.POWERS))
        for j, k in enumerate(self.POWERS):
            if k == float("inf"):
                out[j] = pq[int(np.argmax(lq))]
                continue
            v = lq * k
            w = np.exp(v - v.max())
            out[j] = np.minimum(pq, w / w.sum()).sum()
        return out

    def observe(self, depth: int, p: np.ndarray, q0: np.ndarray) -> None:
        """A verified row of this depth: the target's distribution there, and the head's."""
        if depth >= len(self.choice):
            return
        a = self.acceptance(p, q0)
        self.score[depth] = self.DECAY * self.score[depth] + (1 - self.DECAY) * a
        self.seen[depth] += 1
        best = int(np.argmax(self.score[depth]))
        cur = self.choice[depth]
        # a small margin against flapping between near-equal candidates
        if self.score[depth, best] > self.score[depth, cur] + 1e-3:
            self.choice[depth] = best


@dataclass
class TokenProbs:
    """What llama-server reports for one generated token (``n_probs``): the token's
    probability and the ``n`` most likely tokens with theirs, either from the raw
    logits (``post`` False: llama-server's default, reported as log-probabilities) or
    after the sampling chain (``post`` True: probabilities)."""

    token: int
    p: float
    top: list[tuple[int, float]]
    post: bool = False


def raw_probs(logits: np.ndarray, token: int, n: int) -> TokenProbs:
    """Softmax of a raw logits row: the token's probability and the n best's."""
    row = logits.astype(np.float64)
    m = row.max()
    z = np.exp(row - m)
    total = z.sum()
    k = min(n, row.shape[0])
    top = _by_value(row, largest(row, k) if k < row.shape[0] else np.arange(row.shape[0]))
    return TokenProbs(token, float(z[token] / total), [(int(t), float(z[t] / total)) for t in top])


def chain_probs(dense: np.ndarray, token: int, n: int) -> TokenProbs:
    """The sampling chain's distribution (``Sampler.dense``): the token's probability
    and the n best candidates with a probability above zero."""
    k = min(n, int(np.count_nonzero(dense)))
    top = largest(dense, k) if 0 < k < dense.shape[0] else np.flatnonzero(dense)
    top = _by_value(dense, top)[:k]
    return TokenProbs(token, float(dense[token]), [(int(t), float(dense[t])) for t in top], post=True)


def draft_pick(logits: np.ndarray) -> tuple[int, float]:
    """The draft token (argmax) and its probability among the top 10, as
    llama-server's MTP drafter computes the value ``p_min`` is compared with."""
    k = min(DRAFT_TOP_K, logits.shape[0])
    top = np.sort(largest(logits, k))  # (equal logits: the lowest id, as argmax)
    vals = logits[top].astype(np.float64)
    j = int(np.argmax(vals))
    probs = np.exp(vals - vals[j])
    return int(top[j]), float(1.0 / probs.sum())
