"""Draft worker logic with a fake proposer: run-ahead, commit vs rollback, errors, batching."""
import asyncio
import threading

import pytest

from draft_service.limits import Limits
from draft_service.worker import DraftWorker
from tandem.spec import (
    Close,
    Commit,
    DraftResult,
    DraftToken,
    ErrorCode,
    Invalid,
    Method,
    Open,
    Proposal,
    SessionError,
)
from tandem.v1 import common_pb2, draft_pb2

pytestmark = pytest.mark.unit

VOCAB = 100
POISON = 66  # a session whose prompt starts with this makes the fake proposer raise


class FakeProposer:
    """Drafts last_token + 1, + 2, ...; records every call."""

    method = Method.DRAFT_MODEL

    def __init__(self, per_call=1, gate=None, empty=False):
        self.per_call, self.gate, self.empty = per_call, gate, empty
        self.calls, self.released = [], []

    def propose(self, reqs):
        self.calls.append(list(reqs))
        if self.gate is not None:
            self.gate.wait(5)
        if any(r.token_ids[0] == POISON for r in reqs):
            raise RuntimeError("poisoned batch")
        out = []
        for r in reqs:
            n = 0 if self.empty else min(self.per_call, r.max_tokens)
            last = r.token_ids[-1]
            out.append(DraftResult([DraftToken((last + 1 + i) % VOCAB) for i in range(n)]))
        return out

    def release(self, session_key):
        self.released.append(session_key)


def make_worker(proposer=None, **limits):
    proposer = proposer or FakeProposer()
    lim = Limits(**{"vocab_size": VOCAB, "max_context_length": 64, **limits})
    return DraftWorker({Method.DRAFT_MODEL: proposer}, lim), proposer


async def take(stream, n, timeout=2.0):
    return [await asyncio.wait_for(stream.get(), timeout) for _ in range(n)]


async def nothing_more(stream, wait=0.05):
    await asyncio.sleep(wait)
    assert stream.pending == 0


async def eventually(cond, timeout=2.0):
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never became true")


def run(coro):
    asyncio.run(asyncio.wait_for(coro, 20))


def test_enum_values_match_the_wire_contract():
    for m in Method:
        assert common_pb2.SpeculationMethod.Value(f"SPECULATION_METHOD_{m.name}") == m
    for c in ErrorCode:
        assert draft_pb2.DraftErrorCode.Value(f"DRAFT_ERROR_CODE_{c.name}") == c


def test_run_ahead_is_bounded_and_positions_increase():
    async def main():
        worker, fake = make_worker()
        s = worker.open_stream()
        worker.handle(s, Open("a", [1, 2, 3], max_run_ahead=3, epoch=5))
        got = await take(s, 3)
        assert [(p.position, p.token.token_id, p.epoch) for p in got] == [
            (3, 4, 5), (4, 5, 5), (5, 6, 5)]
        await nothing_more(s)
        assert worker.stats().queue_depth == 0 and worker.stats().tokens_drafted == 3
        await worker.aclose()
    run(main())


def test_same_epoch_commit_keeps_run_ahead():
    async def main():
        worker, fake = make_worker()
        s = worker.open_stream()
        worker.handle(s, Open("a", [1, 2, 3], max_run_ahead=3, epoch=0))
        await take(s, 3)  # drafts 4 5 6 at positions 3 4 5
        calls = len(fake.calls)
        worker.handle(s, Commit("a", 0, 3, [4, 5]))
        got = await take(s, 2)  # room for two more, continuing after 6
        assert [(p.position, p.token.token_id, p.epoch) for p in got] == [(6, 7, 0), (7, 8, 0)]
        # The kept draft 6 is part of the context of the next request.
        assert fake.calls[calls][0].token_ids == [1, 2, 3, 4, 5, 6]
        assert fake.calls[calls][0].num_committed == 5
        await nothing_more(s)
        await worker.aclose()
    run(main())


def test_epoch_bump_discards_drafts_and_drafts_from_the_new_end():
    async def main():
        worker, fake = make_worker()
        s = worker.open_stream()
        worker.handle(s, Open("a", [1, 2, 3], max_run_ahead=3, epoch=0))
        await take(s, 3)  # 4 5 6
        # Verifier accepted 4, rejected 5, committed recovered 50: epoch bumps.
        worker.handle(s, Commit("a", 1, 3, [4, 50]))
        got = await take(s, 3)
        assert [(p.position, p.token.token_id, p.epoch) for p in got] == [
            (5, 51, 1), (6, 52, 1), (7, 53, 1)]
        assert fake.calls[3][0].token_ids == [1, 2, 3, 4, 50]
        await worker.aclose()
    run(main())


def test_a_zero_run_ahead_pauses_drafting_until_a_commit_asks_again():
    async def main():
        worker, fake = make_worker()
        s = worker.open_stream()
        worker.handle(s, Open("a", [1, 2, 3], max_run_ahead=2, epoch=0))
        await take(s, 2)  # 4 5
        worker.handle(s, Commit("a", 1, 3, [9], max_run_ahead=0))  # speculation off
        await nothing_more(s)
        calls = len(fake.calls)
        worker.handle(s, Commit("a", 2, 4, [8]))  # unset: still paused, still in sync
        await nothing_more(s)
        assert len(fake.calls) == calls
        worker.handle(s, Commit("a", 3, 5, [7], max_run_ahead=1))  # a probe round
        (p,) = await take(s, 1)
        assert (p.position, p.epoch) == (6, 3)
        assert fake.calls[-1][0].token_ids == [1, 2, 3, 9, 8, 7]
        await nothing_more(s)
        await worker.aclose()
    run(main())


def test_results_of_a_step_overtaken_by_a_rollback_are_dropped():
    async def main():
        gate = threading.Event()
        worker, fake = make_worker(FakeProposer(gate=gate))
        s = worker.open_stream()
        worker.handle(s, Open("a", [1, 2, 3], max_run_ahead=2, epoch=0))
        await eventually(lambda: len(fake.calls) == 1)  # step in flight on [1 2 3]
        worker.handle(s, Commit("a", 1, 3, [9]))  # diverged meanwhile
        gate.set()
        got = await take(s, 2)
        assert [(p.position, p.token.token_id, p.epoch) for p in got] == [(4, 10, 1), (5, 11, 1)]
        await worker.aclose()
    run(main())


def test_out_of_sync_commits_drop_the_session():
    cases = [
        Commit("a", 0, 5, [1]),  # gap: starts beyond the 3 committed tokens
        Commit("a", 0, 1, [7, 4]),  # re-sent token 7 disagrees with committed 2
        Commit("a", 0, 3, [9]),  # same epoch, but 9 was never drafted
    ]
    for bad in cases:
        async def main(bad=bad):
            worker, fake = make_worker()
            s = worker.open_stream()
            worker.handle(s, Open("a", [1, 2, 3], max_run_ahead=2))
            await take(s, 2)
            worker.handle(s, bad)
            (err,) = await take(s, 1)
            assert err == SessionError("a", ErrorCode.OUT_OF_SYNC, err.message)
            worker.handle(s, Commit("a", 0, 3, [4]))
            (err,) = await take(s, 1)
            assert err.code == ErrorCode.UNKNOWN_SESSION
            assert worker.load() == 0
            await worker.aclose()
        run(main())


def test_errors_carry_the_epoch_of_the_message_they_answer():
    async def main():
        worker, fake = make_worker()
        s = worker.open_stream()
        worker.handle(s, Open("a", [1, 2, 3], max_run_ahead=1, epoch=4))
        await take(s, 1)
        worker.handle(s, Commit("a", 4, 9, [1]))  # a gap: out of sync
        (err,) = await take(s, 1)
        worker.handle(s, Open("b", [], epoch=7))  # invalid open
        (err_b,) = await take(s, 1)
        await worker.aclose()
        assert (err.code, err.epoch) == (ErrorCode.OUT_OF_SYNC, 4)
        assert (err_b.code, err_b.epoch) == (ErrorCode.INVALID_ARGUMENT, 7)

    run(main())


def test_resent_tokens_that_agree_are_harmless():
    async def main():
        worker, fake = make_worker()
        s = worker.open_stream()
        worker.handle(s, Open("a", [1, 2, 3], max_run_ahead=2))
        await take(s, 2)  # 4 5
        worker.handle(s, Commit("a", 0, 2, [3, 4]))  # 3 re-sent, 4 new
        (p,) = await take(s, 1)
        assert (p.position, p.token.token_id) == (5, 6)
        await worker.aclose()
    run(main())


def test_unknown_session_and_decreasing_epoch():
    async def main():
        worker, fake = make_worker()
        s = worker.open_stream()
        worker.handle(s, Commit("ghost", 0, 0, [1]))
        (err,) = await take(s, 1)
        assert (err.session_id, err.code) == ("ghost", ErrorCode.UNKNOWN_SESSION)
        worker.handle(s, Open("a", [1, 2], max_run_ahead=1, epoch=3))
        await take(s, 1)
        worker.handle(s, Commit("a", 2, 2, [3]))
        (err,) = await take(s, 1)
        assert (err.session_id, err.code) == ("a", ErrorCode.INVALID_ARGUMENT)
        assert "epoch" in err.message and worker.load() == 0
        await worker.aclose()
    run(main())


@pytest.mark.parametrize("cmd, code", [
    (Open("", [1]), ErrorCode.INVALID_ARGUMENT),
    (Open("x", []), ErrorCode.INVALID_ARGUMENT),
    (Open("x", [1, VOCAB]), ErrorCode.INVALID_ARGUMENT),
    (Open("x", [-1]), ErrorCode.INVALID_ARGUMENT),
    (Open("x", [1], temperature=-1.0), ErrorCode.INVALID_ARGUMENT),
    (Open("x", [1], temperature=1.0, top_p=1.5), ErrorCode.INVALID_ARGUMENT),
    (Open("x", [1], method=Method.NONE), ErrorCode.UNSUPPORTED_METHOD),
    (Open("x", [1], method=Method.NGRAM), ErrorCode.UNSUPPORTED_METHOD),
    (Open("x", [1], method=42), ErrorCode.UNSUPPORTED_METHOD),
    (Open("x", [1] * 65), ErrorCode.RESOURCE_EXHAUSTED),
    (Commit("", 0, 0, [1]), ErrorCode.INVALID_ARGUMENT),
    (Invalid("", "no control set"), ErrorCode.INVALID_ARGUMENT),
])
def test_bad_controls_are_reported_in_band(cmd, code):
    async def main():
        worker, fake = make_worker()
        s = worker.open_stream()
        worker.handle(s, Open("good", [1], max_run_ahead=1))
        worker.handle(s, cmd)
        got = await take(s, 2)
        errors = [g for g in got if isinstance(g, SessionError)]
        assert [(e.session_id, e.code) for e in errors] == [(cmd.session_id, code)]
        assert any(isinstance(g, Proposal) and g.session_id == "good" for g in got)
        assert worker.load() == 1
        await worker.aclose()
    run(main())


def test_commit_with_bad_tokens_and_context_overflow():
    async def main():
        worker, fake = make_worker(max_context_length=6)
        s = worker.open_stream()
        worker.handle(s, Open("a", [1, 2, 3], max_run_ahead=8))
        got = await take(s, 3)  # stops at the context length: positions 3, 4, 5
        assert [p.position for p in got] == [3, 4, 5]
        await nothing_more(s)
        worker.handle(s, Commit("a", 1, 3, [4, 5, 6, 7]))  # 7 tokens > 6
        (err,) = await take(s, 1)
        assert err.code == ErrorCode.RESOURCE_EXHAUSTED
        worker.handle(s, Open("b", [1], max_run_ahead=1))
        await take(s, 1)
        worker.handle(s, Commit("b", 0, 1, [VOCAB + 5]))
        (err,) = await take(s, 1)
        assert err.code == ErrorCode.INVALID_ARGUMENT and "vocabulary" in err.message
        await worker.aclose()
    run(main())


def test_max_sessions_is_enforced_across_streams():
    async def main():
        worker, fake = make_worker(max_sessions=2)
        s1, s2 = worker.open_stream(), worker.open_stream()
        worker.handle(s1, Open("a", [1], max_run_ahead=1))
        worker.handle(s2, Open("a", [1], max_run_ahead=1))  # same id, other stream: fine
        worker.handle(s2, Open("b", [1]))
        got = [g for g in await take(s2, 2) if isinstance(g, SessionError)]
        assert [(e.session_id, e.code) for e in got] == [("b", ErrorCode.RESOURCE_EXHAUSTED)]
        await worker.aclose()
    run(main())


def test_close_is_idempotent_and_frees_state():
    async def main():
        worker, fake = make_worker()
        s = worker.open_stream()
        worker.handle(s, Open("a", [1], max_run_ahead=1))
        await take(s, 1)
        session_key = fake.calls[0][0].session_key
        for _ in range(2):
            worker.handle(s, Close("a"))
        worker.handle(s, Close("never-opened"))
        await eventually(lambda: fake.released == [session_key])
        await nothing_more(s)
        assert worker.load() == 0
        await worker.aclose()
    run(main())


def test_reopen_replaces_the_session():
    async def main():
        worker, fake = make_worker()
        s = worker.open_stream()
        worker.handle(s, Open("a", [1], max_run_ahead=1, epoch=4))
        await take(s, 1)
        worker.handle(s, Open("a", [7, 8], max_run_ahead=1, epoch=0))
        (p,) = await take(s, 1)
        assert (p.epoch, p.position, p.token.token_id) == (0, 2, 9)
        assert worker.load() == 1 and len(fake.released) == 1
        await worker.aclose()
    run(main())


def test_stream_end_frees_all_its_sessions():
    async def main():
        worker, fake = make_worker()
        s1, s2 = worker.open_stream(), worker.open_stream()
        for session_id in "abc":
            worker.handle(s1, Open(session_id, [1], max_run_ahead=1))
        worker.handle(s2, Open("z", [1], max_run_ahead=2))
        await take(s1, 3)
        worker.close_stream(s1)
        assert worker.load() == 1
        await eventually(lambda: len(fake.released) == 3)
        await take(s2, 2)  # the other stream is untouched
        await worker.aclose()
    run(main())


def test_all_sessions_of_all_streams_are_batched_into_one_call():
    async def main():
        worker, fake = make_worker()
        streams = [worker.open_stream() for _ in range(3)]
        for i in range(12):
            worker.handle(streams[i % 3], Open(f"s{i}", [i + 1], max_run_ahead=2))
        for s in streams:
            await take(s, 8)
        assert [len(c) for c in fake.calls] == [12, 12]
        assert worker.stats().steps == 2
        await worker.aclose()
    run(main())


def test_a_failing_session_does_not_starve_the_others():
    async def main():
        worker, fake = make_worker()
        s = worker.open_stream()
        worker.handle(s, Open("ok", [1], max_run_ahead=2))
        worker.handle(s, Open("bad", [POISON], max_run_ahead=2))
        got = await take(s, 3)
        errors = [g for g in got if isinstance(g, SessionError)]
        assert [(e.session_id, e.code) for e in errors] == [("bad", ErrorCode.INTERNAL)]
        assert [g.position for g in got if isinstance(g, Proposal)] == [1, 2]
        await worker.aclose()
    run(main())


def test_empty_proposal_waits_for_the_next_commit():
    async def main():
        worker, fake = make_worker(FakeProposer(empty=True))
        s = worker.open_stream()
        worker.handle(s, Open("a", [1, 2], max_run_ahead=4))
        await nothing_more(s, 0.1)
        assert len(fake.calls) == 1  # stalled, not spinning
        worker.handle(s, Commit("a", 1, 2, [3]))
        await eventually(lambda: len(fake.calls) == 2)
        await worker.aclose()
    run(main())


def test_limits_caps_and_draft_seed():
    async def main():
        worker, fake = make_worker(max_run_ahead=2, max_spec_tokens=4, top_n=3, max_top_n=5)
        s = worker.open_stream()
        worker.handle(s, Open("a", [1], temperature=0.8, top_p=0.9, seed=7,
                              max_run_ahead=100, top_n=100))
        await take(s, 4)
        await nothing_more(s)
        req = fake.calls[0][0]
        assert (req.max_tokens, req.top_n, req.sampling.seed) == (4, 5, 7)
        # Deterministic, yet not the verifier's stream (which would be seeded with 7 itself).
        assert req.generator is not None and req.generator.initial_seed() != 7
        worker.handle(s, Open("b", [1], temperature=0.8, seed=7))  # defaults: 2 drafts, top 3
        await take(s, 2)
        other = next(c[0] for c in fake.calls if c[0].session_key != req.session_key)
        assert (other.max_tokens, other.top_n) == (2, 3)
        assert other.generator.initial_seed() == req.generator.initial_seed()
        await worker.aclose()
    run(main())


# --- configuration and command line (sizing the worker) --------------------------------------


@pytest.mark.parametrize("bad", [
    dict(port=70000), dict(port=-1), dict(threads=0), dict(max_sessions=True),
    dict(max_run_ahead=20, max_spec_tokens=16), dict(top_n=65), dict(dtype="int4"), dict(mtp=""),
    dict(max_context_length=-1), dict(drain_grace_s=float("nan")), dict(host=""),
    dict(model=""), dict(eagle_vocab=-1), dict(eagle_vocab=1.5),
])
def test_config_rejects_bad_values(bad):
    from draft_service.config import DraftConfig

    with pytest.raises(ValueError):
        DraftConfig(**bad)


def test_cli_flags_and_env(monkeypatch):
    import argparse

    from draft_service import cli

    monkeypatch.setenv("TANDEM_DRAFT_PORT", "0")
    monkeypatch.setenv("TANDEM_DRAFT_MAX_RUN_AHEAD", "4")
    parser = argparse.ArgumentParser(prog="tandem")
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["draft", "--model", "none", "--top-n", "3"])
    cfg = cli.config_from_args(args)
    assert (cfg.port, cfg.max_run_ahead, cfg.top_n, cfg.model) == (0, 4, 3, None)
    assert args.func is cli.run
    assert cli.resolve_model_flag("/some/dir") == "/some/dir"
