"""Token-tree rejection: which path of a draft tree the target keeps, losslessly (the tree
counterpart of kernels/rejection.py; verify_service/forward/rejection.py decides which one a
round uses).

A round's tree: drafts[j] with parents[j] (index among the drafts, -1 = child of the round's
root, the last committed token). The target ran every node in one forward (tree attention,
kernels/paged_attention.py), so row 0 of `rows` is its distribution for the root's children and
row j + 1 the one for node j's children.

- Deterministic sessions (greedy, or seeded: the target's own keyed sample at each position)
  walk down while a child carries the target's token; then that token is emitted (recovered
  where a child existed, bonus at a leaf): the longest matching path.
- Unseeded sampling uses recursive rejection over siblings (SpecInfer, Miao et al. 2024): try
  the children in order, accepting child x with probability min(1, p(x) / q(x)); each rejection
  replaces p by norm(max(0, p - q)). If every child is rejected the recovered token is sampled
  from what is left of p; at a leaf the bonus token is sampled from its row. The emitted text is
  distributed exactly as the target's when siblings are independent draws from their q, which
  includes deterministic candidates (q one-hot: Medusa's and EAGLE's top-k).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kernels.sampling import sample


class DraftToken(Protocol):
    """A draft node as the core's tandem.spec.DraftToken has it; empty q_ids: q one-hot."""

    token_id: int
    q_ids: Sequence[int]
    q_probs: Sequence[float]


@dataclass(frozen=True)
class TreePath:
    accepted: list[int]  # the accepted drafts' tokens, root to leaf
    nodes: list[int]  # their indices among the drafts
    next_token: int  # recovered (below a rejection) or bonus token


def is_chain(parents: Sequence[int] | None) -> bool:
    """None or (-1, 0, 1, ...): each draft continues the one before (the chain case)."""
    return parents is None or all(p == i - 1 for i, p in enumerate(parents))


def children_of(parents: Sequence[int]) -> dict[int, list[int]]:
    """node (-1 = root) -> its children in draft order."""
    out: dict[int, list[int]] = {}
    for j, p in enumerate(parents):
        out.setdefault(p, []).append(j)
    return out


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of each draft node, 1 for the root's children."""
    d: list[int] = []
    for p in parents:
        d.append(1 if p < 0 else d[p] + 1)
    return d


def walk(drafts: Sequence[DraftToken], parents: Sequence[int],
         target_token: Callable[[int, int], int]) -> TreePath:
    """Deterministic walk: target_token(row, depth) is the target's token below a node (row 0 =
    the root's; depth 0 = the root's children's position)."""
    kids = children_of(parents)
    node, accepted, nodes = -1, [], []
    while True:
        tok = target_token(node + 1, len(nodes))
        child = next((c for c in kids.get(node, ()) if drafts[c].token_id == tok), None)
        if child is None:
            return TreePath(accepted, nodes, tok)
        accepted.append(tok)
        nodes.append(child)
        node = child


def _q_row(d: DraftToken, vocab: int) -> torch.Tensor:
    q = torch.zeros(vocab)
    if d.q_ids:
        q[torch.tensor(d.q_ids)] = torch.tensor(d.q_probs, dtype=torch.float32)
        return q / q.sum()
    q[d.token_id] = 1.0
    return q


def reject(drafts: Sequence[DraftToken], parents: Sequence[int],
           probs: torch.Tensor,  # [k + 1, vocab] target probs (after sampling params)
           generator: torch.Generator | None = None) -> TreePath:
    """Recursive rejection sampling down the tree (see the module docstring)."""
    kids = children_of(parents)
    vocab = probs.shape[1]
    node, accepted, nodes = -1, [], []
    while True:
        p = probs[node + 1].float()
        for child in kids.get(node, ()):
            d = drafts[child]
            q = _q_row(d, vocab).to(p.device)
            if q[d.token_id] <= 0:
                raise ValueError(f"draft node {child} (id {d.token_id}) has q(x) = 0")
            u = float(torch.rand((), generator=generator))
            if u * q[d.token_id] < p[d.token_id]:
                break
            residual = (p - q).clamp_min_(0)
            # Zero mass means p <= q everywhere, i.e. p == q: the rejection was rounding.
            p = residual / residual.sum() if residual.sum() > 0 else p
        else:
            return TreePath(accepted, nodes, int(sample(p[None],
                                                        [generator] if generator else None)))
        accepted.append(d.token_id)
        nodes.append(child)
        node = child


def typical(drafts: Sequence[DraftToken], parents: Sequence[int],
            probs: torch.Tensor,  # [k + 1, vocab] target probs (after sampling params)
            threshold: float, alpha: float,
            generator: torch.Generator | None = None) -> TreePath:
    """Medusa's typical acceptance (LOSSY: the text is no longer distributed as the target's):
    keep the first child whose p(x) > min(threshold, alpha * exp(-H(p))), so a confident target
    accepts only its likely tokens and an uncertain one accepts more; then sample the next
    token from the last kept node's row."""
    kids = children_of(parents)
    node, accepted, nodes = -1, [], []
    while True:
        p = probs[node + 1].float()
        entropy = float(-(p * p.clamp_min(1e-12).log()).sum())
        bar = min(threshold, alpha * math.exp(-entropy))
        child = next((c for c in kids.get(node, ()) if p[drafts[c].token_id] > bar), None)
        if child is None:
            return TreePath(accepted, nodes, int(sample(p[None],
                                                        [generator] if generator else None)))
        accepted.append(drafts[child].token_id)
        nodes.append(child)
        node = child
