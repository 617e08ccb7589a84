"""Paired bootstrap confidence intervals for "candidate minus baseline" differences, and the
smallest difference a comparison of that size could detect.

The unit of resampling is the scenario (or mirrored pair): each contributes one paired difference,
so run-to-run noise shared by both sides cancels and the interval reflects scenario variety.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from statistics import NormalDist

import numpy as np


@dataclass(frozen=True)
class PairedCI:
    """Mean paired difference with a percentile-bootstrap interval.

    `n` counts the pairs used; `dropped` counts pairs with a missing (NaN) side, left out.
    With fewer than two pairs the interval is undefined and `low`/`high` are NaN.
    """

    mean: float
    low: float
    high: float
    n: int
    confidence: float
    dropped: int = 0

    @property
    def defined(self) -> bool:
        return self.n >= 2 and not (math.isnan(self.low) or math.isnan(self.high))

    def to_dict(self) -> dict:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(self).items()}


def format_ci(mean: float | None, low: float | None, high: float | None) -> str:
    """``+0.125 [+0.031, +0.219]``: a difference and its 95% interval as every report and table prints them (``n/a``
    for a missing or undefined bound)."""
    return f"{_signed(mean)} [{_signed(low)}, {_signed(high)}]"


def _signed(v: float | None) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:+.3f}"


def paired_differences(baseline: Sequence[float], candidate: Sequence[float]) -> np.ndarray:
    """candidate[i] - baseline[i] as floats (NaN where either side is missing)."""
    b = np.asarray(baseline, dtype=float)
    c = np.asarray(candidate, dtype=float)
    if b.shape != c.shape:
        raise ValueError(f"paired samples need equal lengths; got baseline {b.shape} and candidate {c.shape}")
    return c - b


def bootstrap_ci(
    differences: Sequence[float],
    *,
    confidence: float = 0.95,
    n_resamples: int = 2000,
    seed: int = 0,
) -> PairedCI:
    """Percentile bootstrap CI of the mean of `differences` (NaNs are dropped and counted)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1); got {confidence}")
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1; got {n_resamples}")
    d = np.asarray(differences, dtype=float).ravel()
    finite = d[~np.isnan(d)]
    dropped = int(d.size - finite.size)
    n = int(finite.size)
    if n == 0:
        return PairedCI(math.nan, math.nan, math.nan, 0, confidence, dropped)
    mean = float(finite.mean())
    if n == 1:
        return PairedCI(mean, math.nan, math.nan, 1, confidence, dropped)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(n_resamples, n))
    means = finite[idx].mean(axis=1)
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    # A constant sample gives a zero-width interval; keep it exactly at the mean (no float noise).
    if np.all(finite == finite[0]):
        low = high = mean
    return PairedCI(mean, float(low), float(high), n, confidence, dropped)


def paired_bootstrap(
    baseline: Sequence[float],
    candidate: Sequence[float],
    *,
    confidence: float = 0.95,
    n_resamples: int = 2000,
    seed: int = 0,
) -> PairedCI:
    """Bootstrap CI of mean(candidate - baseline) over aligned pairs."""
    return bootstrap_ci(paired_differences(baseline, candidate), confidence=confidence,
                        n_resamples=n_resamples, seed=seed)


@dataclass(frozen=True)
class DetectableEffect:
    """The minimum detectable effect (`mde`) of a paired comparison over `n` pairs whose differences have
    sample SD `sd`, for a two-sided test at level `alpha` with the given `power`.

    `mde` is NaN when it cannot be estimated: fewer than two pairs, or no spread in the differences.
    """

    mde: float
    n: int
    sd: float
    alpha: float
    power: float

    def to_dict(self) -> dict:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(self).items()}


def detectable_effect(differences: Sequence[float], *, alpha: float = 0.05, power: float = 0.8) -> DetectableEffect:
    """The smallest mean paired difference a two-sided test over these pairs would detect with `power`:
    (z_{1-alpha/2} + z_{power}) * sd / sqrt(n), sd the sample SD (ddof 1) of the differences (NaNs dropped).

    Fewer than two pairs leave the SD unknown, and a sample with no spread (e.g. every pair tied, common
    with few pairs of a 0/1 metric) does not show the noise is zero: both give an NaN `mde`, not 0.
    """
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1); got {alpha}")
    if not 0.0 < power < 1.0:
        raise ValueError(f"power must be in (0, 1); got {power}")
    d = np.asarray(differences, dtype=float).ravel()
    finite = d[~np.isnan(d)]
    n = int(finite.size)
    sd = float(finite.std(ddof=1)) if n >= 2 else math.nan
    if n < 2 or sd == 0.0:
        return DetectableEffect(math.nan, n, sd, alpha, power)
    z = NormalDist().inv_cdf(1.0 - alpha / 2.0) + NormalDist().inv_cdf(power)
    return DetectableEffect(z * sd / math.sqrt(n), n, sd, alpha, power)


def minimum_detectable_effect(differences: Sequence[float], *, alpha: float = 0.05, power: float = 0.8) -> float:
    """`detectable_effect(...).mde`: the smallest mean difference these pairs would detect (NaN if unknown)."""
    return detectable_effect(differences, alpha=alpha, power=power).mde
