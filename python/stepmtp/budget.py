"""llama-server's reasoning budget (``--reasoning-budget N``, a request's
``thinking_budget_tokens``): at most N tokens inside a think block, then the end of
thinking is forced (an optional message first), and the model goes on with its answer.

Per sequence, a state machine over the generated tokens, as llama.cpp's
reasoning-budget sampler: idle until the start tag's tokens, then counting down the
budget (the end tag's tokens end it early), then forcing the message and the end tag
token by token (the budget's last token may be cut inside a character: forcing waits
for the character to end), then done (a new start tag arms it again). The prompt's
tail from its last start tag is fed through first, as llama.cpp feeds the generation
prompt, so a prompt that opens the think block starts the count.

``BudgetState`` speaks the MTP driver's constraint protocol (``masked``, ``mask_into``,
``fill_bitmask``, ``allowed``, ``advance``, ``rollback``, ``begin_round``): while forcing, a row allows
the forced token only, so drafts that agree are accepted and the verify row keeps the
text of plain decoding.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import numpy as np

if TYPE_CHECKING:
    from .llama import Model

__all__ = ["ReasoningBudget", "BudgetState"]

IDLE, COUNTING, WAITING_UTF8, FORCING, DONE = range(5)


@dataclass(frozen=True)
class ReasoningBudget:
    """A budget of ``tokens`` for each think block between ``start`` and ``end`` (-1: no
    limit, for a ``control`` alone); ``message`` is written before the forced end tag.
    ``control``: set from any thread, it ends the reasoning (llama-server's
    ``reasoning_control`` and its ``reasoning_end`` action); it stays set: from the
    driver's next round the think block ends after the next token that completes a
    character, and a later one ends at once."""

    tokens: int
    message: str = ""
    start: str = "<think>"
    end: str = "</think>"
    control: threading.Event | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.tokens < -1:
            raise ValueError("a reasoning budget is >= 0 tokens, or -1 for none")
        if not self.start or not self.end:
            raise ValueError("a reasoning budget needs the think block's start and end tags")

    def start_state(self, model: "Model", prefill: str = "") -> "BudgetState":
        """A sequence's state, after ``prefill`` (the prompt's tail, e.g. from its
        last ``<think>`` on) went through it."""
        tok = lambda s: model.tokenize(s, add_special=False, parse_special=True)  # noqa: E731
        st = BudgetState(model.n_vocab, tok(self.start), tok(self.end), tok(self.message + self.end), self.tokens,
                         lambda t: _utf8_complete(model.token_to_piece(t)), self.control)
        if prefill:
            st.advance_many(tok(prefill))
            st.history.clear()  # the prompt's part is not generated text: nothing to roll back to
        return st


def _utf8_complete(piece: bytes) -> bool:
    """Whether ``piece`` does not end inside a UTF-8 character."""
    n = len(piece)
    for back in range(1, min(4, n) + 1):
        b = piece[n - back]
        if b & 0xC0 != 0x80:  # a lead byte (or ASCII): how long is its character?
            need = 1 if b < 0x80 else 2 if b >> 5 == 0b110 else 3 if b >> 4 == 0b1110 else 4 if b >> 3 == 0b11110 else 1
            return back >= need
    return True  # continuation bytes only: nothing to wait for


class _Matcher:
    """Where a token sequence stands in matching ``tokens`` (llama.cpp's token_matcher:
    a mismatch restarts, at 1 when it is the first token)."""

    __slots__ = ("tokens", "pos")

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = list(tokens)
        self.pos = 0

    def advance(self, t: int) -> bool:
        if not self.tokens:
            return False
        if t == self.tokens[self.pos]:
            self.pos += 1
            if self.pos >= len(self.tokens):
                self.pos = 0
                return True
        else:
            self.pos = 1 if t == self.tokens[0] else 0
        return False


class BudgetState:
    """One sequence's reasoning budget (see the module docstring)."""

    def __init__(self, n_vocab: int, start: Sequence[int], end: Sequence[int], forced: Sequence[int],
                 budget: int, utf8_complete: Callable[[int], bool], control: threading.Event | None = None) -> None:
        self.vocab = SimpleNamespace(n_vocab=n_vocab, n_words=(n_vocab + 31) // 32)
        self._start, self._end = _Matcher(start), _Matcher(end)
        self.forced_tokens = list(forced)
        self.budget = budget
        self._complete = utf8_complete
        self.control = control
        #: the control's request as of this round's start (``begin_round``)
        self._end_latched = False
        self.mode, self.remaining, self.force_pos = IDLE, budget, 0
        #: the state before each token given to advance (for rollback)
        self.history: list[tuple[int, int, int, int, int]] = []

    # -- what may come next ------------------------------------------------------

    @property
    def forcing(self) -> int | None:
        """The token the budget forces next, or None."""
        if self.mode == FORCING and self.force_pos < len(self.forced_tokens):
            return self.forced_tokens[self.force_pos]
        return None

    def allowed(self, token: int) -> bool:
        f = self.forcing
        return 0 <= int(token) < self.vocab.n_vocab and (f is None or int(token) == f)

    def fill_bitmask(self, out: np.ndarray | None = None) -> np.ndarray:
        """The next token's mask in the grammar's layout (int32 words, bit t % 32 of
        word t // 32: token t allowed)."""
        if out is None:
            out = np.empty(self.vocab.n_words, dtype=np.int32)
        f = self.forcing
        if f is None:
            out[:] = -1
        else:
            out[:] = 0
            out.view(np.uint32)[f >> 5] = np.uint32(1) << np.uint32(f & 31)
        return out

    def _forced(self, bits: np.ndarray | None) -> int | None:
        """The token forced next (by this state, or by ``bits`` kept from
        ``fill_bitmask`` at the same position), or None."""
        if bits is None:
            return self.forcing
        words = bits.view(np.uint32)
        if (words == 0xFFFFFFFF).all():
            return None
        w = int(np.flatnonzero(words)[0])
        return w * 32 + int(words[w]).bit_length() - 1

    def mask_into(self, logits: np.ndarray, bits: np.ndarray | None = None) -> None:
        """What the budget forbids next at -inf, in place."""
        f = self._forced(bits)
        if f is not None:
            keep = logits[f]
            logits[:] = -np.inf
            logits[f] = keep

    def masked(self, logits: np.ndarray, bits: np.ndarray | None = None) -> np.ndarray:
        """``logits`` itself while not forcing (no copy: the verify rows of a thinking
        chat), else a row of -inf but the forced token's."""
        f = self._forced(bits)
        if f is None:
            return logits
        out = np.full_like(logits, -np.inf)
        out[f] = logits[f]
        return out

    # -- moving ------------------------------------------------------------------

    def advance(self, token: int) -> None:
        t = int(token)
        self.history.append((self.mode, self.remaining, self.force_pos, self._start.pos, self._end.pos))
        if self.mode == IDLE:
            if self._start.advance(t):
                self._arm()
        elif self.mode in (COUNTING, WAITING_UTF8):
            if self._end.advance(t):
                self.mode = DONE
                return
            complete = self._complete(t)
            if self.mode == WAITING_UTF8:
                if complete:
                    self._force()
            else:
                self.remaining -= 1
                if self._spent():
                    if complete:
                        self._force()
                    else:
                        self.mode = WAITING_UTF8
                        self._end.pos = 0
        elif self.mode == FORCING:
            self.force_pos += 1
            if self.force_pos >= len(self.forced_tokens):
                self.mode = DONE
        elif self._start.advance(t):  # done: a new think block gets a new budget
            self._arm()
            self._end.pos = 0

    def advance_many(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.advance(t)

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` tokens given to ``advance``."""
        if n < 0 or n > len(self.history):
            raise ValueError(f"cannot roll back {n} of {len(self.history)} tokens")
        if n == 0:
            return
        state = self.history[-n]
        del self.history[-n:]
        self.mode, self.remaining, self.force_pos, self._start.pos, self._end.pos = state

    def begin_round(self) -> None:
        """The driver starts a round: a reasoning end requested meanwhile (from another
        thread) applies from here, after the next token that completes a character.
        Read at no other time, so that the masks the drafting step keeps for the
        verify rows and the tokens verification advances see the same state."""
        self._end_latched = self.control is not None and self.control.is_set()

    def _spent(self) -> bool:
        """The think block must end: its budget (if any) is used up, or the end was asked for."""
        return self.budget >= 0 and self.remaining <= 0 or self._end_latched

    def _arm(self) -> None:
        self.mode, self.remaining = COUNTING, self.budget
        if self._spent():
            self._force()

    def _force(self) -> None:
        self.mode, self.force_pos = FORCING, 0
        self._end.pos = 0
        if not self.forced_tokens:
            self.mode = DONE
