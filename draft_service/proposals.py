"""A proposer's DraftResult for one session, sent down its stream as Proposals: a chain
continues the outstanding drafts up to the run-ahead; a tree (one per epoch) goes out whole,
parents first. Both cut at the context length, and return how many tokens they sent.
"""
from __future__ import annotations

from draft_service.session import Session
from tandem.spec import DraftResult, Proposal, TreeNode


def send_chain(s: Session, res: DraftResult, max_context_length: int) -> int:
    room = min(s.max_run_ahead - len(s.drafts), max_context_length - s.length)
    tokens = res.tokens[: max(room, 0)]
    if not res.tokens:
        s.stalled = True  # same sequence, same answer: wait for a commit to change it
    for tok in tokens:
        s.stream.put(Proposal(s.session_id, s.epoch, s.length, tok))
        s.drafts.append(tok.token_id)
    return len(tokens)


def send_tree(s: Session, res: DraftResult, max_context_length: int) -> int:
    """Stream a tree's nodes (parents first; one tree per epoch: the next commit starts a
    new epoch and wakes the session again)."""
    s.stalled = True
    parents = res.parents if res.parents is not None else tuple(range(-1, len(res.tokens) - 1))
    room = max_context_length - s.length  # deepest level that still fits
    kept: dict[int, int] = {-1: -1}  # the proposer's node index -> the one sent
    depth: dict[int, int] = {-1: 0}
    nodes = []
    for j, tok in enumerate(res.tokens):
        p = parents[j]
        if not -1 <= p < j:  # a proposer bug: never send what the verifier must refuse
            raise ValueError(f"tree node {j} has parent {p}")
        if p not in kept or depth[p] + 1 > room or len(nodes) == s.max_run_ahead:
            continue  # beyond the context or the size cap (its subtree goes with it)
        kept[j], depth[j] = len(nodes), depth[p] + 1
        prob = res.scores[j] if j < len(res.scores) else 0.0
        nodes.append((tok, kept[p], depth[j], prob))
    for i, (tok, parent, d, prob) in enumerate(nodes):
        s.stream.put(Proposal(s.session_id, s.epoch, s.length + d - 1, tok,
                              TreeNode(parent, prob, last=i == len(nodes) - 1)))
    return len(nodes)
