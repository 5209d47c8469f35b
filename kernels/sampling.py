"""Sampling core: logits -> probabilities (temperature / min-p / top-k / top-p) -> token ids.

The rejection sampler needs the *distributions* p and q, not just sampled tokens, so the
filters here produce a probability tensor and sampling is a separate step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from kernels.logits_processors import apply_min_p


def _check_2d(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.ndim != 2:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a 2-D tensor [num_rows, vocab_size], got {shape}")


def _check_per_row(name: str, t: torch.Tensor, num_rows: int) -> None:
    if not isinstance(t, torch.Tensor) or t.ndim != 1 or t.shape[0] != num_rows:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a 1-D tensor of length {num_rows}, got {shape}")


def _check_sampling_inputs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
) -> None:
    _check_2d("logits", logits)
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a floating tensor, got {logits.dtype}")
    num_rows = logits.shape[0]
    for name, t in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        _check_per_row(name, t, num_rows)
    if torch.isnan(logits).any() or torch.isposinf(logits).any():
        raise ValueError("logits contain NaN or +inf")
    if (logits == float("-inf")).all(dim=-1).any():
        raise ValueError("a logits row is entirely -inf: no token can be sampled")
    bad_t = ~torch.isfinite(temperature) | (temperature < 0)
    if bad_t.any():
        raise ValueError(f"temperature must be finite and >= 0, got {temperature[bad_t].tolist()}")
    if top_k.is_floating_point():
        raise ValueError(f"top_k must be an integer tensor, got {top_k.dtype}")
    if (top_k < 0).any():
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k[top_k < 0].tolist()}")
    bad_p = ~((top_p > 0) & (top_p <= 1))  # NaN fails both comparisons
    if bad_p.any():
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p[bad_p].tolist()}")


_TOPK_MAX = 1024  # the largest k the fast path takes (topk's cost grows with k)


def _top_k_without_sort(logits, top_k, k_on):
    """Top-k alone (no top-p) from topk's k-th value instead of a full-vocabulary sort (a
    1000-row verify step: 1.6 s of sort on a CPU). The same kept set as the sort's by rank
    wherever exactly k values reach the threshold; None where a tie straddles it (or k is
    large), so the sort decides as before."""
    k = torch.where(k_on, top_k.clamp(max=logits.shape[-1]), 1)  # k past the vocabulary: all
    k_max = int(k.max())
    if k_max > _TOPK_MAX:
        return None
    kth = logits.topk(k_max, dim=-1).values.gather(1, (k - 1)[:, None])
    keep = (logits >= kth) | ~k_on[:, None]
    if not bool((keep.sum(dim=-1) == k)[k_on].all()):
        return None
    return logits.masked_fill(~keep, float("-inf"))


def _apply_top_k_top_p(
    logits: torch.Tensor,  # [N, V] float32, already divided by temperature
    top_k: torch.Tensor,  # [N] int64, 0 = off
    top_p: torch.Tensor,  # [N] float32, 1 = off
) -> torch.Tensor:
    vocab = logits.shape[-1]
    k_on = (top_k > 0) & (top_k < vocab)
    p_on = top_p < 1
    if not (k_on.any() or p_on.any()):
        return logits
    if not p_on.any():
        kept = _top_k_without_sort(logits, top_k, k_on)
        if kept is not None:
            return kept
    # One descending sort serves both filters; masks are built in sorted order, then scattered.
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)
    keep_k = torch.where(k_on, top_k, vocab)
    drop = rank[None, :] >= keep_k[:, None]  # by rank, so exactly k survive even with ties
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Top-p on the top-k renormalised distribution (as vLLM / HF): keep a token while the
    # mass before it is < top_p. Rows with top_p == 1 are untouched so float error in the
    # cumulative sum cannot clip their tail.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= (mass_before >= top_p[:, None]) & p_on[:, None]
    drop[:, 0] = False  # the top token always survives
    mask = torch.empty_like(drop).scatter_(1, order, drop)
    return logits.masked_fill(mask, float("-inf"))


def logits_to_probs(
    logits: torch.Tensor,  # [N, V] float
    temperature: torch.Tensor,  # [N] float32, 0 = greedy
    top_k: torch.Tensor,  # [N] int64, 0 = off
    top_p: torch.Tensor,  # [N] float32, 1 = off
    min_p: torch.Tensor | None = None,  # [N] float32, 0 = off; None: off everywhere
) -> torch.Tensor:  # [N, V] float32
    """Per-row sampling distribution (temperature, min-p, top-k, top-p, in vLLM's order);
    greedy rows are one-hot at the argmax."""
    _check_sampling_inputs(logits, temperature, top_k, top_p)
    logits = logits.float()
    temperature = temperature.to(device=logits.device, dtype=torch.float32)
    # Tiny temperatures are greedy (tandem.sampling_params.MIN_TEMPERATURE): dividing by a
    # subnormal overflows to inf and the softmax to NaN.
    greedy = temperature < 1e-5
    # Divide greedy rows by 1 instead of 0; their row is replaced by a one-hot below.
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    if min_p is not None:
        _check_per_row("min_p", min_p, logits.shape[0])
        scaled = apply_min_p(scaled, min_p)
    scaled = _apply_top_k_top_p(
        scaled, top_k.to(logits.device, torch.int64), top_p.to(logits.device, torch.float32)
    )
    probs = scaled.softmax(dim=-1)
    if greedy.any():
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def make_generator(
    seed: int | None, device: torch.device | str = "cpu"
) -> torch.Generator | None:
    """A private RNG for a seeded request; None means 'use the global RNG'."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an int in [0, 2**63) or None, got {seed!r}")
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def keyed_seed(seed: int, position: int) -> int:
    """A seed for the randomness used at one sequence position of a seeded request.

    Keying by position (not by a running stream) makes a seeded request reproducible however
    its work is split into rounds, steps and batches.
    """
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def exp_noise(rows: int, vocab: int, generator: torch.Generator | None = None,
              device: torch.device | str = "cpu") -> torch.Tensor:  # [rows, vocab] float32
    """Exp(1) race noise, clamped away from 0 (0/0 would be NaN, which argmax takes).

    On the CPU drawn as -log(1 - U) from float64 uniforms: 3-4x faster than
    `Tensor.exponential_` there (0.34 against 1.13 ms per 49k-token row, one thread), which
    made a sampled round's noise cost almost half its forward, and finer-grained than float32.
    A generator (a seeded position) always draws on the CPU, so its stream is the same on
    every device."""
    if generator is None and torch.device(device).type != "cpu":
        noise = torch.empty(rows, vocab, dtype=torch.float32, device=device).exponential_()
    else:
        u = torch.rand(rows, vocab, dtype=torch.float64, generator=generator)
        noise = u.neg_().log1p_().neg_().to(device=device, dtype=torch.float32)
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)


def position_noise(generator: torch.Generator, vocab: int) -> torch.Tensor:  # [vocab] float32
    """The Exp(1) race noise of one seeded position (its generator keyed by keyed_seed), as
    `sample` draws it for that row. A draft worker that draws the same noise for the same
    position proposes the token the verifier will sample whenever its q ranks like p there."""
    return exp_noise(1, vocab, generator)[0]


def sample(
    probs: torch.Tensor,  # [N, V] float, rows need not be normalised
    generators: Sequence[torch.Generator | None] | None = None,  # N entries
) -> torch.Tensor:  # [N] int64
    """Draw one token per row with the exponential race: argmax(p_i / E_i), E_i ~ Exp(1).

    E_i / p_i ~ Exp(rate p_i) and the smallest of independent exponentials is index i with
    probability p_i / sum(p), so this is exact and needs no cumsum/searchsorted per row.
    """
    _check_2d("probs", probs)
    rows, vocab = probs.shape
    if generators is not None and len(generators) != rows:
        raise ValueError(f"generators has {len(generators)} entries, probs has {rows} rows")
    gens = list(generators) if generators is not None else [None] * rows
    # A seeded row draws its own noise from its own generator, so its token does not depend
    # on what else is in the batch (and only the unseeded rows share one draw).
    free = [row for row, gen in enumerate(gens) if gen is None]
    noise = torch.empty(rows, vocab, dtype=torch.float32, device=probs.device)
    if free:
        drawn = exp_noise(len(free), vocab, device=probs.device)
        if len(free) == rows:
            noise = drawn
        else:
            noise[free] = drawn
    for row, gen in enumerate(gens):
        if gen is not None:
            noise[row] = position_noise(gen, vocab).to(noise.device)
    return (probs.float() / noise).argmax(dim=-1)


def top_n_sparse(
    probs: torch.Tensor,  # [N, V] float
    n: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([N, n] int64 ids, [N, n] float32 probs)
    """Top-n truncation of each row, renormalised to sum to 1.

    A draft worker samples from exactly this distribution and sends it as the draft q, which
    keeps verification lossless while the payload stays n (id, prob) pairs per token.
    """
    _check_2d("probs", probs)
    vocab = probs.shape[-1]
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= vocab:
        raise ValueError(f"n must be an int in [1, vocab_size={vocab}], got {n!r}")
    top_probs, top_ids = probs.float().topk(n, dim=-1)
    total = top_probs.sum(dim=-1, keepdim=True)
    if not (total > 0).all():  # NaN fails too
        raise ValueError("a probs row has no positive mass in its top-n entries")
    return top_ids, top_probs / total
