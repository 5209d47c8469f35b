"""Layer-skip proposer: the target without a searched set of its layers (tandem.engine.
layer_skip), drafting exactly as a separate draft model does (paged KV, top-N q).

Built over a target already in memory (the verifier's, sharing its weights) or one it loads
itself (a draft worker on another device).
"""
from __future__ import annotations

from tandem.engine.layer_skip import SkipSet, skip_view
from tandem.engine.llama import LlamaModel
from tandem.engine.model_runner import ModelRunner
from tandem.proposers.draft_model import DraftModelProposer
from tandem.spec import Method


class LayerSkipProposer(DraftModelProposer):
    method = Method.LAYER_SKIP

    @classmethod
    def over(cls, target: LlamaModel, skip: SkipSet, kv_cache_bytes: int,
             block_size: int = 16) -> LayerSkipProposer:
        """A proposer sharing `target`'s weights; its own KV covers the kept layers only."""
        return cls(ModelRunner.with_memory(skip_view(target, skip), kv_cache_bytes, block_size))
