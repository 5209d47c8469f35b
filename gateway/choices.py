"""n > 1 and best_of: each choice is a session of its own on the same verifier, merged into
one stream of events tagged with the choice's index.

Choice 0 is admitted first and the others once its first round is in: the verifier's prefix
cache registers a prompt's blocks only when its prefill commits (tandem/engine/prefix_cache.py),
so choices admitted together would each prefill the whole prompt; admitted after, they find
its full blocks cached and prefill only the last partial block. The same affinity key sends
them to choice 0's verifier. With a seed, choice i samples with a seed derived from
(seed, i) (gateway/sampling_options.choice_seed), so every choice is reproducible.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any

from redis.exceptions import RedisError

from gateway.errors import APIError
from gateway.generation import Finished, GenerationDeps, TextDelta, run_session
from gateway.plan import GenerationPlan
from gateway.sampling_options import choice_seed
from gateway.schemas import speculation_stats
from gateway.text import TextStream

log = logging.getLogger(__name__)
_DONE = object()


@dataclass(frozen=True)
class ChoiceEnd:
    """One choice finished (the last one's end comes inside the request's Finished)."""

    index: int
    finish_reason: str
    completion_tokens: int
    speculation: dict
    logprob: float = 0.0  # the sum of its tokens' logprobs (best_of ranks by it)


def choice_plan(plan: GenerationPlan, index: int) -> GenerationPlan:
    """Choice `index`'s session: its own id and seed, the same prompt and affinity."""
    if index == 0:
        return plan
    return replace(plan, session_id=f"{plan.session_id}-{index}",
                   sampling=replace(plan.sampling, seed=choice_seed(plan.sampling.seed, index)))


async def record_choices(store: Any, plan: GenerationPlan, model: str) -> None:
    """A session record per choice (Redis trouble is logged: bookkeeping only)."""
    for index in range(plan.best_of):
        session_id = choice_plan(plan, index).session_id
        try:
            await store.create(session_id, model=model, prompt_token_ids=plan.prompt_token_ids)
        except (RedisError, OSError) as exc:
            log.warning("session %s not recorded: %s", session_id, exc)


def combined_stats(plan: GenerationPlan, ends: list[ChoiceEnd]) -> dict:
    """The speculation object of the whole request: every choice's rounds and drafts."""
    specs = [e.speculation for e in ends]
    committed = sum(s["mean_accepted_length"] * s["rounds"] for s in specs)
    return speculation_stats(plan.method, sum(s["rounds"] for s in specs),
                             sum(s["drafted_tokens"] for s in specs),
                             sum(s["accepted_tokens"] for s in specs), round(committed),
                             any(s["lossy"] for s in specs))


async def run_choices(plan: GenerationPlan, deps: GenerationDeps, text: TextStream,
                      wrap: Callable[[AsyncIterator], AsyncIterator] = lambda e: e
                      ) -> AsyncIterator:
    """The events of plan.best_of sessions, tagged with their index: ChoiceEnd as each
    ends, and one Finished (totals, every ChoiceEnd) after the last. `wrap` turns one
    session's events into what the client sees (tool calls)."""
    k = plan.best_of
    queue: asyncio.Queue = asyncio.Queue()
    first_in = asyncio.Event()

    async def pump(i: int) -> None:
        try:
            if i:
                await first_in.wait()
            events = wrap(run_session(choice_plan(plan, i), deps, text if i == 0 else
                                      text.fresh(), first_in if i == 0 else None))
            async with aclosing(events):
                async for ev in events:
                    await queue.put((i, ev))
            await queue.put((i, _DONE))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put((i, exc))
        finally:
            first_in.set()  # choice 0 failed or ended without a round: let the rest try

    tasks = [asyncio.create_task(pump(i)) for i in range(k)]
    try:
        async for ev in _merged(plan, queue, k):
            yield ev
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _merged(plan: GenerationPlan, queue: asyncio.Queue, k: int) -> AsyncIterator:
    ends: dict[int, ChoiceEnd] = {}
    logprob = [0.0] * k
    predicted: list[tuple[int, int]] = []  # each choice's prediction tokens kept, rejected
    while len(ends) < k:
        i, ev = await queue.get()
        if isinstance(ev, Exception):
            raise ev
        if ev is _DONE:
            if i not in ends:
                raise APIError(502, f"choice {i} ended without a result")
            continue
        ev = replace(ev, index=i)
        if isinstance(ev, TextDelta):
            logprob[i] += sum(e.logprob for e in ev.logprobs)
        if isinstance(ev, Finished):
            if ev.prediction is not None:
                predicted.append(ev.prediction)
            ends[i] = ChoiceEnd(i, ev.finish_reason, ev.completion_tokens, ev.speculation,
                                logprob[i])
            if len(ends) < k:
                yield ends[i]
            continue
        yield ev
    last = ends[i]
    yield Finished(last.finish_reason, sum(e.completion_tokens for e in ends.values()),
                   combined_stats(plan, list(ends.values())), index=i,
                   choices=tuple(ends[j] for j in range(k)),
                   prediction=tuple(map(sum, zip(*predicted))) if predicted else None)
