"""Reweighting policies and their combination into mean-1 weights."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strategies import reweighting
from strategies.views import BatchGroup, BatchView


def test_per():
    batch = BatchView([BatchGroup([1.0], 0.5), BatchGroup([-4.0], 0.5)])
    weights, tokens = reweighting.combine([reweighting.build("per")], batch)
    np.testing.assert_allclose(np.concatenate(weights), [2 / 3, 4 / 3], rtol=1e-6)  # 1 : 2
    assert tokens is None


def test_softmax():
    batch = BatchView([BatchGroup([0.0, -math.log(3)], 0.5)])
    weights, _ = reweighting.combine([reweighting.build("softmax")], batch)
    np.testing.assert_allclose(weights[0], [0.5, 1.5])  # e^0 : e^ln3 = 1 : 3


def test_diffband_changes_weights_on_binary_rewards():
    # Binary rewards, every group between 25% and 75% accuracy: DataFlex's band over raw
    # rewards is a no-op here; over pass rates the middle groups are emphasized.
    rates = [0.25, 0.5, 0.5, 0.75]  # quantiles 0.25 / 0.75: 0.4375 and 0.5625
    batch = BatchView([BatchGroup([0.5, -0.5, 0.5, -0.5], r) for r in rates])
    weights, _ = reweighting.combine([reweighting.build("diffband")], batch)
    # 8 samples at 2 and 8 at 1, mean 1.5: weights 4/3 and 2/3.
    for w, expected in zip(weights, [2 / 3, 4 / 3, 4 / 3, 2 / 3], strict=True):
        np.testing.assert_allclose(w, [expected] * 4)


def test_diffband_uniform_rates_are_all_in_band():
    batch = BatchView([BatchGroup([1, -1], 0.5), BatchGroup([1, -1], 0.5)])
    weights, _ = reweighting.combine([reweighting.build("diffband")], batch)
    np.testing.assert_allclose(np.concatenate(weights), [1, 1, 1, 1])


def test_ar_token_weights_from_logprobs():
    batch = BatchView([BatchGroup([1.0, -1.0], 0.5, [[math.log(0.5), 0.0], [math.log(0.5)]])])
    weights, tokens = reweighting.combine([reweighting.build("ar")], batch)
    # raw 0.5*p + 0.5 = [0.75, 1.0] and [0.75]; mean over the 3 tokens is 2.5/3.
    np.testing.assert_allclose(tokens[0][0], np.array([0.75, 1.0]) * 3 / 2.5)
    np.testing.assert_allclose(tokens[0][1], np.array([0.75]) * 3 / 2.5)
    np.testing.assert_array_equal(weights[0], [1, 1])
    with pytest.raises(ValueError, match="token_logprobs"):
        reweighting.combine([reweighting.build("ar")], BatchView([BatchGroup([1.0], 0.5)]))


def test_combine_multiplies_then_renormalizes():
    batch = BatchView([BatchGroup([1.0], 0.2), BatchGroup([-4.0], 0.5), BatchGroup([4.0], 0.9)])
    policies = [reweighting.build("per"), reweighting.build("diffband", focus_weight=3.0)]
    weights, _ = reweighting.combine(policies, batch)
    raw = np.array([1.0, 2.0 * 3.0, 2.0])  # per: 1, 2, 2; diffband: only 0.5 is in band
    np.testing.assert_allclose(np.concatenate(weights), raw * 3 / raw.sum(), rtol=1e-6)


def test_no_policies_means_unit_weights():
    batch = BatchView([BatchGroup([1.0, 2.0], 0.5), BatchGroup([], 0.0)])
    weights, tokens = reweighting.combine([], batch)
    np.testing.assert_array_equal(weights[0], [1, 1])
    assert len(weights[1]) == 0 and tokens is None


frames = st.lists(
    st.tuples(
        st.lists(st.floats(-5, 5), min_size=0, max_size=6),
        st.floats(0, 1),
        st.integers(1, 4),
    ),
    min_size=1,
    max_size=6,
).filter(lambda groups: any(len(adv) for adv, _, _ in groups))


@settings(deadline=None, max_examples=150)
@given(frames, st.sets(st.sampled_from(["per", "softmax", "diffband", "ar"])), st.data())
def test_weights_have_mean_one(groups, names, data):
    batch = BatchView(
        [
            BatchGroup(
                adv,
                rate,
                [
                    data.draw(st.lists(st.floats(-8, 0), min_size=n_tok, max_size=n_tok))
                    for _ in adv
                ],
            )
            for adv, rate, n_tok in groups
        ]
    )
    policies = [reweighting.build(n) for n in sorted(names)]
    weights, tokens = reweighting.combine(policies, batch)
    flat = np.concatenate(weights)
    assert len(flat) == batch.n_samples
    assert flat.mean() == pytest.approx(1.0)
    assert (flat > 0).all()
    if "ar" in names:
        flat_tokens = np.concatenate([t for ts in tokens for t in ts])
        assert flat_tokens.mean() == pytest.approx(1.0)
    else:
        assert tokens is None
