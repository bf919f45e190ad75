"""The performance-regression gate: a run compared with a committed baseline.

* Counts. At temperature 0, what each configuration predicts, drafts and accepts on
  each prompt (per draft depth too) is deterministic for a given build and model, so
  the baseline keeps them exactly and any change is reported, with the prompt, the
  configuration and the depth. The output text is kept as a hash: it must not change
  either (and all configurations must agree with each other). An adaptive draft
  length drafts by the machine's timings: of it the gate keeps the text and the
  tokens predicted, which are still exact, and its speed ratio.
* Speed. Absolute tokens per second depend on the machine, so only ratios measured in
  the same run are compared: each speculative configuration's tok/s over the
  no-speculation run's. A ratio lower than the baseline's by more than the tolerance
  (relative) is a regression; a higher one is reported, not failed.

``--update-baseline`` writes the run as the new baseline (a deliberate change).
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .harness import BenchRun
from .report import ratios

__all__ = ["BASELINE_FORMAT", "make_baseline", "load_baseline", "save_baseline", "check", "GateReport",
           "DEFAULT_TOLERANCE"]

BASELINE_FORMAT = "stepmtp-bench-baseline/1"

#: how much lower (relative) a speed ratio may be than the baseline's
DEFAULT_TOLERANCE = 0.25


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def make_baseline(run: BenchRun, tolerance: float = DEFAULT_TOLERANCE) -> dict[str, Any]:
    """The baseline a run makes: its settings (so the gate reruns the same thing), the
    exact counts, text hashes and the speed ratios."""
    rat = ratios(run)
    counts: dict[str, Any] = {}
    for c in run.configs:
        counts[c.label] = {
            r.category: ({"pred": r.predicted, "text_sha256": _sha(r.text), "timed": True} if c.config.adaptive else
                         {"pred": r.predicted, "draft": r.drafted, "acc": r.accepted,
                          "draft_per_depth": r.drafted_per_depth, "acc_per_depth": r.accepted_per_depth,
                          "text_sha256": _sha(r.text)})
            for r in c.results
        }
    speed = {lab: {"tok_s_ratio": a.get("tok_s_ratio"), "relative_to": a.get("relative_to"),
                   "tok_s": a["tok_s"]}
             for lab, a in rat.items()}
    # llama.cpp's KV bytes are exact for given settings; peak RSS is noted, not gated
    memory = {c.label: {k: v for k, v in (c.info.get("memory") or {}).items() if k in ("kv", "peak_rss")}
              for c in run.configs if (c.info.get("memory") or {}).get("kv") is not None}
    env = run.environment
    return {
        "format": BASELINE_FORMAT,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "note": "python -m stepmtp.bench --baseline THIS_FILE reruns these settings and compares; "
                "--update-baseline rewrites it. Counts must match exactly; speed ratios within the tolerance.",
        "settings": run.settings,
        "tolerance": tolerance,
        "model": run.model,
        "prompts": {"source": run.prompts.source, "sha256": run.prompts.sha256,
                    "categories": [p.category for p in run.prompts.prompts]},
        "counts": counts,
        "speed": speed,
        "memory": memory,
        "environment": {k: env.get(k) for k in ("cpu_model", "n_threads", "build_type", "build_flags",
                                                 "llama_cpp_commit", "git_commit", "stepmtp")},
    }


def load_baseline(path: str | os.PathLike[str]) -> dict[str, Any]:
    doc = json.loads(Path(path).read_text())
    if doc.get("format") != BASELINE_FORMAT:
        raise ValueError(f"{path}: not a stepmtp bench baseline (format {doc.get('format')!r}, "
                         f"expected {BASELINE_FORMAT!r})")
    return doc


def save_baseline(path: str | os.PathLike[str], doc: dict[str, Any]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, p)


@dataclass
class GateReport:
    ok: bool = True
    #: what failed the gate
    failures: list[str] = field(default_factory=list)
    #: what changed without failing it, and notes
    notes: list[str] = field(default_factory=list)
    #: label -> (baseline ratio, measured ratio, verdict)
    speed: dict[str, tuple[float | None, float | None, str]] = field(default_factory=dict)
    n_compared: int = 0

    def fail(self, msg: str) -> None:
        self.ok = False
        self.failures.append(msg)

    def text(self) -> str:
        lines = []
        if self.speed:
            lines.append("speed vs no speculation (tok/s ratio, same run):")
            for lab, (b, m, verdict) in self.speed.items():
                bs = "-" if b is None else f"{b:.3f}"
                ms = "-" if m is None else f"{m:.3f}"
                lines.append(f"  {lab:<16} baseline {bs:>6}  now {ms:>6}  {verdict}")
        for n in self.notes:
            lines.append(f"note: {n}")
        for f in self.failures:
            lines.append(f"REGRESSION: {f}")
        verdict = "PASS" if self.ok else f"FAIL ({len(self.failures)} regression{'s' if len(self.failures) != 1 else ''})"
        lines.append(f"gate: {verdict} - {self.n_compared} requests compared with the baseline")
        return "\n".join(lines)


def _depth_diff(name: str, base: list[int] | None, now: list[int] | None) -> list[str]:
    if base is None or now is None or base == now:
        return []
    out = []
    for d in range(max(len(base), len(now))):
        b = base[d] if d < len(base) else 0
        n = now[d] if d < len(now) else 0
        if b != n:
            out.append(f"depth {d + 1} {name} {b} -> {n}")
    return out


def check(run: BenchRun, baseline: dict[str, Any], tolerance: float | None = None) -> GateReport:
    """Compare a run with a baseline (see the module's doc)."""
    tol = baseline.get("tolerance", DEFAULT_TOLERANCE) if tolerance is None else tolerance
    rep = GateReport()
    bm, rm = baseline.get("model") or {}, run.model or {}
    if bm.get("sha256") and rm.get("sha256") and bm["sha256"] != rm["sha256"]:
        rep.notes.append(f"the model differs from the baseline's ({rm.get('name')} {rm['sha256'][:12]} vs "
                         f"{bm.get('name')} {bm['sha256'][:12]}): counts are expected to differ")
    bp = baseline.get("prompts") or {}
    if bp.get("sha256") and bp["sha256"] != run.prompts.sha256:
        rep.notes.append("the prompt file differs from the baseline's")

    for m in run.mismatches:
        rep.fail(f"{m.label} {m.category}: text differs from {m.reference} at temperature 0 (from char {m.at})")
    runs = run.by_label()
    for lab, per_prompt in (baseline.get("counts") or {}).items():
        cr = runs.get(lab)
        if cr is None:
            rep.fail(f"{lab}: in the baseline but not run")
            continue
        if cr.unstable:
            rep.fail(f"{lab}: counts or text changed between repeats of {', '.join(cr.unstable)} "
                     "(not deterministic at temperature 0)")
        got = {r.category: r for r in cr.results}
        for cat, b in per_prompt.items():
            r = got.get(cat)
            if r is None:
                rep.fail(f"{lab} {cat}: in the baseline but not run")
                continue
            rep.n_compared += 1
            diffs = []
            timed = b.get("timed", False)  # an adaptive length: its drafts follow the machine's timings
            for key, now in (("pred", r.predicted),) + (() if timed else (("draft", r.drafted), ("acc", r.accepted))):
                if b.get(key) != now:
                    diffs.append(f"{key} {b.get(key)} -> {now}")
            if not timed:
                diffs += _depth_diff("drafted", b.get("draft_per_depth"), r.drafted_per_depth)
                diffs += _depth_diff("accepted", b.get("acc_per_depth"), r.accepted_per_depth)
            if b.get("text_sha256") and b["text_sha256"] != _sha(r.text):
                diffs.append("output text changed")
            if diffs:
                bd, ba = b.get("draft") or 0, b.get("acc") or 0
                rate = (f" (rate {ba / bd:.3f} -> {r.rate:.3f})" if bd and r.drafted else "")
                rep.fail(f"{lab} {cat}: " + "; ".join(diffs) + rate)
        extra = sorted(set(got) - set(per_prompt))
        if extra:
            rep.notes.append(f"{lab}: prompts not in the baseline: {', '.join(extra)}")
    extra = sorted(set(runs) - set(baseline.get("counts") or {}))
    if extra:
        rep.notes.append(f"configurations not in the baseline: {', '.join(extra)}")

    infos = {c.label: c.info for c in run.configs}
    for lab, b in (baseline.get("memory") or {}).items():
        now = ((infos.get(lab) or {}).get("memory") or {}).get("kv")
        if b.get("kv") is not None and now is not None and now > b["kv"]:
            rep.fail(f"{lab}: KV memory grew from {b['kv'] / 2**20:.2f} MiB to {now / 2**20:.2f} MiB")

    rat = ratios(run)
    for lab, b in (baseline.get("speed") or {}).items():
        base = b.get("tok_s_ratio")
        if lab not in rat or base is None or lab == b.get("relative_to"):
            continue
        now = rat[lab].get("tok_s_ratio")
        if now is None:
            rep.speed[lab] = (base, None, "not measured")
            continue
        floor = base * (1.0 - tol)
        if now < floor:
            verdict = f"SLOWER by {1 - now / base:.0%} (tolerance {tol:.0%})"
            rep.fail(f"{lab}: tok/s relative to {rat[lab].get('relative_to')} fell from {base:.3f} to {now:.3f} "
                     f"(-{1 - now / base:.0%}, tolerance {tol:.0%})")
        elif now > base * (1.0 + tol):
            verdict = f"faster by {now / base - 1:.0%} (consider --update-baseline)"
        else:
            verdict = "ok"
        rep.speed[lab] = (base, now, verdict)
    return rep
