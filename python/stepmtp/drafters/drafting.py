"""Context drafting in the round: each sequence's proposal, the records that cost it,
the pools of earlier sequences (see ``drafters.context`` and ``drafters.ngram`` for the
proposers themselves)."""
from __future__ import annotations


from ..adaptive import expected_tokens, regime
from . import make_proposers
from ..sequence import SeqState, common_prefix
from .context import ContextPool, ContextRecord

# (the driver is mtp's, which imports this module: named in annotations, not imported)

__all__ = ["ContextDrafting"]


class ContextDrafting:
    """A driver's context proposers, their acceptance records (per proposer and
    sampling regime) and pools (per key a request names)."""

    def __init__(self, drv: "MTPDriver") -> None:
        self.drv = drv
        self.spec = drv.spec
        # ours beside the heads, llama-server's n-gram types as listed
        self.proposers = make_proposers(self.spec, drv.speculate) if self.spec.drafts_context else []
        self._ctx_records: dict[tuple[int, tuple[float, bool]], ContextRecord] = {}
        #: pools of earlier sequences' tokens, by the key a request names (the server's:
        #: its API key)
        self.pools: dict[object, ContextPool] = {}

    def begin(self, s: "SeqState") -> None:
        """A new sequence (its tokens the prompt so far): each proposer's state for it."""
        s.ctx_pending = []
        if self.proposers:
            pool = self.pool(s.pool_key)
            s.ctx = [pr.begin(s.tokens, pool) for pr in self.proposers]

    def finish(self, s: "SeqState") -> None:
        for pr, st in zip(self.proposers, s.ctx):
            pr.finish(st)

    def judge(self, s: "SeqState", out: list[int], n_drafted: int) -> None:
        """The round's proposal judged against the tokens the target emitted (``out``),
        whether the round drafted its first ``n_drafted`` tokens or none of them: at
        temperature 0 a draft of it is accepted exactly as far as it equals them, and
        under rejection sampling a point draft is accepted with the chance the target
        samples its token, the chance that the token emitted at its place is that token.
        So the record learns from every round, not only from those that drafted the
        context: one long draft rejected at its first token had left the first place's
        rate low for good while the heads drafted (a loop the context proposed 62 tokens
        of, written in 3-token head drafts for 40 rounds, every one accepted). Where
        every token emitted agreed, its later places wait for the text (``_judge_on``)."""
        prop = s.proposal
        a = common_prefix(prop.tokens, out)
        rec = self.record(s)
        rec.observe(prop, min(len(prop.tokens), len(out)), a)
        if n_drafted:
            self.proposers[s.proposer].accepted(s.ctx[s.proposer], n_drafted, min(a, n_drafted))
        self._judge_on(s)
        if a == len(out) < len(prop.tokens) and len(s.ctx_pending) < self.MAX_PENDING:
            # every token emitted agreed, and the proposal reaches further: its later
            # places are judged when the text gets there. Judged only as far as a round
            # emitted, a place past the drafts the plan dared was never judged, and kept
            # its prior: a copy held for 50 tokens a round, drafted 2-16 at a time (an
            # agent's copy turn on the bench model: 339 tokens matched in 20 context
            # rounds, 96 drafted and accepted)
            s.ctx_pending.append((prop, len(s.tokens) - len(out), len(out), len(out), rec))

    #: proposals waiting to be judged on, a sequence (each resolves within its length)
    MAX_PENDING = 64

    @staticmethod
    def _judge_on(s: "SeqState") -> None:
        """Judge the waiting proposals' later places the text has decided: as far as
        they agree with it and the token after (the first that differs, or the end).
        Each is compared with the tokens emitted since it last was (``agreed``: its
        places known to agree, from ``first`` on not yet judged), once a round."""
        if not s.ctx_pending:
            return
        t, left = s.tokens, []
        for prop, start, first, agreed, rec in s.ctx_pending:
            arrived = t[start + agreed : start + len(prop.tokens)]
            b = common_prefix(prop.tokens[agreed:], arrived)
            if b < len(arrived) or agreed + len(arrived) == len(prop.tokens):
                rec.observe(prop, agreed + min(b + 1, len(arrived)), agreed + b, first=first)
            else:
                left.append((prop, start, first, agreed + b, rec))
        s.ctx_pending = left

    def pool(self, key: object) -> ContextPool | None:
        """The pool of earlier sequences' tokens under ``key`` (None: none kept)."""
        if not self.spec.pool_tokens:
            return None
        p = self.pools.get(key)
        if p is None:
            p = self.pools[key] = ContextPool(self.spec.pool_tokens)
        return p


    def record(self, s: SeqState) -> ContextRecord:
        key = (s.proposer, regime(s.sampler.greedy, s.sampler.params.temperature, s.rejection))
        r = self._ctx_records.get(key)
        if r is None:
            r = self._ctx_records[key] = ContextRecord()
        return r


    def propose(self, seqs: list[SeqState]) -> None:
        """Each sequence's context proposal this round: the one of its proposers that
        promises the most tokens, with each token's chance of acceptance (for the plan)."""
        # the round's rows bound a proposal, not a sequence's share of a decode's were
        # every slot busy (n_rows_seq: with llama-server's 4 slots a quarter of a
        # sliding-window region's rows, 31 drafts on the bench model where the C++
        # server's n-gram drafts 64); the plan and fit_rows keep the round within them
        rows = self.drv.max_verify_rows - len(seqs)
        for s in seqs:
            cap = min(self.spec.context_max, self.drv.n_ctx_seq - 1 - s.pos, rows)
            if s.budget > 0:
                cap = min(cap, s.budget - 1)  # (tokens past the request's end are wasted rows)
            best, best_e, best_acc = None, 1.0, None
            for i, (pr, st) in enumerate(zip(self.proposers, s.ctx)):
                prop = pr.propose(st, cap) if cap > 0 else None
                if prop is None:
                    continue
                s.proposer = i
                acc = self.record(s).accepts(prop)
                e = expected_tokens(acc, len(acc))
                if e > best_e:
                    best, best_e, best_acc = (i, prop), e, acc
            if best is not None:
                s.proposer, s.proposal = best
                # without a plan: the whole proposal, as llama-server verifies an n-gram draft,
                # where the heads cannot draft instead; beside them, where it promises two
                # tokens or more
                use = not self.drv.speculate or best_e >= 2.0
                s.n_point = len(s.proposal.tokens) if s.policy is None and use else 0
            if s.policy is not None:
                s.policy.context = best_acc


    def drafts(self, s: SeqState, n: int) -> None:
        """The round's drafts: the proposal's first n tokens, as far as a grammar allows."""
        toks = s.proposal.tokens[:n]
        c = s.constraint
        if c is not None:
            k = 0
            for tok in toks:
                if not c.allowed(tok):
                    break
                c.advance(tok)
                k += 1
            c.rollback(k)  # (verification advances it again)
            toks = toks[:k]
        s.drafts = list(toks)
        s.n_point = len(toks)
        if s.policy is not None:
            s.policy.n_forced = s.n_point


    def fit_rows(self, seqs: list[SeqState]) -> None:
        """Context drafts cut so that the round's verify stays within max_verify_rows
        (the plan keeps to it; a plan-less round may not)."""
        over = len(seqs) + sum(len(s.drafts) + s.n_plan for s in seqs) - self.drv.max_verify_rows
        for s in sorted(seqs, key=lambda s: -len(s.drafts)):
            if over <= 0:
                break
            if s.n_plan == 0 and s.drafts:
                cut = min(over, len(s.drafts))
                del s.drafts[len(s.drafts) - cut :]
                s.n_point = len(s.drafts)
                if s.policy is not None:
                    s.policy.n_forced = s.n_point
                over -= cut
