"""Prompts kept in host memory (llama-server's ``--cache-ram``): when a slot's cached
prefix is about to be lost (another conversation takes the slot, or a full shared
KV cache evicts it), its state is copied out of llama.cpp; a later request that
shares more with a kept prefix than with any slot's gets it copied back in.

What is kept is whatever ``MTPDriver`` snapshots: the target sequence's KV bytes,
each head's, and the heads' bookkeeping. This module only holds them, least
recently used first out, within a byte budget.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

__all__ = ["HostPromptCache", "Snapshot"]


@dataclass
class Snapshot:
    tokens: list[int]
    #: the driver's serialised state (target KV, heads' KV, anchors...)
    state: Any
    nbytes: int


class HostPromptCache:
    """Snapshots of prompts, within ``budget`` bytes (None: no bound)."""

    def __init__(self, budget: int | None) -> None:
        self.budget = budget
        self._items: OrderedDict[int, Snapshot] = OrderedDict()
        self._next = 0
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, snap: Snapshot) -> bool:
        """Keep ``snap`` (dropping the oldest to make room); False if it alone is too big.
        A kept prompt that is a prefix of the new one is dropped: the new one covers it."""
        if self.budget is not None and snap.nbytes > self.budget:
            return False
        for key, old in list(self._items.items()):
            if old.tokens == snap.tokens[: len(old.tokens)]:
                self._drop(key)
        while self.budget is not None and self.nbytes + snap.nbytes > self.budget and self._items:
            self._drop(next(iter(self._items)))
        self._items[self._next] = snap
        self._next += 1
        self.nbytes += snap.nbytes
        return True

    def best(self, prompt: list[int], common_prefix: Any) -> tuple[int, int]:
        """The key of the kept prompt sharing the longest prefix with ``prompt``, and
        that length (-1, 0 when none)."""
        key, best = -1, 0
        for k, snap in self._items.items():
            n = common_prefix(snap.tokens, prompt)
            if n > best:
                key, best = k, n
        return key, best

    def take(self, key: int) -> Snapshot:
        """Remove and return a kept prompt (it goes back into a slot)."""
        snap = self._items.pop(key)
        self.nbytes -= snap.nbytes
        return snap

    def _drop(self, key: int) -> None:
        self.nbytes -= self._items.pop(key).nbytes
