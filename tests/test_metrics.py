"""metrics.percentile, the one percentile implementation, against numpy's."""

import numpy as np
import pytest

from jaxinfer import metrics


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101, 5000])
def test_percentile_equals_numpy(n):
    xs = np.random.default_rng(n).lognormal(0, 1, n)
    for q in (0, 1, 50, 90, 95, 99, 100):
        assert metrics.percentile(np.sort(xs), q) == pytest.approx(np.percentile(xs, q), rel=1e-12)
    assert metrics.percentiles(list(xs) + [None])["p90"] == pytest.approx(np.percentile(xs, 90), rel=1e-12)


def test_counts_are_repeated_samples():
    values, counts = [0.1, 0.5, 2.0, 7.0], [3, 1, 4, 2]
    expanded = np.repeat(values, counts)
    for q in (0, 10, 33, 50, 75, 99, 100):
        assert metrics.percentile(values, q, counts) == pytest.approx(np.percentile(expanded, q), rel=1e-12)
    assert metrics.percentiles([]) == {"p50": None, "p90": None, "p99": None, "mean": None}
