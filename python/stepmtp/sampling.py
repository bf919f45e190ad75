"""Token sampling in numpy, with llama.cpp's settings and order.

The target's sampler (``Sampler``) applies, as llama.cpp's default chain does:
repetition penalties, then top-k, top-p, min-p, temperature, and a seeded draw; at
temperature <= 0 it is greedy (argmax after the penalties). Draft tokens are picked
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

__all__ = ["SamplingParams", "Sampler", "TokenProbs", "draft_pick", "verify_rejection", "raw_probs"]

DRAFT_TOP_K = 10


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

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

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
        self._penalize = (
            p.repeat_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        ) and p.repeat_last_n != 0
        # long windows: counts per token of history[synced - W : synced]
        self._dense = self._penalize and (p.repeat_last_n == -1 or p.repeat_last_n > DENSE_WINDOW)
        self._counts: np.ndarray | None = None
        self._synced = 0

    @property
    def penalizes(self) -> bool:
        """Whether the history changes the distribution (repetition penalties)."""
        return self._penalize

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

    def transform(self, logits: np.ndarray, history: Sequence[int] = (), extra: Sequence[int] = ()) -> np.ndarray:
        """Logits after penalties and bias (what greedy picks the argmax of)."""
        if self._penalize:
            logits = self._penalties(logits, history, extra)
        if self.params.logit_bias:
            logits = logits.copy() if not self._penalize else logits
            for t, b in self.params.logit_bias.items():
                if 0 <= t < logits.shape[0]:
                    logits[t] += b
        return logits

    def distribution(self, logits: np.ndarray, history: Sequence[int] = (),
                     extra: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """The candidates and their probabilities after the whole chain (temperature > 0)."""
        p = self.params
        logits = self.transform(logits, history, extra)
        n = logits.shape[0]
        k = p.top_k if 0 < p.top_k < n else n
        if k < n:
            ids = np.argpartition(-logits, k - 1)[:k]
        else:
            ids = np.arange(n)
        vals = logits[ids].astype(np.float64)
        order = np.argsort(-vals, kind="stable")
        ids, vals = ids[order], vals[order]
        probs = np.exp(vals - vals[0])
        probs /= probs.sum()
        if p.top_p < 1.0:
            cut = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            ids, vals, probs = ids[:cut], vals[:cut], probs[:cut]
        if p.min_p > 0.0:
            keep = probs >= p.min_p * probs[0]
            ids, vals = ids[keep], vals[keep]
        scaled = vals / p.temperature
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        return ids, probs

    def sample(self, logits: np.ndarray, history: Sequence[int] = (), extra: Sequence[int] = ()) -> int:
        """One token from a row of logits."""
        if self.params.greedy:
            return int(np.argmax(self.transform(logits, history, extra)))
        ids, probs = self.distribution(logits, history, extra)
        return int(ids[self.draw(probs)])

    def dense(self, logits: np.ndarray, history: Sequence[int] = (), extra: Sequence[int] = ()) -> np.ndarray:
        """The whole chain's distribution over the vocabulary (float64, sums to 1);
        one-hot at the argmax when greedy."""
        out = np.zeros(logits.shape[0], dtype=np.float64)
        if self.params.greedy:
            out[int(np.argmax(self.transform(logits, history, extra)))] = 1.0
        else:
            ids, probs = self.distribution(logits, history, extra)
            out[ids] = probs
        return out

    def draw(self, probs: np.ndarray) -> int:
        """An index drawn from a probability vector (need not be normalised)."""
        c = np.cumsum(probs)
        return int(min(np.searchsorted(c, self.rng.random() * c[-1], side="right"), len(c) - 1))


def verify_rejection(sampler: Sampler, p_row: Callable[[int], np.ndarray], drafts: Sequence[int],
                     q_rows: np.ndarray) -> list[int]:
    """Speculative sampling: accept draft i with probability min(1, p_i(d_i) / q_i(d_i));
    at the first rejection draw from the normalised residual max(0, p_i - q_i); when
    every draft is accepted, draw a bonus token from p_n. The tokens returned are
    distributed exactly as sampling from p token by token.

    ``p_row(i)`` (i = 0..n) is the target's distribution at row i (``Sampler.dense``;
    asked for only while the drafts before it are accepted), ``q_rows[i]`` the
    distribution draft i was drawn from.
    """
    out: list[int] = []
    n = len(drafts)
    for i in range(n):
        p, q, d = p_row(i), q_rows[i], drafts[i]
        if sampler.rng.random() * q[d] < p[d]:
            out.append(d)
            continue
        resid = np.maximum(p - q, 0.0)
        out.append(sampler.draw(resid) if resid.sum() > 0 else sampler.draw(p))
        return out
    out.append(sampler.draw(p_row(n)))
    return out


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
    top = np.argpartition(-row, k - 1)[:k] if k < row.shape[0] else np.arange(row.shape[0])
    top = top[np.argsort(-row[top], kind="stable")]
    return TokenProbs(token, float(z[token] / total), [(int(t), float(z[t] / total)) for t in top])


def chain_probs(dense: np.ndarray, token: int, n: int) -> TokenProbs:
    """The sampling chain's distribution (``Sampler.dense``): the token's probability
    and the n best candidates with a probability above zero."""
    k = min(n, int(np.count_nonzero(dense)))
    top = np.argpartition(-dense, k - 1)[:k] if 0 < k < dense.shape[0] else np.flatnonzero(dense)
    top = top[np.argsort(-dense[top], kind="stable")][:k]
    return TokenProbs(token, float(dense[token]), [(int(t), float(dense[t])) for t in top], post=True)


def draft_pick(logits: np.ndarray) -> tuple[int, float]:
    """The draft token (argmax) and its probability among the top 10, as
    llama-server's MTP drafter computes the value ``p_min`` is compared with."""
    k = min(DRAFT_TOP_K, logits.shape[0])
    top = np.argpartition(-logits, k - 1)[:k]
    vals = logits[top].astype(np.float64)
    j = int(np.argmax(vals))
    probs = np.exp(vals - vals[j])
    return int(top[j]), float(1.0 / probs.sum())
