"""An agent's conversation, turn by turn: what prompt caching saves.

Agent loops and chat front-ends send the whole conversation every turn, so turn N
shares all but its newest messages with turn N-1. This runs such a conversation
against servers the bench starts (``python -m stepmtp.server``, with and without
the MTP heads, and the C++ ``llama-server`` when given), each turn streamed through
``/v1/chat/completions``, and reports per turn: the prompt's tokens, how many were
decoded (``timings.prompt_n``) and reused (``timings.cache_n``), the prompt time
and the time to the first streamed token, side by side.

    python -m stepmtp.bench.agent_loop [--turns 6] [--llama-server PATH] [-m MODEL]

Turns are interleaved across the servers (turn 1 on each, then turn 2 on each, ...)
so that a busy machine slows them alike. Each user turn adds a piece of code from
the prompt set (a few hundred tokens); answers are greedy and capped.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from .model import resolve_model
from .prompts import load_prompts
from .runners import ServerProcess, find_llama_server

ANSWER_TOKENS = 48


def chat_stream(url: str, messages: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """One streamed turn: its text, the time to the first content, and the timings."""
    body = json.dumps({"messages": messages, "max_tokens": n, "temperature": 0, "stream": True,
                       "cache_prompt": True}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft = None
    text, reasoning, timings = [], [], {}
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            for ch in ev.get("choices") or []:
                d = ch.get("delta") or {}
                piece = (d.get("content") or "") + (d.get("reasoning_content") or "")
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(d.get("content") or "")
                reasoning.append(d.get("reasoning_content") or "")
            timings = ev.get("timings") or timings
    return {"content": "".join(text), "reasoning": "".join(reasoning), "ttft_ms": 1e3 * (ttft or 0.0),
            "timings": timings}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stepmtp.bench.agent_loop", description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="a step35 GGUF (default: the bundled model)")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("-c", "--ctx-size", type=int, default=8192)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--llama-server", default=None, metavar="PATH",
                    help="also the C++ llama-server (default: the bundled one, when installed)")
    ap.add_argument("--no-llama-server", action="store_true")
    ap.add_argument("--json", metavar="FILE", help="write the per-turn results")
    args = ap.parse_args(argv)
    model = resolve_model(args.model)
    common = ["-m", str(model), "-c", str(args.ctx_size), "-np", "1", "--temp", "0"]
    if args.threads:
        common += ["-t", str(args.threads)]
    servers = {
        "stepmtp none": ServerProcess([sys.executable, "-m", "stepmtp.server", *common], label="srv-none"),
        "stepmtp chain-3": ServerProcess([sys.executable, "-m", "stepmtp.server", *common, "--spec-type",
                                          "draft-mtp"], label="srv-chain-3"),
    }
    exe = None if args.no_llama_server else (args.llama_server or find_llama_server())
    if exe:
        # defaults, as ours: the window-sized sliding-window cache, prompt caching on
        servers["llama-server"] = ServerProcess([str(exe), *common], label="cpp")
    pieces = [p.prompt for p in load_prompts(None).prompts]
    convs: dict[str, list[dict[str, Any]]] = {k: [] for k in servers}
    rows: list[dict[str, Any]] = []
    try:
        for s in servers.values():
            s.start()
        for turn in range(args.turns):
            user = f"Review this code:\n{pieces[turn % len(pieces)]}"
            for name, srv in servers.items():
                convs[name].append({"role": "user", "content": user})
                out = chat_stream(srv.url, convs[name], ANSWER_TOKENS)
                convs[name].append({"role": "assistant", "content": out["content"],
                                    **({"reasoning_content": out["reasoning"]} if out["reasoning"] else {})})
                t = out["timings"]
                rows.append({"turn": turn + 1, "server": name, "prompt_n": t.get("prompt_n"),
                             "cache_n": t.get("cache_n"), "prompt_ms": t.get("prompt_ms"), "ttft_ms": out["ttft_ms"],
                             "predicted_per_second": t.get("predicted_per_second")})
    finally:
        for s in servers.values():
            s.close()
    print(f"model: {model.name}; {args.turns} turns, answers of {ANSWER_TOKENS} tokens, -np 1, interleaved")
    print(f"| turn | server | prompt tokens | decoded (prompt_n) | reused (cache_n) | prompt ms | first token ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        total = (r["prompt_n"] or 0) + (r["cache_n"] or 0)
        print(f"| {r['turn']} | {r['server']} | {total} | {r['prompt_n']} | {r['cache_n']} | "
              f"{r['prompt_ms'] or 0:.1f} | {r['ttft_ms']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
