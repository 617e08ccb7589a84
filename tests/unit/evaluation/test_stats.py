import math

import numpy as np
import pytest

from marft_lg.evaluation.stats import (
    bootstrap_ci,
    detectable_effect,
    format_ci,
    minimum_detectable_effect,
    paired_bootstrap,
    paired_differences,
)


def test_ci_covers_true_mean_at_roughly_nominal_rate():
    rng = np.random.default_rng(1234)
    true_mean, trials, covered = 0.3, 300, 0
    for t in range(trials):
        baseline = rng.normal(0.5, 1.0, size=40)
        candidate = baseline + rng.normal(true_mean, 0.5, size=40)
        ci = paired_bootstrap(baseline, candidate, n_resamples=500, seed=t)
        covered += ci.low <= true_mean <= ci.high
    rate = covered / trials
    # Percentile bootstrap at n=40 sits slightly under 95%; far from it means a broken interval.
    assert 0.89 <= rate <= 0.98, rate


def test_pairing_removes_shared_noise():
    rng = np.random.default_rng(0)
    shared = rng.normal(0, 10.0, size=50)
    baseline, candidate = shared, shared + 0.2 + rng.normal(0, 0.01, size=50)
    paired = paired_bootstrap(baseline, candidate)
    assert paired.low > 0.15 and paired.high < 0.25
    unpaired_width = bootstrap_ci(candidate).high - bootstrap_ci(candidate).low
    assert paired.high - paired.low < unpaired_width / 50


def test_constant_differences_give_zero_width_interval():
    ci = bootstrap_ci([0.5] * 7)
    assert ci.mean == ci.low == ci.high == 0.5
    assert ci.defined


def test_single_pair_has_undefined_interval():
    ci = bootstrap_ci([1.25])
    assert ci.mean == 1.25 and ci.n == 1
    assert math.isnan(ci.low) and not ci.defined
    assert ci.to_dict()["low"] is None


def test_empty_and_nan_pairs_are_dropped_and_counted():
    ci = paired_bootstrap([1.0, float("nan"), 2.0, 3.0], [2.0, 5.0, float("nan"), 4.0])
    assert ci.n == 2 and ci.dropped == 2 and ci.mean == 1.0
    empty = bootstrap_ci([])
    assert empty.n == 0 and math.isnan(empty.mean) and not empty.defined


def test_same_seed_same_interval_and_validation():
    d = np.random.default_rng(3).normal(size=20)
    assert bootstrap_ci(d, seed=5) == bootstrap_ci(d, seed=5)
    with pytest.raises(ValueError, match="equal lengths"):
        paired_differences([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="confidence"):
        bootstrap_ci([1.0, 2.0], confidence=1.5)


def test_mde_matches_a_hand_computation():
    # d = [1, -1, 1, -1]: sample SD sqrt(4/3); z_0.975 = 1.959964, z_0.8 = 0.841621
    expected = (1.959964 + 0.841621) * math.sqrt(4 / 3) / math.sqrt(4)
    assert minimum_detectable_effect([1.0, -1.0, 1.0, -1.0]) == pytest.approx(expected, rel=1e-5)
    assert expected == pytest.approx(1.6175, abs=1e-4)
    # a stricter test at higher power needs a larger effect
    assert minimum_detectable_effect([1.0, -1.0, 1.0, -1.0], alpha=0.01, power=0.9) == pytest.approx(
        (2.575829 + 1.281552) * math.sqrt(4 / 3) / 2, rel=1e-5)


def test_mde_shrinks_as_one_over_sqrt_n():
    rng = np.random.default_rng(7)
    mdes = {}
    for n in (25, 100, 400):
        x = rng.normal(size=n)
        mdes[n] = minimum_detectable_effect((x - x.mean()) / x.std(ddof=1) * 0.7)  # sample SD exactly 0.7
    assert mdes[25] / mdes[100] == pytest.approx(2.0) and mdes[100] / mdes[400] == pytest.approx(2.0)
    assert detectable_effect(rng.normal(size=9)).n == 9


def test_a_true_effect_of_one_mde_is_detected_at_about_the_stated_power():
    rng = np.random.default_rng(11)
    n, sd = 64, 1.0
    effect = (1.959964 + 0.841621) * sd / math.sqrt(n)
    rejected = 0
    for _ in range(1000):
        d = rng.normal(effect, sd, size=n)
        rejected += abs(d.mean()) / (d.std(ddof=1) / math.sqrt(n)) > 1.959964
    assert 0.74 <= rejected / 1000 <= 0.86


def test_mde_is_undefined_without_two_pairs_or_without_spread():
    one = detectable_effect([0.3])
    assert one.n == 1 and math.isnan(one.mde) and math.isnan(one.sd)
    assert one.to_dict()["mde"] is None and one.to_dict()["sd"] is None
    tied = detectable_effect([0.0] * 6)
    assert tied.n == 6 and tied.sd == 0.0 and math.isnan(tied.mde)
    dropped = detectable_effect([1.0, float("nan"), -1.0])
    assert dropped.n == 2 and dropped.mde == pytest.approx(2.801585 * math.sqrt(2) / math.sqrt(2), rel=1e-5)
    with pytest.raises(ValueError, match="power"):
        minimum_detectable_effect([1.0, 2.0], power=1.0)
    with pytest.raises(ValueError, match="alpha"):
        minimum_detectable_effect([1.0, 2.0], alpha=0.0)


def test_format_ci_is_the_one_way_a_difference_and_its_interval_are_printed():
    assert format_ci(0.125, 0.03125, -0.2) == "+0.125 [+0.031, -0.200]"
    assert format_ci(0.1, float("nan"), None) == "+0.100 [n/a, n/a]"
    ci = paired_bootstrap([0.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], seed=0)
    assert format_ci(ci.mean, ci.low, ci.high) == f"{ci.mean:+.3f} [{ci.low:+.3f}, {ci.high:+.3f}]"
