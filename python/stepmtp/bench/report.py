"""What the bench prints and writes: the change's per-prompt lines and aggregate JSON,
the comparison table (Markdown), the machine-readable JSON and the PNG chart."""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from .harness import BenchRun, ConfigRun, agreement
from .runners import SAMPLING_SEED, BenchConfig, Result

__all__ = ["request_line", "aggregate", "prompt_cost", "config_block", "ratios", "markdown", "to_json", "write_chart",
           "environment"]


def request_line(r: Result) -> str:
    """``  code_python        pred= 192 draft= 164 acc= 108 rate=0.658 tok/s=30.8``"""
    return (f"  {r.category:<18} pred={r.predicted:4d} draft={r.drafted:4d} acc={r.accepted:4d} "
            f"rate={r.rate:.3f} tok/s={r.tok_s:.1f}")


def _sum_lists(ls: list[list[int] | None]) -> list[int] | None:
    if not ls or any(x is None for x in ls):
        return None
    n = max(len(x) for x in ls)
    return [sum(x[i] if i < len(x) else 0 for x in ls) for i in range(n)]


def prompt_cost(config: BenchConfig | None, n_heads: int | None, n_prompt: int,
                n_batch: int = 2048) -> tuple[int, int, int]:
    """What bootstrapping one prompt costs, so per-round figures can leave it out:
    (target decodes, draft decodes, passes of the draft context over the prompt rows)."""
    chunks = max(1, -(-n_prompt // n_batch))
    if config is None or config.mode == "none" or not n_heads:
        return chunks, 0, 0
    if config.schedule == "reference":
        # the change's schedule processes the prompt with every head it re-anchors
        k = n_heads if config.mode == "chain" else 1
        return chunks, chunks * k, k
    if config.adaptive:
        # a head sees the prompt's rows only if the policy ever drafts that deep: unknown
        return chunks, 0, -1
    # fused: each head used sees the prompt's rows in its first draft decode
    return chunks, 0, min(config.n_max, n_heads) if config.mode == "chain" else 1


def aggregate(results: list[Result], config: BenchConfig | None = None,
              n_heads: int | None = None) -> dict[str, Any]:
    """The change's aggregate (first six keys, same names and rounding), then per
    draft depth, speed and, in-process, what a round costs (prompt excluded)."""
    pred = sum(r.predicted for r in results)
    draft = sum(r.drafted for r in results)
    acc = sum(r.accepted for r in results)
    gen_s = sum(r.gen_ms for r in results) / 1e3
    out: dict[str, Any] = {
        "n_requests": len(results),
        "total_predicted": pred,
        "total_draft": draft,
        "total_draft_accepted": acc,
        "aggregate_accept_rate": round(acc / draft, 4) if draft else 0.0,
        "wall_s_total": round(sum(r.wall_s for r in results), 2),
    }
    dd = _sum_lists([r.drafted_per_depth for r in results])
    ad = _sum_lists([r.accepted_per_depth for r in results])
    if dd is not None and ad is not None and draft:
        out["draft_per_depth"] = dd
        out["accepted_per_depth"] = ad
        out["accept_rate_per_depth"] = [round(a / d, 4) if d else None for a, d in zip(ad, dd)]
    out["gen_s_total"] = round(gen_s, 3)
    out["tok_s"] = round(pred / gen_s, 2) if gen_s > 0 else 0.0
    rounds = [r.rounds for r in results]
    if all(x is not None for x in rounds) and sum(rounds):
        n_rounds = sum(rounds)
        out["rounds"] = n_rounds
        out["tokens_per_round"] = round(pred / n_rounds, 3)
        if all(r.target_decodes is not None for r in results):
            td = dd_ = tr = dr = 0
            known = True
            for r in results:
                c_t, c_d, passes = prompt_cost(config, n_heads, r.n_prompt)
                r_t, r_d = r.n_prompt, passes * r.n_prompt
                if r.prompt_target_decodes is not None:  # counted, in-process
                    c_t, c_d = r.prompt_target_decodes, r.prompt_draft_decodes
                if r.prompt_cached:
                    # a cached prefix is not decoded again, but its last token, by the
                    # target alone (for its trunk row): the heads start after it
                    r_t, r_d = r.prompt_target_rows, passes * (r.prompt_target_rows - 1)
                td += r.target_decodes - c_t
                dd_ += r.draft_decodes - c_d
                tr += r.target_rows - r_t
                dr += r.draft_rows - r_d
                known = known and passes >= 0
            out["target_decodes_per_round"] = round(td / n_rounds, 3)
            out["draft_decodes_per_round"] = round(dd_ / n_rounds, 3)
            out["target_rows_per_round"] = round(tr / n_rounds, 3)
            # the draft rows with the prompt's share left out, where it is known
            out["draft_rows_per_round"] = round(dr / n_rounds, 3) if known else None
            tp = [r.t_python_ms for r in results]
            if all(x is not None for x in tp):
                tot = sum(r.gen_ms + r.prompt_ms for r in results)
                out["python_share"] = round(sum(tp) / tot, 4) if tot else 0.0
    return out


def config_block(cr: ConfigRun) -> str:
    lines = [f"{cr.label}: {cr.config.describe()}", ""]
    lines += [request_line(r) for r in cr.results]
    agg = _change_keys(aggregate(cr.results, cr.config, cr.info.get("n_heads")))
    lines += ["", "Aggregate: " + _dumps(agg)]
    return "\n".join(lines)


def _dumps(d: dict[str, Any]) -> str:
    """json.dumps(indent=2), with lists of numbers on one line."""
    text = json.dumps(d, indent=2)
    return re.sub(r"\[\s*([^\[\]{}]*?)\s*\]", lambda m: "[" + re.sub(r"\s*\n\s*", " ", m.group(1)) + "]", text)


def _change_keys(agg: dict[str, Any]) -> dict[str, Any]:
    keep = ("n_requests", "total_predicted", "total_draft", "total_draft_accepted", "aggregate_accept_rate",
            "wall_s_total", "draft_per_depth", "accepted_per_depth", "accept_rate_per_depth")
    return {k: agg[k] for k in keep if k in agg}


def ratios(run: BenchRun) -> dict[str, dict[str, Any]]:
    """Per configuration: its aggregate, and tok/s and wall time relative to the
    no-speculation run of the same backend (or the first no-speculation run)."""
    aggs = {c.label: aggregate(c.results, c.config, c.info.get("n_heads")) for c in run.configs}
    nones = {c.config.family: c.label for c in run.configs if c.config.mode == "none"}
    first_none = next((c.label for c in run.configs if c.config.mode == "none"), None)
    out = {}
    for c in run.configs:
        a = dict(aggs[c.label])
        ref = nones.get(c.config.family, first_none)
        if ref is not None:
            r = aggs[ref]
            a["relative_to"] = ref
            a["tok_s_ratio"] = round(a["tok_s"] / r["tok_s"], 4) if r["tok_s"] else None
            a["wall_ratio"] = round(a["wall_s_total"] / r["wall_s_total"], 4) if r["wall_s_total"] else None
        out[c.label] = a
    return out


def _mib(info: dict[str, Any], key: str) -> str:
    v = (info.get("memory") or {}).get(key)
    return "–" if v is None else f"{v / 2**20:.1f}"


def _f(v: Any, fmt: str = "{:.3f}") -> str:
    return "–" if v is None else fmt.format(v)


def markdown(run: BenchRun) -> str:
    """The comparison table, acceptance per category, and the environment."""
    rat = ratios(run)
    n = len(run.prompts)
    npred = sorted({p.n_predict for p in run.prompts.prompts})
    out = [f"### {run.model.get('name', 'model')}: {n} prompts x {'/'.join(map(str, npred))} tokens, "
           f"temperature 0, {run.settings.get('threads') or (run.environment or {}).get('n_threads') or 'all'} threads, "
           f"repeat {run.settings.get('repeat', 1)}"
           + (f", {' '.join(run.settings['placement'])}" if run.settings.get("placement") else ""), ""]
    out += ["| config | accept | accept d1 / d2 / d3 | tok/s | x none | wall s | x none | tok/round "
            "| decodes/round tgt + dft | rows/round tgt + dft | python | KV MiB | peak RSS MiB |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in run.configs:
        a = rat[c.label]
        depth = " / ".join(_f(x, "{:.2f}") for x in a.get("accept_rate_per_depth", [])) or "–"
        dec = (f"{a['target_decodes_per_round']:.2f} + {a['draft_decodes_per_round']:.2f}"
               if "target_decodes_per_round" in a else "–")
        rows = (f"{a['target_rows_per_round']:.2f} + {_f(a['draft_rows_per_round'], '{:.2f}')}"
                if "target_rows_per_round" in a else "–")
        acc = _f(a["aggregate_accept_rate"]) if c.config.mode != "none" else "–"
        out.append(f"| {c.label} | {acc} | {depth} | {a['tok_s']:.1f} | {_f(a.get('tok_s_ratio'), '{:.2f}')} "
                   f"| {a['wall_s_total']:.2f} | {_f(a.get('wall_ratio'), '{:.2f}')} "
                   f"| {_f(a.get('tokens_per_round'), '{:.2f}')} | {dec} | {rows} "
                   f"| {_f(a.get('python_share'), '{:.0%}')} | {_mib(c.info, 'kv')} | {_mib(c.info, 'peak_rss')} |")
    out += ["", "Per round: the generation's decodes and rows (the prompt's bootstrap left out); "
            "x none: relative to no speculation on the same backend; python: share of the time "
            "spent outside llama.cpp. KV: llama.cpp's KV buffers, target and draft contexts "
            "(llama-server's: its contexts made here with its flags); peak RSS: a server process's VmHWM.", ""]
    spec = [c for c in run.configs if c.config.mode != "none"]
    if spec:
        out += ["| category | " + " | ".join(c.label for c in spec) + " |",
                "|---|" + "---|" * len(spec)]
        for i, p in enumerate(run.prompts.prompts):
            out.append(f"| {p.category} | " + " | ".join(f"{c.results[i].rate:.3f}" for c in spec) + " |")
        out.append("")
    out += _speeds(run)
    if run.mismatches:
        out.append(f"**MISMATCH**: {len(run.mismatches)} outputs differ from {run.configs[0].label} at temperature 0: "
                   + ", ".join(f"{m.label}/{m.category} (char {m.at})" for m in run.mismatches))
    else:
        n_greedy = sum(c.config.temperature == 0 for c in run.configs)
        n_sampled = len(run.configs) - n_greedy
        if n_greedy > 1:
            out.append(f"Outputs: identical across the {n_greedy} configurations at temperature 0.")
        if n_sampled:
            out.append(f"Sampled: {n_sampled} configurations at temperature > 0, seed {SAMPLING_SEED} per request "
                       "(their texts differ by design: exact and rejection verification draw differently).")
    env = run.environment
    if env:
        out += ["", f"Environment: {env.get('cpu_model')}, {env.get('cpu_count')} CPUs, "
                f"build {env.get('build_type')} {' '.join(env.get('build_flags') or [])}, "
                f"llama.cpp {str(env.get('llama_cpp_commit'))[:10]}, stepmtp {env.get('stepmtp')}"
                f"{' @ ' + env['git_commit'][:10] if env.get('git_commit') else ''}"]
    return "\n".join(out) + "\n"


def _fixed_peers(run: BenchRun, a: ConfigRun) -> list[ConfigRun]:
    """The fixed-length runs an adaptive one competes with: same backend, mode,
    temperature and verification, n-max 1 up to its bound."""
    return [c for c in run.configs
            if not c.config.adaptive and c.config.family == a.config.family and c.config.mode == a.config.mode
            and c.config.temperature == a.config.temperature and c.config.verify == a.config.verify
            and 1 <= c.config.n_max <= a.config.n_max]


def _speeds(run: BenchRun) -> list[str]:
    """tok/s per prompt and configuration (with repeats: the best, ± how much the
    repeats differed); for an adaptive length, its ratio to the fastest fixed length
    on that prompt."""
    repeats = run.settings.get("repeat", 1) > 1
    adapt = [(a, peers) for a in run.configs if a.config.adaptive and (peers := _fixed_peers(run, a))]
    if len(run.configs) < 2 or not (repeats or adapt):
        return []
    out = ["tok/s per prompt" + (" (best of the repeats, ± how much they differed)" if repeats else "")
           + "".join(f"; {a.label} / best fixed: its ratio to the fastest of {', '.join(c.label for c in peers)}"
                     + (" (± the larger spread of the two)" if repeats else "") for a, peers in adapt) + ":", "",
           "| category | " + " | ".join(c.label for c in run.configs)
           + "".join(f" | {a.label} / best fixed" for a, _ in adapt) + " |",
           "|---|" + "---|" * (len(run.configs) + len(adapt))]
    for i, p in enumerate(run.prompts.prompts):
        cells = [f"{c.results[i].tok_s:.1f}" + (f" ±{c.results[i].spread:.0%}" if repeats else "")
                 for c in run.configs]
        for a, peers in adapt:
            best = max(peers, key=lambda c: c.results[i].tok_s)
            ra, rb = a.results[i], best.results[i]
            ratio = ra.tok_s / rb.tok_s if rb.tok_s else 0.0
            noise = f" ±{max(ra.spread, rb.spread):.0%}" if repeats else ""
            cells.append(f"{ratio:.2f}{noise} ({best.label})")
        out.append(f"| {p.category} | " + " | ".join(cells) + " |")
    return out + [""]


def to_json(run: BenchRun) -> dict[str, Any]:
    rat = ratios(run)
    return {
        "format": "stepmtp-bench/1",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "model": run.model,
        "prompts": {"name": run.prompts.name, "source": run.prompts.source, "sha256": run.prompts.sha256,
                    "categories": [p.category for p in run.prompts.prompts],
                    "n_predict": [p.n_predict for p in run.prompts.prompts]},
        "settings": run.settings,
        "environment": run.environment,
        "wall_s": round(run.wall_s, 3),
        "identical_outputs": not run.mismatches,
        "mismatches": [m.__dict__ for m in run.mismatches],
        "agreement": agreement(run),
        "configs": [
            {**c.config.to_dict(), "description": c.config.describe(), "info": c.info,
             "aggregate": rat[c.label], "unstable": c.unstable,
             "requests": [{k: v for k, v in r.to_dict().items()} for r in c.results]}
            for c in run.configs
        ],
    }


def write_chart(run: BenchRun, path: str | os.PathLike[str]) -> str | None:
    """The PNG: acceptance per category (speculative configurations) and tok/s per
    configuration. Returns None when written, else why not (matplotlib missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'stepmtp[bench]'): no chart"
    import numpy as np

    rat = ratios(run)
    spec = [c for c in run.configs if c.config.mode != "none"]
    cats = [p.category for p in run.prompts.prompts]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [3, 2]})
    if spec:
        w = 0.8 / len(spec)
        x = np.arange(len(cats))
        for j, c in enumerate(spec):
            ax1.bar(x + (j - (len(spec) - 1) / 2) * w, [r.rate for r in c.results], w, label=c.label)
        ax1.set_xticks(x, cats, rotation=35, ha="right", fontsize=8)
        ax1.set_ylim(0, 1.2)
        ax1.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
        ax1.set_ylabel("accepted / drafted")
        ax1.set_title("acceptance per category")
        ax1.legend(fontsize=7, ncol=min(5, len(spec)), loc="upper center")
    else:
        ax1.set_axis_off()
    labels = [c.label for c in run.configs]
    tps = [rat[lab]["tok_s"] for lab in labels]
    colors = ["#888888" if c.config.mode == "none" else "#1f77b4" if c.config.mode == "chain" else "#ff7f0e"
              for c in run.configs]
    bars = ax2.bar(range(len(labels)), tps, color=colors)
    for b, lab in zip(bars, labels):
        r = rat[lab].get("tok_s_ratio")
        if r is not None:
            ax2.annotate(f"x{r:.2f}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                         va="bottom", fontsize=8)
    ax2.set_xticks(range(len(labels)), labels, rotation=35, ha="right", fontsize=8)
    ax2.set_ylabel("tokens / s (generation)")
    ax2.set_title("speed (x: relative to no speculation)")
    fig.suptitle(f"{run.model.get('name', '')} - {len(cats)} prompts, temperature 0", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# -- environment -------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                                  text=True, timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine()


def _git_commit() -> tuple[str | None, bool | None]:
    """The commit of the stepmtp checkout the bench runs from (the current directory's
    repository, when it is one), or STEPMTP_GIT_COMMIT."""
    if os.environ.get("STEPMTP_GIT_COMMIT"):
        return os.environ["STEPMTP_GIT_COMMIT"], None
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, timeout=10)
        if top.returncode != 0 or not (Path(top.stdout.strip()) / "python" / "stepmtp").is_dir():
            return None, None
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=30)
        return head.stdout.strip() or None, bool(dirty.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return None, None


def environment(n_threads: int | None = None) -> dict[str, Any]:
    from .. import system_info
    from ..llama import default_threads

    info = system_info()
    commit, dirty = _git_commit()
    return {
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": default_threads(),
        "n_threads": n_threads or default_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "stepmtp": info.get("stepmtp"),
        "git_commit": commit,
        "git_dirty": dirty,
        "llama_cpp_commit": info.get("llama_cpp_commit"),
        "patches": info.get("patches"),
        "build_type": info.get("build_type"),
        "build_flags": info.get("build_flags"),
        "compiler": info.get("compiler"),
        "backend": info.get("backend"),
        "gpu_offload": info.get("gpu_offload"),
        "gpus": info.get("gpus"),
    }
