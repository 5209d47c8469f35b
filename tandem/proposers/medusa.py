"""Medusa proposer: the target's own Medusa heads (tandem.engine.medusa) behind the one
proposer interface. Hosted in the verifier's forward step: a request's `features` is the
final hidden state of the last position the round kept ([1, hidden]), read off the forward
that just ran, so the next round's tree costs one pass of the heads and no network hop.
"""
from __future__ import annotations

from collections.abc import Hashable

import torch

from tandem.engine.medusa import MedusaHeads
from tandem.spec import DraftRequest, DraftResult, Method


class MedusaProposer:
    method = Method.MEDUSA

    def __init__(self, heads: MedusaHeads):
        self.heads = heads

    def propose(self, requests: list[DraftRequest]) -> list[DraftResult]:
        """One pass of the heads over every request: a tree of at most max_tokens nodes
        (the configured choices, in order), or the heads' top-1 chain when not req.tree."""
        if not requests:
            return []
        trees = self.heads.propose_batch(
            torch.stack([r.features[-1] for r in requests]),
            [(r.max_tokens, not r.tree) for r in requests])
        return [DraftResult(tokens=list(tokens), parents=parents) for tokens, parents in trees]

    def release(self, session_key: Hashable) -> None:
        """Stateless: the heads keep nothing per session."""
