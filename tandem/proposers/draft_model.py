"""Draft-model proposer: a small causal LM sharing the target's tokenizer, over a paged KV cache.

Every step runs ONE flattened variable-length forward over all sessions that want a draft
token (a new session's prompt and other sessions' single new tokens side by side; no padding),
then samples one token per session from the top-N truncation of its distribution. The KV cache
is the verifier's paged design (tandem.engine.model_runner / block_manager): sessions with a
common prefix (a shared system prompt) share its committed blocks.
"""
from __future__ import annotations

import logging
from collections.abc import Hashable

import torch

from kernels.sampling import logits_to_probs, position_noise, sample, top_n_sparse
from tandem.engine.block_manager import BlockManager, NoFreeBlocksError
from tandem.engine.llama import LlamaModel
from tandem.engine.model_runner import ModelRunner, SeqChunk
from tandem.grammar.masks import mask_drafts
from tandem.models import ModelPaths
from tandem.proposers.controls import apply_draft_controls
from tandem.spec import DraftRequest, DraftResult, DraftToken, ErrorCode, Method

log = logging.getLogger(__name__)


class DraftModelProposer:
    """Owns the draft model, its KV cache and, per session, which tokens that cache holds."""

    method = Method.DRAFT_MODEL

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.blocks = BlockManager(runner.num_blocks, runner.block_size)
        self.vocab_size = runner.model.cfg.vocab_size
        self.max_context_length = runner.model.cfg.max_position_embeddings
        self._cached: dict[Hashable, list[int]] = {}  # tokens whose KV is in the cache
        # A draft with another tokenizer (proposers/bridged.py): its logits rows in the
        # target's ids ([rows, draft vocab] -> [rows, target vocab]) before masking and
        # sampling, so q and the drafts are the target's ids; None = the same ids.
        self.to_target = None

    @classmethod
    def load(cls, paths: ModelPaths, kv_cache_bytes: int, block_size: int = 16,
             dtype: torch.dtype | str = torch.float32,
             device: torch.device | str = "cpu") -> DraftModelProposer:
        model = LlamaModel.load(paths, dtype, device=device)
        return cls(ModelRunner.with_memory(model, kv_cache_bytes, block_size))

    def release(self, session_key: Hashable) -> None:
        self._cached.pop(session_key, None)
        if self.blocks.has(session_key):
            self.blocks.free(session_key)

    def propose(self, requests: list[DraftRequest]) -> list[DraftResult]:
        results: list[DraftResult | None] = [None] * len(requests)
        chunks, rows = [], []
        try:
            for i, req in enumerate(requests):
                if req.max_tokens < 1:
                    results[i] = DraftResult()
                    continue
                rows.append(i)  # before _prepare: a failure inside must also be cleaned up
                try:
                    chunks.append(self._prepare(req))
                except NoFreeBlocksError as exc:
                    rows.pop()
                    self.release(req.session_key)
                    results[i] = DraftResult(error=ErrorCode.RESOURCE_EXHAUSTED,
                                             message=f"draft KV cache is full: {exc}")
            logits = self.runner.forward(chunks) if chunks else None  # [len(chunks), vocab]
        except Exception:
            # The cache may now hold slots or half-written KV these sessions' token lists do
            # not describe: forget them, so a retry recomputes from scratch.
            for i in rows:
                self.release(requests[i].session_key)
            raise
        if logits is not None:
            batch = [requests[i] for i in rows]
            for req in batch:
                self._mark_cached(req)
            if self.to_target is not None:
                logits = self.to_target(logits)
            # structured output: only what the grammar allows, q renormalised over it
            logits = mask_drafts(logits, [r.mask for r in batch])
            # the session's controls over each row's prefix: q close to the target's
            logits = apply_draft_controls(logits, batch)
            for i, tok in zip(rows, sample_drafts(logits, batch, logits.shape[1])):
                results[i] = DraftResult([tok])
        return results  # type: ignore[return-value]

    def _prepare(self, req: DraftRequest) -> SeqChunk:
        """Roll this session's cache back to what it shares with req.token_ids; the chunk
        computes the rest (at least the last token: its logits give the next draft)."""
        tokens = req.token_ids
        cached = self._cached.get(req.session_key)
        keep = 0
        if cached is not None:
            keep = _common_prefix(cached, tokens)
            keep = min(keep, len(tokens) - 1)
            if keep < self.blocks.num_committed(req.session_key):
                self.release(req.session_key)  # cannot roll back final blocks; start over (rare)
                cached = None
        if cached is None:
            keep = self.blocks.allocate(req.session_key, tokens)  # leading tokens found cached
            self._cached[req.session_key] = tokens[:keep]
        else:
            self.blocks.rollback(req.session_key, len(cached) - keep)
            del cached[keep:]
            self.blocks.append(req.session_key, tokens[keep:])
        return SeqChunk(tokens[keep:], keep, self.blocks.block_table(req.session_key))

    def _mark_cached(self, req: DraftRequest) -> None:
        self._cached[req.session_key] = list(req.token_ids)
        # Final blocks become shareable with other sessions; the last token stays tentative so
        # that proposing again from this very sequence can always recompute its logits.
        done = min(req.num_committed, len(req.token_ids) - 1)
        self.blocks.commit(req.session_key, max(done, self.blocks.num_committed(req.session_key)))

@torch.inference_mode()
def sample_drafts(
    logits: torch.Tensor,  # [batch, vocab] float32
    batch: list[DraftRequest],
    vocab_size: int,
) -> list[DraftToken]:
    """One draft token per row: argmax for greedy requests (q one-hot, only the id is sent),
    else a sample from the top-N truncation of the filtered distribution, sent as q."""
    out: list[DraftToken | None] = [None] * len(batch)
    greedy = [i for i, r in enumerate(batch) if r.sampling.is_greedy]
    if greedy:
        for i, tok in zip(greedy, logits[greedy].argmax(-1).tolist()):
            out[i] = DraftToken(tok)
    by_n: dict[int, list[int]] = {}
    for i, r in enumerate(batch):
        if not r.sampling.is_greedy:
            by_n.setdefault(min(max(r.top_n, 1), vocab_size), []).append(i)
    for n, idx in by_n.items():
        for i, tok in zip(idx, _sample_top_n(logits[idx], [batch[i] for i in idx], n)):
            out[i] = tok
    return out  # type: ignore[return-value]


def _sample_top_n(
    logits: torch.Tensor,  # [rows, vocab] float32
    reqs: list[DraftRequest],
    n: int,
) -> list[DraftToken]:
    """Sample from the top-n truncation of each row's filtered distribution, which is
    exactly the q sent: verification against it stays lossless."""
    params = [r.sampling for r in reqs]
    probs = logits_to_probs(
        logits,
        torch.tensor([p.temperature for p in params], dtype=torch.float32),
        torch.tensor([p.top_k for p in params], dtype=torch.int64),
        torch.tensor([p.top_p for p in params], dtype=torch.float32),
        torch.tensor([p.min_p for p in params], dtype=torch.float32),
    )  # [rows, vocab]
    ids, q = top_n_sparse(probs, n)  # [rows, n] each
    picks = sample(q).tolist()  # [rows] index into ids
    for row, r in enumerate(reqs):
        if r.generator is not None:  # seeded: race q with the verifier's noise of this position
            noise = position_noise(r.generator, logits.shape[1]).to(q.device)[ids[row]]  # [n]
            picks[row] = int((q[row] / noise).argmax())
    tokens = []
    for row, pick in enumerate(picks):
        row_ids, row_q = ids[row].tolist(), q[row].tolist()
        # top-k / top-p may leave fewer than n tokens: zero entries are not part of q.
        kept = [(t, p) for t, p in zip(row_ids, row_q) if p > 0]
        tokens.append(DraftToken(row_ids[pick], tuple(t for t, _ in kept),
                                 tuple(p for _, p in kept)))
    return tokens


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case (pure append), one C-level compare
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i
