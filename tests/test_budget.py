"""llama-server's reasoning budget: the state machine (as llama.cpp's sampler), the
engine (forced end of thinking, the same text with speculation as without), the
server's flags and fields."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from stepmtp.budget import BudgetState, ReasoningBudget, _utf8_complete

START, END, MSG = [7], [8, 9], [5, 6]  # "<think>", "</think>" in two tokens, a message


def state(budget: int, complete=lambda t: True) -> BudgetState:
    return BudgetState(100, START, END, MSG + END, budget, complete)


def forced_run(st: BudgetState, tokens: list[int]) -> list[int | None]:
    """What the budget forces before each of ``tokens`` (which go in after)."""
    out = []
    for t in tokens:
        out.append(st.forcing)
        st.advance(t)
    return out


def test_counts_the_think_block_then_forces_message_and_end():
    st = state(3)
    assert forced_run(st, [1, 7, 2, 3, 4]) == [None] * 5  # idle, then 3 tokens of thinking
    assert [st.forcing, forced_run(st, [5])] == [5, [5]]
    assert forced_run(st, [6, 8, 9]) == [6, 8, 9]
    assert st.forcing is None and forced_run(st, [1, 2, 3, 4, 5]) == [None] * 5  # done: free
    # a new think block: a new budget
    assert forced_run(st, [7, 1, 2, 3]) == [None] * 4 and st.forcing == 5


def test_natural_end_and_zero_budget():
    st = state(5)
    forced_run(st, [7, 1, 8, 9, 2, 3, 4, 5, 6, 1])
    assert st.forcing is None  # the model closed the block itself within budget
    st = state(0)
    st.advance(7)
    assert st.forcing == 5  # budget 0: the end is forced at once


def test_a_character_is_not_cut():
    """The budget's last token ends inside a UTF-8 character: forcing waits for it."""
    st = state(2, complete=lambda t: t != 42)
    forced_run(st, [7, 1, 42])
    assert st.forcing is None
    st.advance(43)
    assert st.forcing == 5
    assert _utf8_complete("é".encode()) and not _utf8_complete("é".encode()[:1])
    assert not _utf8_complete("語".encode()[:2]) and _utf8_complete(b"ab")


def test_a_requested_end_forces_after_the_next_token_and_stays():
    """No budget (-1) and a control: thinking runs free until the end is requested; from
    the next round's start it is forced after the next token that completes a
    character. The request is not part of the rolled-back state: undoing that token
    leaves it pending, and a later think block ends at once."""
    ctl = threading.Event()
    st = BudgetState(100, START, END, MSG + END, -1, lambda t: t != 42, ctl)
    assert forced_run(st, [7] + [1] * 50) == [None] * 51  # no limit
    ctl.set()
    st.advance(1)
    assert st.forcing is None  # read at a round's start only, never under its masks
    st.begin_round()
    assert st.forcing is None
    st.advance(42)  # a character's first byte: wait for its end
    assert st.forcing is None
    st.advance(43)
    assert st.forcing == 5
    st.rollback(1)
    assert st.forcing is None
    st.advance(2)
    assert forced_run(st, [5, 6, 8, 9, 3]) == [5, 6, 8, 9, None]
    st.advance(7)  # a new think block
    assert st.forcing == 5
    with pytest.raises(ValueError):
        ReasoningBudget(-2)


def test_rollback_restores_the_state_speculation_needs():
    st = state(2)
    st.advance_many([7, 1])
    st.advance_many([2, 5, 6])  # drafts through the forcing
    assert st.forcing == 8
    st.rollback(3)
    assert st.forcing is None and st.remaining == 1
    st.advance(2)
    assert st.forcing == 5
    with pytest.raises(ValueError):
        st.rollback(10)


def test_masks_allow_only_the_forced_token():
    st = state(1)
    st.advance_many([7, 1])
    assert st.allowed(5) and not st.allowed(6)
    row = np.arange(100, dtype=np.float32)
    assert st.masked(row) is not row and state(1).masked(row) is row  # idle rows are left alone (no copy)
    bits = st.fill_bitmask(np.zeros(st.vocab.n_words, dtype=np.int32))
    row = np.arange(100, dtype=np.float32)
    st.mask_into(row, bits)
    assert np.isfinite(row).sum() == 1 and row[5] == 5
    free = state(1).fill_bitmask()
    row = np.arange(100, dtype=np.float32)
    state(1).mask_into(row, free)
    assert np.isfinite(row).all()
    # token 63: bit 31 of word 1 (the sign bit of an int32 word)
    st = BudgetState(100, START, END, [63], 0, lambda t: True)
    st.advance(7)
    row = np.zeros(100, dtype=np.float32)
    st.mask_into(row, st.fill_bitmask())
    assert np.flatnonzero(np.isfinite(row)).tolist() == [63]


def test_engine_forces_the_end_of_thinking_and_speculation_keeps_the_text():
    from stepmtp import Engine
    from stepmtp.models import default_model_path

    budget = ReasoningBudget(10, message=" Enough.")
    outs = {}
    for mode in ("none", "chain"):
        with Engine(default_model_path(), mode=mode, n_ctx=1024) as eng:
            prompt = eng.apply_chat_template([{"role": "user", "content": "hi"}])
            assert prompt.endswith("<think>\n")
            outs[mode] = eng.generate(prompt, n_predict=40, temperature=0, reasoning_budget=budget)
            free = eng.generate(prompt, n_predict=40, temperature=0)
            forced = eng.model.tokenize(" Enough.</think>", add_special=False, parse_special=True)
    toks = outs["none"].tokens
    assert outs["chain"].tokens == toks
    assert "</think>" not in free.text
    # the budget: the prompt's "\n" after <think> and 9 generated tokens (plain decoding's),
    # then the message and the end tag, forced
    assert toks[:9] == free.tokens[:9] and toks[9 : 9 + len(forced)] == forced


def test_server_flags_and_fields(capsys):
    from stepmtp.server.anthropic import to_openai
    from stepmtp.server.cli import parse_args

    cfg = parse_args(["--reasoning-budget", "128", "--reasoning-budget-message", "Time is up."])
    assert cfg.reasoning_budget == 128 and cfg.reasoning_budget_message == "Time is up."
    with pytest.raises(SystemExit):
        parse_args(["--reasoning-budget", "-2"])
    assert "invalid value for --reasoning-budget" in capsys.readouterr().err
    oai = to_openai({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                     "thinking": {"type": "enabled", "budget_tokens": 64}})
    assert oai["thinking_budget_tokens"] == 64
