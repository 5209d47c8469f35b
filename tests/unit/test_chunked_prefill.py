"""Chunked prefill in the scheduler (pure Python): a long prompt admitted beside decoding
sessions is computed a chunk per step, and they keep getting a token every step."""
import pytest

from tandem.engine.block_manager import BlockManager
from tandem.sampling_params import SamplingParams
from tandem.spec import Method
from tandem.spec.cost import CostModel
from verify_service.config import SchedulerConfig
from verify_service.policy.scheduler import Scheduler
from verify_service.session.params import GenerateParams
from verify_service.session.sequence import SeqStatus, Sequence

pytestmark = pytest.mark.unit


def _seq(session_id, n, method=Method.NONE):
    return Sequence(GenerateParams(session_id=session_id, prompt=tuple(range(1, n + 1)),
                                   committed=(), sampling=SamplingParams(temperature=0.0),
                                   max_new_tokens=50,
                                   stop_token_ids=frozenset(), method=method))


def _sched(chunk=8, blocks=64, **kw):
    return Scheduler(BlockManager(blocks, 4), SchedulerConfig(prefill_chunk_tokens=chunk, **kw),
                     CostModel())


def _run_step(sched):
    """One step as the engine applies it: chunks commit KV, full rounds sample token 7."""
    out = sched.schedule()
    for s in out.scheduled:
        sched.update_from_output(s, 0)
        if not s.partial:
            s.seq.commit([], 7)
    return out.scheduled


def test_a_long_prompt_beside_a_decoding_session_goes_in_chunks():
    sched = _sched(chunk=8)
    short = _seq("short", 3)
    sched.add(short)
    _run_step(sched)  # short's prefill: it decodes from now on
    long = _seq("long", 30)
    sched.add(long)
    seen, steps = [], 0
    while long.sched.prefill_left or not seen or seen[-1][1]:
        steps += 1
        scheduled = _run_step(sched)
        assert any(s.seq is short and not s.is_prefill for s in scheduled)  # never stalled
        (chunk,) = [s for s in scheduled if s.seq is long]
        seen.append((chunk.token_ids, chunk.partial, chunk.start_pos))
        assert len(chunk.token_ids) <= 8
    assert [t for ids, _, _ in seen for t in ids] == list(range(1, 31))  # every token, once
    assert [p for _, p, _ in seen] == [True] * (len(seen) - 1) + [False]  # sampled at the end
    assert [s for _, _, s in seen] == [0, 8, 16, 24]
    assert long.output == [7] and sched.blocks.num_tokens("long") == 30
    # KV of each chunk is committed as it is computed (shareable full blocks)
    assert sched.blocks.num_committed("long") == 30


def test_alone_the_whole_prompt_goes_in_one_forward():
    sched = _sched(chunk=8)
    long = _seq("long", 30)
    sched.add(long)
    (s,) = _run_step(sched)
    assert len(s.token_ids) == 30 and not s.partial and long.sched.prefill_left == 0


def test_the_step_budget_bounds_the_chunk():
    sched = _sched(chunk=64, max_num_batched_tokens=6)
    sched.add(_seq("a", 3))
    _run_step(sched)
    sched.add(_seq("b", 20))
    scheduled = _run_step(sched)
    assert sum(len(s.token_ids) for s in scheduled) <= 6


def test_chunking_off_keeps_a_long_prefill_for_a_step_of_its_own():
    sched = _sched(chunk=0, max_num_batched_tokens=16)
    sched.add(_seq("a", 3))
    _run_step(sched)
    sched.add(_seq("b", 20))
    assert [s.seq.session_id for s in _run_step(sched)] == ["a"]  # b (20 > budget 15) waits


def test_eagle_sessions_are_never_chunked():
    sched = _sched(chunk=4)
    sched.add(_seq("a", 3))
    _run_step(sched)
    eagle = _seq("e", 20, Method.EAGLE)
    sched.add(eagle)
    (s,) = [s for s in _run_step(sched) if s.seq is eagle]
    assert len(s.token_ids) == 20 and not s.partial


def test_a_preempted_prefilling_session_starts_over():
    sched = _sched(chunk=4, blocks=12)
    a = _seq("a", 3)
    sched.add(a)
    _run_step(sched)
    b = _seq("b", 36)  # 9 of the 12 blocks
    sched.add(b)
    _run_step(sched)
    assert b.sched.prefill_left > 0
    sched._preempt(b)
    assert b.sched.status is SeqStatus.WAITING and b.sched.prefill_left == 0
    assert not sched.blocks.has("b")


def test_negative_chunk_is_refused():
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        SchedulerConfig(prefill_chunk_tokens=-1)
