"""Forecasts of a bucketed series (requests/s, mean prompt, mean output ...) with
prediction intervals.

Additive Holt-Winters (level + damped trend + one season): the season is a week (168 hourly
buckets) when there are two weeks of history, a day (24) with two days, none below.
statsmodels' ETS (an optional dependency: `pip install 'applianced[planner]'`) fits it
by maximum likelihood and gives its own intervals; without statsmodels, or for short
history, a small built-in fit (grid search of the smoothing constants on one-step
errors; intervals from the one-step error spread, widened as for simple exponential
smoothing, σ_h = σ·√(1 + (h-1)α²)) does the same job.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

DAY_BUCKETS = 24
WEEK_BUCKETS = 168


@dataclass
class Forecast:
    mean: list[float]
    lower: list[float]
    upper: list[float]
    method: str          # "statsmodels-ets" | "holt-winters" | "holt" | "level"
    season: int          # buckets per season (0 = none)
    level: float         # the prediction interval's coverage, e.g. 0.8 for 10%..90%


def season_for(n: int, bucket_s: float) -> int:
    """Seasonal period in buckets that the history supports (two full seasons)."""
    per_hour = 3600.0 / bucket_s
    if abs(per_hour - round(per_hour)) > 1e-9 or bucket_s > 3600:
        return 0
    week, day = int(WEEK_BUCKETS * per_hour), int(DAY_BUCKETS * per_hour)
    if n >= 2 * week:
        return week
    if n >= 2 * day:
        return day
    return 0


def _hw_run(y: np.ndarray, m: int, alpha: float, beta: float, gamma: float, phi: float = 1.0):
    """One pass of additive Holt-Winters with a damped trend (phi): (sum of squared
    one-step errors, errors, final level, trend, seasonals)."""
    if m:
        level = float(y[:m].mean())
        trend = float((y[m:2 * m].mean() - y[:m].mean()) / m) if len(y) >= 2 * m else 0.0
        season = list(y[:m] - level)
    else:
        level, trend, season = float(y[0]), (float(y[1] - y[0]) if len(y) > 1 else 0.0), []
    errors = []
    for t in range(len(y)):
        s = season[t % m] if m else 0.0
        pred = level + phi * trend + s
        err = y[t] - pred
        errors.append(err)
        new_level = level + phi * trend + alpha * err
        trend = phi * trend + beta * (new_level - level - phi * trend)
        if m:
            season[t % m] = s + gamma * err
        level = new_level
    e = np.asarray(errors[m if m else 1:])
    return float(np.dot(e, e)), e, level, trend, season


def holt_winters(y, horizon: int, season: int, level: float = 0.8) -> Forecast:
    """The built-in fit: smoothing constants from a small grid, least one-step SSE."""
    y = np.asarray(y, dtype=float)
    if len(y) == 0:
        return Forecast([0.0] * horizon, [0.0] * horizon, [0.0] * horizon, "level", 0, level)
    if len(y) < 3:
        mu = float(y.mean())
        return Forecast([mu] * horizon, [mu] * horizon, [mu] * horizon, "level", 0, level)
    m = season if season and len(y) >= 2 * season else 0
    alphas = (0.05, 0.1, 0.2, 0.3, 0.5, 0.8)
    betas = (0.0, 0.01, 0.05)
    gammas = (0.05, 0.1, 0.2, 0.4) if m else (0.0,)
    # Damped trends only: a trend fitted on a few hours must not run on for a week.
    phis = (0.8, 0.9, 0.98)
    best = None
    for a, b, g, phi in itertools.product(alphas, betas, gammas, phis):
        if b == 0.0 and phi != phis[0]:
            continue                      # no trend: phi changes nothing
        sse, e, lv, tr, se = _hw_run(y, m, a, b, g, phi)
        if best is None or sse < best[0]:
            best = (sse, e, lv, tr, se, a, phi)
    _, e, lv, tr, se, a, phi = best
    sigma = float(np.std(e)) if len(e) > 1 else 0.0
    z = NormalDist().inv_cdf(0.5 + level / 2)
    n = len(y)
    mean, lower, upper = [], [], []
    damp = 0.0
    for h in range(1, horizon + 1):
        damp += phi ** h
        f = lv + damp * tr + (se[(n + h - 1) % m] if m else 0.0)
        width = z * sigma * math.sqrt(1 + (h - 1) * a * a)
        mean.append(f)
        lower.append(f - width)
        upper.append(f + width)
    return Forecast(mean, lower, upper, "holt-winters" if m else "holt", m, level)


def _statsmodels_fit(y: np.ndarray, horizon: int, season: int, level: float) -> Forecast | None:
    try:
        import warnings

        import pandas as pd
        from statsmodels.tsa.exponential_smoothing.ets import ETSModel
    except ImportError:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = ETSModel(pd.Series(y), error="add", trend="add", damped_trend=True,
                             seasonal="add", seasonal_periods=season)
            fit = model.fit(disp=False, maxiter=200)
            frame = fit.get_prediction(start=len(y), end=len(y) + horizon - 1).summary_frame(
                alpha=1 - level)
    except Exception:       # a fit that does not converge: the built-in one answers
        return None
    mean = frame["mean"].to_numpy()
    lo, hi = frame["pi_lower"].to_numpy(), frame["pi_upper"].to_numpy()
    if not (np.all(np.isfinite(mean)) and np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))):
        return None
    return Forecast(mean.tolist(), lo.tolist(), hi.tolist(), "statsmodels-ets", season, level)


def forecast(y, horizon: int, bucket_s: float, level: float = 0.8, nonnegative: bool = True,
             use_statsmodels: bool = True) -> Forecast:
    """Forecast `horizon` buckets past `y`; statsmodels when installed and a season fits."""
    y = np.asarray(y, dtype=float)
    season = season_for(len(y), bucket_s)
    fc = None
    if use_statsmodels and season:
        fc = _statsmodels_fit(y, horizon, season, level)
    if fc is None:
        fc = holt_winters(y, horizon, season, level)
    if nonnegative:
        fc.mean = [max(0.0, v) for v in fc.mean]
        fc.lower = [max(0.0, v) for v in fc.lower]
        fc.upper = [max(0.0, v) for v in fc.upper]
    return fc


def mape(actual, predicted) -> float:
    """Mean absolute percentage error over buckets with a non-zero actual."""
    a, p = np.asarray(actual, dtype=float), np.asarray(predicted, dtype=float)
    keep = a != 0
    return float(np.mean(np.abs((a[keep] - p[keep]) / a[keep])))
