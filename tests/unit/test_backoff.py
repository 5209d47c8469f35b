"""tandem.backoff.backoff_s, the one exponential backoff (draft side, draft links, launcher)."""
import pytest

from tandem.backoff import backoff_s

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
