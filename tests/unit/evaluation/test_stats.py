import math

import numpy as np
import pytest

from marft_lg.evaluation.stats import bootstrap_ci, paired_bootstrap, paired_differences


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
