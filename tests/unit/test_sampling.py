"""kernels/sampling.py and tandem/sampling_params.py."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.sampling import logits_to_probs, make_generator, sample, top_n_sparse
from tandem.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


def _params(n, temperature=1.0, top_k=0, top_p=1.0):
    return (
        torch.full((n,), temperature, dtype=torch.float32),
        torch.full((n,), top_k, dtype=torch.int64),
        torch.full((n,), top_p, dtype=torch.float32),
    )


def _tv(samples: torch.Tensor, probs: torch.Tensor) -> float:
    freq = torch.bincount(samples, minlength=probs.numel()).double() / samples.numel()
    return 0.5 * float((freq - probs.double()).abs().sum())


# ---- logits_to_probs -------------------------------------------------------------------


def test_temperature_matches_softmax_of_scaled_logits():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    temperature = torch.tensor([1.0, 0.5, 2.0, 0.7])
    probs = logits_to_probs(logits, temperature, *_params(4)[1:])
    expected = torch.softmax(logits / temperature[:, None], dim=-1)
    torch.testing.assert_close(probs, expected)
    assert probs.dtype == torch.float32


def test_greedy_rows_are_one_hot_argmax_and_other_rows_untouched():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    temperature = torch.tensor([0.0, 1.0, 0.0])
    _, top_k, top_p = _params(3, top_k=5, top_p=0.5)  # filters must not matter for greedy
    probs = logits_to_probs(logits, temperature, top_k, top_p)
    for row in (0, 2):
        expected = torch.zeros(20)
        expected[logits[row].argmax()] = 1.0
        assert torch.equal(probs[row], expected)
    assert (probs[1] > 0).sum() <= 5 and probs[1].sum().item() == pytest.approx(1.0)


@pytest.mark.parametrize("temperature", [1e-45, 1e-30, 1e-6, 3e38])
def test_degenerate_temperatures_give_a_valid_distribution(temperature):
    """A subnormal temperature used to overflow logits / T to inf and NaN the row; tiny ones
    are greedy now, huge ones flatten the row to uniform."""
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(2)) * 20
    probs = logits_to_probs(logits, torch.tensor([temperature, 0.0]), *_params(2)[1:])
    assert torch.isfinite(probs).all() and probs.sum(-1).tolist() == pytest.approx([1, 1])
    if temperature < 1e-5:
        assert probs[0].argmax() == logits[0].argmax() and probs[0].max() == 1.0
    else:
        torch.testing.assert_close(probs[0], torch.full((30,), 1 / 30), atol=1e-4, rtol=0)


def test_top_k_keeps_exactly_k_largest_even_with_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0, 2.0], [5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    probs = logits_to_probs(logits, *_params(2, top_k=2))
    assert ((probs > 0).sum(dim=-1) == 2).all()
    assert set(probs[1].nonzero().flatten().tolist()) == {0, 1}
    torch.testing.assert_close(probs[1, :2], torch.softmax(logits[1, :2], dim=-1))
    # top_k >= vocab is the same as off
    torch.testing.assert_close(logits_to_probs(logits, *_params(2, top_k=99)),
                               torch.softmax(logits, dim=-1))


@pytest.mark.parametrize(("top_p", "kept"), [(0.4, 1), (0.75, 2), (0.85, 3), (1.0, 4)])
def test_top_p_keeps_smallest_prefix_reaching_top_p(top_p, kept):
    base = torch.tensor([0.15, 0.5, 0.05, 0.3])  # sorted: 0.5, 0.3, 0.15, 0.05
    probs = logits_to_probs(base.log()[None], *_params(1, top_p=top_p))[0]
    order = base.argsort(descending=True)
    assert int((probs > 0).sum()) == kept
    assert (probs[order[:kept]] > 0).all()
    torch.testing.assert_close(probs[order[:kept]], base[order[:kept]] / base[order[:kept]].sum())


def test_top_p_prefix_is_minimal_on_random_rows():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(64, 100, generator=gen) * 2
    top_p = torch.rand(64, generator=gen) * 0.9 + 0.05
    probs = logits_to_probs(logits, torch.ones(64), torch.zeros(64, dtype=torch.int64), top_p)
    full = torch.softmax(logits, dim=-1)
    for row in range(64):
        kept = full[row][probs[row] > 0]
        # the kept set reaches top_p, and without its smallest member it would not
        assert kept.sum() >= top_p[row] - 1e-6
        assert kept.sum() - kept.min() < top_p[row]
        assert kept.min() >= full[row][probs[row] == 0].max()


def test_top_k_then_top_p_on_renormalised_distribution():
    base = torch.tensor([0.4, 0.3, 0.2, 0.1])
    # top-k 3 renormalises to 4/9, 3/9, 2/9; top_p 0.7 then keeps 4/9 + 3/9 (mass before 3rd = 7/9)
    probs = logits_to_probs(base.log()[None], *_params(1, top_k=3, top_p=0.7))[0]
    torch.testing.assert_close(probs, torch.tensor([4 / 7, 3 / 7, 0.0, 0.0]))


def test_per_row_params_match_row_by_row_calls():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 30, generator=gen)
    temperature = torch.tensor([0.0, 0.8, 1.3, 1.0, 0.5])
    top_k = torch.tensor([0, 4, 0, 10, 1])
    top_p = torch.tensor([1.0, 1.0, 0.6, 0.9, 1.0])
    batched = logits_to_probs(logits, temperature, top_k, top_p)
    for i in range(5):
        single = logits_to_probs(logits[i:i + 1], temperature[i:i + 1], top_k[i:i + 1],
                                 top_p[i:i + 1])
        torch.testing.assert_close(batched[i:i + 1], single)


def test_logits_to_probs_rejects_bad_inputs():
    logits, (t, k, p) = torch.randn(2, 5), _params(2)
    with pytest.raises(ValueError, match="2-D"):
        logits_to_probs(torch.randn(5), t, k, p)
    with pytest.raises(ValueError, match="temperature must be a 1-D tensor of length 2"):
        logits_to_probs(logits, torch.ones(3), k, p)
    with pytest.raises(ValueError, match="NaN"):
        logits_to_probs(torch.tensor([[0.0, float("nan")], [0.0, 0.0]]), t, k, p)
    with pytest.raises(ValueError, match="entirely -inf"):
        logits_to_probs(torch.tensor([[float("-inf")] * 2, [0.0, 0.0]]), t, k, p)
    with pytest.raises(ValueError, match=r"temperature must be finite and >= 0, got \[-0.5\]"):
        logits_to_probs(logits, torch.tensor([1.0, -0.5]), k, p)
    with pytest.raises(ValueError, match=r"top_k must be >= 0 \(0 = off\), got \[-1\]"):
        logits_to_probs(logits, t, torch.tensor([0, -1]), p)
    with pytest.raises(ValueError, match="top_k must be an integer tensor"):
        logits_to_probs(logits, t, torch.tensor([0.0, 1.0]), p)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\] \(1 = off\), got \[0.0\]"):
        logits_to_probs(logits, t, k, torch.tensor([1.0, 0.0]))


# ---- sample ----------------------------------------------------------------------------


def test_sample_frequencies_match_probs():
    torch.manual_seed(4)
    probs = torch.softmax(torch.randn(8) * 1.5, dim=-1)
    n = 50_000
    tokens = sample(probs.expand(n, 8))
    # E[TV] <= sqrt((V-1)/(2*pi*n)) for an exact sampler; 4x that is ~12 standard deviations.
    bound = 4 * math.sqrt(7 / (2 * math.pi * n))
    assert _tv(tokens, probs) < bound


def test_sample_never_picks_zero_probability_tokens():
    torch.manual_seed(5)
    probs = torch.zeros(20_000, 100)
    probs[:, 7], probs[:, 42] = 1e-30, 1.0  # tiny but positive still beats exact zeros
    tokens = sample(probs)
    assert set(tokens.unique().tolist()) <= {7, 42}
    assert sample(torch.tensor([[0.0, 0.0, 3.0]])).item() == 2  # unnormalised rows are fine


def test_greedy_one_hot_rows_sample_their_argmax():
    probs = logits_to_probs(torch.randn(6, 40), *_params(6, temperature=0.0))
    assert torch.equal(sample(probs), probs.argmax(dim=-1))


def test_seeded_rows_are_deterministic_and_independent_of_neighbours():
    probs = torch.softmax(torch.randn(3, 1000), dim=-1)
    first = sample(probs, [None, make_generator(7), None])
    torch.manual_seed(123)  # the global RNG must not matter to the seeded row
    neighbours = torch.softmax(torch.randn(4, 1000), dim=-1)
    batch = torch.cat([neighbours[:2], probs[1:2], neighbours[2:]])
    second = sample(batch, [make_generator(1), None, make_generator(7), None, None])
    assert second[2] == first[1]
    draws = [sample(probs[1:2].expand(1, -1), [make_generator(7)]).item() for _ in range(3)]
    assert draws == [first[1].item()] * 3
    gen = make_generator(7)
    assert len({sample(probs[1:2], [gen]).item() for _ in range(20)}) > 1  # it advances


def test_sample_rejects_bad_inputs():
    with pytest.raises(ValueError, match="2-D"):
        sample(torch.ones(4))
    with pytest.raises(ValueError, match="generators has 1 entries, probs has 2 rows"):
        sample(torch.ones(2, 4), [None])


def test_make_generator():
    assert make_generator(None) is None
    a, b = make_generator(99), make_generator(99)
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))
    with pytest.raises(ValueError, match="seed"):
        make_generator(-1)


# ---- top_n_sparse ----------------------------------------------------------------------


def test_top_n_sparse_is_renormalised_top_n():
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.0, 0.0, 1.0, 0.0]])
    ids, sparse = top_n_sparse(probs, 2)
    assert ids.dtype == torch.int64 and sparse.dtype == torch.float32
    assert ids[0].tolist() == [1, 3]
    torch.testing.assert_close(sparse[0], torch.tensor([4 / 7, 3 / 7]))
    torch.testing.assert_close(sparse.sum(dim=-1), torch.ones(2))
    assert ids[1, 0] == 2 and sparse[1, 0] == 1.0
    with pytest.raises(ValueError, match=r"n must be an int in \[1, vocab_size=4\]"):
        top_n_sparse(probs, 5)
    with pytest.raises(ValueError, match="no positive mass"):
        top_n_sparse(torch.zeros(1, 4), 2)


# ---- SamplingParams --------------------------------------------------------------------


def test_sampling_params_defaults_and_greedy():
    params = SamplingParams()
    assert (params.temperature, params.top_k, params.top_p, params.seed) == (1.0, 0, 1.0, None)
    assert not params.is_greedy
    assert SamplingParams(temperature=0).is_greedy
    tiny = SamplingParams(temperature=5e-324)  # subnormal: greedy, stored as 0
    assert tiny.is_greedy and tiny.temperature == 0.0
    assert not SamplingParams(temperature=1e-5).is_greedy
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1
    with pytest.raises(AttributeError):
        params.temperature = 0.5  # frozen


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature .* got -0.1"),
        ({"temperature": float("inf")}, "temperature .* got inf"),
        ({"temperature": 1e300}, r"temperature .* \[0, 10000\], got 1e\+300"),
        ({"temperature": float("nan")}, "temperature .* got nan"),
        ({"temperature": "hot"}, "temperature .* got 'hot'"),
        ({"top_k": -1}, "top_k .* got -1"),
        ({"top_k": 2.5}, "top_k .* got 2.5"),
        ({"top_k": True}, "top_k .* got True"),
        ({"top_p": 0.0}, r"top_p .* got 0.0"),
        ({"top_p": 1.5}, r"top_p .* got 1.5"),
        ({"top_p": float("nan")}, r"top_p .* got nan"),
        ({"seed": -1}, r"seed .* got -1"),
        ({"seed": 2**63}, r"seed .* got 9223372036854775808"),
        ({"seed": "7"}, r"seed .* got '7'"),
    ],
)
def test_sampling_params_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_position_noise_is_the_noise_sample_draws_for_a_seeded_row():
    """A draft worker racing its q against position_noise(seed, pos) sees exactly the noise
    the verifier's seeded sample() uses for that position."""
    from kernels.sampling import keyed_seed, position_noise

    probs = torch.softmax(torch.randn(3, 500, generator=torch.Generator().manual_seed(3)), -1)
    gens = [make_generator(keyed_seed(9, 40 + j)) for j in range(3)]
    got = sample(probs, gens)
    for j in range(3):
        noise = position_noise(make_generator(keyed_seed(9, 40 + j)), 500)
        assert int((probs[j] / noise).argmax()) == int(got[j])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("ties", [False, True])
def test_top_k_without_a_sort_keeps_exactly_what_the_sort_keeps(seed, ties, monkeypatch):
    """The top-k fast path (topk's k-th value, no full sort) against the sort it skips, bit
    for bit: without ties it is taken; with ties at the k-th value it falls back to the sort.
    Some rows have k off, one k past the vocabulary."""
    import kernels.sampling as ks

    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randint(-6, 6, (64, 50), generator=gen).float() / 2 if ties
              else torch.randn(64, 50, generator=gen))
    top_k = torch.randint(0, 12, (64,), generator=gen)
    top_k[5] = 80
    top_p = torch.ones(64)
    taken = ks._top_k_without_sort(logits, top_k, top_k > 0) is not None
    fast = ks._apply_top_k_top_p(logits.clone(), top_k, top_p)
    monkeypatch.setattr(ks, "_TOPK_MAX", 0)  # every row through the sort
    slow = ks._apply_top_k_top_p(logits.clone(), top_k, top_p)
    assert torch.equal(fast, slow) and taken is not ties
