"""LinearRouter's layouts are measured once per machine, thread count and shape, then read back
from the cache by later loads (every verifier, draft worker and restart)."""
import pytest
import torch

from tandem.engine import linear
from tandem.engine.linear import LinearRouter
from tandem.engine.tune_cache import TuneCache

pytestmark = pytest.mark.unit
ROWS = (1, 2, 16)


def _weights(shape=(48, 32), copies=3):
    torch.manual_seed(0)
    return [[torch.randn(*shape) for _ in range(copies)]]


def _count_timings(monkeypatch) -> list:
    calls = []
    real = linear._best_of
    monkeypatch.setattr(linear, "_best_of", lambda fn: calls.append(1) or real(fn))
    return calls


def test_a_second_load_reads_the_layouts_instead_of_timing(tmp_path, monkeypatch):
    cache = TuneCache(tmp_path / "tune.json")
    calls = _count_timings(monkeypatch)
    first = LinearRouter()
    first.tune(_weights(), rows=ROWS, cache=cache)
    assert len(calls) == 2 * len(ROWS) and cache.path.is_file()
    second = LinearRouter()
    second.tune(_weights(), rows=ROWS, cache=TuneCache(cache.path))
    assert len(calls) == 2 * len(ROWS)  # nothing timed again
    assert second.use_mm == first.use_mm and len(first.use_mm) == len(ROWS)


def test_another_thread_count_shape_or_row_set_is_measured(tmp_path, monkeypatch):
    cache = TuneCache(tmp_path / "tune.json")
    LinearRouter().tune(_weights(), rows=ROWS, cache=cache)
    calls = _count_timings(monkeypatch)
    LinearRouter().tune(_weights((40, 32)), rows=ROWS, cache=cache)
    assert len(calls) == 2 * len(ROWS)
    LinearRouter().tune(_weights(), rows=(*ROWS, 3), cache=cache)  # rows 3 were never timed
    assert len(calls) == 4 * len(ROWS) + 2
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        LinearRouter().tune(_weights(), rows=ROWS, cache=cache)
    finally:
        torch.set_num_threads(threads)
    assert len(calls) == 6 * len(ROWS) + 2


def test_a_broken_cache_file_is_measured_over_and_zero_turns_it_off(tmp_path, monkeypatch):
    path = tmp_path / "tune.json"
    path.write_text("{not json")
    router = LinearRouter()
    router.tune(_weights(), rows=ROWS, cache=TuneCache(path))
    assert len(router.use_mm) == len(ROWS) and TuneCache(path).get(
        TuneCache.key(_weights()[0][0], 3)) is not None
    monkeypatch.setenv("TANDEM_TUNE_CACHE", "0")
    assert TuneCache.default() is None
    monkeypatch.setenv("TANDEM_TUNE_CACHE", str(tmp_path / "other.json"))
    assert TuneCache.default().path == tmp_path / "other.json"
