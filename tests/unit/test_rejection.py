"""kernels/rejection.py: the batched lossless rejection sampler."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import rejection
from kernels.rejection import accepted_per_position, rejection_sample
from kernels.rejection_types import PLACEHOLDER_TOKEN_ID, SparseDraftProbs
from kernels.sampling import make_generator, sample, top_n_sparse

pytestmark = pytest.mark.unit

V = 8


def _one_hot(ids, vocab=V):
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()


def _cu(counts):
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int64)


def _rand_probs(rows, gen, vocab=V, scale=1.5):
    return torch.softmax(torch.randn(rows, vocab, generator=gen) * scale, dim=-1)


def _tv(samples: torch.Tensor, probs: torch.Tensor) -> float:
    freq = torch.bincount(samples, minlength=probs.numel()).double() / samples.numel()
    return 0.5 * float((freq - probs.double()).abs().sum())


def _tv_bound(n: int) -> float:
    # An exact sampler's empirical TV over n draws has mean <= sqrt((V-1)/(2*pi*n)) and a much
    # smaller spread; 4x the mean is ~10 standard deviations, so only a real bias exceeds it.
    return 4 * math.sqrt((V - 1) / (2 * math.pi * n))


# ---- deterministic behaviour -------------------------------------------------------------


def test_greedy_perfect_match_accepts_all_and_emits_bonus():
    target = _one_hot([3, 5, 1, 6])  # 3 draft positions + bonus row
    out = rejection_sample(torch.tensor([3, 5, 1]), _cu([3]), target, None, torch.tensor([True]))
    assert out.output_token_ids.tolist() == [[3, 5, 1, 6]]
    assert out.num_accepted.tolist() == [3] and out.num_emitted.tolist() == [4]


def test_greedy_mismatch_stops_with_target_argmax_as_recovered():
    target = torch.softmax(torch.randn(4, V), dim=-1)
    argmax = target.argmax(dim=-1)
    drafts = torch.stack([argmax[0], (argmax[1] + 1) % V, argmax[2]])
    out = rejection_sample(drafts, _cu([3]), target, None, torch.tensor([True]))
    assert out.output_token_ids.tolist() == [[argmax[0].item(), argmax[1].item(), -1, -1]]
    assert out.num_accepted.tolist() == [1] and out.num_emitted.tolist() == [2]


@pytest.mark.parametrize("form", ["dense", "sparse"])
def test_stochastic_p_equals_q_accepts_all(form):
    gen = torch.Generator().manual_seed(0)
    target = _rand_probs(4, gen)
    drafts = sample(target[:3])
    if form == "dense":
        draft_probs = target[:3].clone()
    else:
        draft_probs = SparseDraftProbs(*top_n_sparse(target[:3], V))
    for _ in range(20):
        out = rejection_sample(drafts, _cu([3]), target, draft_probs, torch.tensor([False]))
        assert out.num_accepted.item() == 3 and out.num_emitted.item() == 4
        assert out.output_token_ids[0, :3].tolist() == drafts.tolist()


def test_stochastic_rejection_at_zero_target_probability_recovers_from_residual():
    # position 1 gives the draft token 2 zero target mass and puts everything on token 5
    target = torch.stack([_one_hot([4])[0], _one_hot([5])[0], torch.full((V,), 1 / V)])
    draft_probs = torch.full((2, V), 1 / V)
    out = rejection_sample(torch.tensor([4, 2]), _cu([2]), target, draft_probs,
                           torch.tensor([False]))
    assert out.output_token_ids.tolist() == [[4, 5, PLACEHOLDER_TOKEN_ID]]
    assert out.num_accepted.tolist() == [1]


def test_one_hot_q_residual_excludes_the_rejected_draft():
    target = torch.tensor([[0.5, 0.5, 0, 0, 0, 0, 0, 0], [0.0] * 7 + [1.0]])
    for _ in range(50):  # when draft 0 is rejected the recovered token must be 1
        out = rejection_sample(torch.tensor([0]), _cu([1]), target, None, torch.tensor([False]))
        expected = [[0, 7]] if out.num_accepted.item() else [[1, -1]]
        assert out.output_token_ids.tolist() == expected


def test_residual_with_zero_mass_falls_back_to_p():
    p = torch.softmax(torch.randn(1, V), dim=-1)
    residual = rejection._residual(p, torch.tensor([0]), torch.tensor([2]), p.clone())
    torch.testing.assert_close(residual, p)


def test_zero_draft_sequences_sample_the_bonus_token():
    target = torch.stack([_one_hot([6])[0], torch.tensor([0, 0.5, 0, 0, 0, 0, 0, 0.5])])
    out = rejection_sample(torch.empty(0, dtype=torch.int64), _cu([0, 0]), target, None,
                           torch.tensor([True, False]))
    assert out.output_token_ids.shape == (2, 1)
    assert out.output_token_ids[0].item() == 6 and out.output_token_ids[1].item() in (1, 7)
    assert out.num_accepted.tolist() == [0, 0] and out.num_emitted.tolist() == [1, 1]


def test_sample_bonus_false_withholds_only_the_bonus():
    target = _one_hot([1, 2, 3, 4, 5])  # seq 0: drafts 1, 2 (+bonus 3); seq 1: draft 0 vs 4
    out = rejection_sample(torch.tensor([1, 2, 0]), _cu([2, 1]), target, None,
                           torch.tensor([True, True]), sample_bonus=torch.tensor([False, False]))
    assert out.output_token_ids.tolist() == [[1, 2, -1], [4, -1, -1]]
    assert out.num_accepted.tolist() == [2, 0] and out.num_emitted.tolist() == [2, 1]


def test_mixed_batch_greedy_stochastic_empty_and_sparse():
    target = torch.cat([
        _one_hot([2, 3, 4]),  # seq 0 greedy: drafts 2, 9->mismatch at 1 -> recovered 3
        _one_hot([7]),  # seq 1: no drafts, bonus 7
        _one_hot([1, 0]),  # seq 2 stochastic: draft 1 surely accepted, bonus 0
    ])
    ids = torch.tensor([[2, 0], [5, 6], [1, 3]])
    probs = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.6, 0.4]])
    out = rejection_sample(torch.tensor([2, 5, 1]), _cu([2, 0, 1]), target,
                           SparseDraftProbs(ids, probs), torch.tensor([True, False, False]))
    assert out.output_token_ids.tolist() == [[2, 3, -1], [7, -1, -1], [1, 0, -1]]
    assert out.num_accepted.tolist() == [1, 0, 1] and out.num_emitted.tolist() == [2, 1, 2]
    assert accepted_per_position(out).tolist() == [2, 0]


def _stochastic_case(gen, counts):
    target = _rand_probs(sum(counts) + len(counts), gen, scale=2.0)
    q = _rand_probs(sum(counts), gen, scale=2.0)
    drafts = torch.multinomial(q, 1, generator=gen).squeeze(1) if sum(counts) else \
        torch.empty(0, dtype=torch.int64)
    return drafts, _cu(counts), target, q


def test_seeded_sequence_is_deterministic_and_independent_of_neighbours():
    gen = torch.Generator().manual_seed(1)
    drafts, cu, target, q = _stochastic_case(gen, [3, 4, 2])
    greedy = torch.zeros(3, dtype=torch.bool)
    results = []
    for neighbour_seed in (None, 5, 6):
        torch.manual_seed(1000 + len(results))  # the global RNG must not matter
        gens = [make_generator(neighbour_seed), make_generator(42), None]
        out = rejection_sample(drafts, cu, target, q, greedy, gens)
        results.append(out.output_token_ids[1].tolist())
    solo = rejection_sample(drafts[3:7], _cu([4]), target[4:9], q[3:7], greedy[:1],
                            [make_generator(42)])
    assert results[0] == results[1] == results[2] == solo.output_token_ids[0].tolist()


def _reference(drafts, cu, target, q, greedy, seeds):
    """Sequence-by-sequence loop consuming each generator in the same order as the kernel."""
    rows = []
    for i, seed in enumerate(seeds):
        gen, lo, hi = make_generator(seed), int(cu[i]), int(cu[i + 1])
        u = torch.rand(hi - lo, generator=gen)
        tokens, final = [], target[hi + i]
        for j in range(hi - lo):
            x, p = int(drafts[lo + j]), target[lo + i + j]
            ok = x == int(p.argmax()) if greedy[i] else u[j] * q[lo + j, x] < p[x]
            if not ok:
                final = p if greedy[i] else (p - q[lo + j]).clamp_min(0)
                break
            tokens.append(x)
        token = final.argmax() if greedy[i] else sample(final[None], [gen])[0]
        rows.append(tokens + [int(token)])
    return rows


@pytest.mark.parametrize("case", range(20))
def test_matches_sequence_by_sequence_reference(case):
    gen = torch.Generator().manual_seed(100 + case)
    counts = torch.randint(0, 5, (int(torch.randint(1, 6, (1,), generator=gen)),),
                           generator=gen).tolist()
    drafts, cu, target, q = _stochastic_case(gen, counts)
    greedy = torch.rand(len(counts), generator=gen) < 0.4
    # most greedy drafts match the target argmax, so greedy acceptance runs vary in length
    rows = torch.arange(len(drafts)) + torch.repeat_interleave(torch.arange(len(counts)),
                                                               torch.tensor(counts))
    matched = greedy.repeat_interleave(torch.tensor(counts)) & \
        (torch.rand(len(drafts), generator=gen) < 0.7)
    drafts = torch.where(matched, target[rows].argmax(dim=-1), drafts)
    seeds = [1000 * case + i for i in range(len(counts))]
    out = rejection_sample(drafts, cu, target, q, greedy, [make_generator(s) for s in seeds])
    expected = _reference(drafts, cu, target, q, greedy, seeds)
    got = [row[:n].tolist() for row, n in zip(out.output_token_ids, out.num_emitted)]
    assert got == expected


# ---- the output distribution is the target's (the lossless property) --------------------

N_SEQ = 100_000


def _run_batch(form, seed, n=N_SEQ, k=2):
    """n identical sequences with k drafts each drawn from q; one vectorised call."""
    gen = torch.Generator().manual_seed(seed)
    p = _rand_probs(k + 1, gen, scale=1.0)  # p1 .. pk, then the bonus row
    # a draft that partly agrees with the target (first-draft acceptance ~0.55 for dense q)
    q = torch.softmax(p[:k].log() + 1.5 * torch.randn(k, V, generator=gen), dim=-1)
    if form == "sparse":  # what a draft worker sends: top-N truncation, renormalised
        ids, sparse = top_n_sparse(q, 4)
        q = torch.zeros(k, V).scatter_(1, ids, sparse)
    drafts = torch.stack([torch.multinomial(q[j], n, True, generator=gen) for j in range(k)], 1)
    if form == "dense":
        draft_probs = q.repeat(n, 1)
    elif form == "sparse":
        draft_probs = SparseDraftProbs(ids.repeat(n, 1), sparse.repeat(n, 1))
    else:  # q one-hot at each sequence's own draft: valid whatever picked that draft
        draft_probs = None
    torch.manual_seed(seed)
    out = rejection_sample(drafts.reshape(-1), torch.arange(0, n * k + 1, k), p.repeat(n, 1),
                           draft_probs, torch.zeros(n, dtype=torch.bool))
    return out, p, q, drafts


def _position_tvs(out, p):
    """TV between p_j and the j-th emitted token over sequences that accepted j earlier drafts.

    Given drafts 0..j-1 were accepted, token j is a fresh one-step rejection sample (or the
    bonus), so it must be distributed as p_j.
    """
    tvs = []
    for j in range(p.shape[0]):
        reached = out.num_accepted >= j
        tvs.append((_tv(out.output_token_ids[reached, j], p[j]), int(reached.sum())))
    return tvs


@pytest.mark.slow
@pytest.mark.parametrize("form", ["dense", "sparse", "one_hot"])
def test_emitted_tokens_follow_the_target_distribution(form):
    out, p, q, _ = _run_batch(form, seed=11)
    tvs = _position_tvs(out, p)
    print(form, [(round(tv, 5), n, round(_tv_bound(n), 5)) for tv, n in tvs])
    for tv, n in tvs:  # position 0 sees all 100k; later ones the sequences that got there
        assert n >= 2_000 and tv < _tv_bound(n)
    # first-draft acceptance: sum_x min(p, q); with one-hot q, x ~ q is accepted w.p. p(x)
    if form == "one_hot":
        expected = float((p[0] * q[0]).sum())
    else:
        expected = float(torch.minimum(p[0], q[0]).sum())
    assert (out.num_accepted >= 1).double().mean().item() == pytest.approx(expected, abs=0.01)


@pytest.mark.slow
def test_tv_metric_detects_wrong_samplers(monkeypatch):
    """Negative controls: the statistical test above can fail."""
    _, p, _, drafts = _run_batch("dense", seed=11)
    bound = _tv_bound(N_SEQ)
    # a sampler that accepts every draft emits q, not p
    always_accept = _tv(drafts[:, 0], p[0])
    # a sampler that draws the recovered token from p instead of the residual max(0, p - q)
    monkeypatch.setattr(rejection, "_residual", lambda p_rows, *_: p_rows)
    wrong_recovered = _tv(_run_batch("dense", seed=11)[0].output_token_ids[:, 0], p[0])
    print("always accept", always_accept, "recovered from p", wrong_recovered, "bound", bound)
    assert always_accept > 10 * bound and wrong_recovered > 5 * bound


# ---- validation --------------------------------------------------------------------------


def _valid_args():
    target = torch.full((5, V), 1 / V)  # seq 0: 2 drafts, seq 1: 1 draft
    return {
        "draft_token_ids": torch.tensor([1, 2, 3]),
        "cu_num_draft_tokens": _cu([2, 1]),
        "target_probs": target,
        "draft_probs": torch.full((3, V), 1 / V),
        "is_greedy": torch.tensor([False, True]),
    }


def _sparse(ids, probs):
    return SparseDraftProbs(torch.tensor(ids), torch.tensor(probs))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"draft_token_ids": torch.tensor([1, 2, V])}, r"draft token ids must be in \[0, 8\)"),
        ({"draft_token_ids": torch.tensor([-1, 2, 3])}, r"draft token ids must be in \[0, 8\)"),
        ({"draft_token_ids": torch.tensor([[1, 2, 3]])}, "draft_token_ids must be 1-D"),
        ({"cu_num_draft_tokens": torch.tensor([1, 2, 3])}, "must start at 0"),
        ({"cu_num_draft_tokens": torch.tensor([0, 3, 2, 3])}, "must be non-decreasing"),
        ({"cu_num_draft_tokens": torch.tensor([0, 2, 4])}, "ends at 4, but there are 3"),
        ({"target_probs": torch.full((4, V), 1 / V)}, r"target_probs must be \[.* = 5, vocab\]"),
        ({"target_probs": torch.full((5, V), 0.2)}, "target_probs row 0 sums to 1.6"),
        ({"target_probs": torch.full((5, V), float("nan"))}, "finite and non-negative"),
        (
            {"draft_probs": torch.full((3, V + 1), 1 / (V + 1))},
            r"dense draft probs must be \[3, 8\]",
        ),
        ({"draft_probs": torch.full((3, V), 0.5)}, "dense draft probs row 0 sums to 4"),
        ({"draft_probs": _sparse([[1, 2]] * 3, [[1.5, -0.5]] * 3)}, "finite and non-negative"),
        ({"draft_probs": _sparse([[1, 2]] * 3, [[0.5, 0.4]] * 3)}, "sparse draft probs row 0"),
        ({"draft_probs": _sparse([[1, V]] * 3, [[0.5, 0.5]] * 3)}, r"sparse draft token ids"),
        ({"draft_probs": _sparse([[1, 2]] * 2, [[0.5, 0.5]] * 2)}, "2 rows, expected 3"),
        ({"draft_probs": _sparse([[5, 6], [2, 4], [3, 1]], [[0.5, 0.5]] * 3)}, "has q\\(x\\) = 0"),
        ({"draft_probs": [0.5]}, "draft_probs must be None, SparseDraftProbs or a tensor"),
        ({"is_greedy": torch.tensor([0, 1])}, r"is_greedy must be a bool tensor \[2\]"),
        ({"is_greedy": torch.tensor([True])}, r"is_greedy must be a bool tensor \[2\]"),
        ({"sample_bonus": torch.tensor([True])}, r"sample_bonus must be a bool tensor \[2\]"),
        ({"generators": [None]}, "generators has 1 entries, batch has 2"),
    ],
)
def test_rejection_sample_rejects_bad_inputs(change, message):
    with pytest.raises(ValueError, match=message):
        rejection_sample(**{**_valid_args(), **change})


def test_sparse_draft_probs_shape_check():
    with pytest.raises(ValueError, match="both \\[num_draft_tokens, N\\]"):
        SparseDraftProbs(torch.zeros(3, 2, dtype=torch.int64), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="integer token_ids and float probs"):
        SparseDraftProbs(torch.zeros(3, 2), torch.zeros(3, 2))


def test_greedy_sequences_ignore_draft_probs_and_empty_batch_works():
    args = _valid_args()
    # seq 1 is greedy: q(x) = 0 at its draft is not an error there (greedy sends ids only)
    args["draft_probs"] = _sparse([[1, 0], [2, 0], [5, 6]], [[1.0, 0.0]] * 3)
    assert rejection_sample(**args).num_emitted.shape == (2,)
    out = rejection_sample(torch.empty(0, dtype=torch.int64), torch.tensor([0]),
                           torch.empty(0, V), None, torch.empty(0, dtype=torch.bool))
    assert out.output_token_ids.shape == (0, 1) and out.num_emitted.shape == (0,)
