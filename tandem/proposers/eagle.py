"""EAGLE proposer: a one-layer feature head (tandem.engine.eagle) over a paged KV cache.

Entry t of a session reads [feature t-1 ; embedding of token t] and predicts feature t, whose
LM-head distribution drafts token t+1. Features of committed positions are the target's own
(shipped by the verifier with each commit, DraftRequest.features); beyond them the head runs on
its own predictions. When true features arrive for positions the head had predicted, the
entries built on predictions are recomputed from the true ones (re-anchoring); a divergence
rolls back like the draft model's cache. Drafts are sampled from the head's top-N truncation
and sent with that q, so verification stays exact.
"""
from __future__ import annotations

import logging
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from kernels.paged_attention import build_attention_metadata
from tandem.engine.block_manager import BlockManager, NoFreeBlocksError
from tandem.engine.eagle import EagleHead
from tandem.grammar.masks import mask_drafts
from tandem.models import ModelError, ModelPaths
from tandem.proposers import eagle_tree
from tandem.proposers.draft_model import _common_prefix, sample_drafts
from tandem.spec import DraftRequest, DraftResult, ErrorCode, Method

log = logging.getLogger(__name__)


def cache_blocks(head: EagleHead, kv_cache_bytes: int, block_size: int) -> int:
    """Blocks of the head's one-layer KV cache that fit the budget."""
    cfg = head.cfg
    per_block = 2 * cfg.num_kv_heads * cfg.head_dim * block_size * head.model.embed.element_size()
    return max(1, kv_cache_bytes // per_block)


@dataclass
class _HeadState:
    entries: list[int] = field(default_factory=list)  # token t of entries 1..E (index t-1)
    true_upto: int = 0  # entries 1..true_upto read true features
    pred: dict[int, torch.Tensor] = field(default_factory=dict)  # entry t -> predicted f_t


@dataclass
class _Work:
    """What one request still needs computed: entries nxt..last (last = L - 1)."""

    row: int
    req: DraftRequest
    nxt: int
    last: int
    m: int  # true feature rows available


class EagleProposer:
    method = Method.EAGLE

    def __init__(self, head: EagleHead, num_blocks: int, block_size: int = 16):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        cfg = head.cfg
        self.head = head
        self.feature_size = head.feature_size  # the target features' width (EAGLE-3: 3x)
        self.vocab_size = cfg.vocab_size
        self.max_context_length = cfg.max_position_embeddings
        self.block_size = block_size
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching=False)
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.device = head.model.device
        kw = {"dtype": head.model.dtype, "device": self.device}
        self.kv_cache = [(torch.zeros(shape, **kw), torch.zeros(shape, **kw))]
        self._state: dict[Hashable, _HeadState] = {}

    @classmethod
    def load(cls, paths: ModelPaths, kv_cache_bytes: int, block_size: int = 16,
             draft_vocab: int = 0, device="cpu", target: ModelPaths | None = None
             ) -> EagleProposer:
        """Tandem's own head format, a published EAGLE-3 head (its own LM head over a draft
        vocabulary; the target's embedding unless it ships one) or a published EAGLE-1/2 head
        over `target` (whose embeddings and LM head it uses)."""
        from tandem.engine.eagle3_published import is_eagle3, load_eagle3
        from tandem.engine.eagle_published import is_published_eagle, load_published

        if is_eagle3(paths.root):
            head = load_eagle3(paths.root, target, device=device)
            log.info("%s: EAGLE-3 head, %d draft tokens; its verifiers need "
                     "--eagle-feature-layers %s", paths.root, len(head.model.vocab_map),
                     ",".join(map(str, head.layer_ids)) if head.layer_ids else "eagle3")
        elif is_published_eagle(paths.root):
            if target is None:
                raise ModelError(f"{paths.root} is a published EAGLE-1/2 head: it drafts with "
                                 "the target's LM head, so pass the target checkpoint "
                                 "(--tokenizer TARGET_DIR)")
            head = load_published(paths.root, target, device=device)
        else:
            head = EagleHead.load(paths, draft_vocab=draft_vocab, device=device)
        return cls(head, cache_blocks(head, kv_cache_bytes, block_size), block_size)

    def release(self, session_key: Hashable) -> None:
        self._state.pop(session_key, None)
        if self.blocks.has(session_key):
            self.blocks.free(session_key)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[DraftResult]:
        results: list[DraftResult | None] = [None] * len(requests)
        work: list[_Work] = []
        try:
            for i, req in enumerate(requests):
                m = 0 if req.features is None else len(req.features)
                if req.max_tokens < 1 or m == 0:
                    results[i] = DraftResult()  # nothing to read yet: wait for a commit
                    continue
                try:
                    work.append(self._plan(i, req, m))
                except NoFreeBlocksError as exc:
                    self.release(req.session_key)
                    results[i] = DraftResult(error=ErrorCode.RESOURCE_EXHAUSTED,
                                             message=f"eagle KV cache is full: {exc}")
            while any(w.nxt <= w.last for w in work):
                self._pass([w for w in work if w.nxt <= w.last])
        except Exception:
            for w in work:  # the cache no longer matches what the states describe
                self.release(w.req.session_key)
            raise
        chains = [w for w in work if not w.req.tree]
        if chains:
            feats = torch.stack([self._next_feature(w) for w in chains])  # [B, hidden]
            logits = self.head.draft_logits(feats)  # [B, vocab]
            logits = mask_drafts(logits, [w.req.mask for w in chains])  # structured output
            for w, tok in zip(chains, sample_drafts(logits, [w.req for w in chains],
                                                   self.vocab_size)):
                results[w.row] = DraftResult([tok])
        trees = [w for w in work if w.req.tree]
        if trees:
            grown = eagle_tree.grow(self, [eagle_tree.Tree(
                w.req.session_key, self.blocks.num_tokens(w.req.session_key)
                if self.blocks.has(w.req.session_key) else 0, w.last, self._next_feature(w),
                w.req.max_tokens, grammar=w.req.grammar)
                for w in trees])
            for w, res in zip(trees, grown):
                results[w.row] = res
        return results  # type: ignore[return-value]

    def _plan(self, row: int, req: DraftRequest, m: int) -> _Work:
        """Roll the session's entries back to what is still valid; what remains to compute."""
        tokens, last = req.token_ids, len(req.token_ids) - 1
        st = self._state.get(req.session_key)
        if st is None:
            st = self._state[req.session_key] = _HeadState()
        valid = _common_prefix(st.entries, tokens[1:])
        if m > st.true_upto:  # entries built on predictions that true features now replace
            valid = min(valid, st.true_upto)
        if valid >= m and valid not in st.pred:
            valid = m - 1  # the next entry reads a prediction we do not hold: recompute it
        if self.blocks.has(req.session_key):
            self.blocks.rollback(req.session_key, len(st.entries) - valid)
        del st.entries[valid:]
        st.true_upto = min(st.true_upto, valid)
        st.pred = {t: p for t, p in st.pred.items() if t <= valid and t >= m - 1}
        return _Work(row, req, valid + 1, last, m)

    def _pass(self, work: list[_Work]) -> None:
        """One head forward: per session, its run of entries with true features, or the one
        entry whose input is the head's latest prediction."""
        ids, feats, pos, q_lens, seq_lens, tables, spans = [], [], [], [], [], [], []
        for w in work:
            st = self._state[w.req.session_key]
            end = min(w.last, w.m) if w.nxt <= w.m else w.nxt
            new = w.req.token_ids[w.nxt:end + 1]
            if self.blocks.has(w.req.session_key):
                self.blocks.append(w.req.session_key, new)
            else:
                self.blocks.allocate(w.req.session_key, new)
            if w.nxt <= w.m:
                # the verifier's features arrive on the CPU (from the wire); EAGLE-3's fc
                feats.append(self.head.project(w.req.features[w.nxt - 1:end].to(self.device)))
            else:
                feats.append(st.pred[w.nxt - 1][None])
            ids.extend(new)
            pos.extend(range(w.nxt - 1, end))
            q_lens.append(len(new))
            seq_lens.append(end)
            tables.append(self.blocks.block_table(w.req.session_key))
            spans.append((w, end))
        meta = build_attention_metadata(q_lens, seq_lens, tables, self.block_size).to(self.device)
        on = {"dtype": torch.int64, "device": self.device}
        _, pred = self.head.forward(
            torch.tensor(ids, **on), torch.cat(feats), torch.tensor(pos, **on), meta,
            self.kv_cache, torch.empty(0, **on))  # [sum(q_lens), hidden]
        at = 0
        for (w, end), n in zip(spans, q_lens):
            st = self._state[w.req.session_key]
            st.entries.extend(w.req.token_ids[w.nxt:end + 1])
            if w.nxt <= w.m:
                st.true_upto = end
            for t in range(max(w.nxt, end - 1), end + 1):  # the next entries read these
                st.pred[t] = pred[at + t - w.nxt].float().clone()
            at += n
            w.nxt = end + 1

    def _next_feature(self, w: _Work) -> torch.Tensor:  # [hidden]
        """Feature of the last token's position: the target's if known and the head's LM head
        reads it (not EAGLE-3's), else predicted."""
        if w.m > w.last and self.head.reads_target_head:
            return w.req.features[w.last].to(self.device)
        return self._state[w.req.session_key].pred[w.last]
