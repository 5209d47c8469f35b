"""Whether a draft worker's proposal counts: for this session, where it belongs, inside the
vocabulary, with a well-formed q (verify_service/drafts/side.py drops the session's stream
otherwise)."""
from __future__ import annotations

import math

from tandem.spec import DraftToken, Proposal
from verify_service.session.sequence import Sequence


def checked(seq: Sequence, p: Proposal, vocab_size: int, top_n: int, max_run_ahead: int
            ) -> DraftToken | None:
    """The proposal's token if it is well formed and where it belongs, else None."""
    if (bool(seq.params.tree) and not seq.local.in_verifier) != (p.tree is not None):
        return None  # a chain token for a tree session, or a tree node for a chain one
    if p.tree is None:
        if p.position != seq.next_draft_position():
            return None
    elif not _node_fits(seq, p, max_run_ahead):
        return None
    v, tok = vocab_size, p.token
    if not 0 <= tok.token_id < v:
        return None
    ids, probs = tok.q_ids, tok.q_probs
    if ids or probs:
        # At most the top-N asked for (before any scan: a peer could send millions), each
        # id once (a dense q would keep only one of its entries).
        if len(ids) != len(probs) or len(ids) > top_n or len(set(ids)) != len(ids):
            return None
        if any(not 0 <= i < v for i in ids):
            return None
        if any(not math.isfinite(q) or q < 0 for q in probs) or abs(sum(probs) - 1) > 1e-3:
            return None
        if tok.token_id not in ids or probs[ids.index(tok.token_id)] <= 0:
            return None
        if p.tree is not None and sum(q > 0 for q in probs) > 1:
            # The sibling rule (kernels/tree_rejection.py) is exact for one-hot candidates
            # or independent draws; a tree's q cannot say which, so only one-hot is taken.
            return None
    return tok

def _node_fits(seq: Sequence, p: Proposal, max_run_ahead: int) -> bool:
    """A tree node: the next of an unfinished tree, under an earlier node (or the root),
    at its depth's position, with a probability for an estimate, within the size cap."""
    node, n = p.tree, len(seq.drafts)
    return (not seq.tree_complete and n < max_run_ahead and -1 <= node.parent < n
            and p.position == seq.num_tokens + seq.node_depth(node.parent)
            and math.isfinite(node.path_prob) and 0 <= node.path_prob <= 1)
