"""MTP proposer: the target checkpoint's own multi-token-prediction module (tandem.engine.mtp).

It drafts exactly as the EAGLE proposer does (same entry alignment, the verifier's shipped
features, re-anchoring, top-N q); only the head differs.
"""
from __future__ import annotations

from tandem.engine.mtp import MtpHead
from tandem.models import ModelPaths
from tandem.proposers.eagle import EagleProposer, cache_blocks
from tandem.spec import Method


class MtpProposer(EagleProposer):
    method = Method.MTP

    @classmethod
    def load(cls, paths: ModelPaths, kv_cache_bytes: int, block_size: int = 16,
             module: int = 0, device="cpu") -> MtpProposer:
        head = MtpHead.load(paths, index=module, device=device)
        return cls(head, cache_blocks(head, kv_cache_bytes, block_size), block_size)
