"""One session's failure inside a draft worker's drafting loop costs that session alone (issue
47): a grammar mask that raises, or panics (pyo3's PanicException is a BaseException), a
proposer that panics; the grammar mask is computed on the forward thread, not the event loop;
and a loop that dies anyway is logged and restarted, never left dead behind a SERVING port."""
import threading

import pytest
import torch
from test_draft_worker import FakeProposer, make_worker, run, take

from tandem.spec import ErrorCode, Open, Proposal, SessionError

pytestmark = pytest.mark.unit


class Panic(BaseException):
    """Stands for pyo3_runtime.PanicException: not an Exception."""


class Grammar:
    """A session's GrammarState: allows every token, or fails computing a mask."""

    def __init__(self, fail: BaseException | None = None):
        self.fail, self.threads = fail, []

    def copy_after(self, drafts):
        return self  # (a copy in the real one: this fake has no position to move)

    def next_mask(self, drafts):
        self.threads.append(threading.current_thread())
        if self.fail is not None:
            raise self.fail
        return torch.full((1, 4), -1, dtype=torch.int32)

    def commit(self, tokens):
        return True


def _open_with_grammar(worker, stream, session_id, grammar, prompt=(1, 2)):
    worker.handle(stream, Open(session_id, list(prompt), max_run_ahead=2))
    worker.session(stream, session_id).grammar = grammar  # before the loop's first step


@pytest.mark.parametrize("fail", [RuntimeError("matcher broke"), Panic("rust panicked")])
def test_a_failing_grammar_mask_costs_its_session_only(fail):
    async def main():
        worker, _ = make_worker()
        s = worker.open_stream()
        _open_with_grammar(worker, s, "bad", Grammar(fail))
        worker.handle(s, Open("good", [10, 11], max_run_ahead=2))
        got = await take(s, 3)
        errors = [m for m in got if isinstance(m, SessionError)]
        assert [(e.session_id, e.code) for e in errors] == [("bad", ErrorCode.INTERNAL)]
        assert type(fail).__name__ in errors[0].message
        assert [m.token.token_id for m in got if isinstance(m, Proposal)] == [12, 13]
        assert worker.stats().sessions_open == 1
        await worker.aclose()
    run(main())


def test_the_grammar_mask_is_computed_off_the_event_loop():
    async def main():
        worker, fake = make_worker()
        s = worker.open_stream()
        grammar = Grammar()
        _open_with_grammar(worker, s, "a", grammar)
        await take(s, 2)
        assert grammar.threads and threading.main_thread() not in grammar.threads
        assert fake.calls[0][0].mask is not None  # and the proposer got it
        await worker.aclose()
    run(main())


class PanickingProposer(FakeProposer):
    def propose(self, reqs):
        if any(r.token_ids[0] == 66 for r in reqs):
            raise Panic("rust panicked")
        return super().propose(reqs)


def test_a_proposer_panic_costs_its_session_only():
    async def main():
        worker, _ = make_worker(PanickingProposer())
        s = worker.open_stream()
        worker.handle(s, Open("bad", [66], max_run_ahead=2))
        worker.handle(s, Open("good", [10], max_run_ahead=2))
        got = await take(s, 3)
        assert [(m.session_id, m.code) for m in got if isinstance(m, SessionError)] == [
            ("bad", ErrorCode.INTERNAL)]
        assert [m.token.token_id for m in got if isinstance(m, Proposal)] == [11, 12]
        await worker.aclose()
    run(main())


def test_a_drafting_loop_that_dies_fails_its_sessions_and_starts_again(caplog):
    async def main():
        worker, _ = make_worker()
        step = worker._run_step

        def broken_once(jobs):
            worker._run_step = step
            raise KeyError("a bug outside any session's handling")

        worker._run_step = broken_once
        s = worker.open_stream()
        worker.handle(s, Open("a", [1], max_run_ahead=2))
        (err,) = await take(s, 1)
        assert isinstance(err, SessionError) and err.code == ErrorCode.INTERNAL
        assert worker.stats().sessions_open == 0
        worker.handle(s, Open("b", [20], max_run_ahead=2))  # the loop drafts again
        assert [m.token.token_id for m in await take(s, 2)] == [21, 22]
        await worker.aclose()
    run(main())
    assert "drafting loop ended unexpectedly" in caplog.text


def test_results_keep_their_sessions_when_a_mask_fails_mid_batch():
    async def main():
        worker, fake = make_worker()
        s = worker.open_stream()
        worker.handle(s, Open("x", [30], max_run_ahead=1))
        _open_with_grammar(worker, s, "bad", Grammar(RuntimeError("no")), prompt=(40,))
        worker.handle(s, Open("y", [50], max_run_ahead=1))
        got = await take(s, 3)
        tokens = {m.session_id: m.token.token_id for m in got if isinstance(m, Proposal)}
        assert tokens == {"x": 31, "y": 51}  # each its own drafts, none shifted by the failure
        assert len(fake.calls[0]) == 2
        await worker.aclose()
    run(main())



def test_a_grammar_view_masks_as_the_sessions_own_matcher_would(grammar_compiler, tokenizer):
    """The copy taken on the loop, walked on the forward thread, gives the session's mask
    (chain) and tree grammar; the session's own matcher does not move."""
    from test_grammar import state

    from draft_service.session import GrammarView
    from tandem.grammar import GrammarKind, GrammarSpec
    from tandem.spec import DraftRequest

    st = state(grammar_compiler, GrammarSpec(GrammarKind.REGEX, r"(cat|car|dog)s?"))
    ca = tokenizer("ca", add_special_tokens=False).input_ids
    before, want = st.next_mask([]), st.next_mask(ca)
    req = DraftRequest(session_key=1, token_ids=[1, *ca], num_committed=1, max_tokens=2)
    chain = GrammarView(st.copy_after([]), tuple(ca), tree=False).apply(req)
    tree = GrammarView(st.copy_after([]), tuple(ca), tree=True).apply(req)
    assert torch.equal(chain.mask, want) and chain.grammar is None
    assert torch.equal(tree.mask, want) and torch.equal(tree.grammar.mask_after([]), want)
    assert not torch.equal(want, before)
    assert torch.equal(st.next_mask([]), before)  # the session's own matcher stays put
