"""A draft model with another tokenizer than the target's, drafting in the target's ids.

Each step, a session's committed target ids become the draft's ids through their text
(TextBridge; its outstanding drafts map back one to one), the draft model runs as usual, and
its logits are spread onto the target's vocabulary: tokens of both vocabularies keep their
logit, every other target id gets -inf. Sampling, top-N, grammar masks and seeded noise then
all happen in the target's ids, so each draft is one target token with exactly the draft's
bytes and q is the real distribution it was sampled from (renormalised over the shared tokens):
the verifier's rejection sampling stays exact, and the wire is unchanged.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Hashable

import torch

from tandem.models import ModelPaths, read_hf_config
from tandem.proposers.draft_model import DraftModelProposer
from tandem.proposers.token_bridge import TextBridge, VocabMap
from tandem.spec import DraftRequest, DraftResult, Method

log = logging.getLogger(__name__)
# Committed draft ids that stay tentative in the draft's KV cache: re-encoding the text after
# a commit may retokenize its last few tokens, and tentative ones roll back in place.
_UNSETTLED = 8


class BridgedProposer:
    """DraftModelProposer over a TextBridge: requests and results in the target's ids."""

    method = Method.DRAFT_MODEL

    def __init__(self, inner: DraftModelProposer, bridge: TextBridge):
        vocab = bridge.vocab
        if len(vocab.draft_to_target) != inner.vocab_size:
            raise ValueError(f"the vocabulary map covers {len(vocab.draft_to_target)} draft "
                             f"ids, the draft model has {inner.vocab_size}")
        self.inner, self.bridge = inner, bridge
        self.vocab_size = len(vocab.target_to_draft)  # the target's: ids on the wire
        self.max_context_length = inner.max_context_length
        self._from = vocab.draft_ids  # [shared] draft ids of the shared tokens
        self._to = vocab.draft_to_target[self._from]  # [shared] their target ids
        inner.to_target = self.to_target

    @classmethod
    def load(cls, draft: ModelPaths, target: ModelPaths, kv_cache_bytes: int,
             block_size: int = 16, dtype: torch.dtype | str = torch.float32,
             device: torch.device | str = "cpu") -> BridgedProposer:
        inner = DraftModelProposer.load(draft, kv_cache_bytes, block_size, dtype, device)
        target_vocab = int(read_hf_config(target)["vocab_size"])
        vocab = VocabMap.from_dirs(draft.root, inner.vocab_size, target.root, target_vocab)
        log.info("draft %s has another tokenizer than the target %s: bridging them, %d "
                 "tokens in both (of %d draft, %d target)", draft.root.name, target.root.name,
                 vocab.size, inner.vocab_size, target_vocab)
        return cls(inner, TextBridge(vocab, draft.root, target.root))

    def to_target(
        self,
        logits: torch.Tensor,  # [rows, draft vocab]
    ) -> torch.Tensor:  # [rows, target vocab], -inf off the shared tokens
        out = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        out[:, self._to.to(logits.device)] = logits[:, self._from.to(logits.device)]
        return out

    def propose(self, requests: list[DraftRequest]) -> list[DraftResult]:
        results: list[DraftResult] = [DraftResult()] * len(requests)
        rows, inner = [], []
        for i, req in enumerate(requests):
            ids, committed = self.bridge.draft_ids(req.session_key, req.token_ids,
                                                   req.num_committed)
            if len(ids) >= self.max_context_length:
                continue  # the draft's context is full: no drafts (the verifier decodes)
            rows.append(i)
            inner.append(dataclasses.replace(req, token_ids=ids,
                                             num_committed=max(0, committed - _UNSETTLED)))
        for i, res in zip(rows, self.inner.propose(inner)):
            results[i] = res
        return results

    def release(self, session_key: Hashable) -> None:
        self.inner.release(session_key)
        self.bridge.release(session_key)
