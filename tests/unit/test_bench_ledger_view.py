"""bench_vs_vllm's readings of a client's run: `ledger_view`, what the run looks like in the
daemon's own ledger, read from a real ledger file (the Ledger's schema, rows written as it
writes them); `output_counts`, aiperf's token counts and ITL from its per-request records;
`request_gflop`, a request's matmul work, against the linear layers of a real model."""
from __future__ import annotations

import json
import sqlite3
import sys
import time
from pathlib import Path

import pytest

from appliance.accounting.ledger import REQUEST_COLUMNS, Ledger, write_rows
from helpers.ledger_rows import row

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from bench_vs_vllm import ledger_file, ledger_view, request_gflop  # noqa: E402


def request(rid: str, arrival: float, first: float, finish: float, status: str = "ok",
            cached: int = 0):
    r = row(rid, "t", finish)._replace(arrival=arrival, first_token=first, status=status,
                                       prompt_tokens=256, output_tokens=64, cached_tokens=cached)
    return tuple(r)


def test_a_run_is_its_window_less_warm_up_and_failures(tmp_path):
    db = tmp_path / "ledger.db"
    Ledger(db, retention_days=0).stop()
    rows = [request("before", 90.0, 90.5, 91.0),            # another client's run
            request("warm0", 100.0, 100.1, 100.5),          # this run's warm-up
            request("a", 101.0, 101.5, 103.0),
            request("b", 101.0, 101.5, 102.0, cached=64),
            request("c", 102.0, 102.5, 105.0),
            request("x", 102.5, 102.6, 102.7, status="error"),
            request("after", 120.0, 120.1, 121.0)]
    conn = sqlite3.connect(db)
    with conn:
        write_rows(conn, "INSERT", "requests", REQUEST_COLUMNS, rows)
    conn.close()
    v = ledger_view(db, 100.0, 110.0, concurrency=2, skip=1)
    assert v["requests"] == 3
    span = 105.0 - 101.0
    assert v["req_s"] == pytest.approx(3 / span)
    assert v["duration_s"] == pytest.approx((2.0 + 1.0 + 3.0) / 3)
    assert v["ttft_s"] == pytest.approx(0.5)
    assert v["cached_tokens"] == pytest.approx(64 / 3)
    assert (v["prompt_tokens"], v["output_tokens"]) == (256, 64)
    assert v["slots_busy"] == pytest.approx(6.0 / (2 * span))
    assert ledger_view(db, 130.0, 140.0, concurrency=2) == {}


def test_the_ledger_is_read_once_it_holds_the_run_or_after_the_timeout(tmp_path):
    """Rows reach the ledger when their accounting window closes, seconds after the run:
    the reader waits for as many as the run sent, and gives up at its timeout."""
    db = tmp_path / "state" / "ledger.db"
    db.parent.mkdir()
    Ledger(db, retention_days=0).stop()
    conn = sqlite3.connect(db)
    with conn:
        write_rows(conn, "INSERT", "requests", REQUEST_COLUMNS,
                   [request("a", 101.0, 101.5, 103.0), request("b", 102.0, 102.5, 104.0)])
    conn.close()
    t = time.monotonic()
    assert ledger_file(tmp_path, 100.0, 110.0, 2, timeout=30.0) == db
    assert time.monotonic() - t < 30.0      # it did not wait out its timeout
    t = time.monotonic()
    assert ledger_file(tmp_path, 100.0, 110.0, 3, timeout=0.6) == db
    assert time.monotonic() - t >= 0.6
    with pytest.raises(SystemExit, match="no ledger.db"):
        ledger_file(tmp_path / "elsewhere", 100.0, 110.0, 1, timeout=0.1)


def test_aiperf_itl_is_also_taken_over_the_servers_own_token_counts(tmp_path):
    """`output_counts`: aiperf's per-request records as it writes them (metrics as plain
    numbers or as {"value", "unit"}), a record without usage, a line that is not JSON."""
    from bench_vs_vllm import output_counts
    records = tmp_path / "profile_export.jsonl"
    lines = [
        {"metadata": {}, "metrics": {"output_token_count": 73, "usage_completion_tokens": 64,
                                      "decode_duration": 6300.0}},
        {"metadata": {}, "metrics": {"output_token_count": {"value": 71, "unit": "tokens"},
                                      "usage_completion_tokens": {"value": 64, "unit": "tokens"},
                                      "decode_duration": {"value": 12600.0, "unit": "ms"}}},
        {"metadata": {}, "metrics": {"output_token_count": 66, "usage_completion_tokens": 64,
                                      "decode_duration": 9450.0}},
        {"metadata": {}, "metrics": {"output_token_count": 70}},            # no usage
    ]
    records.write_text("\n".join(json.dumps(x) for x in lines) + "\nnot json\n")
    got = output_counts(records)
    assert got["tokens_counted"] == pytest.approx((73 + 71 + 66 + 70) / 4)
    assert got["tokens_served"] == 64
    assert got["itl_p50_ms_served_tokens"] == pytest.approx(150.0)     # 100, 200, 150 ms
    empty = output_counts(tmp_path / "missing.jsonl")
    assert all(v != v for v in empty.values())                         # NaN: no records


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_requests_matmul_work_is_what_the_models_linear_layers_hold(family):
    """Counted from the weights transformers builds for the config, not from the formula:
    each Linear in the layers costs 2 x its weights a row, the LM head 2 x its own."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    # qwen3 with head_dim != hidden / heads, as Qwen3's released configs have
    shape = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    if family == "qwen3":
        shape["head_dim"] = 32
    config = AutoConfig.for_model(family, **shape)
    model = AutoModelForCausalLM.from_config(config)
    per_row = sum(2 * m.weight.numel() for m in model.model.layers.modules()
                  if isinstance(m, torch.nn.Linear))
    head = 2 * model.lm_head.weight.numel()
    prompt, output = 9, 5
    expected = ((prompt + output - 1) * per_row + output * head) / 1e9
    assert request_gflop(config.to_dict(), prompt, output) == pytest.approx(expected, rel=1e-12)
