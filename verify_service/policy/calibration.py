"""Start-up calibration: the verify-cost curve of this machine, timed before serving.

The cost model (tandem/spec/cost.py: CostModel for one session's k, StepCost for the batch
plan) starts from these times and the rounds keep it current afterwards.
"""
from __future__ import annotations

import asyncio
import logging
import time

from tandem.device import synchronize
from tandem.engine.model_runner import ModelRunner, SeqChunk

# Tokens per forward the verifier times at start-up (k + 1 of a round); past 8 the curve is
# near linear here, so two points cover up to 16 drafts.
CALIBRATION_COUNTS = (1, 2, 3, 4, 5, 6, 8, 12, 17)
# And the tokens of whole batch steps (one token per session plus their drafts), for the
# batch plan: how a step's time grows with its rows once it is compute-bound.
STEP_CALIBRATION_COUNTS = (16, 32, 64)


def calibration_counts(max_spec_tokens: int) -> tuple[int, ...]:
    """The counts a verifier with this k cap ever runs for one session."""
    return tuple(q for q in CALIBRATION_COUNTS if q <= max_spec_tokens + 1) or (1,)


def calibrate(runner: ModelRunner, token_counts=CALIBRATION_COUNTS, reps: int = 3,
              context: int = 64) -> dict[int, float]:
    """Median ms of a forward over q new tokens after `context` cached ones, per q: the
    verify-cost curve of this machine now. Runs before serving, in the cache's first
    blocks (nothing is allocated yet; later sessions overwrite them); {} if it is smaller
    than that."""
    q_max = max(token_counts)
    bs = runner.block_size
    table = list(range(-(-(context + q_max) // bs)))
    if len(table) > runner.num_blocks:
        return {}  # a cache this small: keep the built-in table
    ids = [(37 * i) % 1000 + 100 for i in range(context + q_max)]
    runner.forward([SeqChunk(ids[:context], 0, table)])
    times: dict[int, list[float]] = {q: [] for q in token_counts}
    for _ in range(reps + 1):  # the first pass warms up; interleaved, so noise is shared
        for q in token_counts:
            t0 = time.perf_counter()
            runner.forward([SeqChunk(ids[context:context + q], context, table, q)])
            synchronize(runner.device)  # a GPU forward returns before it is done
            times[q].append((time.perf_counter() - t0) * 1e3)
    return {q: sorted(ts[1:])[len(ts[1:]) // 2] for q, ts in times.items()}


async def timed_curve(runner: ModelRunner, max_spec_tokens: int, reps: int
                      ) -> tuple[dict[int, float], tuple[int, ...]]:
    """(ms of a forward by its tokens, {} when reps is 0; the token counts one session's
    rounds run): the cost curves' start, timed off the event loop."""
    calibrated, solo = {}, calibration_counts(max_spec_tokens)
    if reps:
        counts = tuple(sorted({*solo, *STEP_CALIBRATION_COUNTS}))
        calibrated = await asyncio.get_running_loop().run_in_executor(
            None, lambda: calibrate(runner, counts, reps=reps))
        logging.getLogger(__name__).info("verify cost by tokens per forward (ms): %s",
                                         {q: round(ms, 1) for q, ms in calibrated.items()})
    return calibrated, solo

