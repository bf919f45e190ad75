"""``python -m stepmtp --compare``, the first command a newcomer runs: what its report
says holds (the same text in every mode, fewer target decodes with the heads, time
parts that add up), and its default prompts complete to Python. No timing is asserted."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import Counter

import pytest

from stepmtp import Engine, GenStats
from stepmtp import compare as C
from stepmtp.__main__ import DEFAULT_FUNCTIONS, DEFAULT_STOP, default_prompts, main
from stepmtp.models import default_model_path

ROW = re.compile(r"^\s+(none \(plain decoding\)|single head, 3 drafts|chain of heads, 3 drafts)\s+(\d+)\s+(\d+)\s+"
                 r"([\d.]+)\s+(?:(\d+)/(\d+)\s+\d+%|-)")


@pytest.fixture(scope="module")
def report() -> subprocess.CompletedProcess:
    """The README's main command, as a newcomer runs it (one run of each, one thread)."""
    return subprocess.run([sys.executable, "-m", "stepmtp", "--compare", "--repeat", "1", "-t", "1"],
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def greedy() -> list:
    """Plain greedy decoding of the default prompts, as the command runs them."""
    with Engine(default_model_path(), mode="none", n_threads=1) as eng:
        return [eng.generate(p, n_predict=128, temperature=0, stop=DEFAULT_STOP) for p in default_prompts()]


def _rows(out: str) -> dict[str, dict[str, float]]:
    rows = {}
    for line in out.splitlines():
        m = ROW.match(line)
        if m:
            rows[m.group(1).split()[0]] = {"tokens": int(m.group(2)), "decodes": int(m.group(3)),
                                           "per_decode": float(m.group(4)),
                                           "accepted": int(m.group(5) or 0), "drafted": int(m.group(6) or 0)}
    return rows


def _time_rows(out: str) -> dict[str, list[str]]:
    block = out[out.index("Where the time went"):out.index("KV cache")]
    rows = {}
    for line in block.splitlines()[2:]:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) == 4:
            rows[cells[0]] = cells[1:]
    return rows


def test_same_text_fewer_target_decodes(report, greedy):
    """Every mode made the same tokens; plain decoding one token a decode, the single
    head fewer decodes, the chain fewer still; the text shown is plain greedy decoding's."""
    assert report.returncode == 0, report.stderr
    out = report.stdout
    assert "ok: the three modes made the same text, token for token" in out
    rows = _rows(out)
    assert set(rows) == {"none", "single", "chain"}, out
    n = sum(c.stats.n_predicted for c in greedy)
    assert {r["tokens"] for r in rows.values()} == {n}
    assert rows["none"]["decodes"] == n and rows["none"]["drafted"] == 0
    assert rows["chain"]["decodes"] < rows["single"]["decodes"] < rows["none"]["decodes"]
    for r in rows.values():
        assert r["per_decode"] == pytest.approx(r["tokens"] / r["decodes"], abs=0.006)
    # the chain accepts more of its drafts than the head alone, at the same draft count a round
    assert rows["chain"]["accepted"] / rows["chain"]["drafted"] > rows["single"]["accepted"] / rows["single"]["drafted"]
    for prompt, c in zip(default_prompts(), greedy):
        assert prompt + c.text + "\n" in out
    fewer = re.search(r"The chain made the same text with ([\d.]+)x fewer target\s+decodes", out)
    assert fewer and float(fewer.group(1)) == pytest.approx(rows["none"]["decodes"] / rows["chain"]["decodes"],
                                                            abs=0.051)


def test_time_parts_add_up(report):
    """The time table's parts sum to its total, in every mode; the heads take no time
    without speculation; plain decoding is the speed's unit."""
    rows = _time_rows(report.stdout)
    parts = ["generating: the target's decodes", "the heads' decodes", "Python"]
    assert rows["the heads' decodes"][0] == "-"
    for i in range(3):
        values = [float(rows[p][i]) if rows[p][i] != "-" else 0.0 for p in parts]
        assert all(v >= 0 for v in values)
        assert sum(values) == pytest.approx(float(rows["all"][i]), abs=0.2)
    assert rows["speed, x plain decoding"][0] == "1.00x"
    assert all(float(v) > 0 for v in rows["tokens a second, generating"])


def test_says_why_and_how_to_see_the_speed_up(report):
    """The tiny model's costs against Step-3.5-Flash's, and the command that times the
    same text on the bench-size model."""
    out = report.stdout
    flash = re.search(r"a round\s+of the chain's ([\d.]+)\s+tokens would cost ([\d.]+) decodes there, ([\d.]+)x", out)
    assert flash, out
    assert float(flash.group(3)) == pytest.approx(float(flash.group(1)) / float(flash.group(2)), rel=0.01)
    assert re.search(r"On this \d+ MB model a plain decode takes [\d.]+ ms", out)
    assert "\n    python -m stepmtp --compare --bench-model\n" in out


def test_default_prompts_complete_to_python(greedy):
    """The default prompts' completions read as code: each function ends (a blank line)
    and parses, with no line said three times. Greedy texts change with the CPU build
    (see test_default_model), so one of the four may fail."""
    assert len(greedy) == len(DEFAULT_FUNCTIONS)
    good = 0
    for prompt, c in zip(default_prompts(), greedy):
        lines = [ln for ln in c.text.splitlines() if ln.strip()]
        try:
            ast.parse(prompt + c.text)
        except SyntaxError:
            continue
        good += c.finish_reason == "stop" and len(lines) >= 2 and max(Counter(lines).values()) <= 2
    assert good >= len(greedy) - 1


def test_one_mode_prints_the_texts(capsys):
    assert main(["-p", "def f(x):", "-n", "8", "-t", "1", "--mtp-mode", "single"]) == 0
    out, err = capsys.readouterr()
    assert "def f(x):" in out and "single" in err and "pred=   8" in err


def test_bench_model_flag(monkeypatch, capsys):
    """--bench-model runs the model's bench-size variant (here a stand-in: the bundled
    model itself), and no longer offers to."""
    import stepmtp.bench.model as B

    made = []
    monkeypatch.setattr(B, "bench_model", lambda src, *a, **kw: made.append(src) or src)
    assert main(["--compare", "--bench-model", "--repeat", "1", "-t", "1"]) == 0
    out = capsys.readouterr().out
    assert made == [default_model_path()]
    assert "bench-size variant" in out and "On the bench-size model a plain decode takes" in out
    assert "--bench-model\n" not in out and "To time the same text" not in out


def test_draft_time_is_the_heads_share():
    """GenStats.t_draft_ms: the heads' part of the time in llama.cpp, none without them."""
    prompt = default_prompts()[0]
    with Engine(default_model_path(), mode="none", n_threads=1) as eng:
        plain = eng.generate(prompt, n_predict=16, temperature=0).stats
    with Engine(default_model_path(), mode="chain", n_threads=1) as eng:
        chain = eng.generate(prompt, n_predict=16, temperature=0).stats
    assert plain.t_draft_ms == 0 and plain.t_llama_ms > 0
    assert 0 < chain.t_draft_ms < chain.t_llama_ms and chain.n_draft_decodes > 0


def test_totals_and_costs():
    a = GenStats(n_predicted=3, n_drafted=4, drafted_per_depth=[2, 1, 1], t_gen_ms=1.5)
    b = GenStats(n_predicted=5, n_drafted=2, drafted_per_depth=[1, 1, 0], t_gen_ms=2.0)
    t = GenStats.total([a, b])
    assert (t.n_predicted, t.n_drafted, t.drafted_per_depth, t.t_gen_ms) == (8, 6, [3, 2, 1], 3.5)
    assert GenStats.total([]) == GenStats()
    ratios = {"target2/target1": 1.5, "target3/target1": 2.0, "target4/target1": 2.5}
    assert C.verify_cost(ratios, 1, "target{}/target1") == 1.0
    assert C.verify_cost(ratios, 3.5, "target{}/target1") == pytest.approx(2.25)
    assert C.verify_cost(ratios, 9, "target{}/target1") == 2.5
    assert C.head_cost({"target1": 0.01, "head0/target1": 0.1, "head1/target1": 0.3}) == pytest.approx(0.2)


def test_modes_take_turns_and_the_fastest_run_counts():
    """A small model is opened again for each run of the prompts, the modes in turn (a
    busy spell slows all alike); a large one once per mode. Each prompt keeps its fastest run."""
    from stepmtp.slots import Completion

    opened: list[str] = []
    # per run of the prompts: none a, none b, chain a, chain b
    times = iter([5.0, 3.0, 4.0, 9.0, 4.0, 6.0, 3.0, 2.0, 6.0, 1.0, 7.0, 7.0, 8.0, 8.0, 8.0])

    class Fake:
        def __init__(self, mode):
            opened.append(mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def memory(self):
            return {"target": {"kv": 2**20}, "draft": {"kv": 0}}

        def generate(self, prompt, n_predict=0, **kw):
            if n_predict == 4:  # the warm-up
                return None
            return Completion(prompt, [1], "stop", "eos", stats=GenStats(n_predicted=1, t_gen_ms=next(times)))

    runs = C.run_modes(lambda mode, first: Fake(mode), ["none", "chain"], 3, ["a", "b"], {}, repeat=3)
    assert opened == ["none", "chain"] * 3
    assert [c.stats.t_gen_ms for c in runs["none"].completions] == [4.0, 1.0]
    assert [c.stats.t_gen_ms for c in runs["chain"].completions] == [3.0, 2.0]
    assert runs["chain"].n_max == 3 and runs["none"].n_max == 0 and runs["none"].kv_mib == (1.0, 0.0)
    opened.clear()
    times = iter([1.0] * 6)
    C.run_modes(lambda mode, first: Fake(mode), ["none", "chain"], 3, ["a"], {}, repeat=3, reload=False)
    assert opened == ["none", "chain"]
