"""tools.bench.stats.percentile, the one percentile of tools/bench and benchmarks/: numpy's
linear interpolation by default, statistics.quantiles' exclusive method when asked."""
import math
import statistics

import pytest

from tools.bench.stats import percentile

pytestmark = pytest.mark.unit


def test_linear_is_the_default():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(xs, 50) == 3.0 and percentile(xs, 99) == pytest.approx(4.96)
    assert math.isnan(percentile([], 50)) and math.isnan(percentile([], 50, "exclusive"))


@pytest.mark.parametrize("xs", [[3.0, 1.0], [5.0, 1.0, 3.0, 2.0, 4.0],
                                [float(i * i % 17) for i in range(40)]])
def test_exclusive_is_statistics_quantiles(xs):
    for q in (1, 50, 90, 99):
        assert percentile(xs, q, method="exclusive") == statistics.quantiles(xs, n=100)[q - 1]
    assert percentile(xs, 50.0, method="exclusive") == statistics.median(xs)


def test_exclusive_of_one_value_is_that_value():
    assert percentile([7.5], 99, method="exclusive") == 7.5


@pytest.mark.parametrize("q, method", [(0, "exclusive"), (100, "exclusive"),
                                       (99.5, "exclusive"), (50, "nearest"), (101, "linear")])
def test_refuses_what_it_cannot_compute(q, method):
    with pytest.raises(ValueError):
        percentile([1.0, 2.0, 3.0], q, method=method)
