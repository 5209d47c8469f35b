"""Each scheduled session's StepInput: its tokens, KV blocks, drafts and grammar masks, and
what the step should draft for its next round (Medusa nodes, a carried bonus row)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from verify_service.forward.step import History, StepInput
from verify_service.policy import auto

if TYPE_CHECKING:
    import torch

    from verify_service.drafts.side import DraftSide
    from verify_service.policy.scheduler import ScheduledSeq, Scheduler
    from verify_service.session.sequence import Sequence
    from verify_service.sessions import SessionTable


class InputBuilder:
    def __init__(self, scheduler: Scheduler, table: SessionTable, drafts: DraftSide,
                 has_heads: bool):
        self.scheduler, self.table, self.drafts = scheduler, table, drafts
        self.has_heads = has_heads  # the executor runs Medusa heads

    def build(self, s: ScheduledSeq, drafts: list, mask: torch.Tensor | None,
              heads_ms: float) -> StepInput:
        """`drafts`: the round's drafts as scheduled (a snapshot: more may arrive while the
        masks are made); `mask`: the grammar's allowed tokens per sampled row."""
        seq = s.seq
        return StepInput(s.token_ids, s.start_pos, list(self.scheduler.blocks.block_table(
            seq.session_id)), drafts, seq.params.sampling,
            carried=self.table.carried.get(seq.session_id) if seq.sched.carried else None,
            sample_bonus=not self._may_carry(seq, s.num_drafts), parents=s.parents,
            want_features=seq.needs_features, partial=s.partial,
            prefill=s.is_prefill and not s.partial,
            # The heads cost a few ms: only the nodes the next round may verify.
            propose_tree=self._head_nodes(s, heads_ms), propose_chain=not seq.params.tree,
            typical=None if seq.params.sampling.is_greedy else seq.params.typical,
            logprobs=seq.params.logprobs, mask=mask, history=self._history(seq))

    @staticmethod
    def _history(seq: Sequence) -> History | None:
        """The prefix the sampling controls read, for a session that has any."""
        p = seq.params
        if not p.sampling.has_controls:
            return None
        return History(p.prompt, tuple(seq.output), p.stop_token_ids)

    def _head_nodes(self, s: ScheduledSeq, heads_ms: float) -> int:
        """Medusa nodes the step drafts for the session's next round: a medusa session's
        size; an auto session's when its heads may compete (verify_service/policy/auto.py)."""
        seq = s.seq
        if seq.params.method.in_verifier:
            return self.scheduler.desired_k(seq, 1)
        if self.has_heads and auto.wants_heads(seq, s.num_drafts):
            return auto.head_nodes(self.scheduler, seq, heads_ms)
        return 0

    def _may_carry(self, seq: Sequence, k: int) -> bool:
        """Skip the bonus token when the draft's next token is already here (unseeded sampling
        only: greedy is the same either way; seeded tokens are keyed samples, rejection.py)."""
        s = seq.params.sampling
        return (k >= 1 and len(seq.drafts) > k and not s.is_greedy and s.seed is None
                and not s.has_controls  # each row is processed over its own round's prefix
                and not seq.params.tree  # a tree's nodes beyond k are not the next draft
                and seq.params.logprobs is None  # a carried row has no logits to report
                and seq.grammar is None  # masks are made per round, from the root
                and self.drafts.linked(seq) and not seq.local.in_verifier  # (auto: afresh)
                and len(seq.output) + k < seq.params.max_new_tokens)
