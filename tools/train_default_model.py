#!/usr/bin/env python
"""Train stepmtp's default model: a small ``step35`` (Step-3.5-Flash architecture)
model with three chained MTP heads, on the CPython standard library's sources.

Build-time tool only: needs ``torch`` (``pip install torch==2.13.0``, CPU), which is
never a runtime dependency of the package. One CPU thread, seeded, deterministic
for a given machine, torch version, llama.cpp build and CPython (the corpus is that
Python's stdlib).

From scratch (phase 1 then phase 2):

    python tools/train_default_model.py --out python/stepmtp/models/

The heads alone (phase 2 only) on an existing model's trunk, which is kept byte for
byte (how the model before 08feade's was made from d535fcb's):

    python tools/train_default_model.py --heads-only base.gguf --out python/stepmtp/models/

A fine-tune (phase 1 again from a model's weights, on the whole standard library but
the held-out modules, then phase 2); how the shipped model was made from 08feade's
(git show 08feade:python/stepmtp/models/stdlib-q8_0.gguf > base.gguf; see docs/bundled-model.md):

    python tools/train_default_model.py --finetune base.gguf --out python/stepmtp/models/ \
        --steps 2000 --lr 1.5e-3 --warmup 50 --head-weight 1.5 --head-steps 3000 --head-lr 2e-3

Phase 1: corpus (``stepmtp.models.corpus``, the first files of ``Lib/*.py`` by
name) -> byte-level BPE -> train the trunk and the three MTP heads together.

Phase 2 (:func:`head_data`, :func:`train_heads`): the trunk frozen, the heads alone,
on what they will have to predict: ``onpolicy_seqs`` greedy continuations written
by the trunk itself in llama.cpp (the Q8_0 file, so exactly the trunk of inference)
of prompts drawn from the *whole* standard library (``C.head_corpus_files``: about
600 files, packages included, the held-out evaluation modules
``stepmtp.models.OUT_OF_CORPUS_FILES`` left out), mixed with excerpts of the same
files; targets half the trunk's distribution, half its argmax. The trunk's hidden
rows are computed once (in torch, from the dequantized weights: Q8_0 is exact in
float32), so a step only runs the heads.

Export: a Q8_0 GGUF with the heads embedded (from scratch through
``stepmtp.tiny._write_gguf``, then a check that llama.cpp tokenizes the corpus exactly
as the training did; ``--heads-only``: the source file with its MTP blocks replaced,
every other tensor copied as it is, checked to be byte-identical).

The heads are trained on exactly the inputs the driver (``stepmtp/mtp.py``) feeds
them, with the true tokens in place of the drafts. With ``H[p]`` the trunk's last
hidden row at ``p`` (before the output norm, ``H[-1] = 0``) and ``t_p`` the tokens:

* every head's KV at a position ``p`` holds the *trunk-fed* row ``(t_p, H[p-1])``
  (what the process step writes);
* head 0, row ``q`` = ``(t_q, H[q-1])``, over its trunk-fed KV, predicts ``t_{q+1}``;
  its output row is ``O0[q]``;
* head 1 drafts at ``r + 1`` from the batch ``[(t_r, H[r-1]), (t_{r+1}, O0[r])]``:
  the query row ``j = r + 1`` is ``(t_j, O0[j-1])``, it sees head 1's trunk-fed
  rows at ``p <= j - 1`` and itself, predicts ``t_{j+1}``; output ``O1[j]``;
* head 2 drafts at ``r + 2`` from ``[(t_r, H[r-1]), (t_{r+1}, O0[r]), (t_{r+2}, O1[r+1])]``:
  the query row ``j = r + 2`` is ``(t_j, O1[j-1])``; it sees head 2's trunk-fed rows
  at ``p <= j - 2``, head 2's row ``(t_{j-1}, O0[j-2])`` at ``j - 1``, and itself;
  predicts ``t_{j+1}``.

All three are computed for every position of a training window at once, with
attention masks over the concatenated key sets.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import gguf

from stepmtp.models import DEFAULT_MODEL_FILE
from stepmtp.models import corpus as C
from stepmtp.tiny import SPECIAL_TOKENS, TinyConfig, TinyVocab, _write_gguf, llama3_rope_factors

ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------

#: The default model's architecture, as llama.cpp will see it (see TinyConfig).
MODEL_CONFIG = TinyConfig(
    n_embd=128,
    n_layer=6,              # blk.0 full + dense; blk.1-3 swa, blk.4 full, blk.5 swa, all MoE
    n_nextn=3,              # blk.6, blk.7 (swa), blk.8 (full): dense MTP blocks
    head_dim=32,
    n_head_full=4,
    n_head_swa=4,
    n_head_kv=2,
    swa_period=4,
    n_swa=128,
    n_ff=384,
    n_ff_exp=128,
    n_ff_shexp=128,
    n_expert=4,
    n_expert_used=2,
    n_leading_dense=1,
    n_ctx_train=1024,
    expert_weights_scale=2.0,
    swiglu_clamp_exp_trunk=(0.0, 0.0, 0.0, 0.0, 0.0, 7.0),
    swiglu_clamp_shexp_trunk=(0.0, 0.0, 0.0, 0.0, 0.0, 7.0),
    n_vocab=2048,
)


@dataclass
class TrainConfig:
    seed: int = 0
    seq_len: int = 256
    batch: int = 4
    steps: int = 1400
    lr: float = 4e-3
    lr_min_frac: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    head_weight: float = 0.5        # loss weight of each MTP head
    distill: float = 0.0            # head targets: (1-distill) * true next token + distill * trunk's distribution
    router_bias_rate: float = 1e-3  # aux-loss-free balancing of the router bias
    init_std: float = 0.02
    head_steps: int = 5000          # phase 2: heads alone on the frozen trunk
    head_batch: int = 4
    head_lr: float = 2e-3
    head_warmup: int = 100
    head_distill: float = 0.5       # the rest of the target: the trunk's argmax
    onpolicy_seqs: int = 6000       # phase 2 learns on the trunk's own greedy text ...
    onpolicy_prompt_min: int = 8    # ... of prompts of this many tokens ...
    onpolicy_prompt: int = 128      # ... to this many, from the whole stdlib (C.head_corpus_files)
    onpolicy_frac: float = 0.75     # share of such rows, the others stdlib excerpts ...
    text_windows: int = 1500        # ... of which there are this many
    head_val_seqs: int = 48         # greedy continuations held out to follow the heads' agreement
    log_every: int = 100


# ---------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, w.shape, w, eps)


def swiglu(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    a = F.silu(g)
    if limit > 1e-6:
        a = a.clamp(max=limit)
        u = u.clamp(-limit, limit)
    return a * u


def rope_tables(cfg: TinyConfig, il: int, n_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n_pos, n_rot/2] of block il (NEOX; full layers: partial rotary and rope_freqs)."""
    n_rot = cfg.n_rot(il)
    half = n_rot // 2
    inv = cfg.rope_base(il) ** (-torch.arange(half, dtype=torch.float64) * 2.0 / n_rot)
    if not cfg.is_swa(il):
        inv = inv / torch.from_numpy(llama3_rope_factors(cfg)[:half]).double()
    ang = torch.arange(n_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, hd]; cos/sin [T, half]."""
    half = cos.shape[-1]
    x0, x1, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos, rest], dim=-1)


class Block(torch.nn.Module):
    """One step35 decoder layer (attention with q/k norms and a head-wise gate, then a
    dense SwiGLU MLP or a sigmoid-routed MoE with a router bias and a shared expert)."""

    def __init__(self, cfg: TinyConfig, il: int, std: float, out_std: float) -> None:
        super().__init__()
        self.cfg, self.il = cfg, il
        E, hd = cfg.n_embd, cfg.head_dim
        self.nh, self.nkv = cfg.n_head(il), cfg.n_head_kv
        self.swa = cfg.is_swa(il)
        self.moe = cfg.is_moe(il)
        self.clamp_exp = cfg.swiglu_clamp_exp(cfg.n_layer_all)[il]
        self.clamp_shexp = cfg.swiglu_clamp_shexp(cfg.n_layer_all)[il]
        P = torch.nn.Parameter

        def mat(*shape: int, s: float = std) -> torch.nn.Parameter:
            return P(torch.randn(*shape) * s)

        self.attn_norm = P(torch.ones(E))
        # q | k | v | gate rows in one matrix
        self.n_q, self.n_k = self.nh * hd, self.nkv * hd
        self.wqkvg = mat(self.n_q + 2 * self.n_k + self.nh, E)
        self.q_norm = P(torch.ones(hd))
        self.k_norm = P(torch.ones(hd))
        self.wo = mat(E, self.n_q, s=out_std)
        self.ffn_norm = P(torch.ones(E))
        if self.moe:
            X, Fe, S = cfg.n_expert, cfg.n_ff_exp, cfg.n_ff_shexp
            self.router = mat(X, E)
            self.register_buffer("router_bias", torch.zeros(X))
            self.w_gu_exps = mat(X, 2 * Fe, E)
            self.w_down_exps = mat(X, E, Fe, s=out_std / cfg.expert_weights_scale)
            self.w_gu_sh = mat(2 * S, E)
            self.w_down_sh = mat(E, S, s=out_std)
            self.last_load: torch.Tensor | None = None
        else:
            self.w_gu = mat(2 * cfg.n_ff, E)
            self.w_down = mat(E, cfg.n_ff, s=out_std)

    # -- attention pieces -------------------------------------------------------

    def qkvg(self, xn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, need_q: bool = True):
        """xn [B, T, E] (after attn_norm) -> q [B,H,T,hd] (or None), k, v [B,Hkv,T,hd], gate [B,T,H]."""
        B, T, _ = xn.shape
        hd = self.cfg.head_dim
        eps = self.cfg.rms_eps
        if need_q:
            y = xn @ self.wqkvg.t()
            q, k, v, g = y.split([self.n_q, self.n_k, self.n_k, self.nh], dim=-1)
            q = rms_norm(q.view(B, T, self.nh, hd), self.q_norm, eps).transpose(1, 2)
            q = apply_rope(q, cos, sin)
        else:
            y = xn @ self.wqkvg[self.n_q : self.n_q + 2 * self.n_k].t()
            k, v = y.split([self.n_k, self.n_k], dim=-1)
            q = g = None
        k = rms_norm(k.view(B, T, self.nkv, hd), self.k_norm, eps).transpose(1, 2)
        k = apply_rope(k, cos, sin)
        v = v.reshape(B, T, self.nkv, hd).transpose(1, 2)
        return q, k, v, g

    def attend(self, q, k, v, g, mask, residual: torch.Tensor) -> torch.Tensor:
        """Attention output (gated, projected) plus the residual, then the FFN half."""
        B, H, T, hd = q.shape
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        o = o * torch.sigmoid(g).transpose(1, 2)[..., None]
        x = residual + o.transpose(1, 2).reshape(B, T, H * hd) @ self.wo.t()
        return x + self.ffn(rms_norm(x, self.ffn_norm, self.cfg.rms_eps))

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        if not self.moe:
            g, u = (x @ self.w_gu.t()).chunk(2, dim=-1)
            return swiglu(g, u, self.clamp_shexp) @ self.w_down.t()
        cfg = self.cfg
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        probs = torch.sigmoid(x2 @ self.router.t())                        # [N, X]
        top = torch.topk(probs.detach() + self.router_bias, cfg.n_expert_used, dim=-1).indices
        wts = probs.gather(1, top)
        if cfg.expert_weights_norm:
            wts = wts / wts.sum(-1, keepdim=True).clamp(min=6.103515625e-5)
        wts = wts * cfg.expert_weights_scale
        self.last_load = torch.bincount(top.reshape(-1), minlength=cfg.n_expert).float()
        out = torch.zeros_like(x2)
        for e in range(cfg.n_expert):
            rows, slot = (top == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            xe = x2.index_select(0, rows)
            g, u = (xe @ self.w_gu_exps[e].t()).chunk(2, dim=-1)
            ye = swiglu(g, u, self.clamp_exp) @ self.w_down_exps[e].t()
            out = out.index_add(0, rows, ye * wts[rows, slot][:, None])
        g, u = (x2 @ self.w_gu_sh.t()).chunk(2, dim=-1)
        out = out + swiglu(g, u, self.clamp_shexp) @ self.w_down_sh.t()
        return out.view(shape)

    def forward(self, x: torch.Tensor, cos, sin, mask) -> torch.Tensor:
        xn = rms_norm(x, self.attn_norm, self.cfg.rms_eps)
        q, k, v, g = self.qkvg(xn, cos, sin)
        return self.attend(q, k, v, g, mask, x)


class MTPHead(torch.nn.Module):
    """An appended NextN block: eh_proj([enorm(embed(tok)); hnorm(h)]) -> decoder layer ->
    shared head (its own norm and output matrix). ``embed``: the head's own token
    embedding (``nextn.embed_tokens``), or None for the trunk's."""

    def __init__(self, cfg: TinyConfig, k: int, std: float, out_std: float) -> None:
        super().__init__()
        E, P = cfg.n_embd, torch.nn.Parameter
        self.cfg = cfg
        self.enorm = P(torch.ones(E))
        self.hnorm = P(torch.ones(E))
        self.eh_proj = P(torch.randn(E, 2 * E) * std)
        self.block = Block(cfg, cfg.n_layer + k, std, out_std)
        self.head_norm = P(torch.ones(E))
        self.head = P(torch.randn(cfg.n_vocab, E) * std)
        self.embed: torch.nn.Parameter | None = None

    def inp(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        eps = self.cfg.rms_eps
        return torch.cat([rms_norm(e, self.enorm, eps), rms_norm(h, self.hnorm, eps)], -1) @ self.eh_proj.t()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden, self.head_norm, self.cfg.rms_eps) @ self.head.t()


def _shift(h: torch.Tensor, n: int = 1) -> torch.Tensor:
    """Rows moved n positions later along T, zeros in front: out[:, j] = h[:, j - n]."""
    return F.pad(h, (0, 0, n, 0))[:, : h.shape[1]]


class StepModel(torch.nn.Module):
    def __init__(self, cfg: TinyConfig, seq_len: int, std: float = 0.02) -> None:
        super().__init__()
        self.cfg = cfg
        out_std = std / math.sqrt(2 * cfg.n_layer)
        self.embed = torch.nn.Parameter(torch.randn(cfg.n_vocab, cfg.n_embd) * std)
        self.blocks = torch.nn.ModuleList(Block(cfg, il, std, out_std) for il in range(cfg.n_layer))
        self.out_norm = torch.nn.Parameter(torch.ones(cfg.n_embd))
        self.output = torch.nn.Parameter(torch.randn(cfg.n_vocab, cfg.n_embd) * std)
        self.heads = torch.nn.ModuleList(MTPHead(cfg, k, std, out_std) for k in range(cfg.n_nextn))
        T = seq_len
        for il in range(cfg.n_layer_all):
            cos, sin = rope_tables(cfg, il, T)
            self.register_buffer(f"cos{il}", cos, persistent=False)
            self.register_buffer(f"sin{il}", sin, persistent=False)
        pos = torch.arange(T)
        qp, kp = pos[:, None], pos[None, :]
        causal = kp <= qp
        window = causal & (qp - kp < cfg.n_swa)
        eye = qp == kp
        prev = kp == qp - 1
        self.register_buffer("mask_full", causal, persistent=False)
        self.register_buffer("mask_swa", window, persistent=False)
        # chained queries: trunk-fed keys up to j-d (d = depth), then the chain rows
        for d in (1, 2):
            for kind, base in (("full", causal), ("swa", window)):
                tf = base & (kp <= qp - d)
                parts = [tf, eye] if d == 1 else [tf, prev, eye]
                self.register_buffer(f"mask_c{d}_{kind}", torch.cat(parts, dim=1), persistent=False)

    def rope(self, il: int):
        return getattr(self, f"cos{il}"), getattr(self, f"sin{il}")

    def mask(self, il: int, name: str = "") -> torch.Tensor:
        kind = "swa" if self.cfg.is_swa(il) else "full"
        return getattr(self, f"mask_{name}{'_' if name else ''}{kind}")

    def forward(self, tokens: torch.Tensor, train_trunk: bool = True):
        """tokens [B, T] -> (trunk logits, [head k logits]); head k's logits row j
        predicts tokens[j+1] from the chain described in the module docstring.
        ``train_trunk=False``: the trunk (and the token embedding) run without
        gradients, only the heads are trained."""
        with torch.set_grad_enabled(train_trunk and torch.is_grad_enabled()):
            e, H = self.trunk(tokens)
            trunk_logits = self.trunk_logits(H)
        return trunk_logits, self.heads_forward(e, H, tokens)

    def trunk(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T] -> (token embeddings, the trunk's last hidden rows H before the output norm)."""
        e = F.embedding(tokens, self.embed)
        x = e
        for il, blk in enumerate(self.blocks):
            cos, sin = self.rope(il)
            x = blk(x, cos, sin, self.mask(il))
        return e, x

    def trunk_logits(self, H: torch.Tensor) -> torch.Tensor:
        return rms_norm(H, self.out_norm, self.cfg.rms_eps) @ self.output.t()

    def heads_forward(self, e: torch.Tensor, H: torch.Tensor, tokens: torch.Tensor) -> list[torch.Tensor]:
        """Each head's logits (row j predicts tokens[j+1]) from the token embeddings
        (the trunk's ``e``, or a head's own) and the trunk's hidden rows, chained as the
        module docstring says."""
        cfg = self.cfg
        Hs = _shift(H)
        e0, e1, e2 = (e if h.embed is None else F.embedding(tokens, h.embed) for h in self.heads)

        heads_out = []
        # head 0: trunk-fed rows, plain causal self-attention
        h0 = self.heads[0]
        il = cfg.n_layer
        cos, sin = self.rope(il)
        x0 = h0.inp(e0, Hs)
        O0 = h0.block(x0, cos, sin, self.mask(il))
        heads_out.append(h0.logits(O0))

        # head 1: query (t_j, O0[j-1]) over trunk-fed keys p <= j-1 and itself
        h1 = self.heads[1]
        il = cfg.n_layer + 1
        cos, sin = self.rope(il)
        b = h1.block
        eps = cfg.rms_eps
        _, k_tf, v_tf, _ = b.qkvg(rms_norm(h1.inp(e1, Hs), b.attn_norm, eps), cos, sin, need_q=False)
        xc = h1.inp(e1, _shift(O0))
        q, k, v, g = b.qkvg(rms_norm(xc, b.attn_norm, eps), cos, sin)
        O1 = b.attend(q, torch.cat([k_tf, k], 2), torch.cat([v_tf, v], 2), g, self.mask(il, "c1"), xc)
        heads_out.append(h1.logits(O1))

        # head 2: query (t_j, O1[j-1]) over trunk-fed keys p <= j-2, (t_{j-1}, O0[j-2]) and itself
        h2 = self.heads[2]
        il = cfg.n_layer + 2
        cos, sin = self.rope(il)
        b = h2.block
        _, k_tf, v_tf, _ = b.qkvg(rms_norm(h2.inp(e2, Hs), b.attn_norm, eps), cos, sin, need_q=False)
        _, k_a, v_a, _ = b.qkvg(rms_norm(h2.inp(e2, _shift(O0)), b.attn_norm, eps), cos, sin, need_q=False)
        xc = h2.inp(e2, _shift(O1))
        q, k, v, g = b.qkvg(rms_norm(xc, b.attn_norm, eps), cos, sin)
        O2 = b.attend(q, torch.cat([k_tf, k_a, k], 2), torch.cat([v_tf, v_a, v], 2), g, self.mask(il, "c2"), xc)
        heads_out.append(h2.logits(O2))
        return heads_out

    def update_router_bias(self, rate: float) -> None:
        """Aux-loss-free load balancing: nudge each router bias toward an even load."""
        with torch.no_grad():
            for blk in self.blocks:
                if blk.moe and blk.last_load is not None:
                    load = blk.last_load
                    blk.router_bias += rate * torch.sign(load.mean() - load)

    # -- export -------------------------------------------------------------------

    def gguf_tensors(self) -> dict[str, np.ndarray]:
        """All weights under their GGUF names, numpy (n_out, n_in) layout, float32."""
        cfg = self.cfg
        t: dict[str, np.ndarray] = {}

        def a(x: torch.Tensor) -> np.ndarray:
            return x.detach().float().contiguous().numpy().copy()

        def block(p: str, b: Block) -> None:
            q, k, v, g = b.wqkvg.split([b.n_q, b.n_k, b.n_k, b.nh], dim=0)
            t[p + "attn_norm.weight"] = a(b.attn_norm)
            t[p + "attn_q.weight"] = a(q)
            t[p + "attn_k.weight"] = a(k)
            t[p + "attn_v.weight"] = a(v)
            t[p + "attn_q_norm.weight"] = a(b.q_norm)
            t[p + "attn_k_norm.weight"] = a(b.k_norm)
            t[p + "attn_gate.weight"] = a(g)
            t[p + "attn_output.weight"] = a(b.wo)
            t[p + "ffn_norm.weight"] = a(b.ffn_norm)
            if b.moe:
                Fe = cfg.n_ff_exp
                t[p + "ffn_gate_inp.weight"] = a(b.router)
                t[p + "exp_probs_b.bias"] = a(b.router_bias)
                t[p + "ffn_gate_exps.weight"] = a(b.w_gu_exps[:, :Fe])
                t[p + "ffn_up_exps.weight"] = a(b.w_gu_exps[:, Fe:])
                t[p + "ffn_down_exps.weight"] = a(b.w_down_exps)
                S = cfg.n_ff_shexp
                t[p + "ffn_gate_shexp.weight"] = a(b.w_gu_sh[:S])
                t[p + "ffn_up_shexp.weight"] = a(b.w_gu_sh[S:])
                t[p + "ffn_down_shexp.weight"] = a(b.w_down_sh)
            else:
                n = cfg.n_ff
                t[p + "ffn_gate.weight"] = a(b.w_gu[:n])
                t[p + "ffn_up.weight"] = a(b.w_gu[n:])
                t[p + "ffn_down.weight"] = a(b.w_down)

        t["token_embd.weight"] = a(self.embed)
        for il, b in enumerate(self.blocks):
            block(f"blk.{il}.", b)
        for k, h in enumerate(self.heads):
            p = f"blk.{cfg.n_layer + k}."
            t[p + "nextn.enorm.weight"] = a(h.enorm)
            t[p + "nextn.hnorm.weight"] = a(h.hnorm)
            t[p + "nextn.eh_proj.weight"] = a(h.eh_proj)
            block(p, h.block)
            t[p + "nextn.shared_head_norm.weight"] = a(h.head_norm)
            t[p + "nextn.shared_head_head.weight"] = a(h.head)
            if h.embed is not None:
                t[p + "nextn.embed_tokens.weight"] = a(h.embed)
        t["output_norm.weight"] = a(self.out_norm)
        t["output.weight"] = a(self.output)
        t["rope_freqs.weight"] = llama3_rope_factors(cfg)
        return t

    def load_gguf_tensors(self, t: dict[str, np.ndarray]) -> None:
        """The inverse of :meth:`gguf_tensors`: every weight from (dequantized) GGUF tensors."""
        cfg = self.cfg

        def put(p: torch.Tensor, *arrays: np.ndarray, dim: int = 0) -> None:
            x = torch.from_numpy(np.concatenate(arrays, axis=dim) if len(arrays) > 1 else arrays[0])
            if tuple(x.shape) != tuple(p.shape):
                raise ValueError(f"shape {tuple(x.shape)} != {tuple(p.shape)}")
            with torch.no_grad():
                p.copy_(x.float())

        def block(p: str, b: Block) -> None:
            put(b.wqkvg, t[p + "attn_q.weight"], t[p + "attn_k.weight"], t[p + "attn_v.weight"],
                t[p + "attn_gate.weight"])
            put(b.attn_norm, t[p + "attn_norm.weight"])
            put(b.q_norm, t[p + "attn_q_norm.weight"])
            put(b.k_norm, t[p + "attn_k_norm.weight"])
            put(b.wo, t[p + "attn_output.weight"])
            put(b.ffn_norm, t[p + "ffn_norm.weight"])
            if b.moe:
                put(b.router, t[p + "ffn_gate_inp.weight"])
                put(b.router_bias, t[p + "exp_probs_b.bias"])
                put(b.w_gu_exps, t[p + "ffn_gate_exps.weight"], t[p + "ffn_up_exps.weight"], dim=1)
                put(b.w_down_exps, t[p + "ffn_down_exps.weight"])
                put(b.w_gu_sh, t[p + "ffn_gate_shexp.weight"], t[p + "ffn_up_shexp.weight"])
                put(b.w_down_sh, t[p + "ffn_down_shexp.weight"])
            else:
                put(b.w_gu, t[p + "ffn_gate.weight"], t[p + "ffn_up.weight"])
                put(b.w_down, t[p + "ffn_down.weight"])

        put(self.embed, t["token_embd.weight"])
        for il, b in enumerate(self.blocks):
            block(f"blk.{il}.", b)
        for k, h in enumerate(self.heads):
            p = f"blk.{cfg.n_layer + k}."
            put(h.enorm, t[p + "nextn.enorm.weight"])
            put(h.hnorm, t[p + "nextn.hnorm.weight"])
            put(h.eh_proj, t[p + "nextn.eh_proj.weight"])
            block(p, h.block)
            put(h.head_norm, t[p + "nextn.shared_head_norm.weight"])
            put(h.head, t[p + "nextn.shared_head_head.weight"])
            if p + "nextn.embed_tokens.weight" in t:
                h.embed = torch.nn.Parameter(torch.empty(cfg.n_vocab, cfg.n_embd))
                put(h.embed, t[p + "nextn.embed_tokens.weight"])
        put(self.out_norm, t["output_norm.weight"])
        put(self.output, t["output.weight"])


# ---------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------


def build_tokenizer(docs, cfg: TinyConfig) -> tuple[TinyVocab, C.BPETokenizer]:
    n_specials = len(cfg.special_tokens)
    tokens, merges = C.train_bpe([text for _, text in docs], cfg.n_vocab - n_specials)
    if len(tokens) != cfg.n_vocab - n_specials:
        raise RuntimeError(f"BPE gave {len(tokens)} tokens")
    vocab = TinyVocab(
        tokens=tokens + list(cfg.special_tokens),
        token_types=[int(gguf.TokenType.NORMAL)] * len(tokens) + [int(gguf.TokenType.CONTROL)] * n_specials,
        merges=merges,
    )
    return vocab, C.BPETokenizer(vocab.tokens, merges, bos_id=cfg.bos_id)


def token_stream(docs, tok: C.BPETokenizer) -> np.ndarray:
    """Every file as BOS + its tokens, files concatenated in corpus order."""
    out: list[int] = []
    for _, text in docs:
        out.extend(tok.encode(text, add_bos=True))
    return np.asarray(out, dtype=np.int64)


def line_starts(stream: np.ndarray, tok: C.BPETokenizer, T: int) -> np.ndarray:
    """Indices where a window can start: the first token of a line at column 0 (the
    token before it ends with a newline) or of a file, with T-1 tokens after it."""
    ends_nl = np.array([t.endswith("\u010a") for t in tok.tokens], dtype=bool)  # GPT-2 spelling of "\n"
    is_bos = stream == tok.bos_id
    ok = np.zeros(len(stream), dtype=bool)
    ok[1:] = ends_nl[stream[:-1]] | is_bos[:-1]
    ok &= ~is_bos
    idx = np.nonzero(ok)[0]
    return idx[idx + T - 1 < len(stream)]


def batches(stream: np.ndarray, starts: np.ndarray, bos: int, B: int, T: int, gen: torch.Generator):
    """Endless random windows: BOS followed by T-1 consecutive corpus tokens, starting
    at a random line start (half of them: prompts are like that, BOS then ``def ...``)
    or anywhere (the other half: every token gets trained on, however deep in a class)."""
    s = torch.from_numpy(stream)
    st = torch.from_numpy(starts)
    while True:
        at_line = st[torch.randint(0, len(st), (B,), generator=gen)]
        anywhere = torch.randint(0, len(stream) - T, (B,), generator=gen)
        first = torch.where(torch.arange(B) % 2 == 0, at_line, anywhere)
        idx = first[:, None] + torch.arange(T - 1)[None, :]
        body = s[idx]
        yield torch.cat([torch.full((B, 1), bos, dtype=torch.long), body], 1), s[idx[:, -1] + 1]


# ---------------------------------------------------------------------------
# the heads' data: excerpts of the whole standard library, the trunk's greedy text
# ---------------------------------------------------------------------------

_DEF = ("def ", "class ", "async def ")
_QUOTES = ('"""', "'''")


class Excerpts:
    """Seeded random excerpts of the heads' files (``C.head_corpus_files``), as token ids.

    :meth:`prompt` is what a user would prompt with: with probability ``p_def`` a
    ``def``/``class`` line (a method's block dedented to column 0), else a line at
    column 0, and the lines after it (within the definition's block) until about a
    random length in ``[n_min, n_max]`` tokens, or, for half of the definitions with a
    docstring, exactly to the docstring's end (the evaluation prompts' shape); at most
    ``n_max`` tokens, never ending in a newline (see ``EVAL_PROMPTS``).
    :meth:`window` is ``n`` tokens of consecutive text from a line at column 0."""

    def __init__(self, files: list[Path], tok: C.BPETokenizer, seed: int, p_def: float = 0.6) -> None:
        self.files, self.tok, self.p_def = files, tok, p_def
        self.rng = np.random.default_rng(seed)
        self._lines: dict[Path, list[str]] = {}

    def _file(self) -> list[str]:
        while True:
            f = self.files[int(self.rng.integers(len(self.files)))]
            if f not in self._lines:
                try:
                    self._lines[f] = f.read_bytes().decode("utf-8").splitlines(keepends=True)
                except UnicodeDecodeError:
                    self._lines[f] = []
            lines = self._lines[f]
            if any(ln.strip() for ln in lines):
                return lines

    def _pick(self, lines: list[str], defs_too: bool) -> int:
        col0 = [i for i, ln in enumerate(lines) if ln.strip() and not ln[0].isspace()]
        defs = [i for i, ln in enumerate(lines) if ln.lstrip().startswith(_DEF)] if defs_too else []
        pool = defs if defs and self.rng.random() < self.p_def else (col0 or defs)
        return pool[int(self.rng.integers(len(pool)))] if pool else -1

    def prompt(self, n_min: int, n_max: int) -> list[int]:
        while True:
            lines = self._file()
            i = self._pick(lines, True)
            if i < 0:
                continue
            first = lines[i]
            indent = first[: len(first) - len(first.lstrip())]
            want = int(self.rng.integers(n_min, n_max + 1))
            is_def = first.lstrip().startswith(_DEF)
            doc_end = _docstring_end(lines, i) if is_def and self.rng.random() < 0.5 else -1
            out, n = [], 0
            for j in range(i, len(lines)):
                ln = lines[j]
                if is_def and j > i and ln.strip() and not ln.startswith((indent + " ", indent + "\t")):
                    if not (ln.startswith(indent) and ln[len(indent):].lstrip().startswith((")", "]", "}"))):
                        break  # left the block
                out.append(ln[len(indent):] if ln.startswith(indent) else ln.lstrip(" \t"))
                if doc_end >= 0:
                    if j >= doc_end:
                        break
                    continue
                n += max(1, len(ln) // 3)
                if n >= want:
                    break
            ids = self.tok.encode("".join(out).rstrip())
            if len(ids) >= 4:
                return ids[:n_max]

    def window(self, n: int) -> list[int]:
        while True:
            lines = self._file()
            i = self._pick(lines, False)
            if i < 0:
                continue
            text, j = "", i
            while j < len(lines) and len(text) < 6 * n:
                text += lines[j]
                j += 1
            ids = self.tok.encode(text)
            if len(ids) >= n:
                return ids[:n]


def _docstring_end(lines: list[str], i: int) -> int:
    """Index of the line that closes the docstring of the definition at line i, or -1."""
    j = i
    while j < len(lines) and not lines[j].rstrip().endswith(":"):  # a signature over several lines
        j += 1
    j += 1
    if j >= len(lines):
        return -1
    body = lines[j].strip()
    for q in _QUOTES:
        if body.startswith((q, "r" + q)):
            rest = body[body.index(q) + 3:]
            if q in rest:
                return j
            for k in range(j + 1, min(len(lines), j + 80)):
                if q in lines[k]:
                    return k
    return -1


def greedy_continuations(path: Path, prompts: list[list[int]], T: int, bos: int, log=print,
                         n_parallel: int = 16) -> torch.Tensor:
    """BOS + each prompt + the model's greedy (temperature 0) continuation to ``T + 1``
    tokens, run by llama.cpp on ``path`` (the trunk as it is shipped, Q8_0): what the
    heads must predict at inference. ``n_parallel`` generations share each decode
    (prompts sorted by length so that those generated together need about as many
    tokens). Those that stop early (an end token) are left out. Returns the rows
    ``[N, T + 1]`` and where each one's generated tokens start ``[N]``."""
    from stepmtp import Engine

    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    got: dict[int, list[int]] = {}
    t0 = time.perf_counter()
    slack = 64
    with Engine(path, mode="none", n_ctx=n_parallel * (T + 8 + slack), n_threads=1, n_parallel=n_parallel) as eng:
        for c in range(0, len(order), n_parallel):
            chunk = order[c : c + n_parallel]
            shortest = 1 + min(len(prompts[i]) for i in chunk)
            longest = 1 + max(len(prompts[i]) for i in chunk)
            if longest - shortest > slack:
                raise RuntimeError("prompt lengths in a chunk differ too much")
            outs = eng.generate_many([[bos, *prompts[i]] for i in chunk], n_predict=T + 1 - shortest,
                                     temperature=0)
            for i, o in zip(chunk, outs):
                seq = [bos, *prompts[i], *o.tokens]
                if len(seq) >= T + 1:
                    got[i] = seq[: T + 1]
    keep = sorted(got)
    log(f"greedy continuations: {len(keep)} of {len(prompts)} prompts ({len(prompts) - len(keep)} stopped early), "
        f"{time.perf_counter() - t0:.0f}s")
    return (torch.tensor([got[i] for i in keep], dtype=torch.long),
            torch.tensor([1 + len(prompts[i]) for i in keep], dtype=torch.long))


# ---------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------


def head_losses(heads: list[torch.Tensor], target: torch.Tensor, soft: torch.Tensor | None,
                distill: float) -> list[torch.Tensor]:
    """Each head's loss: ``(1 - distill)`` cross-entropy against the true next token
    plus ``distill`` against the trunk's own distribution ``soft`` at that row (what a
    draft needs is to agree with the trunk). Head k's rows are valid from j = k on
    (they need k chained rows before them)."""
    out = []
    for k, hl in enumerate(heads):
        V = hl.shape[-1]
        lg, tg = hl[:, k:].reshape(-1, V), target[:, k:].reshape(-1)
        loss = F.cross_entropy(lg, tg) if distill < 1 else lg.new_zeros(())
        if soft is not None:
            xent = -(soft[:, k:].reshape(-1, V) * F.log_softmax(lg, -1)).sum(-1).mean()
            loss = (1 - distill) * loss + distill * xent
        out.append(loss)
    return out


def losses(model: StepModel, tokens: torch.Tensor, nxt: torch.Tensor, distill: float, train_trunk: bool = True):
    """Trunk next-token loss and each head's loss (row j predicts tokens[j+1], see
    :func:`head_losses`)."""
    logits, heads = model(tokens, train_trunk=train_trunk)
    V = model.cfg.n_vocab
    target = torch.cat([tokens[:, 1:], nxt[:, None]], 1)  # token after each position
    trunk = F.cross_entropy(logits.reshape(-1, V), target.reshape(-1))
    soft = F.softmax(logits.detach(), -1) if distill > 0 else None
    return trunk, head_losses(heads, target, soft, distill)


def agreement_of(logits: torch.Tensor, heads: list[torch.Tensor]) -> list[float]:
    """Teacher-forced proxy of greedy acceptance: fraction of anchors r where heads
    0..d-1 all match the trunk's argmax at r+1..r+d (true tokens in between)."""
    tr = logits.argmax(-1)  # [B, T] trunk's next token after each position
    B, T = tr.shape
    ok = torch.ones(B, T - 3, dtype=torch.bool)
    out = []
    for k, hl in enumerate(heads):
        # anchor r: head k's row r + k predicts position r + k + 1, like the trunk's row r + k
        hk = hl.argmax(-1)[:, k : k + T - 3]
        ok = ok & (hk == tr[:, k : k + T - 3])
        out.append(ok.float().mean().item())
    return out


def agreement(model: StepModel, tokens: torch.Tensor) -> list[float]:
    with torch.no_grad():
        logits, heads = model(tokens)
    return agreement_of(logits, heads)


def param_groups(params: list[torch.nn.Parameter], wd: float):
    decay, no_decay = [], []
    for p in params:
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def _cosine(step: int, n: int, peak: float, warmup: int, min_frac: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, n - warmup)
    return peak * (min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * frac)))


def train(cfg: TinyConfig, tc: TrainConfig, stream: np.ndarray, starts: np.ndarray,
          log=print, init_state: dict | None = None) -> StepModel:
    """Phase 1 (``tc.steps``): trunk and heads together, the trunk on next-token loss,
    the heads on their chained inputs (the module docstring), their gradients
    flowing into the trunk too. Phase 2 is :func:`train_heads`."""
    torch.manual_seed(tc.seed)
    model = StepModel(cfg, tc.seq_len, tc.init_std)
    if init_state is not None:
        model.load_state_dict(init_state)
    gen = torch.Generator().manual_seed(tc.seed + 1)
    data = batches(stream, starts, cfg.bos_id, tc.batch, tc.seq_len, gen)
    eval_tokens = next(batches(stream, starts, cfg.bos_id, 8, tc.seq_len, torch.Generator().manual_seed(12345)))[0]
    t0 = time.perf_counter()
    params = list(model.parameters())
    lr_at = lambda s: _cosine(s, tc.steps, tc.lr, tc.warmup, tc.lr_min_frac)  # noqa: E731
    opt = torch.optim.AdamW(param_groups(params, tc.weight_decay), lr=lr_at(0), betas=(0.9, 0.95), eps=1e-8)
    acc = np.zeros(4)
    for step in range(tc.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        tokens, nxt = next(data)
        trunk, hl = losses(model, tokens, nxt, tc.distill, True)
        loss = trunk + tc.head_weight * sum(hl)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        model.update_router_bias(tc.router_bias_rate)
        acc += np.array([trunk.item(), *[h.item() for h in hl]])
        done = step + 1
        if done % tc.log_every == 0 or done == tc.steps:
            acc /= tc.log_every if done % tc.log_every == 0 else done % tc.log_every
            ag = agreement(model, eval_tokens)
            log(f"joint {done:5d}/{tc.steps} lr {lr_at(step):.2e} loss trunk {acc[0]:.3f} "
                f"heads {acc[1]:.3f} {acc[2]:.3f} {acc[3]:.3f} agree {ag[0]:.3f} {ag[1]:.3f} {ag[2]:.3f} "
                f"{time.perf_counter() - t0:7.1f}s")
            acc[:] = 0
    return model


@dataclass
class HeadData:
    """The heads' training rows: ``tokens [N, T + 1]``, the trunk's hidden rows of
    ``tokens[:, :-1]`` (``H [N, T, E]``, computed once: the trunk is frozen) and which
    rows are the trunk's greedy text (the others are stdlib excerpts)."""

    tokens: torch.Tensor
    H: torch.Tensor
    onpolicy: torch.Tensor


def trunk_hidden(model: StepModel, tokens: torch.Tensor, chunk: int = 16) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model.trunk(tokens[i : i + chunk, :-1])[1] for i in range(0, len(tokens), chunk)])


def head_data(model: StepModel, tc: TrainConfig, trunk_path: Path, tok: C.BPETokenizer,
              log=print) -> tuple[HeadData, HeadData, dict]:
    """Training and validation rows for :func:`train_heads`, and a description of them.

    Prompts from the whole standard library (``C.head_corpus_files``, the held-out
    evaluation modules ``OUT_OF_CORPUS_FILES`` left out) continued greedily by the
    trunk in llama.cpp (``tc.onpolicy_seqs`` rows, plus ``tc.head_val_seqs`` for
    validation), and ``tc.text_windows`` excerpts of the same files."""
    from stepmtp.models import OUT_OF_CORPUS_FILES

    T, bos = tc.seq_len, model.cfg.bos_id
    files = C.head_corpus_files(OUT_OF_CORPUS_FILES)
    n_bytes = sum(p.stat().st_size for p in files)
    log(f"heads' data: {len(files)} stdlib files, {n_bytes} bytes")
    ex = Excerpts(files, tok, tc.seed + 3)
    t0 = time.perf_counter()
    want = tc.onpolicy_seqs + tc.head_val_seqs
    prompts = [ex.prompt(tc.onpolicy_prompt_min, tc.onpolicy_prompt) for _ in range(int(want * 1.1) + 8)]
    windows = torch.tensor([[bos, *ex.window(T)] for _ in range(tc.text_windows)], dtype=torch.long)
    log(f"{len(prompts)} prompts (mean {np.mean([len(p) for p in prompts]):.0f} tokens), "
        f"{len(windows)} text windows: {time.perf_counter() - t0:.0f}s")
    seqs, first = greedy_continuations(trunk_path, prompts, T, bos, log)
    if len(seqs) < want:
        raise RuntimeError(f"only {len(seqs)} greedy continuations of {want}")
    # the validation rows are the last ones (prompts drawn after the training rows')
    train_seqs, val_seqs = seqs[: tc.onpolicy_seqs], seqs[len(seqs) - tc.head_val_seqs:]
    val_first = first[len(seqs) - tc.head_val_seqs:]
    t0 = time.perf_counter()
    tokens = torch.cat([train_seqs, windows])
    H = trunk_hidden(model, tokens)
    Hv = trunk_hidden(model, val_seqs)
    with torch.no_grad():  # how often the trunk here picks what llama.cpp picked (Q8_0 rounding)
        picked = model.trunk_logits(Hv).argmax(-1) == val_seqs[:, 1:]  # row j predicts token j + 1
        generated = torch.arange(T)[None, :] + 1 >= val_first[:, None]
        same = picked[generated].float().mean().item()
    log(f"trunk hidden rows of {len(tokens) + len(val_seqs)} rows: {time.perf_counter() - t0:.0f}s; "
        f"torch's trunk picks llama.cpp's token at {same:.4f} of the positions")
    onp = torch.arange(len(tokens)) < len(train_seqs)
    desc = {"files": len(files), "bytes": n_bytes, "onpolicy_seqs": len(train_seqs),
            "text_windows": len(windows), "held_out": list(OUT_OF_CORPUS_FILES)}
    return (HeadData(tokens, H, onp), HeadData(val_seqs, Hv, torch.ones(len(val_seqs), dtype=torch.bool)), desc)


def train_heads(model: StepModel, tc: TrainConfig, data: HeadData, val: HeadData, log=print) -> None:
    """Phase 2 (``tc.head_steps``): the trunk frozen, the heads alone, with
    ``tc.head_distill`` of their target the trunk's own distribution and the rest
    its argmax (the trunk's rows are cached in ``data``), a row the trunk's greedy
    text with probability ``tc.onpolicy_frac``, else a stdlib excerpt."""
    gen = torch.Generator().manual_seed(tc.seed + 2)
    params = list(model.heads.parameters())
    lr_at = lambda s: _cosine(s, tc.head_steps, tc.head_lr, tc.head_warmup, tc.lr_min_frac)  # noqa: E731
    opt = torch.optim.AdamW(param_groups(params, tc.weight_decay), lr=lr_at(0), betas=(0.9, 0.95), eps=1e-8)
    on_idx = torch.nonzero(data.onpolicy).squeeze(1)
    off_idx = torch.nonzero(~data.onpolicy).squeeze(1)
    B = tc.head_batch
    t0 = time.perf_counter()

    def forward(tokens: torch.Tensor, H: torch.Tensor):
        with torch.no_grad():
            e = F.embedding(tokens[:, :-1], model.embed)
            logits = model.trunk_logits(H)
        return logits, model.heads_forward(e, H, tokens[:, :-1])

    acc = np.zeros(3)
    for step in range(tc.head_steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        take = torch.rand(B, generator=gen) < tc.onpolicy_frac
        a = on_idx[torch.randint(0, len(on_idx), (B,), generator=gen)]
        b = off_idx[torch.randint(0, len(off_idx), (B,), generator=gen)] if len(off_idx) else a
        rows = torch.where(take, a, b)
        tokens = data.tokens[rows]
        logits, heads = forward(tokens, data.H[rows])
        soft = F.softmax(logits, -1) if tc.head_distill > 0 else None
        # the hard target is the trunk's own pick (what a draft must match), not the text's
        hl = head_losses(heads, logits.argmax(-1), soft, tc.head_distill)
        loss = sum(hl)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        acc += np.array([h.item() for h in hl])
        done = step + 1
        if done % tc.log_every == 0 or done == tc.head_steps:
            acc /= tc.log_every if done % tc.log_every == 0 else done % tc.log_every
            with torch.no_grad():
                ag = np.mean([agreement_of(*forward(val.tokens[i : i + 16], val.H[i : i + 16]))
                              for i in range(0, len(val.tokens), 16)], axis=0)
            log(f"heads {done:5d}/{tc.head_steps} lr {lr_at(step):.2e} loss {acc[0]:.3f} {acc[1]:.3f} "
                f"{acc[2]:.3f} agree (greedy text, held out) {ag[0]:.3f} {ag[1]:.3f} {ag[2]:.3f} "
                f"{time.perf_counter() - t0:7.1f}s")
            acc[:] = 0


# ---------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------

# tensors kept in F32 like the converter does: 1-d tensors (norms, biases, rope
# factors) and the router
def _keep_f32(name: str, arr: np.ndarray) -> bool:
    return arr.ndim == 1 or name.endswith("ffn_gate_inp.weight")


def export_gguf(model: StepModel, vocab: TinyVocab, path: Path, qtype: str, meta: dict[str, str]) -> None:
    cfg = model.cfg
    tensors = model.gguf_tensors()
    q = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "f16": gguf.GGMLQuantizationType.F16,
         "f32": gguf.GGMLQuantizationType.F32}[qtype]
    ftype = {"q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "f32": gguf.LlamaFileType.ALL_F32}[qtype]
    types = {n: (gguf.GGMLQuantizationType.F32 if _keep_f32(n, a) else q) for n, a in tensors.items()}
    _write_gguf(path, cfg, vocab, tensors.items(), with_nextn=True, seed=0, variant="default",
                name="stepmtp stdlib step35 (3 MTP heads)", tokenizer_pre=C.TOKENIZER_PRE,
                file_type=ftype, tensor_types=types, extra_kv=meta, chat_template=step_chat_template())


def step_chat_template() -> str:
    """Step-3.5-Flash's own chat template (<think>, tools, tool responses), from the
    vendored llama.cpp tree (`python vendor/fetch.py` materialises it): what users
    of the bundled model meet first is the real format."""
    src = ROOT / "vendor" / "llama.cpp" / "models" / "templates" / "stepfun-ai-Step-3.5-Flash.jinja"
    if not src.is_file():
        raise SystemExit(f"{src} is missing: run `python vendor/fetch.py` first")
    return src.read_text(encoding="utf-8")


def _is_mtp(name: str, n_layer: int) -> bool:
    return name.startswith("blk.") and int(name.split(".")[1]) >= n_layer


def load_gguf_model(path: Path, seq_len: int, cfg: TinyConfig = MODEL_CONFIG) -> tuple[StepModel, C.BPETokenizer]:
    """A model with every weight of ``path`` (dequantized: Q8_0 is exact in float32)
    and the file's tokenizer. ``cfg`` must be the file's architecture."""
    r = gguf.GGUFReader(str(path))
    f = lambda k: r.fields[k].contents()  # noqa: E731
    tokens = list(f("tokenizer.ggml.tokens"))
    got = {"n_embd": f("step35.embedding_length"), "n_layer_all": f("step35.block_count"),
           "n_nextn": f("step35.nextn_predict_layers"), "n_ff": f("step35.feed_forward_length"),
           "n_expert": f("step35.expert_count"), "n_vocab": len(tokens), "bos_id": f("tokenizer.ggml.bos_token_id")}
    want = {k: getattr(cfg, k) for k in got}
    if got != want:
        raise SystemExit(f"{path} is not MODEL_CONFIG's architecture: {got} != {want}")
    model = StepModel(cfg, seq_len)
    model.load_gguf_tensors({t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(
        [int(d) for d in reversed(t.shape)]) for t in r.tensors})
    return model, C.BPETokenizer(tokens, list(f("tokenizer.ggml.merges")), bos_id=cfg.bos_id)


def export_heads(src: Path, model: StepModel, path: Path, meta: dict[str, str]) -> None:
    """``src`` with its MTP blocks' tensors replaced by ``model``'s heads, each in the
    type ``src`` stores it in; every other tensor is copied byte for byte (the trunk
    stays bit-identical) and every metadata key as it is, ``meta``'s keys set."""
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    n_layer = model.cfg.n_layer
    new = model.gguf_tensors()
    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), arch)
    for field in r.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or field.name in meta:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for key, value in meta.items():
        w.add_string(key, value)
    old = {t.name: t for t in r.tensors}
    types = {t.name: t.tensor_type for t in r.tensors}
    for name in (n for n in new if _is_mtp(n, n_layer) and n not in types):  # a head's own embedding
        types[name] = types["token_embd.weight"]
    for name, qtype in types.items():
        if not _is_mtp(name, n_layer):
            w.add_tensor(name, old[name].data, raw_dtype=qtype)
            continue
        arr = np.ascontiguousarray(new[name], dtype=np.float32)
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)


def trunk_digest(path: Path) -> str:
    """sha256 over the name, type and bytes of every tensor but the MTP blocks'."""
    import hashlib

    r = gguf.GGUFReader(str(path))
    n_layer = int(r.fields["step35.block_count"].contents()) - int(r.fields["step35.nextn_predict_layers"].contents())
    h = hashlib.sha256()
    for t in sorted(r.tensors, key=lambda t: t.name):
        if not _is_mtp(t.name, n_layer):
            h.update(f"{t.name}:{t.tensor_type.name}:".encode() + np.ascontiguousarray(t.data).tobytes())
    return h.hexdigest()


def check_tokenization(path: Path, docs, tok: C.BPETokenizer) -> int:
    """llama.cpp's tokenization of every corpus file against ours; returns the mismatches."""
    from stepmtp import Model

    bad = 0
    with Model(path) as m:
        for name, text in docs:
            if m.tokenize(text, add_special=False) != tok.encode(text):
                print(f"tokenization differs on {name}", file=sys.stderr)
                bad += 1
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for the GGUF")
    ap.add_argument("--name", default=DEFAULT_MODEL_FILE)
    ap.add_argument("--heads-only", type=Path, metavar="GGUF",
                    help="keep this model's trunk (byte for byte) and train only its MTP heads (phase 2)")
    ap.add_argument("--finetune", type=Path, metavar="GGUF",
                    help="phase 1 again from this model's weights (its tokenizer kept), on the whole standard "
                         "library but the held-out modules, then phase 2 on the new trunk")
    ap.add_argument("--heads-init", choices=["file", "fresh"], default="file",
                    help="--heads-only: start from the file's heads or from a seeded random init")
    ap.add_argument("--head-embed", action="store_true",
                    help="--heads-only: each head gets its own token embedding (nextn.embed_tokens), "
                         "starting as the trunk's")
    ap.add_argument("--quant", choices=["q8_0", "f16", "f32"], default="q8_0")
    ap.add_argument("--steps", type=int, default=TrainConfig.steps)
    ap.add_argument("--batch", type=int, default=TrainConfig.batch)
    ap.add_argument("--seq-len", type=int, default=TrainConfig.seq_len)
    ap.add_argument("--lr", type=float, default=TrainConfig.lr)
    ap.add_argument("--warmup", type=int, default=TrainConfig.warmup)
    ap.add_argument("--init-std", type=float, default=TrainConfig.init_std)
    ap.add_argument("--log-every", type=int, default=TrainConfig.log_every)
    ap.add_argument("--head-weight", type=float, default=TrainConfig.head_weight)
    ap.add_argument("--distill", type=float, default=TrainConfig.distill)
    ap.add_argument("--seed", type=int, default=TrainConfig.seed)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--budget-bytes", type=int, default=C.CORPUS_BUDGET_BYTES)
    ap.add_argument("--max-file-bytes", type=int, default=C.CORPUS_MAX_FILE_BYTES)
    ap.add_argument("--head-steps", type=int, default=TrainConfig.head_steps)
    ap.add_argument("--head-batch", type=int, default=TrainConfig.head_batch)
    ap.add_argument("--head-lr", type=float, default=TrainConfig.head_lr)
    ap.add_argument("--head-warmup", type=int, default=TrainConfig.head_warmup)
    ap.add_argument("--head-distill", type=float, default=TrainConfig.head_distill)
    ap.add_argument("--onpolicy-seqs", type=int, default=TrainConfig.onpolicy_seqs)
    ap.add_argument("--onpolicy-frac", type=float, default=TrainConfig.onpolicy_frac)
    ap.add_argument("--text-windows", type=int, default=TrainConfig.text_windows)
    ap.add_argument("--init-state", type=Path, help="start from this torch state dict (experiments)")
    ap.add_argument("--save-torch", type=Path, help="also save the torch state dict here")
    ap.add_argument("--head-data", type=Path,
                    help="experiments: load the heads' data from this file if it exists, else save it there")
    ap.add_argument("--arch", default="{}", help="JSON overrides of MODEL_CONFIG fields (experiments)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    tc = TrainConfig(seed=args.seed, steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr,
                     head_weight=args.head_weight, distill=args.distill, warmup=args.warmup,
                     head_steps=args.head_steps, head_batch=args.head_batch, head_lr=args.head_lr,
                     head_warmup=args.head_warmup, head_distill=args.head_distill,
                     onpolicy_seqs=args.onpolicy_seqs, onpolicy_frac=args.onpolicy_frac,
                     text_windows=args.text_windows, init_std=args.init_std, log_every=args.log_every)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / args.name
    if args.heads_only:
        return heads_only(args.heads_only, path, tc, args, t_start)
    if args.finetune:
        return finetune(args.finetune, path, tc, args, t_start)

    over = json.loads(args.arch)
    for key in ("swiglu_clamp_exp_trunk", "swiglu_clamp_shexp_trunk"):
        if key in over:
            over[key] = tuple(over[key])
    cfg = replace(MODEL_CONFIG, **over)
    files = C.corpus_files(args.budget_bytes, args.max_file_bytes)
    docs = C.read_corpus(files)
    n_bytes = sum(len(t.encode("utf-8")) for _, t in docs)
    digest = C.corpus_digest(docs)
    print(f"corpus: {len(docs)} files, {n_bytes} bytes, sha256 {digest[:16]} (Python {sys.version.split()[0]})")
    vocab, tok = build_tokenizer(docs, cfg)
    stream = token_stream(docs, tok)
    print(f"tokens: {len(stream)} ({n_bytes / len(stream):.2f} bytes/token), vocab {cfg.n_vocab}")
    print(f"model: {asdict(cfg)}")
    print(f"train: {asdict(tc)}")

    init = torch.load(args.init_state) if args.init_state else None
    starts = line_starts(stream, tok, tc.seq_len)
    print(f"windows start at {len(starts)} line starts")
    model = train(cfg, tc, stream, starts, init_state=init)
    heads_desc = {}
    if tc.head_steps:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            trunk = Path(tmp) / "trunk.gguf"  # the trunk as it will be shipped, for llama.cpp's greedy text
            export_gguf(model, vocab, trunk, args.quant, {})
            data, val, heads_desc = cached_head_data(args.head_data, model, tc, trunk, tok)
        train_heads(model, tc, data, val)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"trained {n_params} parameters in {time.perf_counter() - t_start:.0f}s")

    meta = {
        "stepmtp.corpus": f"CPython {sys.version.split()[0]} Lib/*.py, {len(docs)} files, {n_bytes} bytes, "
                          f"sha256 {digest}",
        "stepmtp.training": json.dumps({**asdict(tc), "torch": torch.__version__}),
        "stepmtp.heads_data": json.dumps(heads_desc),
    }
    export_gguf(model, vocab, path, args.quant, meta)
    if args.save_torch:
        torch.save(model.state_dict(), args.save_torch)
    print(f"wrote {path} ({path.stat().st_size} bytes)")
    bad = check_tokenization(path, docs, tok)
    print(f"tokenization check: {len(docs) - bad}/{len(docs)} files identical in llama.cpp")
    print(f"total {time.perf_counter() - t_start:.0f}s")
    return 1 if bad else 0


def cached_head_data(cache: Path | None, model: StepModel, tc: TrainConfig, trunk: Path, tok: C.BPETokenizer):
    """:func:`head_data`, or what an earlier run saved in ``cache`` (experiments only: the
    file does not record what made it)."""
    if cache is not None and cache.is_file():
        d = torch.load(cache)
        print(f"heads' data from {cache}: {d['desc']}")
        return HeadData(**d["data"]), HeadData(**d["val"]), d["desc"]
    data, val, desc = head_data(model, tc, trunk, tok)
    if cache is not None:
        torch.save({"data": asdict(data), "val": asdict(val), "desc": desc}, cache)
    return data, val, desc


#: TrainConfig fields of phase 1 alone, and those both phases use.
PHASE1_ONLY = ("steps", "batch", "lr", "warmup", "head_weight", "distill", "init_std")
PHASE_SHARED = ("seed", "seq_len", "lr_min_frac", "weight_decay", "router_bias_rate", "log_every")


def library_stream(model_path: Path, files: list[Path], bos: int) -> np.ndarray:
    """Every file that is UTF-8 as BOS + its tokens, in order. llama.cpp tokenizes
    (``model_path``'s tokenizer, which :func:`check_tokenization` holds equal to ours):
    ours in Python would take minutes on the whole library."""
    from stepmtp import Model

    out: list[int] = []
    with Model(model_path) as m:
        for p in files:
            try:
                text = p.read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                continue
            out.append(bos)
            out.extend(m.tokenize(text, add_special=False))
    return np.asarray(out, dtype=np.int64)


def export_weights(src: Path, model: StepModel, path: Path) -> None:
    """``src`` with every tensor replaced by ``model``'s, each in the type ``src``
    stores it in; every metadata key (tokenizer, chat template) kept."""
    r = gguf.GGUFReader(str(src))
    new = model.gguf_tensors()
    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), r.fields["general.architecture"].contents())
    for field in r.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for t in r.tensors:
        arr = np.ascontiguousarray(new[t.name], dtype=np.float32)
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            w.add_tensor(t.name, arr)
        else:
            w.add_tensor(t.name, gguf.quants.quantize(arr, t.tensor_type), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)


def finetune(src: Path, path: Path, tc: TrainConfig, args, t_start: float) -> int:
    """Phase 1 again from ``src``'s weights, trunk and heads together, on the heads'
    files (the whole standard library but the held-out modules: the first trunk saw
    51 files for many epochs and had memorised them, its loss on the rest of the
    library was 5.2 nats), then phase 2 on the new trunk as llama.cpp runs it (Q8_0).
    ``src``'s tokenizer, chat template and metadata are kept; the phases' settings are
    added under ``stepmtp.finetune`` and ``stepmtp.heads_training``."""
    import tempfile

    from stepmtp.models import OUT_OF_CORPUS_FILES

    src = src.resolve()
    model, tok = load_gguf_model(src, tc.seq_len)
    files = C.head_corpus_files(OUT_OF_CORPUS_FILES)
    stream = library_stream(src, files, model.cfg.bos_id)
    print(f"phase 1 from {src.name}: {len(files)} files, {len(stream)} tokens")
    print(f"train: {asdict(tc)}")
    model = train(model.cfg, tc, stream, line_starts(stream, tok, tc.seq_len), init_state=model.state_dict())
    print(f"phase 1: {time.perf_counter() - t_start:.0f}s")
    with tempfile.TemporaryDirectory() as tmp:
        trunk = Path(tmp) / "trunk.gguf"
        export_weights(src, model, trunk)
        model, _ = load_gguf_model(trunk, tc.seq_len)  # the heads learn the Q8_0 trunk llama.cpp runs
        data, val, desc = cached_head_data(args.head_data, model, tc, trunk, tok)
        train_heads(model, tc, data, val)
        phase2 = {k: v for k, v in asdict(tc).items() if k not in PHASE1_ONLY}
        phase1 = {k: v for k, v in asdict(tc).items() if k in PHASE1_ONLY + PHASE_SHARED}
        meta = {"stepmtp.finetune": json.dumps({**phase1, "from": src.name, "files": len(files),
                                                "held_out": list(OUT_OF_CORPUS_FILES),
                                                "tokens": int(len(stream)), "torch": torch.__version__}),
                "stepmtp.heads_training": json.dumps({**phase2, "torch": torch.__version__}),
                "stepmtp.heads_data": json.dumps(desc)}
        export_heads(trunk, model, path, meta)
    print(f"wrote {path} ({path.stat().st_size} bytes)")
    print(f"total {time.perf_counter() - t_start:.0f}s")
    return 0


def heads_only(src: Path, path: Path, tc: TrainConfig, args, t_start: float) -> int:
    """Phase 2 alone on ``src``'s trunk: its weights (dequantized) are what the heads
    learn to draft for, llama.cpp runs ``src`` itself for the greedy text, and the
    new file is ``src`` with new MTP blocks (:func:`export_heads`)."""
    src = src.resolve()
    model, tok = load_gguf_model(src, tc.seq_len)
    if args.heads_init == "fresh":
        torch.manual_seed(tc.seed)
        fresh = StepModel(model.cfg, tc.seq_len, tc.init_std)
        model.heads.load_state_dict(fresh.heads.state_dict(), strict=False)
    if args.head_embed:
        for h in model.heads:
            if h.embed is None:
                h.embed = torch.nn.Parameter(model.embed.detach().clone())
    print(f"trunk and tokenizer from {src} ({src.stat().st_size} bytes); heads: {args.heads_init}")
    print(f"train: {asdict(tc)}")
    data, val, desc = cached_head_data(args.head_data, model, tc, src, tok)
    train_heads(model, tc, data, val)
    print(f"trained the heads in {time.perf_counter() - t_start:.0f}s")
    training = {k: v for k, v in asdict(tc).items() if k not in PHASE1_ONLY}  # the trunk is src's
    training.update(heads_only=True, heads_init=args.heads_init, torch=torch.__version__)
    meta = {"stepmtp.heads_training": json.dumps(training), "stepmtp.heads_data": json.dumps(desc)}
    before = trunk_digest(src)
    export_heads(src, model, path, meta)
    if args.save_torch:
        torch.save(model.state_dict(), args.save_torch)
    ok = trunk_digest(path) == before
    print(f"wrote {path} ({path.stat().st_size} bytes); trunk byte-identical to {src.name}: {ok}")
    print(f"total {time.perf_counter() - t_start:.0f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
