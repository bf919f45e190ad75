"""Adaptive draft length: pick, each round, the number of drafts that maximises the
expected accepted tokens per second.

With per-depth acceptance estimates a_d (the chance draft d is accepted given drafts
1..d-1 were) a round of n drafts emits E[n] = 1 + a_1 + a_1 a_2 + ... tokens, and
costs T[n] = draft_1 + .. + draft_n + verify(n+1 rows), all measured on this machine
as the generation runs (moving averages). The policy picks argmax E[n] / T[n] for
n in 0..n_max; 0 means a plain decode this round. Every length is tried once at the
start, and again whenever it has not been tried for ``probe_every`` rounds, so the
estimates stay fresh when the text changes character.
"""
from __future__ import annotations

import numpy as np

__all__ = ["AdaptiveLength"]


class AdaptiveLength:
    """Per-sequence draft-length policy (acceptance depends on the text; the costs
    are the machine's but cheap to learn again)."""

    def __init__(self, n_max: int, *, decay: float = 0.9, probe_every: int = 32,
                 prior_accept: float = 0.5) -> None:
        self.n_max = n_max
        self.decay = decay
        self.probe_every = probe_every
        self.accept = np.full(max(1, n_max), prior_accept)
        self.t_draft = np.full(max(1, n_max), np.nan)  # seconds per draft step, by depth
        self.t_verify = np.full(n_max + 2, np.nan)  # seconds per verify, by rows
        self.last_tried = np.full(n_max + 1, -(10**9))
        self.round = 0
        self.chosen = n_max
        self._n: dict[int, np.ndarray] = {}  # observations per estimate

    def _ema(self, arr: np.ndarray, i: int, x: float) -> None:
        # a plain mean over the first observations, then a moving average: the prior
        # and the first samples do not linger
        n = self._n.setdefault(id(arr), np.zeros(len(arr), dtype=np.int64))
        n[i] += 1
        w = max(1.0 / n[i], 1.0 - self.decay)
        arr[i] = x if np.isnan(arr[i]) else (1 - w) * arr[i] + w * x

    def expected_rate(self, n: int) -> float:
        """Expected tokens per second of a round drafting n tokens."""
        if (n > 0 and np.isnan(self.t_draft[:n]).any()) or np.isnan(self.t_verify[n + 1]):
            return float("nan")
        tokens = 1.0 + float(np.cumprod(self.accept[:n]).sum()) if n else 1.0
        cost = float(self.t_draft[:n].sum()) + float(self.t_verify[n + 1])
        return tokens / cost if cost > 0 else float("inf")

    def choose(self) -> int:
        """The draft length for this round."""
        self.round += 1
        rates = [self.expected_rate(n) for n in range(self.n_max + 1)]
        # lengths not measured yet, longest first (it also times the shorter drafts)
        for n in range(self.n_max, -1, -1):
            if np.isnan(rates[n]):
                return self._pick(n)
        stale = int(np.argmin(self.last_tried))
        if self.round - self.last_tried[stale] > self.probe_every:
            return self._pick(stale)
        return self._pick(int(np.nanargmax(rates)))

    def _pick(self, n: int) -> int:
        self.last_tried[n] = self.round
        self.chosen = n
        return n

    def observe(self, n_drafted: int, n_accepted: int, t_steps: list[float], t_verify: float) -> None:
        """What the round did: drafts, accepted drafts, seconds per draft step and for
        the verification (target decode and acceptance)."""
        for d in range(n_drafted):
            self._ema(self.accept, d, 1.0 if d < n_accepted else 0.0)
            if d >= n_accepted:
                break  # later drafts were never judged
        for d, t in enumerate(t_steps[: self.n_max]):
            self._ema(self.t_draft, d, t)
        self._ema(self.t_verify, n_drafted + 1, t_verify)
        self.last_tried[min(n_drafted, self.n_max)] = self.round
