"""Verifier scheduler: admits prefills, decides each step's batch, preempts when KV runs out.
Pure Python, no torch (nano-vllm's layering). One flattened forward per step: every running
session (plain decode, or the drafts that arrived up to its k) and the prefills that fit."""
from __future__ import annotations

import copy
import itertools
from collections import deque

from tandem.engine.block_manager import BlockManager, NoFreeBlocksError
from tandem.spec.cost import CostModel, StepCost, choose_tree_size, plan_batch
from verify_service.config import SchedulerConfig
from verify_service.policy import batch
from verify_service.policy.scheduled import ScheduledSeq, SchedulerOutput
from verify_service.session.sequence import SeqStatus, Sequence

EXPLORE_EVERY = 16  # rounds between probes of a session whose speculation is switched off


def probing(seq: Sequence, ahead: int = 0) -> bool:
    """Whether the session's round `ahead` rounds from now is one of its periodic probes."""
    return (seq.stats.rounds + ahead) % EXPLORE_EVERY == EXPLORE_EVERY - 1


class Scheduler:
    def __init__(self, blocks: BlockManager, config: SchedulerConfig, cost: CostModel,
                 tree_reach: tuple[float, ...] = (), chain_reach: tuple[float, ...] = (),
                 step_cost: StepCost | None = None):
        self.blocks, self.config = blocks, config
        # single-session rounds: what k costs one session alone; sampled ones apart (cost_of)
        self.cost, self.sampled_cost = cost, copy.deepcopy(cost)
        self.step_cost = step_cost or StepCost()  # whole steps: what drafts cost a batch
        self.draft_ms = (0.0, 0.0)  # a worker chain's wait: to its first draft, then each
        self._caps: dict[str, int] = {}  # this step's batch plan: drafts per session at most
        self._solo: dict[str, int] | None = None  # _solo_k by session while schedule() runs
        self.pool = batch.AcceptancePool()  # each method's acceptance over its sessions
        # Medusa: estimated chance each node of the tree (in order) is reached under greedy;
        # and each node of its chain (the heads' top-1 tokens).
        self.tree_reach, self.chain_reach = tree_reach, chain_reach
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._arrivals = itertools.count()

    @property
    def num_sessions(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        if seq.num_tokens + 1 > self.config.max_model_len:
            raise ValueError(f"sequence of {seq.num_tokens} tokens exceeds the context "
                             f"{self.config.max_model_len}")
        seq.sched.arrival = next(self._arrivals)
        seq.sched.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def abort(self, session_id: str) -> Sequence | None:
        for seq in [*self.running, *self.waiting]:
            if seq.session_id == session_id:
                self.finish(seq, "abort")
                return seq
        return None

    def finish(self, seq: Sequence, reason: str | None = None, error: str = "") -> None:
        if reason:
            seq.set_finished(reason, error)
        seq.sched.status = SeqStatus.FINISHED
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)
        if self.blocks.has(seq.session_id):
            self.blocks.free(seq.session_id)

    def desired_k(self, seq: Sequence, ahead: int = 0) -> int:
        """Drafts the session may verify this round (`ahead` later), before arrivals: the plan's
        cut, but never a probe's (how what the plan priced out is measured again)."""
        if not (k := self._solo_k(seq, ahead)):  # nothing to cap: plain sessions, most under
            return 0  # load (a hot path: every session, several times a step)
        cap = self._caps.get(  # (none yet: batch.unplanned_cap)
            seq.session_id, batch.unplanned_cap(seq, self.step_cost, self.num_sessions))
        return k if cap is None or self.probes(seq, ahead) else min(k, cap)

    def probes(self, seq: Sequence, ahead: int = 0) -> bool:  # policy/batch.py probe_round
        return batch.probe_round(seq, self.pool, self.step_cost, self.num_sessions,
                                 probing(seq, ahead), ahead, len(self.running))

    def cost_of(self, seq: Sequence) -> CostModel:  # a sampled row pays its draw too (~1 ms)
        return self.cost if seq.params.sampling.is_greedy else self.sampled_cost

    def _solo_k(self, seq: Sequence, ahead: int = 0) -> int:
        """The k that pays for the session alone (the single-session cost curve); once per
        session while schedule() runs (its plan and its batch ask for it, ~10 us a call)."""
        if ahead or self._solo is None:
            return self._solo_k_now(seq, ahead)
        if (k := self._solo.get(seq.session_id)) is None:
            k = self._solo[seq.session_id] = self._solo_k_now(seq)
        return k

    def _solo_k_now(self, seq: Sequence, ahead: int = 0) -> int:
        if not seq.speculating:
            return 0
        k_allowed, cost = self.k_allowed(seq), self.cost_of(seq)  # (k: a share under load)
        reach = self.reach(seq, k_allowed)
        if reach is not None:
            k = choose_tree_size(reach, k_allowed, cost, seq.est.tree_wait_ms)
        else:  # a draft worker's chain, drafted after the commit: a round with any waits
            k = choose_tree_size(batch.worker_reach(seq, self.pool, k_allowed), k_allowed,
                                 cost, *self.draft_ms)
        if k == 0 and k_allowed and self.probes(seq, ahead):
            # Speculation is off: probe, estimates move (a tree: what pays without its wait)
            k = max(1, choose_tree_size(reach, k_allowed, cost) if reach is not None else 1)
        return k

    def k_allowed(self, seq: Sequence) -> int:
        """Most drafts a round may verify: request cap, config cap, share of max_verify_tokens."""
        capped = min(seq.params.num_speculative_tokens or self.config.max_spec_tokens,
                     self.config.max_spec_tokens)
        per_seq = self.config.max_verify_tokens // max(1, len(self.running)) - 1
        return max(0, min(capped, per_seq))

    def reach(self, seq: Sequence, k_allowed: int | None = None) -> list[float] | None:
        """Chance each draft node (in order) is accepted, scaled by the session's correction, for
        trees and Medusa's chains; None for a draft worker's chain (sized by its EMA)."""
        if seq.local.in_verifier:  # the proposal's own per-token estimates (none: no match)
            return seq.scaled_reach(seq.local.source, seq.draft_reach)
        if seq.params.method.in_verifier:
            base = self.heads_reach(seq)
        elif seq.params.tree:  # the arrived nodes' own estimates, the last tree's for the rest
            base = seq.last_reach or [seq.est.acceptance_ema ** (i + 1) for i in range(
                self.k_allowed(seq) if k_allowed is None else k_allowed)]
            got = seq.draft_reach
            base = got if seq.tree_complete else [*got, *base[len(got):]]
        else:
            return None
        return [r * seq.est.tree_scale for r in base]

    def heads_reach(self, seq: Sequence) -> tuple[float, ...]:  # Medusa's, tree or chain
        return self.tree_reach if seq.params.tree else self.chain_reach

    def plan(self) -> dict[str, int]:
        """Drafts per decoding session this step, when several share it: a draft's row (and
        a worker's wait) must pay in the batch's tokens per ms; a losing method is off for the
        step. {} for one session alone (tandem/spec/batch_plan.py, policy/batch.py)."""
        b = len(decoding := self.decoding())
        if not batch.planned(self.step_cost, b):
            return {}
        bar = batch.row_bar(self.step_cost, b)
        counts = plan_batch([self._gains(s, self._solo_k(s), bar) for s in decoding],
                            self.step_cost.above(b),
                            batch.wait_entry(decoding, self.step_cost.wait_ms),
                            [s.params.method for s in decoding])
        return {s.session_id: k for s, k in zip(decoding, counts)}

    def decoding(self) -> list[Sequence]:  # running, prefill done
        return [s for s in self.running
                if s.sched.status is SeqStatus.RUNNING and not s.sched.prefill_left]

    def _gains(self, seq: Sequence, k: int, bar: float) -> list[float]:  # its first k drafts'
        return batch.gains(seq, k, self.reach(seq) if k else None, self.pool, bar)

    def schedule(self) -> SchedulerOutput:
        preempted: list[Sequence] = []
        decoding = self.decoding()  # who the step just waited for, by the last plan:
        self.step_cost.asked_share = batch.asked_share(decoding, self.desired_k)  # (observe)
        self.pool.age(decoding)  # a step older, their methods' pooled evidence (batch.py)
        self._solo = {}  # (no session's state moves until the batch is chosen)
        try:
            self._caps = self.plan()
            scheduled = self._schedule_running(preempted)
        finally:
            self._solo = None
        budget = self.config.max_num_batched_tokens - sum(len(s.token_ids) for s in scheduled)
        chunks = self._schedule_chunks(budget, bool(scheduled))
        budget -= sum(len(s.token_ids) for s in chunks)
        scheduled += chunks
        scheduled += self._schedule_prefills(budget, bool(scheduled))
        return SchedulerOutput(scheduled, preempted)

    def _chunk_size(self, remaining: int, budget: int, have_work: bool) -> int:
        """Prefill tokens to compute now: all of them alone; beside other work, a chunk."""
        return max(0, min(remaining, budget, self.config.prefill_chunk_tokens)) if have_work \
            else remaining

    def _schedule_chunks(self, budget: int, have_work: bool) -> list[ScheduledSeq]:
        """The next chunk of each running session whose prefill is not done (oldest first)."""
        out = []
        for seq in sorted(self.running, key=lambda s: s.sched.arrival):
            if seq.sched.status is not SeqStatus.RUNNING or not seq.sched.prefill_left:
                continue
            n = self._chunk_size(seq.sched.prefill_left, budget, have_work or bool(out))
            if n == 0:
                break
            start = seq.num_tokens - seq.sched.prefill_left
            seq.sched.prefill_left -= n
            out.append(ScheduledSeq(seq, seq.tokens[start:start + n], start, 0, True,
                                    partial=seq.sched.prefill_left > 0))
            budget -= n
        return out

    def _schedule_running(self, preempted: list[Sequence]) -> list[ScheduledSeq]:
        out, planned = [], batch.plan_curve(self.step_cost, self.num_sessions) is not None
        for seq in sorted(self.running, key=lambda s: s.sched.arrival):
            if seq.sched.status is not SeqStatus.RUNNING or seq.sched.prefill_left:
                continue  # preempted below while serving an earlier one; or prefilling
            wanted = self.desired_k(seq)
            room = self.config.max_model_len - seq.num_tokens - 1
            k = max(0, min(len(seq.drafts), wanted, room))
            seq.sched.probe_until = batch.probe_window(seq, wanted > 0 and self.probes(seq), k,
                                                       planned)
            drafts = [d.token_id for d in seq.drafts[:k]]
            # A tree's first k nodes are a tree too: parents come before their children.
            parents = seq.draft_parents[:k] if seq.draft_parents is not None else None
            # A carried session's last token is already in the cache: only drafts go in (none:
            # the engine samples from the carried distribution without a forward).
            new = drafts if seq.sched.carried else [seq.tokens[-1], *drafts]
            if not self._append_or_preempt(seq, new, preempted):
                continue
            start = seq.num_tokens - (0 if seq.sched.carried else 1)
            out.append(ScheduledSeq(seq, new, start, k, False, wanted, parents))
        return out

    def _append_or_preempt(self, seq: Sequence, new: list[int], preempted: list) -> bool:
        while True:
            try:
                self.blocks.append(seq.session_id, new)
                return True
            except NoFreeBlocksError:
                victim = max(self.running, key=lambda s: s.sched.arrival)  # newest goes back
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    return False

    def defer(self, sched: ScheduledSeq) -> None:  # a decode round sits this step out
        self.blocks.rollback(sched.seq.session_id, len(sched.token_ids))

    def carry(self, seq: Sequence, carried: bool) -> None:  # its KV holds all it committed
        seq.sched.carried = carried

    def _preempt(self, seq: Sequence) -> None:
        """Free its KV; it is recomputed from its committed tokens when re-admitted."""
        self.running.remove(seq)
        self.blocks.free(seq.session_id)
        seq.sched.status = SeqStatus.WAITING
        seq.clear_drafts()
        seq.sched.carried = False  # the re-prefill recomputes that distribution
        seq.sched.prefill_left = 0
        seq.next_epoch()
        self.waiting.appendleft(seq)

    def _schedule_prefills(self, budget: int, have_work: bool) -> list[ScheduledSeq]:
        out = []
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            tokens = seq.tokens
            # EAGLE sessions need the target's hidden state of every position: cache hits
            # and chunks only where the runner keeps every cached token's features.
            use_cache = self.config.features_cached or not seq.needs_features
            chunked = use_cache and self.config.prefill_chunk_tokens > 0
            busy = have_work or bool(out)
            if busy and (budget < 1 if chunked else len(tokens) > budget):
                break  # no room this step (unchunked: a long prefill waits for its own)
            if not self.blocks.can_allocate(tokens, use_cache):
                break
            cached = self.blocks.allocate(seq.session_id, tokens, use_cache)
            self.waiting.popleft()
            seq.sched.status = SeqStatus.RUNNING
            self.running.append(seq)
            remaining = len(tokens) - cached
            n = self._chunk_size(remaining, budget, busy) if chunked else remaining
            seq.sched.prefill_left = remaining - n
            out.append(ScheduledSeq(seq, tokens[cached:cached + n], cached, 0, True,
                                    partial=seq.sched.prefill_left > 0))
            budget -= n
        return out

    def update_from_output(self, sched: ScheduledSeq, num_accepted: int,
                           path: list[int] | None = None) -> None:
        """Keep the KV of the round's first input and the accepted drafts; roll back the rest.
        A tree's accepted path (its tokens, `path`) was moved to the slots after the root."""
        seq = sched.seq
        if sched.partial:  # a prefill chunk: its slots are final, the rest is still to come
            self.blocks.commit(seq.session_id, sched.start_pos + len(sched.token_ids))
            return
        if sched.num_drafts and batch.from_worker(seq):
            self.pool.learn(seq.params.method, sched.num_drafts, num_accepted)
            seq.sched.probe_until = -1  # (batch.py late_probe)
        if sched.num_drafts > num_accepted:
            self.blocks.rollback(seq.session_id, sched.num_drafts - num_accepted)
        if path:
            self.blocks.rewrite(seq.session_id, path)
        self.blocks.commit(seq.session_id, self.blocks.num_tokens(seq.session_id))
        if self.config.kv_window:  # the next round's queries start at the last token
            self.blocks.release_before(seq.session_id, seq.num_tokens - self.config.kv_window)
