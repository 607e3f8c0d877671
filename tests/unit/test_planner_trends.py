"""The trend store: minute rows in SQLite (WAL) that roll up to hours, percentiles from
mergeable histograms, writes off the hot path."""
from __future__ import annotations

import random
import sqlite3
import time

import numpy as np
import pytest

from appliance.accounting.records import RequestRecord
from appliance.planner.trends import BIN_RATIO, MinuteGaps, TrendStore, gap_stats


def rec(i, t, prompt, output, cached=0, ttft=0.2, itl=0.02, status="ok", model="m", choices=1):
    first = t + ttft
    return RequestRecord(f"r{i}", "t", model, "chat", prompt, output, cached, t, first,
                         first + itl * (output / choices - 1), None, None, status, "stop",
                         choices=choices)


def test_minutes_roll_up_and_percentiles(tmp_path):
    est = lambda r: (r.prompt_tokens * 1e-4, r.output_tokens * 1e-3)  # noqa: E731
    store = TrendStore(tmp_path / "ledger.db", est, gpu_source="estimated: test")
    rng = random.Random(1)
    t0 = 1_700_000_000 // 3600 * 3600
    prompts, ttfts = [], []
    for i in range(3000):
        t = t0 + rng.uniform(0, 3600)
        p, o = rng.randint(10, 5000), rng.randint(2, 400)
        ttft = rng.uniform(0.01, 2.0)
        prompts.append(p)
        ttfts.append(ttft)
        store.observe(rec(i, t, p, o, cached=p // 4, ttft=ttft, itl=0.03))
    assert store.flush() == 3000
    minutes = store.buckets("m", 60, t0, t0 + 3600)
    hour, = store.buckets("m", 3600, t0, t0 + 3600)
    assert len(minutes) == 60
    assert sum(b.requests for b in minutes) == hour.requests == 3000
    assert hour.rate == pytest.approx(3000 / 3600)
    assert hour.prompt_mean == pytest.approx(np.mean(prompts))
    assert hour.prefix_hit == pytest.approx(sum(p // 4 for p in prompts) / sum(prompts))
    # Histogram percentiles: within one bin (2^(1/8), ~9%) of the exact ones.
    for q, got in ((0.5, hour.prompt_p50), (0.9, hour.prompt_p90)):
        assert got == pytest.approx(np.quantile(prompts, q), rel=BIN_RATIO - 1)
    assert hour.ttft_p90_s == pytest.approx(np.quantile(ttfts, 0.9), rel=BIN_RATIO - 1)
    assert hour.itl_p50_s == pytest.approx(0.03, rel=BIN_RATIO - 1)
    assert hour.prefill_gpu_s == pytest.approx(sum(prompts) * 1e-4)
    assert hour.rho == pytest.approx(hour.prefill_gpu_s / hour.decode_gpu_s)
    assert hour.gpu_source == "estimated: test"
    store.close()

    # Durable: WAL mode, and the rows are there for the next process.
    db = sqlite3.connect(tmp_path / "ledger.db")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("SELECT SUM(requests) FROM planner_minutes").fetchone()[0] == 3000
    db.close()
    again = TrendStore(tmp_path / "ledger.db")
    again.observe(rec(9999, t0 + 10, 100, 10))
    again.flush()                                 # merges into the existing minute row
    assert again.buckets("m", 3600, t0, t0 + 3600)[0].requests == 3001
    assert again.models() == ["m"] and again.span("m") == (t0, t0 + 3600)
    again.close()


def test_edge_records_and_empty_buckets(tmp_path):
    store = TrendStore(tmp_path / "ledger.db")
    t0 = 1_700_000_040
    store.observe(rec(1, t0, 100, 0, status="rejected"))       # demand, no latency
    store.observe(rec(2, t0 + 1, 100, 1))                      # one token: no ITL
    store.observe(rec(3, t0 + 2, 100, 40, choices=4, itl=0.05))  # 10 tokens per choice
    store.flush()
    b, = store.buckets("m", 60, t0, t0 + 59)
    assert b.requests == 3 and b.itl_p50_s == pytest.approx(0.05, rel=BIN_RATIO - 1)
    assert b.output_p50 is not None and b.output_p90 <= 10 * BIN_RATIO
    gap = store.buckets("m", 60, t0 + 600, t0 + 720)
    assert all(x.requests == 0 and x.rate == 0 and x.prompt_mean is None for x in gap)
    assert store.buckets("other", 60, t0, t0 + 60)[0].requests == 0
    store.close()


def test_writer_thread_batches_off_the_hot_path(tmp_path):
    store = TrendStore(tmp_path / "ledger.db", flush_interval_s=0.05)
    store.start()
    t0 = time.time()
    for i in range(500):
        store.observe(rec(i, t0, 100, 10))       # no I/O here: a deque append
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if sum(b.requests for b in store.buckets("m", 60, t0 - 60, t0 + 60)) == 500:
            break
        time.sleep(0.05)
    assert sum(b.requests for b in store.buckets("m", 60, t0 - 60, t0 + 60)) == 500
    store.observe(rec(501, t0, 100, 10))
    store.close()                                 # flushes what is still queued
    db = sqlite3.connect(tmp_path / "ledger.db")
    assert db.execute("SELECT SUM(requests) FROM planner_minutes").fetchone()[0] == 501


def _onoff(rng, t0: float, seconds: float, rate: float, period: float = 20.0, on: float = 2.0):
    """On/off arrivals at mean `rate`: Poisson at rate·period/on during `on` seconds of
    every `period`, silence the rest."""
    out, t = [], t0
    while t < t0 + seconds:
        start = t
        while True:
            t += rng.expovariate(rate * period / on)
            if t >= start + on:
                break
            out.append(t)
        t = start + period
    return [x for x in out if x < t0 + seconds]


def test_arrival_burstiness_per_minute_in_any_finish_order(tmp_path):
    """c_a² of inter-arrival gaps per minute: ~1 for Poisson, far above for on/off bursts,
    the same whether records come in arrival order or (as finished requests do) shuffled
    across flushes; the prompt-length spread c_L² beside it."""
    rng = random.Random(5)
    t0 = 1_700_000_000 // 3600 * 3600
    poisson, t = [], float(t0)
    while True:
        t += rng.expovariate(5.0)
        if t >= t0 + 1800:
            break
        poisson.append(t)
    bursty = _onoff(rng, t0, 1800, 5.0)
    results = {}
    for name, times in (("poisson", poisson), ("bursty", bursty)):
        store = TrendStore(tmp_path / f"{name}.db")
        order = list(range(len(times)))
        rng.shuffle(order)                      # finish order is not arrival order
        for k, i in enumerate(order):
            store.observe(rec(i, times[i], 1000 + (i % 2) * 2000, 10))   # prompts 1000 or 3000
            if k % 97 == 0:
                store.flush()                   # many flushes, each a partial minute
        store.flush()
        half, = store.buckets("m", 1800, t0, t0 + 1800)
        results[name] = half
        minute = store.buckets("m", 60, t0, t0 + 60)[0]
        assert minute.arrival_gaps == minute.requests - 1
        store.close()
    p, b = results["poisson"], results["bursty"]
    assert p.requests == len(poisson) and b.requests == len(bursty)
    assert p.rate == pytest.approx(b.rate, rel=0.15)        # the same mean rate
    assert 0.85 < p.arrival_scv < 1.15
    assert b.arrival_scv > 4
    assert p.prompt_scv == pytest.approx(0.25, abs=0.02)     # 1000/3000 alike: (1000/2000)²
    # Exact: the weighted mean of per-minute squared CVs of the sorted gaps.
    w = tot = 0.0
    for m in range(30):
        g = np.diff(sorted(x for x in bursty if t0 + 60 * m <= x < t0 + 60 * (m + 1)))
        if len(g):
            w += len(g) * g.var() / g.mean() ** 2
            tot += len(g)
    assert b.arrival_scv == pytest.approx(w / tot)


def test_old_ledger_gains_the_burstiness_columns(tmp_path):
    """A ledger.db written before the burstiness columns: rows stay, columns appear,
    and a minute another process wrote keeps its gap sums (this process saw none of it)."""
    path = tmp_path / "ledger.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE planner_minutes (model TEXT NOT NULL, minute INTEGER NOT NULL, "
               "requests INTEGER NOT NULL, prompt_sum REAL NOT NULL, output_sum REAL NOT NULL, "
               "cached_sum REAL NOT NULL, prefill_gpu_s REAL NOT NULL, decode_gpu_s REAL NOT NULL, "
               "ttft_sum REAL NOT NULL, ttft_n INTEGER NOT NULL, itl_sum REAL NOT NULL, "
               "itl_n INTEGER NOT NULL, hist TEXT NOT NULL, gpu_source TEXT NOT NULL, "
               "PRIMARY KEY (model, minute))")
    t0 = 1_700_000_040
    db.execute("INSERT INTO planner_minutes VALUES ('m', ?, 2, 200, 20, 0, 0, 0, 0, 0, 0, 0, "
               "'{}', 'old')", (t0 // 60,))
    db.commit()
    db.close()
    store = TrendStore(path)
    b, = store.buckets("m", 60, t0, t0 + 59)
    assert b.requests == 2 and b.arrival_scv is None and b.arrival_gaps == 0
    store.observe(rec(1, t0 + 1, 100, 10))
    store.observe(rec(2, t0 + 3, 100, 10))
    store.flush()
    b, = store.buckets("m", 60, t0, t0 + 59)
    assert b.requests == 4 and b.arrival_gaps == 0          # not ours to measure
    store.observe(rec(3, t0 + 61, 100, 10))
    store.observe(rec(4, t0 + 62, 100, 10))
    store.observe(rec(5, t0 + 64, 100, 10))
    store.flush()
    b = store.buckets("m", 60, t0 + 60, t0 + 119)[0]
    assert b.arrival_gaps == 2 and b.arrival_scv == pytest.approx(((1 - 1.5) ** 2 + 0.25) / 2 / 1.5 ** 2)
    store.close()


def test_minute_gaps_kept_up_to_date_in_any_order():
    """Inserting arrivals one by one in random order (ties too) keeps the same gap sums
    as a pass over the sorted minute."""
    rng = random.Random(2)
    for _ in range(200):
        ts = [rng.uniform(0, 60) for _ in range(rng.randint(0, 40))]
        ts += ts[:rng.randint(0, 3)]
        g = MinuteGaps()
        for t in ts:
            g.add(t)
        n, total, sq = gap_stats(sorted(ts))
        assert g.times == sorted(ts)
        assert g.n == n and g.sum == pytest.approx(total) and g.stats()[2] == pytest.approx(sq)
