"""Prompt sets: files of prompts, one per category, each generated for n_predict tokens.

Two file formats (``--prompts FILE``):

* JSON: either an object ``{"name": ..., "n_predict": 192, "prompts": [...]}`` or a
  bare list of prompts;
* JSONL: one prompt object per line (blank lines and lines starting with ``#`` are
  skipped).

A prompt is an object ``{"category": "code_python", "prompt": "def f(x):\\n"}``, with
an optional ``"n_predict"`` of its own (``"name"`` is accepted for ``"category"``,
``"content"`` for ``"prompt"``), or a plain string (category ``p0``, ``p1``, ...).

The default set (``prompts/default.json`` in this package) has the nine categories of
the change's benchmark, written as Python source, since the bundled model is trained
on the standard library's sources.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

__all__ = ["Prompt", "PromptSet", "DEFAULT_PROMPTS", "CATEGORIES", "load_prompts"]

#: The package's default prompt set.
DEFAULT_PROMPTS = Path(__file__).resolve().parent / "prompts" / "default.json"

#: The categories of the change's benchmark, in its order.
CATEGORIES = ("code_python", "code_cpp", "explain_concept", "summarize", "qa_factual",
              "translation", "creative_short", "stepwise_math", "long_code_review")

DEFAULT_N_PREDICT = 192


@dataclass(frozen=True)
class Prompt:
    category: str
    prompt: str
    n_predict: int


@dataclass(frozen=True)
class PromptSet:
    name: str
    prompts: tuple[Prompt, ...]
    #: where it came from ("default" for the package's set, else the file's path)
    source: str
    #: of the file's bytes: names the exact set a baseline was made with
    sha256: str

    def __len__(self) -> int:
        return len(self.prompts)

    def select(self, categories: Sequence[str] | None = None, limit: int | None = None,
               n_predict: int | None = None) -> "PromptSet":
        """A subset: the given categories (in the set's order), the first ``limit``,
        every prompt's n_predict replaced."""
        ps = list(self.prompts)
        if categories:
            want = set(categories)
            unknown = want - {p.category for p in ps}
            if unknown:
                raise ValueError(f"no prompt of category {', '.join(sorted(unknown))} in {self.source} "
                                 f"(it has {', '.join(p.category for p in ps)})")
            ps = [p for p in ps if p.category in want]
        if limit is not None:
            ps = ps[: max(0, limit)]
        if n_predict is not None:
            ps = [Prompt(p.category, p.prompt, n_predict) for p in ps]
        return PromptSet(self.name, tuple(ps), self.source, self.sha256)


def _prompt(obj: Any, i: int, n_predict: int, where: str) -> Prompt:
    if isinstance(obj, str):
        return Prompt(f"p{i}", obj, n_predict)
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: prompt {i} is neither a string nor an object")
    cat = obj.get("category", obj.get("name", f"p{i}"))
    text = obj.get("prompt", obj.get("content"))
    if not isinstance(text, str) or not text:
        raise ValueError(f"{where}: prompt {i} ({cat}) has no \"prompt\" text")
    n = obj.get("n_predict", n_predict)
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise ValueError(f"{where}: prompt {i} ({cat}): n_predict must be a positive integer, not {n!r}")
    return Prompt(str(cat), text, n)


def load_prompts(path: str | Path | None = None) -> PromptSet:
    """Read a prompt set (the package's default one when ``path`` is None or "default")."""
    default = path is None or str(path) == "default"
    p = DEFAULT_PROMPTS if default else Path(path)
    raw = p.read_bytes()
    sha = hashlib.sha256(raw).hexdigest()
    text = raw.decode("utf-8")
    name, n_predict = p.stem, DEFAULT_N_PREDICT
    items: list[Any]
    if p.suffix.lower() == ".jsonl":
        items = []
        for ln, line in enumerate(text.splitlines(), 1):
            s = line.strip()
            if not s or s.startswith("#"):
                continue
            try:
                items.append(json.loads(s))
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{ln}: not JSON ({e.msg})") from None
    else:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{e.lineno}: not JSON ({e.msg})") from None
        if isinstance(doc, dict):
            name = str(doc.get("name", name))
            n_predict = doc.get("n_predict", n_predict)
            if not isinstance(n_predict, int) or n_predict <= 0:
                raise ValueError(f"{p}: n_predict must be a positive integer")
            items = doc.get("prompts")
            if not isinstance(items, list):
                raise ValueError(f"{p}: expected a \"prompts\" list")
        elif isinstance(doc, list):
            items = doc
        else:
            raise ValueError(f"{p}: expected an object with \"prompts\" or a list of prompts")
    prompts = tuple(_prompt(o, i, n_predict, str(p)) for i, o in enumerate(items))
    if not prompts:
        raise ValueError(f"{p}: no prompts")
    cats = [q.category for q in prompts]
    dup = sorted({c for c in cats if cats.count(c) > 1})
    if dup:
        raise ValueError(f"{p}: categories must be unique (repeated: {', '.join(dup)})")
    return PromptSet(name, prompts, "default" if default else str(p), sha)
