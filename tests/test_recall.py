"""The recall study's synthetic tasks: every scored value is the one its key was paired with earlier."""

import numpy as np
import pytest

from kimi_jax.analysis import recall


def _check_recallable(ids, scored):
    for row, marks in zip(ids, scored):
        at = np.flatnonzero(marks)
        assert len(at) > 0
        for t in at:
            key, value = row[t - 1], row[t]
            assert recall.KEY0 <= key < recall.VALUE0 and recall.VALUE0 <= value < recall.FILLER0
            earlier = [j for j in range(t - 1) if row[j] == key]
            assert earlier, "a query's key must have been seen before"
            assert row[earlier[0] + 1] == value, "the scored value is the one paired with the key first"


@pytest.mark.parametrize("length", [64, 128, 512])
def test_mqar_pairs_then_spread_queries(length):
    ids, scored = recall.mqar(np.random.default_rng(length), 4, length)
    assert ids.shape == scored.shape == (4, length) and ids.max() < recall.VOCAB
    n = length // recall.PAIRS_PER
    assert (scored.sum(1) == n).all()
    keys = ids[:, 0:2 * n:2]
    assert all(len(set(k)) == n for k in keys)  # distinct keys: each query has one answer
    _check_recallable(ids, scored)
    # the queries are spread over the rest, not packed right after the pairs
    last = np.array([np.flatnonzero(s).max() for s in scored])
    assert (last > 4 * n).any()


@pytest.mark.parametrize("length", [64, 256])
def test_needle_values_follow_their_keys(length):
    ids, scored = recall.needle(np.random.default_rng(length), 4, length)
    assert (scored.sum(1) == recall.NEEDLES).all()
    _check_recallable(ids, scored)


def test_too_short_is_refused():
    with pytest.raises(ValueError, match="too short"):
        recall.needle(np.random.default_rng(0), 1, 8)
