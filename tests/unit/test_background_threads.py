"""Deferrable heavy work (grammar compiles) runs at a lower CPU priority than the threads
every tenant waits on (tandem/background.py)."""
import os
import threading

import pytest

from tandem.background import NICENESS, background_pool

pytestmark = pytest.mark.unit


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_background_pool_threads_run_at_a_lower_priority():
    own = _nice()
    pool = background_pool(2, "bg-test")
    try:
        niceness = {pool.submit(_nice).result(5) for _ in range(4)}
    finally:
        pool.shutdown()
    assert niceness == {min(19, own + NICENESS)}
    assert _nice() == own  # the caller's thread is untouched


def test_grammar_compiles_run_in_a_background_pool(tokenizer):
    from tandem.grammar.compiler import GrammarCompiler

    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    assert compiler._pool.submit(_nice).result(5) > _nice()
