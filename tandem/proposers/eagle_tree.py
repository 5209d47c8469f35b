"""EAGLE-2's dynamic draft tree over the eagle head (tandem/proposers/eagle.py).

From the head's feature of the last committed position the tree grows one depth per head pass.
A node's children are its `branch` most likely tokens under the head, each scored by its path
probability (the product of the head's probabilities from the root); the `width` best-scored
nodes of the newest depth are expanded next. A pass recomputes every expanded node of the
session's tree at once under a tree attention mask: each node sees the committed entries and
its own ancestors. Its KV slots after the committed entries are scratch, rolled back after the
pass, so no tree state stays in the paged cache between steps.

The tree sent is the `n` best-scored nodes, in score order: a child never outscores its parent,
so parents come first and every prefix is the best tree of its size, which is how the verifier
sizes it by its cost model (tandem.spec.cost.choose_tree_size over the scores). Nodes are
deterministic candidates (q one-hot), which tree verification accepts exactly
(kernels/tree_rejection.py). Under structured output each node's children are drawn from what
the session's grammar allows after the node's path, so no branch is spent on a token the
verifier's mask would reject.
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from kernels.paged_attention import ancestor_mask, build_attention_metadata
from tandem.grammar.masks import mask_drafts
from tandem.spec import DraftResult, DraftToken

BRANCH = 4  # children per expanded node
WIDTH = 4  # nodes expanded per depth
MAX_DEPTH = 5


@dataclass
class _Node:
    token: int
    parent: int  # index among the tree's nodes, -1 = the root (the last committed token)
    depth: int  # 1 = a child of the root
    score: float  # path probability under the head
    feature: torch.Tensor | None = None  # [hidden] predicted at this node, once expanded


@dataclass
class Tree:
    """One session's tree while it grows."""

    session_key: Hashable
    entries: int  # the session's committed head entries (KV slots 0..entries-1)
    position: int  # absolute position of the last committed token (the root)
    root: torch.Tensor  # [hidden] the head's feature at the root
    size: int  # nodes wanted
    nodes: list[_Node] = field(default_factory=list)
    expanded: list[int] = field(default_factory=list)  # node indices, parents first
    grammar: object | None = None  # a GrammarState at the root (structured output), or None

    def path(self, node: int) -> list[int]:
        """The tokens from the root to `node` (-1: the root itself, no tokens)."""
        out = []
        while node >= 0:
            out.append(self.nodes[node].token)
            node = self.nodes[node].parent
        return out[::-1]


def grow(proposer, trees: list[Tree], branch: int = BRANCH, width: int = WIDTH,
         max_depth: int = MAX_DEPTH) -> list[DraftResult]:
    """Draft each session's tree (one result per tree, in order)."""
    roots = torch.stack([t.root for t in trees])  # [B, hidden]
    _add_children(trees, [-1] * len(trees), proposer.head.draft_logits(roots), branch)
    for depth in range(1, min(max_depth, max(t.size for t in trees))):
        frontier = [_frontier(t, depth, width) for t in trees]
        active = [(t, f) for t, f in zip(trees, frontier) if f and depth < t.size]
        if not active:
            break
        logits = _pass(proposer, active)  # [sum of frontier sizes, vocab]
        at = 0
        for t, f in active:
            _add_children([t] * len(f), f, logits[at:at + len(f)], branch)
            at += len(f)
    return [_result(t) for t in trees]


def _add_children(trees: list[Tree], parents: list[int], logits: torch.Tensor,
                  branch: int) -> None:
    """Children of node parents[i] of trees[i] from its row of head logits [rows, vocab]."""
    if any(t.grammar is not None for t in trees):  # only what the grammar allows there
        logits = mask_drafts(logits, [None if t.grammar is None else
                                      t.grammar.mask_after(t.path(p))
                                      for t, p in zip(trees, parents)])
    probs, ids = logits.float().softmax(-1).topk(branch, dim=-1)  # [rows, branch] each
    for t, p, row_p, row_ids in zip(trees, parents, probs.tolist(), ids.tolist()):
        base, depth = (1.0, 1) if p < 0 else (t.nodes[p].score, t.nodes[p].depth + 1)
        for prob, tok in zip(row_p, row_ids):
            if prob > 0:  # outside a truncated vocabulary: never a candidate
                t.nodes.append(_Node(tok, p, depth, base * prob))


def _frontier(t: Tree, depth: int, width: int) -> list[int]:
    """The best-scored nodes at `depth`, to expand now (recorded as expanded). A node that
    does not beat the size-th best score so far is not expanded: its children score no more
    than it does, so none of them could enter the tree."""
    scores = sorted((n.score for n in t.nodes), reverse=True)
    cutoff = scores[t.size - 1] if len(scores) >= t.size else 0.0
    at_depth = [i for i, n in enumerate(t.nodes) if n.depth == depth and n.score > cutoff]
    best = sorted(at_depth, key=lambda i: -t.nodes[i].score)[:width]
    t.expanded.extend(best)
    return best


def _pass(proposer, active: list[tuple[Tree, list[int]]]) -> torch.Tensor:
    """One head forward over every expanded node of the active trees (tree masks); sets the
    new frontier nodes' features and returns their logits [frontier rows, vocab]."""
    head, blocks = proposer.head, proposer.blocks
    ids, feats, pos, q_lens, seq_lens, tables, masks, rows = [], [], [], [], [], [], [], []
    at = 0
    try:
        for t, frontier in active:
            order = {n: j for j, n in enumerate(t.expanded)}
            nodes = [t.nodes[i] for i in t.expanded]
            tokens = [n.token for n in nodes]  # scratch slots after the entries
            if blocks.has(t.session_key):
                blocks.append(t.session_key, tokens)
            else:
                blocks.allocate(t.session_key, tokens)
            ids += tokens
            feats += [t.root if n.parent < 0 else t.nodes[n.parent].feature for n in nodes]
            pos += [t.position + n.depth - 1 for n in nodes]  # entry t sits at position t - 1
            q_lens.append(len(nodes))
            seq_lens.append(t.entries + len(nodes))
            tables.append(blocks.block_table(t.session_key))
            masks.append(ancestor_mask([order.get(n.parent, -1) for n in nodes]))
            rows += [at + order[i] for i in frontier]
            at += len(nodes)
        meta = build_attention_metadata(q_lens, seq_lens, tables, proposer.block_size,
                                        masks).to(proposer.device)
        on = {"dtype": torch.int64, "device": proposer.device}
        logits, pred = head.forward(
            torch.tensor(ids, **on), torch.stack(feats), torch.tensor(pos, **on), meta,
            proposer.kv_cache, torch.tensor(rows, **on))  # [rows, vocab], [at, hidden]
    finally:
        for t, _ in active:
            if blocks.has(t.session_key):
                blocks.rollback(t.session_key, blocks.num_tokens(t.session_key) - t.entries)
    it = iter(rows)
    for t, frontier in active:
        for i in frontier:
            t.nodes[i].feature = pred[next(it)].float()
    return logits


def _result(t: Tree) -> DraftResult:
    """The tree's `size` best nodes in score order (parents first), renumbered."""
    ranked = sorted(range(len(t.nodes)), key=lambda i: (-t.nodes[i].score, t.nodes[i].depth, i))
    kept = ranked[:t.size]
    index = {i: j for j, i in enumerate(kept)}
    nodes = [t.nodes[i] for i in kept]
    return DraftResult(tokens=[DraftToken(n.token) for n in nodes],
                       parents=tuple(index[n.parent] if n.parent >= 0 else -1 for n in nodes),
                       scores=tuple(n.score for n in nodes))
