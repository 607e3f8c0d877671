"""The trend store: minute rows in SQLite (WAL) that roll up to hours, percentiles from
mergeable histograms, writes off the hot path."""
from __future__ import annotations

import random
import sqlite3
import time

import numpy as np
import pytest

from appliance.accounting.records import RequestRecord
from appliance.planner.trends import BIN_RATIO, TrendStore


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
