"""Drafters: who proposes the tokens a round verifies.

Two kinds sit behind the driver's round (``mtp.MTPDriver``), and the plan
(``adaptive.DraftPlanner``) chooses between them per sequence every round:

* the MTP heads (``drafters.heads``): each draft step one decode of one head for
  every sequence drafting that deep; a draft carries the head's distribution, and how
  sure the head was;
* context proposers (``Proposer``): continuations of the text found in what the
  sequence (or an earlier one) already holds, with no decode at all: ours
  (``drafters.context``) and llama-server's n-gram drafters (``drafters.ngram``). A
  proposal is a point: each of its tokens is proposed with certainty, so rejection
  sampling accepts it with the target's probability of it (``PointMass``).

A proposer's life cycle is llama.cpp's: ``begin`` with a sequence's tokens, ``propose``
each round, ``accepted`` after the verify, ``finish`` when the sequence ends.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from .context import ContextDrafter, ContextPool, ContextProposal


__all__ = ["PointMass", "Proposer", "make_proposers"]


class Proposer(Protocol):
    """A context proposer (see the module)."""

    #: its name in logs and statistics (a ``--spec-type`` name, or ``context``)
    name: str

    def begin(self, tokens: list[int], pool: ContextPool | None) -> object:
        """A new sequence whose token list (prompt, then output as it grows) is
        ``tokens``; returns the proposer's state for it."""

    def propose(self, state: object, cap: int) -> ContextProposal | None:
        """At most ``cap`` tokens following the sequence's tokens, or None."""

    def accepted(self, state: object, n_drafted: int, n_accepted: int) -> None:
        """Its last proposal's first ``n_drafted`` tokens were verified, ``n_accepted``
        of them accepted."""

    def finish(self, state: object) -> None:
        """The sequence ended."""


class PointMass:
    """The distribution a context draft was drawn from: all its mass on the token. As
    ``q`` of ``sampling.verify_rejection`` it accepts the token with the target's
    probability of it, and at a rejection leaves the target's distribution without it."""

    __slots__ = ("token",)

    def __init__(self, token: int) -> None:
        self.token = token

    def __getitem__(self, i: int | np.ndarray) -> float | np.ndarray:
        if isinstance(i, np.ndarray):
            return (i == self.token).astype(np.float64)
        return 1.0 if i == self.token else 0.0


def make_proposers(spec, heads: bool) -> list[Proposer]:  # noqa: ANN001 - a sequence.SpecConfig
    """The context proposers of settings ``spec`` (a ``sequence.SpecConfig``): llama-server's n-gram types as listed,
    and ours wherever the heads draft (unless ``spec.context`` is off)."""
    from .ngram import make_ngram

    out: list[Proposer] = [make_ngram(t, spec.ngram_config) for t in spec.ngram]
    if heads and spec.context and spec.context_max > 0:
        out.append(ContextDrafter(spec.context_max))
    return out


def best_proposal(props: Sequence[ContextProposal | None]) -> int:
    """The index of the longest proposal (-1: none)."""
    best, n = -1, 0
    for i, p in enumerate(props):
        if p is not None and len(p.tokens) > n:
            best, n = i, len(p.tokens)
    return best
