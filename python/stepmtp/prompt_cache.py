"""A slot's cache out of llama.cpp: in host memory (llama-server's ``--cache-ram``)
and in files (its ``/slots/{id}?action=save|restore``).

``SlotState`` is what ``MTPDriver`` exports of a slot: the tokens its KV holds, the
target's KV (bytes, or a llama.cpp sequence file beside it), each head's KV and the
heads' bookkeeping (how far each is anchored, the rows some head has not seen).
``HostPromptCache`` keeps such states within a byte budget, least recently used
out first: a prompt a slot is about to lose (another conversation takes the slot,
a full shared cache evicts it) goes there, and back into a slot for a later
request that shares more with it.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

__all__ = ["Checkpoint", "SlotState", "HostPromptCache", "write_heads", "read_heads", "heads_path"]


@dataclass
class Checkpoint:
    """The target's sliding-window cells of a sequence right after it decoded position
    ``q`` (llama-server's context checkpoint; llama.cpp saves those the next position's
    window needs): restored, the sequence goes on from q or q + 1, exactly."""

    q: int
    data: bytes

    def reach(self, p: int) -> int:
        """Where a sequence sharing the first p tokens goes on from with this
        checkpoint (the tokens between there and p decoded again); -1: it cannot."""
        return min(p, self.q + 1) if p >= self.q else -1


@dataclass
class SlotState:
    tokens: list[int]
    #: the target's sequence (llama_state_seq_get_data); None when it is in a file
    target: bytes | None
    #: each head's sequence, in head order (empty without heads)
    heads: list[bytes]
    #: head k is anchored on positions [0, kv_valid[k])
    kv_valid: list[int]
    #: the anchored rows some head has not seen: (position of the first, tokens, trunk rows)
    anchors: tuple[int, np.ndarray, np.ndarray] | None
    #: a trimmed sliding-window cache: the context checkpoints (MTPDriver's)
    checkpoints: list[Checkpoint] = field(default_factory=list)
    #: the LoRA scales its KV was computed with (SeqState.adapter)
    adapter: tuple[float, ...] = ()

    @property
    def nbytes(self) -> int:
        n = len(self.target or b"") + sum(map(len, self.heads)) + sum(len(c.data) for c in self.checkpoints)
        return n + (self.anchors[1].nbytes + self.anchors[2].nbytes if self.anchors else 0)


class HostPromptCache:
    """Slot states within ``budget`` bytes (None: no bound)."""

    def __init__(self, budget: int | None) -> None:
        self.budget = budget
        self._items: OrderedDict[int, SlotState] = OrderedDict()
        self._next = 0
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, st: SlotState) -> bool:
        """Keep ``st`` (dropping the oldest to make room); False if it alone is too big.
        A kept prompt that is a prefix of the new one is dropped: the new one covers it."""
        if self.budget is not None and st.nbytes > self.budget:
            return False
        for key, old in list(self._items.items()):
            if old.adapter == st.adapter and old.tokens == st.tokens[: len(old.tokens)]:
                self._drop(key)
        while self.budget is not None and self.nbytes + st.nbytes > self.budget and self._items:
            self._drop(next(iter(self._items)))
        self._items[self._next] = st
        self._next += 1
        self.nbytes += st.nbytes
        return True

    def best(self, prompt: list[int], common_prefix: Callable[[list[int], list[int]], int],
             adapter: tuple[float, ...] = ()) -> tuple[int, int]:
        """The key of the kept prompt sharing the longest prefix with ``prompt``, and
        that length (-1, 0 when none); only prompts computed with the LoRA scales
        ``adapter`` count."""
        key, best = -1, 0
        for k, st in self._items.items():
            n = common_prefix(st.tokens, prompt) if st.adapter == adapter else 0
            if n > best:
                key, best = k, n
        return key, best

    def take(self, key: int) -> SlotState:
        """Remove and return a kept state (it goes back into a slot)."""
        st = self._items.pop(key)
        self.nbytes -= st.nbytes
        return st

    def _drop(self, key: int) -> None:
        self.nbytes -= self._items.pop(key).nbytes


def heads_path(path: Path) -> Path:
    """Where a slot file's heads go: beside the target's llama.cpp sequence file."""
    return path.with_name(path.name + ".mtp.npz")


def write_heads(path: Path, st: SlotState, n_embd: int) -> int:
    """The heads' part of a slot file, and the context checkpoints; its size."""
    start, tok, h = st.anchors or (0, np.zeros(0, np.int32), np.zeros((0, n_embd), np.float32))
    # a head without a draft context (not decoded with these settings) holds nothing
    arrays = {f"head{k}": np.frombuffer(b, dtype=np.uint8) for k, b in enumerate(st.heads)}
    arrays["ckpt_q"] = np.array([c.q for c in st.checkpoints], dtype=np.int64)
    arrays.update({f"ckpt{i}": np.frombuffer(c.data, dtype=np.uint8) for i, c in enumerate(st.checkpoints)})
    side = heads_path(path)
    with open(side, "wb") as f:
        np.savez(f, kv_valid=np.array(st.kv_valid, dtype=np.int64), n_tokens=np.array(len(st.tokens)),
                 anchors_start=np.array(start), anchors_tok=tok, anchors_h=h, **arrays)
    return side.stat().st_size


def read_heads(path: Path, tokens: list[int], n_heads: int, need_heads: bool = True) -> tuple[SlotState, int]:
    """The state a slot file's heads part holds for ``tokens`` (the target's file
    gave them), and its size; ValueError when it is missing or not this file's.
    ``need_heads`` False: only its checkpoints are wanted (a server without heads)."""
    side = heads_path(path)
    if not side.is_file():
        raise ValueError(f"{path.name} holds no MTP heads' state ({side.name}): saved by another server or "
                         "without speculation")
    with np.load(side) as z:
        if int(z["n_tokens"]) != len(tokens) or (need_heads and len(z["kv_valid"]) != n_heads):
            raise ValueError(f"{side.name} does not belong to {path.name}")
        ckpts = [Checkpoint(int(q), z[f"ckpt{i}"].tobytes()) for i, q in enumerate(z["ckpt_q"])] \
            if "ckpt_q" in z else []
        if not need_heads:
            return SlotState(tokens, None, [], [len(tokens)] * n_heads, None, ckpts), side.stat().st_size
        heads = [z[f"head{k}"].tobytes() for k in range(n_heads)]
        anchors = (int(z["anchors_start"]), z["anchors_tok"], z["anchors_h"])
        st = SlotState(tokens, None, heads, [int(v) for v in z["kv_valid"]], anchors, ckpts)
    return st, side.stat().st_size
