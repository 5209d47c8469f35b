"""A step's grammar masks run off the verifier's event loop, in parallel, and a mask that
fails (even by a native panic) ends that session alone: issue 47's "nothing heavier than
bookkeeping on any event loop"."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from tandem.engine.block_manager import BlockManager
from tandem.grammar.state import GrammarFailed
from tandem.sampling_params import SamplingParams
from tandem.spec import Method
from tandem.spec.cost import CostModel
from verify_service.config import SchedulerConfig
from verify_service.engine import Engine, EngineConfig
from verify_service.forward.masks import PENDING, MaskJob, MaskPool
from verify_service.policy.scheduler import Scheduler
from verify_service.session.params import GenerateParams

pytestmark = pytest.mark.unit
WORDS = 4


class PanicException(BaseException):
    """What a native extension raises on a panic (pyo3's is a BaseException)."""


class SlowGrammar:
    """A GrammarState stand-in: `masks` takes `seconds` (without the GIL, as llguidance's
    mask computation does) and notes the thread it ran on, or raises `error`."""

    def __init__(self, seconds: float = 0.0, error: BaseException | None = None):
        self.seconds, self.error, self.threads = seconds, error, []

    def masks(self, drafts, parents=None):
        self.threads.append(threading.current_thread().name)
        time.sleep(self.seconds)
        if self.error is not None:
            raise self.error
        return torch.full((len(drafts) + 1, WORDS), -1, dtype=torch.int32)


def test_masks_run_in_parallel_off_the_loop_and_errors_are_per_job():
    grammars = [SlowGrammar(0.3), SlowGrammar(0.3), SlowGrammar(error=PanicException("boom"))]

    async def main():
        pool = MaskPool(workers=3)
        ticks = 0

        async def ticker():  # the loop keeps serving while masks are made
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        start = time.perf_counter()
        out = await pool.compute([MaskJob(g, [5, 6], None) for g in grammars] + [None])
        took = time.perf_counter() - start
        task.cancel()
        pool.close()
        return out, took, ticks

    out, took, ticks = asyncio.run(main())
    assert out[0].shape == out[1].shape == (3, WORDS) and out[3] is None
    assert isinstance(out[2], PanicException)
    assert took < 0.55  # the two 0.3 s masks overlapped
    assert ticks >= 10  # ~30 ticks in 0.3 s; on the loop there would be none
    assert all(name.startswith("verify-masks") for g in grammars for name in g.threads)


def _params(session_id: str) -> GenerateParams:
    return GenerateParams(session_id=session_id, prompt=(1, 2, 3), committed=(),
                          sampling=SamplingParams(temperature=0.0), max_new_tokens=8,
                          stop_token_ids=frozenset({0}), method=Method.NONE)


@pytest.mark.parametrize("error, reason", [
    (PanicException("pyo3 panic"), "fault"), (RuntimeError("matcher bug"), "fault"),
    (GrammarFailed("grammar: too many items"), "error")])
def test_a_session_whose_masks_fail_ends_alone_with_why(error, reason):
    async def main():
        sched = Scheduler(BlockManager(64, 4), SchedulerConfig(), CostModel())
        engine = Engine(None, sched, EngineConfig(), 100)
        good_grammar = SlowGrammar()
        queues = {sid: engine.submit(_params(sid), grammar=g) for sid, g in
                  (("good", good_grammar), ("bad", SlowGrammar(error=error)))}
        kept, inputs = await engine._step_inputs(sched.schedule().scheduled)
        last = queues["bad"].get_nowait()
        await engine.close()
        return kept, inputs, last, good_grammar

    kept, inputs, last, good_grammar = asyncio.run(main())
    assert [s.seq.session_id for s in kept] == ["good"]
    assert inputs[0].mask is not None and inputs[0].mask.shape == (1, WORDS)
    assert last.finish_reason == reason and last.error
    assert good_grammar.threads and good_grammar.threads[0].startswith("verify-masks")


def test_a_grammar_that_breaks_at_its_first_mask_fails_instead_of_forcing_eos(tokenizer):
    """The issue's poison regex: a few tokens in, llguidance's lexer runs out of expressions;
    that lexer is shared by every copy of the compiled grammar, so the next session's very
    first mask comes back empty with the matcher in error. That is a GrammarFailed (a 400),
    not EOS alone (a 200 whose empty text the regex forbids)."""
    from tandem.grammar.compiler import GrammarCompiler
    from tandem.grammar.spec import GrammarKind, GrammarSpec

    compiler = GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    spec = GrammarSpec(GrammarKind.REGEX, "([a-z ]{1,50}){1,50}")
    first = compiler.state_now(spec)
    with pytest.raises(GrammarFailed, match="grammar: "):
        for t in tokenizer.encode(" use commas to separate items in a sentence that is long",
                                  add_special_tokens=False):
            first.masks([])
            first.commit([t])
    with pytest.raises(GrammarFailed, match="too many expressions"):
        compiler.state_now(spec).masks([])


def test_a_grammar_whose_first_mask_breaks_is_refused_at_admission(tokenizer):
    """LazyCompiler.state (the verifier's admission) tries the first mask off the loop: a
    session that could only fail never enters a step's batch, where every session would
    wait for its mask."""
    from tandem.grammar.compiler import GrammarCompiler, LazyCompiler
    from tandem.grammar.spec import GrammarKind, GrammarSpec

    compiler = GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    lazy = LazyCompiler(lambda: compiler)
    spec = GrammarSpec(GrammarKind.REGEX, "([a-z ]{1,50}){1,50}")
    first = asyncio.run(lazy.state(spec))  # fine at first
    with pytest.raises(GrammarFailed):  # its walk exhausts the lexer all copies share
        for t in tokenizer.encode(" use commas to separate items in a sentence that is long",
                                  add_special_tokens=False):
            first.masks([])
            first.commit([t])
    with pytest.raises(GrammarFailed, match="too many expressions"):
        asyncio.run(lazy.state(spec))


def test_a_session_whose_masks_are_late_sits_the_step_out_and_keeps_them():
    """Issue 47: a hostile grammar's mask (0.3 s for 1,500 optional properties) must not hold
    every session's step. Past MASK_WAIT_S the step goes on without that session, its slot
    given back; its masks go on being made and serve its next step, made once."""
    async def main():
        sched = Scheduler(BlockManager(64, 4), SchedulerConfig(), CostModel())
        engine = Engine(None, sched, EngineConfig(), 100)
        slow = SlowGrammar(0.4)
        for sid, g in (("quick", SlowGrammar()), ("slow", slow)):
            engine.submit(_params(sid), grammar=g)
        sched.schedule()  # the prefills (their masks are awaited: a prefill cannot sit out)
        decode = sched.schedule().scheduled
        slots = sched.blocks.num_tokens("slow")
        start = time.perf_counter()
        kept, _ = await engine._step_inputs(decode)
        took = time.perf_counter() - start
        rolled_back = slots - sched.blocks.num_tokens("slow")
        busy = engine._masks.busy("slow")
        await asyncio.sleep(0.5)
        again = [s for s in sched.schedule().scheduled if s.seq.session_id == "slow"]
        kept2, inputs2 = await engine._step_inputs(again)
        await engine.close()
        return kept, took, rolled_back, busy, kept2, inputs2, slow

    kept, took, rolled_back, busy, kept2, inputs2, slow = asyncio.run(main())
    assert [s.seq.session_id for s in kept] == ["quick"] and took < 0.3
    assert rolled_back == 1 and busy
    assert [s.seq.session_id for s in kept2] == ["slow"] and inputs2[0].mask.shape == (1, WORDS)
    assert len(slow.threads) == 1  # the late job's masks were used, not made again


def test_a_prefills_masks_are_awaited_and_a_late_job_blocks_a_new_one():
    """A prefill's root mask cannot be deferred (its first token is sampled in that step);
    a session whose late job covers other drafts waits for that job (one thread per
    matcher) rather than starting a second walk of it."""
    async def main():
        pool = MaskPool(workers=2)
        g = SlowGrammar(0.3)
        (first,) = await pool.compute([MaskJob(g, [], None, "s")], 0.01)
        (late,) = await pool.compute([MaskJob(g, [5], None, "t", deferrable=True)], 0.01)
        (other,) = await pool.compute([MaskJob(g, [6], None, "t", deferrable=True)], 0.01)
        await asyncio.sleep(0.4)
        (fresh,) = await pool.compute([MaskJob(g, [6], None, "t", deferrable=True)], 1.0)
        pool.close()
        return first, late, other, fresh, g

    first, late, other, fresh, g = asyncio.run(main())
    assert first.shape == (1, WORDS) and fresh.shape == (2, WORDS)
    assert late is PENDING and other is PENDING
    assert len(g.threads) == 3  # s's, t's first, then t's for the new drafts once it was free


def test_a_prefill_waits_for_its_matchers_late_job_instead_of_sitting_out():
    """A session preempted while its decode masks were late re-prefills: its prefill's mask
    is never PENDING (a prefill cannot be deferred). The late job covers it (row 0 is the
    committed text's), so it waits for that job and takes its first row."""
    async def main():
        pool = MaskPool(workers=2)
        g = SlowGrammar(0.2)
        (late,) = await pool.compute([MaskJob(g, [5], None, "s", deferrable=True)], 0.01)
        (prefill,) = await pool.compute([MaskJob(g, [], None, "s")], 0.01)
        pool.close()
        return late, prefill, g

    late, prefill, g = asyncio.run(main())
    assert late is PENDING and prefill.shape == (1, WORDS) and len(g.threads) == 1
