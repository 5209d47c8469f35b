"""tandem.backoff: the one exponential backoff (backoff_s) and its per-key circuit breaker
(KeyedBackoff): the draft side, the draft links, the launcher."""
import pytest

from tandem.backoff import KeyedBackoff, backoff_s

pytestmark = pytest.mark.unit


def test_doubles_from_first_up_to_the_cap():
    assert [backoff_s(n, 0.25, 1.0) for n in range(1, 6)] == [0.25, 0.5, 1.0, 1.0, 1.0]
    assert [backoff_s(n, 0.5, 5.0) for n in range(1, 6)] == [0.5, 1.0, 2.0, 4.0, 5.0]
    # the launcher's restarts: 1 s, 2 s, 4 s ... 30 s (its count is 0-based)
    assert [backoff_s(count + 1, 1.0, 30.0) for count in range(7)] == [
        min(30.0, 2.0 ** count) for count in range(7)]


def test_a_long_run_of_failures_stays_at_the_cap():
    assert backoff_s(10_000, 0.5, 5.0) == 5.0  # 0.5 * 2 ** 9999 would not be a float


def test_no_failure_is_not_a_backoff():
    with pytest.raises(ValueError, match="failures"):
        backoff_s(0, 0.5, 5.0)


def test_keyed_backoff_opens_per_key_and_a_success_starts_over():
    now = [100.0]
    skips = KeyedBackoff(0.5, 5.0, clock=lambda: now[0])
    assert skips.ready("a") and skips.failures("a") == 0
    assert skips.failed("a") == 1
    assert not skips.ready("a") and skips.ready("b")  # one key's failure spares the others
    now[0] = 100.5
    assert skips.ready("a")
    assert skips.failed("a") == 2  # in a row: 1 s now
    now[0] = 101.4
    assert not skips.ready("a")
    now[0] = 101.5
    assert skips.ready("a")
    skips.succeeded("a")
    assert skips.failures("a") == 0 and skips.failed("a") == 1  # 0.5 s again
    assert not skips.ready("a") and skips.ready("a", now=102.0)


def test_keyed_backoff_takes_the_callers_time():
    skips = KeyedBackoff(1.0, 30.0)  # the launcher's restarts, on its own clock
    assert [skips.failed("draft-0", now=0.0) for _ in range(3)] == [1, 2, 3]
    assert not skips.ready("draft-0", now=3.9) and skips.ready("draft-0", now=4.0)
