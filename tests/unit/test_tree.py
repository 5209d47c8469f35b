"""Token trees without the real model: the tree mask and depth positions against chains on a
tiny random Llama, KV compaction, the walks and recursive rejection over siblings (exact joint
distribution, with a negative control that must fail), Medusa trees and the block manager."""
from collections import Counter

import pytest
import torch
import transformers

from kernels import tree_rejection as tree
from kernels.paged_attention import ancestor_mask
from tandem.engine.block_manager import BlockManager
from tandem.engine.llama import LlamaModel
from tandem.engine.medusa import MedusaConfig, MedusaHeads, expected_accepted, tree_from_accuracy
from tandem.engine.model_runner import ModelRunner, SeqChunk
from tandem.models import resolve_model
from tandem.spec import DraftToken
from tandem.spec.cost import CostModel, choose_tree_size

pytestmark = pytest.mark.unit

# root -> a, b; a -> c, d; b -> e; d -> f  (draft indices 0..5)
PARENTS = (-1, -1, 0, 0, 1, 3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(vocab_size=53, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128)
    root = tmp_path_factory.mktemp("tiny-tree")
    transformers.LlamaForCausalLM(cfg).float().eval().save_pretrained(root)
    return LlamaModel.load(resolve_model(root), tune=False)


def test_ancestor_mask_and_bad_parents():
    m = ancestor_mask((-1, 0, 0, 1))
    assert m.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    with pytest.raises(ValueError, match="parents must come first"):
        ancestor_mask((-1, 2, 0))


def _path(node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = PARENTS[node]
    return out[::-1]


def test_tree_forward_equals_each_branch_as_a_chain(tiny):
    prompt, nodes = [5, 9, 2, 30, 7], [11, 12, 13, 14, 15, 16]
    runner = ModelRunner(tiny, 16, 4)
    table = list(range(4))
    runner.forward([SeqChunk(prompt[:-1], 0, table)])
    # The root (last prompt token) then the six nodes, one forward with the tree mask.
    chunk = SeqChunk([prompt[-1], *nodes], len(prompt) - 1, table, num_logits=7,
                     parents=(-1, *(p + 1 for p in PARENTS)))
    assert chunk.positions() == [4, 5, 5, 6, 6, 6, 7]
    logits = runner.forward([chunk])
    for j in range(len(nodes)):
        chain = prompt + [nodes[i] for i in _path(j)]
        ref = ModelRunner(tiny, 16, 4).forward([SeqChunk(chain, 0, table)])
        torch.testing.assert_close(logits[j + 1], ref[0], atol=1e-4, rtol=1e-4)


def test_compacted_path_kv_continues_like_the_chain(tiny):
    prompt, nodes = [5, 9, 2, 30, 7], [11, 12, 13, 14, 15, 16]
    runner = ModelRunner(tiny, 16, 4)
    table = list(range(4))
    runner.forward([SeqChunk(prompt[:-1], 0, table)])
    runner.forward([SeqChunk([prompt[-1], *nodes], 4, table, 7,
                             parents=(-1, *(p + 1 for p in PARENTS)))])
    path = _path(5)  # a -> d -> f: draft indices 0, 3, 5 at positions 5, 6, 7
    runner.move_kv(table, [5 + j for j in path], [5, 6, 7])
    nxt = runner.forward([SeqChunk([40], 8, table)])
    chain = prompt + [nodes[j] for j in path] + [40]
    ref = ModelRunner(tiny, 16, 4).forward([SeqChunk(chain, 0, table)])
    torch.testing.assert_close(nxt[0], ref[0], atol=1e-4, rtol=1e-4)


def test_kept_features_follow_the_kv_chunks_and_tree_paths(tiny):
    """keep_features: each token's hidden state kept in its slot, read back for positions a
    later session finds in the prefix cache, and moved with a tree's accepted path."""
    prompt, nodes = [5, 9, 2, 30, 7], [11, 12, 13, 14, 15, 16]
    ref_runner = ModelRunner(tiny, 16, 4)
    table = [3, 1, 2, 0]  # a scattered block table
    chain = prompt + [nodes[j] for j in _path(5)]
    _, ref = ref_runner.forward([SeqChunk(chain, 0, table)], with_hidden=True)
    runner = ModelRunner(tiny, 16, 4, keep_features=True)
    runner.forward([SeqChunk(prompt[:3], 0, table)])  # in chunks, no hidden asked
    runner.forward([SeqChunk(prompt[3:4], 3, table)])
    runner.forward([SeqChunk([prompt[-1], *nodes], 4, table, 7,
                             parents=(-1, *(p + 1 for p in PARENTS)))])
    runner.move_kv(table, [5 + j for j in _path(5)], [5, 6, 7])
    got = runner.features_at(table, 0, len(chain))
    assert got.dtype == torch.float16 and got.shape == (len(chain), 32)
    torch.testing.assert_close(got.float(), ref, atol=2e-3, rtol=2e-3)
    with pytest.raises(RuntimeError, match="keeps no features"):
        ref_runner.features_at(table, 0, 1)
    with pytest.raises(ValueError, match="outside the block table"):
        runner.features_at(table, 0, 17)


def test_greedy_walk_takes_the_longest_matching_path():
    drafts = [DraftToken(t) for t in (10, 20, 30, 40, 50, 60)]
    # Target tokens by row: root -> 20 (node b), below b -> 50 (node e), below e -> 7.
    rows = {0: 20, 2: 50, 5: 7}
    got = tree.walk(drafts, PARENTS, lambda row, depth: rows.get(row, 99))
    assert (got.accepted, got.nodes, got.next_token) == ([20, 50], [1, 4], 7)
    got = tree.walk(drafts, PARENTS, lambda row, depth: 8)
    assert (got.accepted, got.nodes, got.next_token) == ([], [], 8)


def _joint(probs):
    """Target joint over two positions for the test tree below: row 0 then row of child."""
    return {(a, b): float(probs[0, a] * probs[1 + a % 2, b]) for a in range(4) for b in range(4)}


def _draw(reject_fn, n=6000, seed=0):
    """n rounds of a tree with two one-hot candidates at depth 1 (tokens 0, 1) and two below
    each; the target's rows: p0 for the root, p1 / p2 below tokens 0 / 1 (rows 1 and 2)."""
    p0 = torch.tensor([0.5, 0.3, 0.15, 0.05])
    p1 = torch.tensor([0.1, 0.6, 0.2, 0.1])
    p2 = torch.tensor([0.4, 0.1, 0.1, 0.4])
    drafts = [DraftToken(0), DraftToken(1), DraftToken(1), DraftToken(2), DraftToken(0),
              DraftToken(3)]
    parents = (-1, -1, 0, 0, 1, 1)
    # Rows in draft order: root, node0 (token 0), node1 (token 1), then the leaves' bonus rows.
    probs = torch.stack([p0, p1, p2, p0, p0, p0, p0])
    gen = torch.Generator().manual_seed(seed)
    out = Counter()
    for _ in range(n):
        p = reject_fn(drafts, parents, probs, gen)
        toks = [*p.accepted, p.next_token][:2]
        if len(toks) < 2:  # rejected at depth 1: the second token comes from the next row
            nxt = probs[1 + toks[0]] if toks[0] < 2 else p0
            toks.append(int(torch.multinomial(nxt, 1, generator=gen)))
        out[tuple(toks)] += 1
    want = {}
    for a in range(4):
        below = probs[1 + a] if a < 2 else p0
        for b in range(4):
            want[(a, b)] = float(p0[a] * below[b])
    return out, want, n


def _tv(out, want, n):
    return 0.5 * sum(abs(out[o] / n - p) for o, p in want.items())


def test_recursive_rejection_reproduces_the_target_joint():
    out, want, n = _draw(tree.reject)
    assert _tv(out, want, n) < 0.03  # E[TV] for 16 outcomes at n=6000 is ~0.015


def test_negative_control_without_the_residual_update_is_caught():
    def no_residual(drafts, parents, probs, gen):
        # The bug: every sibling tried against the unchanged p (no norm(max(0, p - q))).
        kids = tree.children_of(parents)
        node, acc, nodes = -1, [], []
        while True:
            p = probs[node + 1]
            for c in kids.get(node, ()):
                if float(torch.rand((), generator=gen)) < p[drafts[c].token_id]:
                    break
            else:
                return tree.TreePath(acc, nodes, int(torch.multinomial(p, 1, generator=gen)))
            acc.append(drafts[c].token_id)
            nodes.append(c)
            node = c

    out, want, n = _draw(no_residual)
    assert _tv(out, want, n) > 0.06


def test_medusa_tree_from_accuracy_is_parent_first_and_best_prefix():
    acc = ((0.6, 0.2, 0.11), (0.5, 0.2), (0.4,))
    choices = tree_from_accuracy(acc, 6)
    assert choices[0] == (0,) and set(choices) == {(0,), (0, 0), (1,), (0, 0, 0), (0, 1),
                                                   (2,)}
    for i, c in enumerate(choices):
        assert len(c) == 1 or c[:-1] in choices[:i]
    assert expected_accepted(acc, choices) == pytest.approx(
        0.6 + 0.3 + 0.2 + 0.12 + 0.12 + 0.11)


def test_medusa_heads_propose_the_configured_tree():
    torch.manual_seed(0)
    cfg = MedusaConfig(2, 1, 8, tuple(range(10, 26)), ((0,), (1,), (0, 0), (1, 0), (0, 1)))
    rows = torch.randn(16, 8)
    heads = MedusaHeads(cfg, rows)
    h = torch.randn(8)
    tokens, parents = heads.propose(h)
    assert parents == (-1, -1, 0, 1, 0)
    top = heads.vocab[heads.forward(h[None])[:, 0].topk(2, dim=-1).indices].tolist()
    assert [t.token_id for t in tokens] == [top[0][0], top[0][1], top[1][0], top[1][0],
                                            top[1][1]]
    assert heads.propose(h, 2) == (tokens[:2], parents[:2])  # head 1 alone suffices
    # Several sessions in one heads pass: each gets what it would have got alone.
    hs = torch.randn(3, 8)
    asks = [(None, False), (2, False), (None, True)]
    assert heads.propose_batch(hs, asks) == [heads.propose(x, n, chain=c)
                                             for x, (n, c) in zip(hs, asks)]
    with pytest.raises(ValueError, match="before its parent"):
        MedusaConfig(2, 1, 8, (1, 2), ((0, 0), (0,)))


def test_tree_size_follows_the_cost_curve():
    reach = [0.6, 0.3, 0.2, 0.1, 0.05]
    flat = CostModel({q: 10.0 for q in range(1, 10)})
    steep = CostModel({1: 10.0, **{q: 10.0 * q for q in range(2, 10)}})
    assert choose_tree_size(reach, 5, flat) == 5
    assert choose_tree_size(reach, 5, steep) == 0
    assert choose_tree_size(reach, 2, flat) == 2


def test_block_manager_rewrites_only_tentative_tokens():
    bm = BlockManager(8, 4)
    bm.allocate("s", [1, 2, 3])
    bm.commit("s", 3)
    bm.append("s", [4, 10, 11, 12])
    bm.rollback("s", 2)
    bm.rewrite("s", [11])  # the path's token moved into the first draft slot
    assert bm.num_tokens("s") == 5
    with pytest.raises(ValueError, match="committed tokens are final"):
        bm.rewrite("s", [9, 9, 9])


def test_typical_acceptance_keeps_likely_children_only():
    drafts = [DraftToken(t) for t in (0, 1, 2)]
    parents = (-1, -1, 0)
    confident = torch.tensor([0.9, 0.05, 0.03, 0.02])
    flat = torch.full((4,), 0.25)
    probs = torch.stack([confident, flat, flat, flat])  # rows: root, below 0, below 1, 2
    got = tree.typical(drafts, parents, probs, 0.09, 0.3)
    # Root: token 0 (p 0.9) clears the bar; below it token 2 has p 0.25 > min(0.09, ...).
    assert got.accepted == [0, 2] and got.nodes == [0, 2]
    probs = torch.stack([torch.tensor([0.05, 0.05, 0.0, 0.9]), confident, flat, flat])
    got = tree.typical(drafts, parents, probs, 0.09, 0.3)
    assert got.accepted == [] and got.next_token in (0, 1, 3)
