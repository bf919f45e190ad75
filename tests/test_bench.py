"""``stepmtp.bench``: the change's output layout, prompt files, the regression gate
(an unchanged run passes; a driver with chaining disabled, or a slower loop, fails
it), the widened model and the bench-size model shaped like Step-3.5-Flash (same
greedy tokens), and server processes."""
from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from stepmtp.bench import gate as G
from stepmtp.bench import matrix as X
from stepmtp.bench import report as R
from stepmtp.bench import speed as S
from stepmtp.bench.__main__ import main as bench_main
from stepmtp.bench.harness import run_bench
from stepmtp.bench.prompts import CATEGORIES, Prompt, load_prompts
from stepmtp.bench.runners import BenchConfig, EngineRunner, Result, ServerProcess, URLRunner, parse_configs
from stepmtp.tiny import write_agree_model

N_PREDICT = 32
CATS = ["code_python", "qa_factual", "summarize"]


@pytest.fixture(scope="module")
def agree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_agree_model(tmp_path_factory.mktemp("agree"), seed=0)[0]


@pytest.fixture(scope="module")
def prompts():
    return load_prompts().select(CATS, n_predict=N_PREDICT)


def bench(model: Path, prompts, configs: str = "none,single-2,chain-3", repeat: int = 2):
    runners = [EngineRunner(c, model, n_ctx=1024, n_threads=1) for c in parse_configs(configs)]
    return run_bench(prompts, runners, repeat=repeat, warmup=1, progress=False)


@pytest.fixture(scope="module")
def baseline(agree, prompts):
    return G.make_baseline(bench(agree, prompts, repeat=3), tolerance=0.5)


# -- layout -----------------------------------------------------------------------------


def test_request_line_is_the_changes_layout():
    # two lines of the change's description
    r = Result("summarize", "chain-2", "", 10, 192, 160, 110, None, None, gen_ms=192 / 33.2 * 1e3,
               prompt_ms=0.0, wall_s=1.0)
    assert R.request_line(r) == "  summarize          pred= 192 draft= 160 acc= 110 rate=0.688 tok/s=33.2"
    r = Result("creative_short", "x", "", 10, 192, 189, 95, None, None, gen_ms=192 / 28.1 * 1e3,
               prompt_ms=0.0, wall_s=1.0)
    assert R.request_line(r) == "  creative_short     pred= 192 draft= 189 acc=  95 rate=0.503 tok/s=28.1"


def test_aggregate_keys_and_depths(agree, prompts):
    run = bench(agree, prompts, "none,chain-3", repeat=1)
    chain = run.by_label()["chain-3"]
    agg = R.aggregate(chain.results, chain.config, chain.info["n_heads"])
    assert list(agg)[:6] == ["n_requests", "total_predicted", "total_draft", "total_draft_accepted",
                             "aggregate_accept_rate", "wall_s_total"]
    assert agg["n_requests"] == len(CATS) and agg["total_predicted"] == len(CATS) * N_PREDICT
    assert 0 < agg["total_draft_accepted"] < agg["total_draft"]
    assert agg["aggregate_accept_rate"] == round(agg["total_draft_accepted"] / agg["total_draft"], 4)
    assert sum(agg["draft_per_depth"]) == agg["total_draft"]
    assert sum(agg["accepted_per_depth"]) == agg["total_draft_accepted"]
    # chain-3 fused: one target decode and three draft decodes per round, prompt left out
    assert agg["target_decodes_per_round"] == 1.0 and agg["draft_decodes_per_round"] == 3.0
    # a verify carries the last token and the drafts; the warm-up left the prompt cached,
    # so its rows are the ones actually decoded (not len(prompt)), for heads too
    rounds = agg["rounds"]
    assert agg["target_rows_per_round"] == round((rounds + agg["total_draft"]) / rounds, 3)
    # each head: one row at least, at most the round's new anchors (accepted + 1) and a draft
    assert 3.0 <= agg["draft_rows_per_round"] <= 3.0 * 5
    assert all(r.prompt_target_rows < r.n_prompt for r in chain.results)
    block = R.config_block(chain)
    assert "Aggregate: {" in block and R.request_line(chain.results[0]) in block
    assert not run.mismatches
    md = R.markdown(run)
    assert "| chain-3 |" in md and "identical" in md
    doc = R.to_json(run)
    json.dumps(doc)
    assert doc["environment"] == {} or "cpu_model" in doc["environment"]
    assert [c["label"] for c in doc["configs"]] == ["none", "chain-3"]


def test_config_specs():
    labels = [c.label for c in parse_configs("none,single:2,chain-3,chain-3-ref,cpp-single-2,cpp-none,srv-chain-2")]
    assert labels == ["none", "single-2", "chain-3", "chain-3-ref", "cpp-single-2", "cpp-none", "srv-chain-2"]
    with pytest.raises(ValueError):
        BenchConfig.parse("cpp-chain-3")  # the C++ server does not chain
    with pytest.raises(ValueError):
        parse_configs("none,none")
    sampled = parse_configs("none-t0.7,chain-3-t0.7-exact,chain-3-t0.7-rej,chain-2-adapt,srv-chain-3-adapt-t1-rej")
    assert [c.label for c in sampled] == ["none-t0.7", "chain-3-t0.7-exact", "chain-3-t0.7-rej", "chain-2-adapt",
                                          "srv-chain-3-adapt-t1-rej"]
    assert sampled[2].verify == "rejection" and sampled[2].temperature == 0.7 and sampled[3].adaptive
    # sampled configurations are compared with no speculation at their own temperature
    assert sampled[0].family == sampled[1].family != parse_configs("none")[0].family
    for bad in ("cpp-single-3-rej", "chain-3-t9", "chain-3-fast"):
        with pytest.raises(ValueError):
            BenchConfig.parse(bad)


def test_cli_compare_verify_and_adaptive(tmp_path, capsys):
    """--compare verify samples at three temperatures with both verifiers on the random
    tiny model (heads that disagree, so the verifiers differ); --compare adaptive runs
    the adaptive length next to every fixed n-max, with identical greedy texts."""
    from stepmtp.tiny import write_tiny_models

    model = write_tiny_models(tmp_path / "tiny", seed=0)["embedded"]
    js = tmp_path / "v.json"
    assert bench_main(["-m", str(model), "--compare", "verify", "--limit", "2", "-n", "24", "-t", "1", "-q",
                       "--json", str(js)]) == 0
    doc = json.loads(js.read_text())
    labels = [c["label"] for c in doc["configs"]]
    assert labels == ["none-t0.3", "chain-3-t0.3-exact", "chain-3-t0.3-rej", "none-t0.7", "chain-3-t0.7-exact",
                      "chain-3-t0.7-rej", "none-t1", "chain-3-t1-exact", "chain-3-t1-rej"]
    assert "Sampled: 9 configurations" in capsys.readouterr().out
    js = tmp_path / "a.json"
    assert bench_main(["-m", str(model), "--compare", "adaptive", "--limit", "2", "-n", "24", "-t", "1", "-q",
                       "--repeat", "2", "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "| chain-3-adapt |" in out and "identical across the 5 configurations" in out
    # per prompt: every configuration's speed with the repeats' spread, and the
    # adaptive length against the fastest fixed one
    assert "| category | none | chain-1 | chain-2 | chain-3 | chain-3-adapt | chain-3-adapt / best fixed |" in out
    doc = json.loads(js.read_text())
    for c in doc["configs"]:
        assert all(len(r["gen_ms_repeats"]) == 2 for r in c["requests"])
        # adaptive draft counts follow measured times, so repeats may differ: not "unstable"
        assert c["unstable"] == []


# -- prompt sets -------------------------------------------------------------------------


def test_default_prompts():
    ps = load_prompts()
    assert [p.category for p in ps.prompts] == list(CATEGORIES)
    assert all(p.n_predict == 192 for p in ps.prompts)


def test_prompt_files(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('# a comment\n{"category": "a", "prompt": "def f():"}\n\n{"name": "b", "content": "x", '
                 '"n_predict": 7}\n')
    ps = load_prompts(f)
    assert [(p.category, p.prompt, p.n_predict) for p in ps.prompts] == [("a", "def f():", 192), ("b", "x", 7)]
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"n_predict": 5, "prompts": ["one", {"category": "two", "prompt": "2"}]}))
    assert [(p.category, p.n_predict) for p in load_prompts(f).prompts] == [("p0", 5), ("two", 5)]
    f.write_text(json.dumps([{"category": "a", "prompt": "1"}, {"category": "a", "prompt": "2"}]))
    with pytest.raises(ValueError, match="unique"):
        load_prompts(f)
    with pytest.raises(ValueError, match="no prompt of category"):
        load_prompts().select(["nope"])


# -- the gate -----------------------------------------------------------------------------


def test_gate_passes_unchanged(agree, prompts, baseline):
    rep = G.check(bench(agree, prompts), baseline)
    assert rep.ok, rep.text()
    assert rep.n_compared == 3 * len(CATS)
    assert "PASS" in rep.text()


def test_gate_fails_with_chaining_disabled(agree, prompts, baseline, monkeypatch):
    """A broken driver: every draft step runs head 0 (each head's context left on the
    MTP layer offset's default, block 0)."""
    from stepmtp.llama import Context

    init = Context.__init__

    def unbound(self, *a, mtp_block=None, **k):
        init(self, *a, **k)

    monkeypatch.setattr(Context, "__init__", unbound)
    run = bench(agree, prompts)
    assert not run.mismatches  # the output is still exact; only the drafts are worse
    rep = G.check(run, baseline)
    assert not rep.ok
    text = rep.text()
    assert "REGRESSION: chain-3 code_python:" in text and "depth 2 accepted" in text, text
    # single mode only ever uses head 0: its counts unchanged (its head's context now
    # holds every block's layer: the memory gate sees that)
    assert not any(f.startswith("single-2") and "KV memory grew" not in f for f in rep.failures), text


def test_gate_fails_when_kv_memory_grows(agree, prompts, baseline, monkeypatch):
    """A change that keeps a full-size sliding-window cache: same tokens, more KV."""
    from stepmtp.engine import Engine

    assert all(b["kv"] > 0 for b in baseline["memory"].values())
    init = Engine.__init__
    monkeypatch.setattr(Engine, "__init__", lambda self, *a, **k: init(self, *a, **{**k, "swa_full": True}))
    rep = G.check(bench(agree, prompts, "none,chain-3", repeat=1), baseline)
    text = rep.text()
    assert any(f.startswith("chain-3: KV memory grew") for f in rep.failures), text
    assert any(f.startswith("none: KV memory grew") for f in rep.failures), text


def test_gate_fails_with_shifted_drafts(agree, prompts, baseline, monkeypatch):
    """A broken driver: every draft token is off by one."""
    from stepmtp.drafters.heads import Heads

    pick = Heads._pick  # (token, probability, hidden row, confidence) of the last draft decode

    def shifted(self, *a, **k):
        tok, p, h, conf = pick(self, *a, **k)
        return (tok + 1) % 500, p, h, conf

    monkeypatch.setattr(Heads, "_pick", shifted)
    rep = G.check(bench(agree, prompts, "none,chain-3", repeat=1), baseline)
    assert not rep.ok
    assert any("chain-3" in f and "acc" in f for f in rep.failures), rep.text()
    assert any("single-2: in the baseline but not run" in f for f in rep.failures)


def test_gate_fails_when_the_loop_is_slower(agree, prompts, baseline, monkeypatch):
    """Same counts, but each speculative round costs 100 ms more: the speed ratio falls
    far below the baseline's (several times more than the tolerance of 50%)."""
    from stepmtp.mtp import MTPDriver

    orig = MTPDriver.round

    def slow_round(self, s):
        if self.speculate:
            time.sleep(0.1)
        return orig(self, s)

    monkeypatch.setattr(MTPDriver, "round", slow_round)
    rep = G.check(bench(agree, prompts, repeat=1), baseline)
    assert not rep.ok
    assert all("tok/s relative to none fell" in f for f in rep.failures), rep.text()
    assert {f.split(":")[0] for f in rep.failures} == {"single-2", "chain-3"}, rep.text()


def test_cli_gate_and_update(agree, tmp_path, capsys):
    base = tmp_path / "base.json"
    args = ["-m", str(agree), "--configs", "none,chain-2", "--categories", "qa_factual,translation", "-n", "24",
            "-t", "1", "--repeat", "1", "-q"]
    assert bench_main(["--baseline", str(base), "--update-baseline", *args]) == 0
    doc = json.loads(base.read_text())
    assert doc["settings"]["configs"] == ["none", "chain-2"]
    # the baseline's settings are the defaults: --baseline alone reruns the same thing
    assert bench_main(["--baseline", str(base), "-q", "--tolerance", "0.9"]) == 0
    assert "gate: PASS" in capsys.readouterr().out
    # a deliberate change not yet accepted
    doc["counts"]["chain-2"]["translation"]["acc"] += 1
    doc["counts"]["chain-2"]["translation"]["acc_per_depth"][1] += 1
    base.write_text(json.dumps(doc))
    assert bench_main(["--baseline", str(base), "-q", "--tolerance", "0.9"]) == 1
    out = capsys.readouterr().out
    assert "REGRESSION: chain-2 translation: acc" in out and "depth 2 accepted" in out
    assert "gate: FAIL" in out
    # accepted with --update-baseline
    assert bench_main(["--baseline", str(base), "-q", "--update-baseline"]) == 0
    assert bench_main(["--baseline", str(base), "-q", "--tolerance", "0.9"]) == 0


def test_cli_outputs(agree, tmp_path, capsys):
    out = tmp_path / "out"
    rc = bench_main(["-m", str(agree), "--configs", "none,single-2", "--categories", "code_cpp", "-n", "16",
                     "-t", "1", "--out", str(out), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "  code_cpp           pred=  16 draft=" in text and "Aggregate: {" in text
    doc = json.loads((out / "bench.json").read_text())
    assert doc["identical_outputs"] and doc["environment"]["cpu_model"]
    assert "build_flags" in doc["environment"]
    assert "| single-2 |" in (out / "bench.md").read_text()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not (out / "bench.png").exists()
    else:
        assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("server", [False, True])
def test_cli_parallel(agree, tmp_path, capsys, server):
    """--parallel 3: each configuration on 1 slot with 1 client and on 3 slots with 3
    clients, same texts, in-process or through the server."""
    js = tmp_path / "par.json"
    rc = bench_main(["-m", str(agree), "--configs", "none,chain-3", "--limit", "4", "-n", "12", "-t", "1",
                     "--parallel", "3", "--json", str(js), "--no-progress", *(["--server"] if server else [])])
    assert rc == 0
    pre = "srv-" if server else ""
    assert f"| {pre}chain-3 | 3 | 4 | 48 |" in capsys.readouterr().out
    doc = json.loads(js.read_text())
    runs = {(r["config"].removeprefix(pre), r["clients"]): r for r in doc["runs"]}
    assert set(runs) == {("none", 1), ("none", 3), ("chain-3", 1), ("chain-3", 3)}
    assert runs[("chain-3", 3)]["accept_rate"] == runs[("chain-3", 1)]["accept_rate"] > 0
    assert all(r["tok_s"] > 0 for r in runs.values())
    assert bench_main(["-m", str(agree), "--parallel", "1"]) == 2


def test_cli_matrix(agree, tmp_path, capsys):
    """--matrix: servers at their default flags (MTP off, on, fixed lengths), temperatures
    x clients; at temperature 0 every entry writes MTP off's texts, under load too (else
    exit 3); a table per temperature, JSON with every run, a heat-map when matplotlib is there."""
    out = tmp_path / "m"
    rc = bench_main(["-m", str(agree), "--matrix", "--entries", "off,mtp,n3,n3-raw", "--temps", "0,1",
                     "--clients", "1,2", "--limit", "3", "-n", "12", "-t", "1", "--out", str(out), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "**temperature 0**" in text and "**temperature 1**" in text and "| `n3-raw` |" in text
    doc = json.loads((out / "matrix.json").read_text())
    cells = {(c["temperature"], c["clients"]): c for c in doc["matrix"]}
    assert set(cells) == {(0.0, 1), (0.0, 2), (1.0, 1), (1.0, 2)}
    for c in cells.values():
        e = c["entries"]
        assert set(e) == {"off", "mtp", "n3", "n3-raw"}
        assert all(x["runs"][0]["tokens"] == 36 for x in e.values())  # 3 prompts x 12 tokens
        assert e["off"]["x_off"] == 1.0 and e["off"]["accept"] is None
    assert cells[(0.0, 1)]["entries"]["n3"]["accept"] > 0  # a fixed length drafts every round
    assert (out / "matrix.md").read_text().startswith("**temperature 0**")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / "matrix.png").read_bytes()[:4] == b"\x89PNG"



def test_cli_speed(agree, tmp_path, capsys):
    """--speed: each entry's fresh prompt and N clients' decoding through its server, the
    same prompt to every entry; the table, and the JSON with one figure per repetition."""
    out = tmp_path / "s"
    rc = bench_main(["-m", str(agree), "--speed", "--entries", "off,mtp", "--clients", "1,2", "--prompt-tokens", "96",
                     "-n", "8", "--repeat", "2", "-t", "1", "--out", str(out), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| `mtp` x `off` |" in text and "prompt 96 tokens" in text
    doc = json.loads((out / "speed.json").read_text())
    assert doc["cells"] == ["prompt", "decode-1", "decode-2"] and doc["reference"] == "off"
    for cell in doc["cells"]:
        assert set(doc["speed"][cell]) == {"off", "mtp"}
        assert all(len(v) == 2 and min(v) > 0 for v in doc["speed"][cell].values())
    run = S.SpeedRun(["prompt"], {"prompt": {"a": [2.0, 4.0], "b": [1.0, 1.0]}})
    ratio, se = run.paired("prompt", "a", "b")
    assert abs(ratio - 8 ** 0.5) < 1e-9 and se > 0 and run.best("prompt", "a") == 4.0


def test_cli_verify_costs(agree, tmp_path, capsys):
    """--verify-costs: k rows in one-row decodes, our kernels against llama.cpp's (fresh
    processes, the rule off by the environment); k = 1 is 1 by construction."""
    out = tmp_path / "v"
    rc = bench_main(["-m", str(agree), "--verify-costs", "-t", "1", "--out", str(out), "--no-progress"])
    assert rc == 0
    assert "| ours x llama.cpp's |" in capsys.readouterr().out
    doc = json.loads((out / "verify-costs.json").read_text())
    assert doc["rows"] == [1, 2, 3, 4, 8, 16, 32, 63] and set(doc["ratios"]) == {"ours", "llama.cpp"}
    for r in doc["ratios"].values():
        assert r["1"] == 1.0 and r["63"] > r["2"] > 1.0


def test_matrix_entries_take_turns_group_by_group():
    """A cell's pass: each group of `clients` prompts goes to every entry before the next
    group does, the first entry rotating, so entries are compared within seconds; every
    entry is sent every prompt once, and its pass adds up its groups."""
    t = X.turns(9, 4, ["off", "mtp", "cpp-mtp"])
    assert [(n, list(g)) for n, g in t[:4]] == [("off", [0, 1, 2, 3]), ("mtp", [0, 1, 2, 3]),
                                               ("cpp-mtp", [0, 1, 2, 3]), ("mtp", [4, 5, 6, 7])]
    assert [n for n, _ in t[3:6]] == ["mtp", "cpp-mtp", "off"] and [n for n, _ in t[6:]] == ["cpp-mtp", "off", "mtp"]
    for name in ("off", "mtp", "cpp-mtp"):
        assert [i for n, g in t if n == name for i in g] == list(range(9))
    assert [len(g) for n, g in t if n == "off"] == [4, 4, 1]
    assert [list(g) for _, g in X.turns(3, 1, ["a", "b"])] == [[0], [0], [1], [1], [2], [2]]
    run = X.Run.joined([X.Run(2.0, 40, 10, 8, ["a", "b"]), X.Run(1.0, 20, 5, 1, ["c"])])
    assert (run.wall_s, run.tokens, run.drafted, run.accepted, run.texts) == (3.0, 60, 15, 9, ["a", "b", "c"])
    assert run.tok_s == 20.0


def test_matrix_cells_get_fresh_servers(monkeypatch):
    """Every cell of every pass runs on servers started for it, and the warm-up sends
    none of the bench's prompts: a server drafting from earlier requests (our context
    pool) would otherwise copy what it wrote for the same prompts a cell before."""
    started, sent = [], []

    class Fake:
        def __init__(self, argv, label):
            self.argv, self.label, self.url, self.open = argv, label, f"fake://{label}", False

        def start(self):
            self.open = True
            started.append(self)

        def close(self):
            self.open = False

    def request(url, p, temperature, timeout):
        server = next(s for s in reversed(started) if s.url == url)
        assert server.open
        sent.append((server, p.prompt))
        return {"content": "x", "timings": {"predicted_n": 4}}

    monkeypatch.setattr(X, "ServerProcess", lambda argv, label: Fake(argv, label))
    monkeypatch.setattr(X, "_http", lambda url, timeout: (200, {}))
    monkeypatch.setattr(X, "_request", request)
    prompts = [Prompt("c", f"prompt {i}\n", 4) for i in range(3)]
    cells, props = X.run_matrix(prompts, [X.ENTRIES["off"], X.ENTRIES["mtp"]], Path("m.gguf"),
                                temps=(0.0, 1.0), clients=(1,), repeat=2, progress=False)
    assert len(started) == 2 * 2 * 2 and not any(s.open for s in started)  # entries x cells x passes
    assert set(props) == {"off", "mtp"}
    for server in started:  # each server: the warm-up, then the cell's prompts once each
        got = [p for s, p in sent if s is server]
        assert got[0] == X.WARM_UP.prompt and sorted(got[1:]) == [p.prompt for p in prompts]
    assert X.WARM_UP.prompt not in {p.prompt for p in prompts}


def test_matrix_paired_ratio_is_group_by_group():
    """Cell.paired: the geometric mean of the entries' tok/s ratios over the same groups
    and its standard error; the passes' ratio (tokens over wall time, each pass joined from
    its groups) can say another thing: here `mtp` is faster in every group, but its texts
    ran longer in its slower groups (temperature 1), which weigh more in its pass."""
    c = X.Cell(1.0, 1)
    c.passes["off"] = [[X.Run(1.0, 10, 0, 0, []), X.Run(1.0, 40, 0, 0, []), X.Run(1.0, 10, 0, 0, [])]]
    c.passes["mtp"] = [[X.Run(2.0, 22, 0, 0, []), X.Run(1.0, 44, 0, 0, []), X.Run(2.0, 24, 0, 0, [])]]
    assert [r.tok_s for r in c.runs["off"]] == [20.0] and [r.tok_s for r in c.runs["mtp"]] == [18.0]
    r, se, n = c.paired("mtp")
    assert n == 3 and r == pytest.approx((1.1 * 1.1 * 1.2) ** (1 / 3))
    logs = [math.log(1.1), math.log(1.1), math.log(1.2)]
    assert se == pytest.approx(statistics.stdev(logs) / 3 ** 0.5)
    assert c.ratio("mtp") < 1 < r
    assert c.paired("mtp", "cpp-mtp") is None
    d = c.to_dict()["entries"]["mtp"]
    assert d["paired_x_off"]["groups"] == 3 and d["paired_x_off"]["ratio"] == pytest.approx(r)
    assert "| `mtp` x `off` | 1.132 ±" in X.markdown([c], [X.ENTRIES["off"], X.ENTRIES["mtp"]])

# -- the widened model -------------------------------------------------------------------


def test_widen_keeps_greedy_tokens(agree, tmp_path):
    import gguf

    from stepmtp import Engine
    from stepmtp.bench.widen import widen

    dst = tmp_path / "wide.gguf"
    res = widen(agree, dst, 3.0)
    assert res.widths == {"experts": (32, 128), "shexp": (48, 192)}
    r = gguf.GGUFReader(str(dst))
    assert int(r.fields["step35.expert_feed_forward_length"].contents()) == 128
    assert int(r.fields["step35.expert_shared_feed_forward_length"].contents()) == 192
    assert int(r.fields["step35.feed_forward_length"].contents()) == 96  # dense (and MTP blocks) untouched
    src_keys = set(gguf.GGUFReader(str(agree)).fields)
    assert src_keys == set(r.fields)
    out = {}
    for path in (agree, dst):
        for mode in ("none", "chain"):
            with Engine(path, mode=mode, n_ctx=512, n_threads=1, adaptive=False) as eng:
                c = eng.generate("def heappush(heap, item):", n_predict=48, temperature=0)
                out[(path, mode)] = (c.tokens, c.stats.n_drafted, c.stats.n_accepted)
    assert out[(agree, "none")][0] == out[(dst, "none")][0] == out[(agree, "chain")][0]
    assert out[(agree, "chain")] == out[(dst, "chain")]
    with pytest.raises(ValueError):
        widen(agree, tmp_path / "x.gguf", 0.5)


def test_bench_tiny_model_has_ascii_byte_tokens(agree, tmp_path, monkeypatch):
    """The bench's tiny agree model: same tokens as write_agree_model's, text that any
    server can return (valid UTF-8, the lone byte tokens spelled ~xHH~)."""
    from stepmtp import Engine
    from stepmtp.bench.model import resolve_model

    monkeypatch.setenv("STEPMTP_CACHE_DIR", str(tmp_path))
    path = resolve_model("tiny-agree")
    assert path.parent == tmp_path / "bench"
    assert resolve_model("tiny-agree") == path  # unchanged bytes: kept as it is
    out = []
    for p in (agree, path):
        with Engine(p, mode="chain", n_ctx=512, n_threads=1) as eng:
            c = eng.generate("def f(x):", n_predict=64, temperature=0)
            out.append(c)
    assert out[0].tokens == out[1].tokens
    assert "\ufffd" in out[0].text and "\ufffd" not in out[1].text and "~x" in out[1].text


def _requantize(src: Path, dst: Path, names: tuple[str, ...]) -> None:
    """A copy of ``src`` with the tensors whose names end with ``names`` stored as Q8_0."""
    import gguf
    import numpy as np

    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), str(r.fields["general.architecture"].contents()))
    for name, f in r.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            w.add_key_value(name, f.contents(), f.types[0],
                            sub_type=f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        if t.name.endswith(names):
            q = gguf.quants.quantize(np.asarray(t.data, dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(t.name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(t.name, np.asarray(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_widen_quantized(agree, tmp_path):
    """Q8_0 tensors are widened at the byte level (a zero block is zero) and stay Q8_0."""
    import gguf

    from stepmtp import Engine
    from stepmtp.bench.widen import widen

    q8 = tmp_path / "q8.gguf"
    _requantize(agree, q8, ("_exps.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight"))
    wide = tmp_path / "q8-wide.gguf"
    widen(q8, wide, 2.0)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(wide)).tensors}
    assert types["blk.1.ffn_down_exps.weight"] == gguf.GGMLQuantizationType.Q8_0
    toks = []
    for path in (q8, wide):
        with Engine(path, mode="chain", n_ctx=512, n_threads=1, adaptive=False) as eng:
            c = eng.generate("class Queue:", n_predict=32, temperature=0)
            toks.append((c.tokens, c.stats.n_accepted))
    assert toks[0] == toks[1]


def test_widen_target_size(agree, tmp_path):
    from stepmtp.bench.widen import widen

    res = widen(agree, tmp_path / "w.gguf", target_mb=6)
    assert 5.5e6 < res.dst_bytes < 7e6



# -- the bench-size model: Step-3.5-Flash's cost shape ----------------------------------


@pytest.fixture(scope="module")
def flash_small(tmp_path_factory: pytest.TempPathFactory):
    """The bundled model shaped like Step-3.5-Flash at a small scale, 12 trunk layers
    (the bench's own is scale 1/16, 45 layers, 512 wide, F16: same rules, 3.3 GB)."""
    from stepmtp.bench.flash import shape_like_flash
    from stepmtp.bench.model import resolve_model

    src = resolve_model("bundled")
    res = shape_like_flash(src, tmp_path_factory.mktemp("flash") / "flash.gguf", 0.03, n_layer=12)
    return src, res


@pytest.fixture(scope="module")
def flash_wide(tmp_path_factory: pytest.TempPathFactory):
    """As ``flash_small``, with the bench's own hidden width (4x the trained one), head
    width (Step-3.5-Flash's 128, 4x the trained 32) and F16."""
    from stepmtp.bench.flash import shape_like_flash
    from stepmtp.bench.model import resolve_model

    src = resolve_model("bundled")
    res = shape_like_flash(src, tmp_path_factory.mktemp("flash") / "wide.gguf", 0.03, n_layer=12, hidden=512,
                           head_dim_new=128, f16=True)
    return src, res


def test_flash_wide_shape(flash_wide):
    """Every hidden-wide axis is 512, the trained channels first; matrices F16, norms F32
    and scaled by sqrt(128 / 512) = 1/2 (exactly), zero past the trained channels."""
    import gguf
    import numpy as np

    src, res = flash_wide
    r = gguf.GGUFReader(str(res.path))
    assert r.fields["step35.embedding_length"].contents() == 512 and res.n_embd == 512
    t = {x.name: x for x in r.tensors}
    s = {x.name: x for x in gguf.GGUFReader(str(src)).tensors}
    assert [int(n) for n in t["token_embd.weight"].shape] == [512, 3872]
    assert [int(n) for n in t["blk.3.attn_output.weight"].shape][1] == 512
    assert [int(n) for n in t["blk.13.nextn.eh_proj.weight"].shape] == [1024, 512]
    assert [int(n) for n in t["blk.11.ffn_down_exps.weight"].shape][1] == 512
    assert t["blk.3.ffn_up_exps.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    # the source's 6 trunk layers and heads 6-8 are blocks 0-5 and 12-14 here
    for name, was in (("blk.0.attn_norm.weight", "blk.0.attn_norm.weight"),
                      ("blk.13.nextn.hnorm.weight", "blk.7.nextn.hnorm.weight"),
                      ("output_norm.weight", "output_norm.weight")):
        new, old = np.asarray(t[name].data), np.asarray(s[was].data)
        assert t[name].tensor_type == gguf.GGMLQuantizationType.F32
        assert (new[:128] == old / 2).all() and not new[128:].any()
    # eh_proj's input is [embedding | hidden]: each half at the start of its 512
    from gguf.quants import dequantize

    old = dequantize(np.asarray(s["blk.7.nextn.eh_proj.weight"].data), s["blk.7.nextn.eh_proj.weight"].tensor_type)
    new = np.asarray(t["blk.13.nextn.eh_proj.weight"].data).astype(np.float32)
    assert np.array_equal(new[:128, :128], old[:, :128].astype(np.float16).astype(np.float32))
    assert np.array_equal(new[:128, 512:640], old[:, 128:].astype(np.float16).astype(np.float32))
    assert not new[:128, 128:512].any() and not new[:128, 640:].any() and not new[128:].any()


def test_flash_wide_heads(flash_wide):
    """Heads 128 wide: each trained 32-wide head (query, key, value, output columns) at
    the start of its own, zeros after; the query norm halved and the key norm kept (the
    scores stay what they were under 1/sqrt(128)); the trained rotary width, 32, set."""
    import gguf
    import numpy as np

    src, res = flash_wide
    r = gguf.GGUFReader(str(res.path))
    f = {k: v.contents() for k, v in r.fields.items()}
    assert f["step35.attention.key_length"] == f["step35.attention.value_length"] == 128
    assert f["step35.rope.dimension_count"] == 32
    t = {x.name: x for x in r.tensors}
    s = {x.name: x for x in gguf.GGUFReader(str(src)).tensors}
    q_old, k_old = np.asarray(s["blk.1.attn_q_norm.weight"].data), np.asarray(s["blk.1.attn_k_norm.weight"].data)
    q_new, k_new = np.asarray(t["blk.1.attn_q_norm.weight"].data), np.asarray(t["blk.1.attn_k_norm.weight"].data)
    assert q_new.shape == k_new.shape == (128,)
    assert (q_new[:32] == q_old / 2).all() and (k_new[:32] == k_old).all() and not q_new[32:].any()
    heads = f["step35.attention.head_count"]
    kv = f["step35.attention.head_count_kv"]
    assert heads[1] * 128 == [int(n) for n in t["blk.1.attn_q.weight"].shape][1]
    assert kv[1] == 2 and [int(n) for n in t["blk.1.attn_k.weight"].shape][1] == 2 * 128
    wk = np.asarray(t["blk.1.attn_k.weight"].data).astype(np.float32)  # [kv heads x 128, 512]
    assert wk[0:32, :128].any() and wk[128:160, :128].any()
    assert not wk[32:128].any() and not wk[160:256].any()
    wo = np.asarray(t["blk.1.attn_output.weight"].data).astype(np.float32)  # [512, heads x 128]
    per_head = wo[:128].reshape(128, heads[1], 128)
    assert not per_head[:, :, 32:].any() and per_head[:, :, :32].any()
    # identity layers: norms of the new width
    assert [int(n) for n in t["blk.9.attn_q_norm.weight"].shape] == [128]


def test_flash_writing_reports_progress(tmp_path):
    """The bench-size model takes a minute to write: shaping calls back with the share
    written, rising to all of it."""
    from stepmtp.bench.flash import shape_like_flash
    from stepmtp.bench.model import resolve_model

    shares: list[float] = []
    shape_like_flash(resolve_model("bundled"), tmp_path / "x.gguf", 0.03, n_layer=8, progress=shares.append)
    assert len(shares) > 10 and shares == sorted(shares) and 0 < shares[0] and shares[-1] == 1.0


def test_flash_head_width_must_be_a_power_of_4_wider(tmp_path):
    from stepmtp.bench.flash import shape_like_flash
    from stepmtp.bench.model import resolve_model

    with pytest.raises(ValueError, match="head width 64 is not 32 times a power of 4"):
        shape_like_flash(resolve_model("bundled"), tmp_path / "x.gguf", 0.03, n_layer=8, head_dim_new=64)


def test_flash_hidden_must_be_a_power_of_4_wider(tmp_path):
    from stepmtp.bench.flash import shape_like_flash
    from stepmtp.bench.model import resolve_model

    with pytest.raises(ValueError, match="not 128 times a power of 4"):
        shape_like_flash(resolve_model("bundled"), tmp_path / "x.gguf", 0.03, n_layer=8, hidden=256)
    assert not (tmp_path / "x.gguf").exists()


def test_flash_shape(flash_small):
    import gguf

    src, res = flash_small
    r = gguf.GGUFReader(str(res.path))
    f = {k: v.contents() for k, v in r.fields.items()}
    assert f["step35.block_count"] == 12 + 3
    assert f["step35.expert_count"] == 72 and f["step35.expert_used_count"] == 2  # 2 of 72 = 8 of 288
    assert res.n_vocab == (2048, 3872)  # 0.03 x 128896, padded to 32
    assert len(f["tokenizer.ggml.tokens"]) == 3872 and f["tokenizer.ggml.token_type"][-1] == gguf.TokenType.UNUSED
    assert f["step35.feed_forward_length"] == 384  # 0.03 x 11264 = 352, never narrower than trained
    assert f["step35.expert_feed_forward_length"] == 160  # 0.03 x 1280 x 8 / 2
    assert f["step35.expert_shared_feed_forward_length"] == 128  # never narrower than trained
    # trained layers and heads keep their attention kinds; added layers follow 1 full : 3 SWA
    swa = f["step35.attention.sliding_window_pattern"]
    assert swa[:6] == [False, True, True, True, False, True] and swa[12:] == [True, True, False]
    assert swa[6:12] == [i % 4 != 0 for i in range(6, 12)]
    t = {x.name: x for x in r.tensors}
    assert [int(n) for n in t["blk.14.nextn.shared_head_head.weight"].shape] == [128, 3872]
    assert "blk.11.ffn_down_exps.weight" in t and "blk.15.attn_q.weight" not in t


@pytest.mark.parametrize("shaped", ["flash_small", "flash_wide"])
def test_flash_keeps_predictions(shaped, request):
    """Greedy tokens, drafts and acceptances are the bundled model's, plain and chained,
    at the trained widths and at 4x the hidden and head widths in F16 (there up to
    rounding: these 48 tokens are the same); a padded token's logit is the mean real logit: never the
    largest."""
    import numpy as np

    from stepmtp import Batch, Context, Engine, Model

    src, res = request.getfixturevalue(shaped)
    out = {}
    for path in (src, res.path):
        for mode in ("none", "chain"):
            with Engine(path, mode=mode, n_ctx=512, n_threads=1, adaptive=False) as eng:
                c = eng.generate("def heappush(heap, item):\n    \"\"\"Push item onto heap", n_predict=48,
                                 temperature=0)
                out[(path, mode)] = (c.tokens, c.stats.n_drafted, c.stats.n_accepted)
    assert out[(src, "none")][0] == out[(res.path, "none")][0]
    assert out[(src, "chain")] == out[(res.path, "chain")]
    assert out[(src, "chain")][1] > 0
    with Model(str(res.path)) as m:
        ctx = Context(m, n_ctx=256, n_threads=1)
        toks = m.tokenize("class OrderedDict(dict):\n    def __init__(self, other=(), /, **kwds):")
        b = Batch(256)
        b.fill(toks, 0, outputs="all")
        ctx.decode(b)
        L = ctx.logits_rows(len(toks))
        real, pad = L[:, :2048], L[:, 2048:]
        assert (L.argmax(1) < 2048).all()
        assert np.allclose(pad, real.mean(1, keepdims=True), atol=0.1)
        assert (real.max(1) - pad.max(1) > 3).all()
        assert (np.sort(real, 1)[:, -10] > pad.max(1)).all()  # not among the 10 a draft is picked from
        ctx.close()


def test_flash_estimate():
    """Step-3.5-Flash's ratios from its configuration (docs/performance.md, "Costs")."""
    from stepmtp.bench.flash import FLASH, decode_params, estimate_costs

    ratios, text = estimate_costs()
    assert ratios["head/target1"] == pytest.approx(0.0706, abs=5e-4)
    assert [round(ratios[f"verify{k}/target1"], 3) for k in (2, 3, 4)] == [1.448, 1.884, 2.308]
    p = decode_params()
    assert p["target"][1] == pytest.approx(11.46e9, rel=1e-3)  # "11B active"
    assert p["distinct"][2] == pytest.approx(FLASH.n_expert * (1 - (1 - 8 / 288) ** 2))
    assert "T4 / T1" in text


def test_bench_model_cached(tmp_path, monkeypatch):
    from stepmtp.bench import flash
    from stepmtp.bench.model import bench_model, bench_scale

    from stepmtp.bench.model import resolve_model

    # F16 at 4x the trained width: 180 MB per decode is scale 1/16 (2.865 GB per unit scale)
    assert bench_scale(180) == 1 / 16 and bench_scale(1) == 1 / 64 and bench_scale(720) == 0.25
    made = []

    def fake(src, dst, scale, **kw):
        made.append((scale, kw))
        Path(dst).write_bytes(b"x")

    monkeypatch.setattr(flash, "shape_like_flash", fake)
    monkeypatch.setenv("STEPMTP_CACHE_DIR", str(tmp_path))
    src = tmp_path / "m.gguf"
    src.write_bytes(resolve_model("bundled").read_bytes())
    a = bench_model(src, 180, quiet=True)
    assert bench_model(src, 180, quiet=True) == a and made == [(1 / 16, {"hidden": 512, "head_dim_new": 128, "f16": True})]
    assert a.parent == tmp_path / "bench" and "flash" in a.name

# -- servers ----------------------------------------------------------------------------

FAKE_SERVER = textwrap.dedent('''
    import json, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a): pass
        def _send(self, code, obj):
            body = json.dumps(obj).encode()
            self.send_response(code); self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
        def do_GET(self):
            self._send(200, {"status": "ok"} if self.path == "/health" else {"model_path": "fake"})
        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert req["temperature"] == 0 and req["cache_prompt"] is False
            n = req["n_predict"]
            self._send(200, {"content": "x" * n, "tokens_predicted": n, "tokens_evaluated": 5,
                             "timings": {"prompt_n": 5, "prompt_ms": 1.0, "predicted_n": n,
                                         "predicted_ms": 100.0, "predicted_per_second": n * 10.0,
                                         "draft_n": 30, "draft_n_accepted": 20},
                             "mtp": {"rounds": 12, "draft_n_per_depth": [10, 10, 10],
                                     "draft_n_accepted_per_depth": [9, 7, 4]}})
    HTTPServer(("127.0.0.1", port), H).serve_forever()
''')


def test_server_process_and_url_runner(tmp_path):
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    sp = ServerProcess([sys.executable, str(script)], label="fake", startup_timeout=30)
    sp.start()
    try:
        runner = URLRunner(sp.url)
        runner.start()
        r = runner.run("qa_factual", "Q?", 16)
        assert (r.predicted, r.drafted, r.accepted, r.rounds) == (16, 30, 20, 12)
        assert r.drafted_per_depth == [10, 10, 10] and r.accepted_per_depth == [9, 7, 4]
        assert r.tok_s == pytest.approx(160.0)
        pid = sp.proc.pid
    finally:
        sp.close()
    assert sp.proc.poll() is not None
    with pytest.raises(ProcessLookupError):
        import os

        os.kill(pid, 0)


def test_server_process_that_fails(tmp_path):
    sp = ServerProcess([sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"], label="bad",
                       startup_timeout=30)
    with pytest.raises(RuntimeError, match="no model here"):
        sp.start()


def test_interrupt_leaves_no_server(tmp_path):
    """Ctrl-C during a run with started servers: the bench exits and the servers are gone."""
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER.replace("self._send(200, {\"content\"", "time.sleep(60); self._send(200, {\"content\"")
                      .replace("import json, sys", "import json, sys, time"))
    driver = tmp_path / "drive.py"
    driver.write_text(textwrap.dedent(f'''
        import sys
        from stepmtp.bench.harness import run_bench
        from stepmtp.bench.prompts import load_prompts
        from stepmtp.bench.runners import BenchConfig, ServerProcess, URLRunner

        class R(URLRunner):
            def __init__(self):
                super().__init__("http://x", BenchConfig(mode="none", n_max=0, backend="url"))
                self.p = ServerProcess([sys.executable, {str(script)!r}], label="fake")
            def start(self):
                self.p.start(); self.url = self.p.url
                print(self.p.proc.pid, flush=True)
            def close(self):
                self.p.close()
        try:
            run_bench(load_prompts().select(limit=1, n_predict=4), [R()], warmup=0, progress=False)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
    '''))
    import signal

    # Ctrl-C as a terminal gives it: whatever this process's own SIGINT disposition is
    # (a child inherits an ignored SIGINT, and Python then installs no handler for it)
    p = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    pid = int(p.stdout.readline())
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=60)
    assert "interrupted" in out
    import os

    with pytest.raises(ProcessLookupError):
        for _ in range(50):  # the child is reaped by the bench; give the kernel a moment
            os.kill(pid, 0)
            time.sleep(0.1)


@pytest.mark.skipif(sys.platform != "linux", reason="the server's dependencies")
def test_stepmtp_server_backend(agree, prompts, tmp_path):
    """The same counts through `python -m stepmtp.server` started by the bench as in-process."""
    pytest.importorskip("fastapi")
    pytest.importorskip("stepmtp.server")
    from stepmtp.bench.runners import ServerRunner

    one = prompts.select(["qa_factual"])
    c = BenchConfig(mode="chain", n_max=3, backend="server")
    run = run_bench(one, [EngineRunner(BenchConfig(mode="chain", n_max=3), agree, n_ctx=1024, n_threads=1),
                          ServerRunner(c, agree, n_ctx=1024, n_threads=1, startup_timeout=120)],
                    warmup=0, progress=False)
    a, b = (cr.results[0] for cr in run.configs)
    assert not run.mismatches, (a.text, b.text)
    assert (a.predicted, a.drafted, a.accepted) == (b.predicted, b.drafted, b.accepted)


def test_llama_server_gets_our_kv_layout(tmp_path):
    """The C++ llama-server runs with its defaults, as ours: the window-sized
    sliding-window cache (placed by position in both: the same llama.cpp, patched)."""
    from stepmtp.bench.runners import ServerRunner

    exe = tmp_path / "llama-server"
    exe.write_text("")
    r = ServerRunner(BenchConfig(mode="single", n_max=2, backend="llama-server"), tmp_path / "m.gguf",
                     llama_server=exe, n_threads=1)
    argv = r.process.argv
    assert argv[0] == str(exe) and "--swa-full" not in argv
    assert argv[argv.index("--spec-draft-n-max") + 1] == "2"


def test_gpu_backends_report_agreement(prompts, monkeypatch, capsys):
    """Texts that part at temperature 0 fail the bench (exit 3) on the CPU backend; on a
    GPU backend, where kernels differ by batch size, it reports how far they agree."""
    import argparse

    from stepmtp.bench import __main__ as M
    from stepmtp.bench.harness import agreement
    from stepmtp.bench.runners import Runner

    class Fixed(Runner):
        def __init__(self, label: str, tokens_by_cat: dict[str, list[int]]):
            self.config = BenchConfig.parse(label)
            self.by_cat = tokens_by_cat

        def run(self, category, prompt, n_predict):
            toks = self.by_cat[category]
            return Result(category, self.config.label, " ".join(map(str, toks)), 3, len(toks), 0, 0, None, None,
                          gen_ms=1.0, prompt_ms=0.0, wall_s=0.01, tokens=list(toks))

    same = {c: [10, 11, 12, 13] for c in CATS}
    parted = dict(same, **{CATS[0]: [10, 11, 99, 13]})
    run = run_bench(prompts, [Fixed("none", same), Fixed("chain-3", parted)], warmup=0, progress=False)
    assert [(m.label, m.category, m.token_at) for m in run.mismatches] == [("chain-3", CATS[0], 2)]
    a = agreement(run)["chain-3"]
    assert a["identical"] == round(2 / 3, 4) and a["tokens_until_difference"] == [2] and a["differing"] == 1
    args = argparse.Namespace(quiet=True, out=None, json=None, markdown=None, chart=None, baseline=None,
                              update_baseline=False, tolerance=None)
    monkeypatch.setattr(M, "gpu_backend", lambda: False)
    assert M.report(run, args, None) == 3
    assert "MISMATCH" in capsys.readouterr().err
    monkeypatch.setattr(M, "gpu_backend", lambda: True)
    assert M.report(run, args, None) == 0
    err = capsys.readouterr().err
    assert "chain-3: 67% of prompts identical; the others part after 2 tokens" in err


def test_cpu_build_is_no_gpu_backend():
    """This CPU build has the RPC backend, for which llama.cpp's own offload check says
    yes: the bench must still fail mismatches here, not call them GPU rounding."""
    import stepmtp
    from stepmtp.bench import __main__ as M

    info = stepmtp.system_info()
    if any(k in info["backend"] for k in ("CUDA", "METAL", "VULKAN", "HIP", "SYCL")):
        pytest.skip("a GPU build")
    assert info["gpus"] == [] and not M.gpu_backend()
    if info["rpc"]:
        assert info["gpu_offload"]  # why llama_supports_gpu_offload cannot decide it


def test_agent_turns_are_copies_echoes_and_summaries():
    from stepmtp.bench import agent_turns as A

    turns = A.agent_prompts(2)
    assert [t.kind for t in turns] == ["copy", "echo", "summary"] * 2
    assert len({t.name for t in turns}) == 6  # each from its own module: new to every server
    copy = turns[0]
    first = copy.prompt.split("\n", 1)[1].splitlines()[0]
    assert copy.prompt.count(first) >= 2  # the module's first line, read and written again
    with pytest.raises(ValueError):
        A.agent_prompts(10)
    # every module is found, frozen ones (genericpath on Python 3.11+) included
    assert len(A.agent_prompts(len(A.MODULES) // 3)) == 3 * (len(A.MODULES) // 3)


def test_agent_run_pairs_turn_by_turn():
    from stepmtp.bench import agent_turns as A
    from stepmtp.bench.matrix import ENTRIES

    run = A.AgentRun()
    for name, (a, b) in {"copy:x": (100.0, 50.0), "copy:y": (100.0, 200.0)}.items():
        run.add("mtp", "copy", name, A.Result(100, 1e5 / a, 10, 9, "t"))
        run.add("off", "copy", name, A.Result(100, 1e5 / b, 0, 0, "t"))
    # aggregate: 200 tokens in 1 + 1 s against 2 + 0.5 s; paired: ratios 2 and 0.5
    assert run.tok_s("mtp", "copy") == pytest.approx(100.0) and run.tok_s("off", "copy") == pytest.approx(80.0)
    g, se, n = run.paired("mtp", "off", "copy")
    assert (g, n) == (pytest.approx(1.0), 2) and se > 0
    assert run.accept("mtp", "copy") == pytest.approx(0.9)
    md = A.agent_markdown(run, [ENTRIES["off"], ENTRIES["mtp"]])
    assert "| `mtp` | 100.0 (1.25x; 0.90)" in md and "`mtp` x `off`" in md
    run.add("mtp", "again", "copy:x", A.Result(10, 10.0, 0, 0, "other"))
    run.add("off", "again", "copy:x", A.Result(10, 10.0, 0, 0, "t"))
    assert A.check_agent_texts(run, [ENTRIES["off"], ENTRIES["mtp"]]) == ["agent again copy:x: mtp's text differs from off's"]
