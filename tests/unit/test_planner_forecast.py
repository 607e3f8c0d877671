"""Forecasts: a known daily pattern plus noise, the last day held back, within 15% MAPE
on hourly buckets; with and without statsmodels; and through the trend store."""
from __future__ import annotations

import builtins
import math
import random

import numpy as np
import pytest

from appliance.accounting.records import RequestRecord
from appliance.planner import forecast as fc
from appliance.planner.trends import TrendStore, series

DAYS = 5


def daily(h: np.ndarray) -> np.ndarray:
    """Requests/s by hour of day: a night trough, a working-day plateau, an evening bump."""
    hod = h % 24
    return 0.05 + 0.1 * (1 + np.sin(2 * np.pi * (hod - 9) / 24)) + 0.08 * ((hod >= 9) & (hod < 18))


def test_season_detection():
    assert fc.season_for(47, 3600) == 0
    assert fc.season_for(48, 3600) == 24
    assert fc.season_for(2 * 168, 3600) == 168
    assert fc.season_for(2 * 24 * 60, 60) == 24 * 60
    assert fc.season_for(500, 5000) == 0


def test_builtin_holt_winters_mape_on_held_back_day():
    rng = np.random.default_rng(7)
    h = np.arange(24 * DAYS)
    y = daily(h) * (1 + rng.normal(0, 0.05, len(h)))
    f = fc.forecast(y[:-24], 24, 3600, use_statsmodels=False)
    assert f.method == "holt-winters" and f.season == 24
    assert fc.mape(y[-24:], f.mean) <= 0.15
    # The 80% interval holds most of the held-back day and is ordered.
    inside = np.mean((y[-24:] >= f.lower) & (y[-24:] <= f.upper))
    assert inside >= 0.5
    assert all(lo <= m <= hi for lo, m, hi in zip(f.lower, f.mean, f.upper))
    # A forecast that ignored the season would miss by far more.
    flat = fc.forecast(y[:-24], 24, 3600, use_statsmodels=False)
    flat_mean = np.full(24, np.mean(y[:-24]))
    assert fc.mape(y[-24:], flat_mean) > 2 * fc.mape(y[-24:], flat.mean)


def test_statsmodels_absent_falls_back(monkeypatch):
    real_import = builtins.__import__

    def no_statsmodels(name, *args, **kwargs):
        if name.startswith("statsmodels"):
            raise ImportError("statsmodels hidden by the test")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_statsmodels)
    rng = np.random.default_rng(3)
    h = np.arange(24 * DAYS)
    y = daily(h) * (1 + rng.normal(0, 0.05, len(h)))
    f = fc.forecast(y[:-24], 24, 3600)          # asks for statsmodels, gets the built-in
    assert f.method == "holt-winters"
    assert fc.mape(y[-24:], f.mean) <= 0.15


def test_statsmodels_ets_when_installed():
    pytest.importorskip("statsmodels")
    rng = np.random.default_rng(11)
    h = np.arange(24 * DAYS)
    y = daily(h) * (1 + rng.normal(0, 0.05, len(h)))
    f = fc.forecast(y[:-24], 24, 3600)
    assert f.method == "statsmodels-ets"
    assert fc.mape(y[-24:], f.mean) <= 0.15


def test_short_history_and_damped_trend():
    f = fc.forecast([], 5, 60)
    assert f.mean == [0.0] * 5
    f = fc.forecast([2.0, 2.0], 3, 60)
    assert f.method == "level" and f.mean == [2.0, 2.0, 2.0]
    # A rising hour must not become a runaway week: the trend is damped.
    y = np.linspace(1.0, 2.0, 60)
    f = fc.forecast(y, 7 * 24 * 60, 60, use_statsmodels=False)
    # (phi <= 0.98: the trend adds at most phi / (1 - phi) = 49 more steps of its slope,
    # where an undamped one would add 10,080.)
    assert f.method == "holt" and 2.0 < f.mean[-1] < 2.0 + 50 * (1.0 / 59)


def test_seasonal_load_through_the_trend_store(tmp_path):
    """Poisson arrivals at the daily pattern for 5 days, written as request records, read
    back as hourly buckets, forecast on 4 days: the 5th day within 15% MAPE."""
    store = TrendStore(tmp_path / "ledger.db")
    rng = random.Random(5)
    t0 = 1_700_006_400 // 86400 * 86400           # midnight UTC
    n = 0
    for hour in range(24 * DAYS):
        lam = float(daily(np.array([hour]))[0])
        t = t0 + hour * 3600.0
        end = t + 3600.0
        while True:
            t += rng.expovariate(lam)
            if t >= end:
                break
            store.observe(RequestRecord(f"r{n}", "t", "m", "completions", 1000, 50, 0, t,
                                        t + 0.1, t + 1.0, None, None, "ok", "length"))
            n += 1
    assert store.flush() == n
    buckets = store.buckets("m", 3600, t0, t0 + 24 * DAYS * 3600)
    assert len(buckets) == 24 * DAYS and sum(b.requests for b in buckets) == n
    rate = series(buckets, "rate")
    f = fc.forecast(rate[:-24], 24, 3600, use_statsmodels=False)
    err = fc.mape(rate[-24:], f.mean)
    assert err <= 0.15, err
    assert math.isclose(buckets[0].prompt_mean, 1000) and buckets[0].output_p50 == pytest.approx(50, rel=0.1)
    store.close()
