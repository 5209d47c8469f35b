"""`tandem search-skip`: find the layers a self-speculative draft skips, by Bayesian
optimisation (Optuna's TPE) of the measured speedup.

A trial is a skip set. Its score is a speedup estimated from two measurements: the
acceptance rates of the skip view along the target's own greedy paths on a prompt set (a round
at every position, k drafts from the true prefix), and c, the view's timed 1-token forward over
the target's (interleaved, same thread count). The first and last layers are always kept
(LayerSkip and Draft & Verify both find them indispensable).

Two cost models (`objective`):
- "serial" (Leviathan et al.): drafting and verifying take turns on the same compute,
  tokens / (1 + k c). With this alone, when nothing pays, the cheapest junk draft scores best.
- "pipelined" (the default; how Tandem runs drafts, the in-process layer-skip worker included):
  the draft runs on its own thread or device while the target verifies, so a round costs one
  target forward, plus what drafting k tokens takes beyond it (k c - 1), plus the restart
  after a rejection (probability 1 - P(all k accepted)), when the verifier waits c for the
  first draft from the corrected token.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.attention import default_block_size
from tandem.engine.generate import LocalGenerator
from tandem.engine.layer_skip import SkipSet, skip_view
from tandem.engine.llama import LlamaModel
from tandem.engine.model_runner import ModelRunner
from tandem.sampling_params import SamplingParams
from tools.distill.acceptance import (
    SlotRunner,
    forward_cost_ms,
    mean_accepted,
    per_position_rates,
    speedup,
)


def pipelined_speedup(rates: list[float], k: int, c: float) -> float:
    """Tokens per round over a round's cost in target forwards, drafting concurrently."""
    all_accepted = 1.0
    for r in rates[:k]:
        all_accepted *= r
    cost = 1 + max(0.0, k * c - 1) + (1 - all_accepted) * c
    return (1 + mean_accepted(rates, k)) / cost


OBJECTIVES = {"serial": speedup, "pipelined": pipelined_speedup}


@dataclass(frozen=True)
class SearchConfig:
    trials: int = 60
    objective: str = "pipelined"  # or "serial" (see the module docstring)
    k: int = 8  # longest proposal scored; the best k <= this is reported
    max_new_tokens: int = 48  # length of each target path
    num_prompts: int = 8
    seed: int = 0
    timing_threads: int = 1
    timing_reps: int = 12

    def __post_init__(self):
        for name in ("trials", "k", "max_new_tokens", "num_prompts", "timing_threads",
                     "timing_reps"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.k > 16:
            raise ValueError(f"k must be <= 16, got {self.k}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got "
                             f"{self.objective!r}")


@dataclass(frozen=True)
class TrialResult:
    skip: SkipSet
    counts: tuple[int, ...]  # accepted drafts per round (0..k)
    c: float  # the view's forward cost over the target's
    k: int  # the proposal length with the best speedup
    speedup: float
    alpha: float


def target_paths(model: LlamaModel, prompts: list[list[int]], n: int,
                 stop: tuple[int, ...]) -> list[list[int]]:
    """Prompt + the target's greedy continuation, per prompt (on the model's device)."""
    longest, bs = max(map(len, prompts)) + n + 1, default_block_size(model.device)
    runner = ModelRunner(model, len(prompts) * -(-longest // bs) + 1, bs)
    outs = LocalGenerator(runner).generate(prompts, SamplingParams(temperature=0.0), n, stop)
    return [list(p) + o for p, o in zip(prompts, outs)]


def greedy_counts(draft: LlamaModel, paths: list[list[int]], starts: list[int],
                  k: int) -> list[int]:
    """Accepted drafts of a round at every generated position: under greedy a draft is
    accepted exactly when it equals the target's path token, so no target forward is needed."""
    runner = SlotRunner(draft, len(paths), max(map(len, paths)) + k + 1)
    for i, (p, s) in enumerate(zip(paths, starts)):
        if s > 1:
            runner.forward([(i, p[:s - 1], 0, 0)])
    counts: list[int] = []
    for t in range(max(len(p) - s for p, s in zip(paths, starts))):
        live = [i for i, (p, s) in enumerate(zip(paths, starts)) if s + t < len(p)]
        matched = dict.fromkeys(live, 0)
        # Only the leading run of matches counts, so a sequence stops drafting at its first
        # miss; while it matches, the token it fed itself is the path's own.
        for j in range(k):
            going = [i for i in live if matched[i] == j and starts[i] + t + j < len(paths[i])]
            if not going:
                break
            rows = [(i, [paths[i][starts[i] + t + j - 1]], starts[i] + t + j - 1, 1)
                    for i in going]
            for i, tok in zip(going, runner.forward(rows).argmax(-1).tolist()):
                matched[i] += tok == paths[i][starts[i] + t + j]
        counts.extend(matched[i] for i in live)
    return counts


class CostTable:
    """c by number of kept layers (the cost depends on the count only), measured once each."""

    def __init__(self, model: LlamaModel, cfg: SearchConfig):
        self.model, self.cfg = model, cfg
        self._c: dict[int, float] = {}

    def __call__(self, skip: SkipSet) -> float:
        kept = len(skip.kept)
        if kept not in self._c:
            view = skip_view(self.model, skip)
            threads = torch.get_num_threads()
            torch.set_num_threads(self.cfg.timing_threads)
            try:  # interleaved, so a noisy neighbour slows both alike
                ratios = [forward_cost_ms(view, self.cfg.timing_reps)
                          / forward_cost_ms(self.model, self.cfg.timing_reps) for _ in range(3)]
            finally:
                torch.set_num_threads(threads)
            self._c[kept] = statistics.median(ratios)
        return self._c[kept]


def score(counts: list[int], k_allowed: int, c: float,
          objective: str = "serial") -> tuple[int, float, float]:
    """(best k, its speedup, alpha) from a trial's accepted counts."""
    rates, estimate = per_position_rates(counts, k_allowed), OBJECTIVES[objective]
    best = max(range(1, k_allowed + 1), key=lambda j: estimate(rates, j, c))
    return best, estimate(rates, best, c), rates[0]


def evaluate(model: LlamaModel, skip: SkipSet, paths, starts, cfg: SearchConfig,
             cost: CostTable) -> TrialResult:
    counts = greedy_counts(skip_view(model, skip), paths, starts, cfg.k)
    c = cost(skip)
    k, sp, alpha = score(counts, cfg.k, c, cfg.objective)
    return TrialResult(skip, tuple(counts), c, k, sp, alpha)


def seed_sets(num_layers: int) -> list[tuple[int, ...]]:
    """Starting points: alternate middle layers, the upper half (LayerSkip's early exit), and
    a single upper layer (the cheapest change to the model)."""
    middle = range(1, num_layers - 1)
    return [tuple(i for i in middle if i % 2 == 1),
            tuple(i for i in middle if i % 3 == 1),
            tuple(i for i in middle if i >= num_layers // 2),
            (max(1, num_layers - 4),)]


def search(model: LlamaModel, prompts: list[list[int]], stop: tuple[int, ...],
           cfg: SearchConfig, on_trial: Callable[[int, TrialResult], None] | None = None,
           progress: bool = True) -> list[TrialResult]:
    """Every trial's result, in order; the best is max(..., key=speedup)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    layers = model.cfg.num_layers
    paths = target_paths(model, prompts[:cfg.num_prompts], cfg.max_new_tokens, stop)
    starts = [len(p) for p in prompts[:cfg.num_prompts]]
    cost = CostTable(model, cfg)
    results: list[TrialResult] = []
    seen: dict[tuple[int, ...], TrialResult] = {}
    study = optuna.create_study(direction="maximize",
                                sampler=optuna.samplers.TPESampler(seed=cfg.seed))
    middle, most = range(1, layers - 1), max(1, (layers - 2) // 2)
    # How many layers, then which: a per-layer score ranks them. (Independent per-layer
    # booleans make TPE sample about half the layers skipped, never the few that can pay.)
    for s in (s for s in seed_sets(layers) if 1 <= len(s) <= most):
        study.enqueue_trial({"num_skipped": len(s)}
                            | {f"rank_{i}": float(i in s) for i in middle})

    def objective(trial) -> float:
        n = trial.suggest_int("num_skipped", 1, most)
        ranks = {i: trial.suggest_float(f"rank_{i}", 0.0, 1.0) for i in middle}
        skip = tuple(sorted(sorted(middle, key=lambda i: -ranks[i])[:n]))
        if skip not in seen:  # TPE proposes a converged set again and again
            seen[skip] = evaluate(model, SkipSet(layers, skip), paths, starts, cfg, cost)
        result = seen[skip]
        trial.set_user_attr("k", result.k)
        results.append(result)
        if on_trial is not None:
            on_trial(trial.number, result)
        return result.speedup

    study.optimize(objective, n_trials=cfg.trials, show_progress_bar=progress)
    return results


def summary(best: TrialResult, cfg: SearchConfig) -> dict:
    rates = per_position_rates(list(best.counts), cfg.k)
    return {"objective": cfg.objective, "k": best.k,
            "estimated_speedup": round(best.speedup, 4),
            "alpha": round(best.alpha, 4), "c": round(best.c, 4),
            "mean_accepted": round(mean_accepted(rates, best.k), 3),
            "rounds": len(best.counts)}
