"""Group-relative advantages from valid rewards only."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qwengyre.rollout.groups import group_advantages


def test_mean_centred_by_hand():
    assert group_advantages({1: 1.0, 2: 0.0, 3: 0.0, 4: 1.0}) == {1: 0.5, 2: -0.5, 3: -0.5, 4: 0.5}


def test_std_scaled_by_hand():
    adv = group_advantages({1: 1.0, 2: 0.0}, scale_by_std=True, eps=0.0)
    assert adv == pytest.approx({1: 1.0, 2: -1.0})


def test_a_missing_reward_is_not_a_zero():
    # Execution 3 had no valid assessment: it is absent, and the others are not pulled
    # down by an invented zero.
    assert group_advantages({1: 1.0, 2: 1.0}) == {1: 0.0, 2: 0.0}


def test_refusals():
    with pytest.raises(ValueError, match="at least one valid reward"):
        group_advantages({})
    assert group_advantages({1: 1.0}) == {1: 0.0}
    with pytest.raises(ValueError, match="finite"):
        group_advantages({1: 1.0, 2: math.nan})


@given(st.dictionaries(st.integers(0, 50), st.floats(-10, 10), min_size=2, max_size=20))
def test_advantages_sum_to_zero(rewards):
    for scaled in (False, True):
        adv = group_advantages(rewards, scale_by_std=scaled)
        assert set(adv) == set(rewards)
        assert abs(sum(adv.values())) < 1e-6 * max(1.0, len(adv))
