"""Domain mixers (static, reward_gap, dump_ucb, tscl), the floor and deficit admission."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strategies import PolicyError, mixing


def test_floor_procedure_repeats_until_none_is_below():
    # Pinning the 0 share at 0.05 rescales the others to 0.95, which pushes 0.052 under
    # the floor, so it is pinned too and the last share gets 0.9.
    np.testing.assert_allclose(
        mixing.apply_floor(np.array([0.0, 0.052, 0.948]), 0.05), [0.05, 0.05, 0.9]
    )
    np.testing.assert_allclose(
        mixing.apply_floor(np.array([2.0, 1.0, 1.0]), 0.05), [0.5, 0.25, 0.25]
    )


def test_floor_too_large_for_domain_count():
    with pytest.raises(PolicyError) as info:
        mixing.build("static", domains=[f"d{i}" for i in range(21)])  # 21 x 0.05 > 1
    assert info.value.field == "floor"


def test_static_proportions():
    assert mixing.build("static", domains=["a", "b"]).proportions() == {"a": 0.5, "b": 0.5}
    mixer = mixing.build("static", domains=["a", "b", "c"], proportions={"a": 3, "b": 1})
    np.testing.assert_allclose(list(mixer.proportions().values()), [0.7125, 0.2375, 0.05])
    with pytest.raises(PolicyError) as info:
        mixing.build("static", domains=["a"], proportions={"z": 1.0})
    assert info.value.field == "proportions"


def test_reward_gap_favors_the_lagging_domain_after_warmup():
    mixer = mixing.build("reward_gap", domains=["math", "code"])
    for _ in range(15):
        mixer.observe("math", reward_mean=0.8, adv_abs_mean=0.3)
        mixer.observe("code", reward_mean=0.2, adv_abs_mean=0.3)
    mixer.observe("math", 0.8, 0.3)
    assert mixer.proportions() == {"math": 0.5, "code": 0.5}  # 31 groups: still warming up
    mixer.observe("code", 0.2, 0.3)  # 32nd group
    # logits (0.8 - m_d) / 0.2: math 0, code 3 -> code e^3 / (1 + e^3) = 0.9526 -> floor
    np.testing.assert_allclose(list(mixer.proportions().values()), [0.05, 0.95])


def test_reward_gap_responds_when_the_gap_flips():
    mixer = mixing.build("reward_gap", domains=["a", "b"], warmup=0, update_every=1, window=4)
    for _ in range(4):
        mixer.observe("a", 0.5, 0.1)
        mixer.observe("b", 0.6, 0.1)
    shares = mixer.proportions()
    assert shares["a"] == pytest.approx(1 / (1 + math.exp(-0.5)))  # gap 0.1 / T 0.2
    for _ in range(4):
        mixer.observe("a", 0.9, 0.1)  # a overtakes b within its window
    assert mixer.proportions()["b"] == pytest.approx(1 / (1 + math.exp(-1.5)))


def test_domain_without_data_gets_the_largest_share():
    mixer = mixing.build("reward_gap", domains=["a", "b", "c"], warmup=0, update_every=1)
    mixer.observe("a", 0.5, 0.0)
    mixer.observe("b", 0.9, 0.0)
    shares = mixer.proportions()  # logits a 2, b 0, c (no data) ties the top: 2
    assert shares["c"] == shares["a"] == pytest.approx(math.e**2 / (2 * math.e**2 + 1))


def test_dump_ucb_uses_real_visit_counts():
    mixer = mixing.build("dump_ucb", domains=["common", "rare"], warmup=0, update_every=1)
    for _ in range(3):
        mixer.observe("common", 0.5, adv_abs_mean=0.5)
    mixer.observe("rare", 0.5, adv_abs_mean=0.5)
    assert mixer.counts() == {"common": 3, "rare": 1}
    # N = 4: bonus sqrt(2 ln 5 / (n_d + 1)); softmax over UCB / 0.5
    gap = (math.sqrt(2 * math.log(5) / 2) - math.sqrt(2 * math.log(5) / 4)) / 0.5
    assert mixer.proportions()["rare"] == pytest.approx(1 / (1 + math.exp(-gap)))
    assert mixer.proportions()["rare"] > 0.6


def test_tscl_reacts_to_reward_slope():
    mixer = mixing.build(
        "tscl", domains=["rising", "flat"], warmup=0, update_every=1, window=10, temperature=0.5
    )
    for i in range(10):
        mixer.observe("rising", reward_mean=0.1 * i, adv_abs_mean=0.2)
        mixer.observe("flat", reward_mean=0.5, adv_abs_mean=0.2)
    assert mixer.slope("rising") == pytest.approx(0.9)  # reward change across the window
    assert mixer.slope("flat") == pytest.approx(0.0)
    # logits |slope| / 0.5: rising 1.8, flat 0
    assert mixer.proportions()["rising"] == pytest.approx(1 / (1 + math.exp(-1.8)))
    for i in range(10):
        mixer.observe("flat", reward_mean=1.0 - 0.05 * i, adv_abs_mean=0.2)  # forgetting
    assert mixer.slope("flat") == pytest.approx(-0.45)
    # logits: rising 1.8, flat 0.9
    assert mixer.proportions()["flat"] == pytest.approx(1 / (1 + math.exp(0.9)))


def test_update_every_holds_targets_between_updates():
    mixer = mixing.build("reward_gap", domains=["a", "b"], warmup=2, update_every=3)
    mixer.observe("a", 1.0, 0.0)
    mixer.observe("b", 0.0, 0.0)  # 2 groups: first update
    first = mixer.proportions()
    mixer.observe("b", 1.0, 0.0)
    mixer.observe("b", 1.0, 0.0)
    assert mixer.proportions() == first  # 4 groups: no update yet
    mixer.observe("b", 1.0, 0.0)  # 5 groups: update (b now 0.75 mean)
    assert mixer.proportions() != first


def test_unknown_domain_and_bad_parameters():
    mixer = mixing.build("reward_gap", domains=["a", "b"])
    with pytest.raises(PolicyError) as info:
        mixer.observe("c", 0.5, 0.1)
    assert info.value.field == "domain"
    for name, params, field in [
        ("reward_gap", {"temp": 0.2}, "temp"),
        ("dump_ucb", {"c": "1"}, "c"),
        ("tscl", {"window": 0}, "window"),
        ("static", {"floor": "0.05"}, "floor"),
        ("ucb", {}, "mixing"),
    ]:
        with pytest.raises(PolicyError) as info:
            mixing.build(name, domains=["a", "b"], **params)
        assert info.value.field == field


def test_mixer_state_round_trip_through_json():
    mixer = mixing.build("dump_ucb", domains=["a", "b"], warmup=4, update_every=3)
    for i in range(9):
        mixer.observe("a" if i % 3 else "b", 0.1 * i, 0.05 * i)
    restored = mixing.build("dump_ucb", domains=["a", "b"], warmup=4, update_every=3)
    restored.load_state_dict(json.loads(json.dumps(mixer.state_dict())))
    assert restored.proportions() == mixer.proportions()
    assert restored.counts() == mixer.counts() == {"a": 6, "b": 3}
    for m in (mixer, restored):
        m.observe("a", 0.3, 0.1)
    assert restored.proportions() == mixer.proportions()


observations = st.lists(st.tuples(st.integers(0, 3), st.floats(0, 1), st.floats(0, 2)), max_size=60)


@settings(deadline=None, max_examples=100)
@given(
    st.sampled_from(["static", "reward_gap", "dump_ucb", "tscl"]),
    st.integers(1, 4),
    st.floats(0, 0.25),
    observations,
)
def test_proportions_sum_to_one_and_respect_floor(name, n_domains, floor, obs):
    domains = [f"d{i}" for i in range(n_domains)]
    mixer = mixing.build(name, domains=domains, floor=floor, warmup=5, update_every=2, window=8)
    for d, reward, adv in obs:
        if d < n_domains:
            mixer.observe(domains[d], reward, adv)
        shares = mixer.proportions()
        assert list(shares) == domains
        assert sum(shares.values()) == pytest.approx(1.0)
        assert min(shares.values()) >= floor - 1e-12


def test_deficit_admitter_is_deterministic_with_ties_by_domain_order():
    admitter = mixing.DeficitAdmitter(["a", "b", "c"])
    picks = [admitter.choose({"a": 0.5, "b": 0.25, "c": 0.25}) for _ in range(8)]
    assert picks == ["a", "b", "c", "a", "a", "b", "c", "a"]
    assert admitter.shares() == {"a": 0.5, "b": 0.25, "c": 0.25}
    assert admitter.choose({"a": 0.5, "b": 0.25, "c": 0.25}, available={"b", "c"}) == "b"


def test_deficit_admitter_window_and_state():
    admitter = mixing.DeficitAdmitter(["a", "b"], window=4)
    for d in ["a", "a", "a", "a", "b"]:
        admitter.record(d)
    assert admitter.shares() == {"a": 0.75, "b": 0.25}  # the oldest "a" left the window
    restored = mixing.DeficitAdmitter(["a", "b"], window=4)
    restored.load_state_dict(json.loads(json.dumps(admitter.state_dict())))
    assert restored.shares() == admitter.shares()
    targets = {"a": 0.5, "b": 0.5}
    assert restored.choose(targets) == admitter.choose(targets) == "b"


@settings(deadline=None, max_examples=60)
@given(st.lists(st.floats(0, 1), min_size=1, max_size=5).filter(lambda w: sum(w) > 0.1))
def test_deficit_admitter_realized_shares_converge_to_targets(raw):
    domains = [f"d{i}" for i in range(len(raw))]
    targets = {d: w / sum(raw) for d, w in zip(domains, raw, strict=True)}
    admitter = mixing.DeficitAdmitter(domains, window=200)
    for _ in range(600):
        admitter.choose(targets)
    realized = admitter.shares()
    for d in domains:
        assert abs(realized[d] - targets[d]) <= 0.02


def test_static_targets_follow_config_after_restore():
    old = mixing.build("static", domains=["a", "b"], proportions={"a": 0.9, "b": 0.1})
    old.observe("a", 0.5, 0.1)
    new = mixing.build("static", domains=["a", "b"], proportions={"a": 0.25, "b": 0.75})
    new.load_state_dict(json.loads(json.dumps(old.state_dict())))
    assert new.proportions() == {"a": 0.25, "b": 0.75}
    assert new.counts() == {"a": 1, "b": 0}
