"""n-gram drafts on device (``speculative.ngram_drafts``) are the host's prompt lookup
(``speculative.ngram_propose``), row by row, over padded histories: worked cases by hand, then
random histories over small alphabets (where suffixes recur) with random padding after them."""

import functools

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.engine.speculative import ngram_drafts, ngram_propose

L = 24  # the padded history width
R = 6


@functools.partial(jax.jit, static_argnames=("k", "min_n", "max_n"))
def _device(history, lengths, *, k, min_n, max_n):
    return ngram_drafts(history, lengths, k, min_n, max_n)


def _check(rows, k, min_n, max_n, pad):
    """Device drafts of every row (padded with ``pad`` after its length) equal the host's."""
    hist = np.array([list(r) + [pad(i, j) for j in range(L - len(r))] for i, r in enumerate(rows)], np.int32)
    lens = np.array([len(r) for r in rows], np.int32)
    drafts, count = map(np.asarray, _device(hist, lens, k=k, min_n=min_n, max_n=max_n))
    for i, r in enumerate(rows):
        want = ngram_propose(r, k, min_n, max_n)
        assert count[i] == len(want), (r, want, drafts[i], count[i])
        assert drafts[i, : count[i]].tolist() == want, (r, want, drafts[i])
        assert (drafts[i, count[i]:] == -1).all()


def test_worked_cases():
    cases = [  # (history, k, min_n, max_n, drafts), as test_spec_engine's host cases
        ([1, 2, 3, 9, 1, 2, 3], 2, 1, 3, [9, 1]),  # suffix 1 2 3 seen at 0
        ([5, 1, 2, 7, 1, 2], 3, 1, 4, [7, 1, 2]),
        ([1, 2, 3, 4], 2, 1, 3, []),  # nothing recurs
        ([4, 4, 4], 5, 1, 2, [4]),  # the latest occurrence, cut at the end
        ([3, 1, 2, 8, 3, 1, 2], 1, 2, 2, [8]),
        ([7, 5, 7, 6, 7], 2, 1, 1, [6, 7]),  # the latest of two occurrences of 7
        ([1, 2, 9, 2, 1, 2], 3, 1, 2, [9, 2, 1]),  # 1 2 (n = 2) beats the later 2 (n = 1)
        ([], 2, 1, 2, []),
        ([5], 2, 1, 2, []),
    ]
    for rows, k, lo, hi, want in cases:
        assert ngram_propose(rows, k, lo, hi) == want
    for k, lo, hi in {(c[1], c[2], c[3]) for c in cases}:
        group = [c[0] for c in cases if (c[1], c[2], c[3]) == (k, lo, hi)]
        # padding that would match if read: copies of the row's own tokens
        _check(group, k, lo, hi, pad=lambda i, j: (group[i] or [0])[j % max(len(group[i]), 1)])


def test_bad_settings_are_one_clear_error():
    with pytest.raises(ValueError, match="min_n <= max_n"):
        ngram_drafts(np.zeros((1, 4), np.int32), np.zeros(1, np.int32), 2, 3, 2)
    with pytest.raises(ValueError, match="min_n <= max_n"):
        ngram_drafts(np.zeros((1, 4), np.int32), np.zeros(1, np.int32), 2, 0, 2)


@settings(max_examples=150, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(0, 3), max_size=L), min_size=R, max_size=R),
    alphabet=st.integers(1, 4),
    settings_=st.sampled_from([(1, 1, 1), (4, 1, 4), (3, 2, 3), (2, 3, 3), (5, 1, 2), (16, 1, 5)]),
    pad=st.integers(0, 5),
)
def test_random_histories_equal_host_lookup(rows, alphabet, settings_, pad):
    rows = [[t % alphabet for t in r] for r in rows]
    k, lo, hi = settings_
    _check(rows, k, lo, hi, pad=lambda i, j: (pad + i * j) % 5)
