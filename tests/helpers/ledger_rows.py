"""Ledger rows written straight to a file: the raw request rows the scale tests (unit) and
the report-timeout test (integration) seed a ledger with."""
from __future__ import annotations

import sqlite3

from appliance.accounting.ledger import REQUEST_COLUMNS, Ledger, RequestRow, write_rows


def row(rid: str, tenant: str, finish: float, gpu: float = 1.0, final: int = 1) -> RequestRow:
    values = dict.fromkeys(REQUEST_COLUMNS, 0)
    values.update(request_id=rid, tenant=tenant, model="m", site="s1", appliance="app1",
                  endpoint="chat", status="ok", finish_reason="stop", arrival=finish - 2,
                  first_token=finish - 1, finish=finish, prompt_tokens=100, output_tokens=10,
                  choices=1, prefill_worker="p0", decode_worker="d0", prefill_gpu_s=gpu / 4,
                  decode_gpu_s=gpu * 3 / 4, prefill_j=100.0 * gpu, decode_j=300.0 * gpu,
                  prefill_cost_usage=0.001 * gpu, decode_cost_usage=0.003 * gpu,
                  prefill_co2e_op_g=0.01 * gpu, decode_co2e_op_g=0.03 * gpu,
                  prefill_co2e_emb_g=0.001, decode_co2e_emb_g=0.002, intensity_g_per_kwh=480.0,
                  intensity_source="static", intensity_kind="average", intensity_factor="",
                  pue=1.56, energy_source="measured", final=final)
    return RequestRow(**values)


def seed(path, n: int, t0: float, t1: float, prefix: str = "S") -> None:
    """`n` request rows finishing evenly over [t0, t1), written straight to the file."""
    Ledger(path, retention_days=0).stop()
    conn = sqlite3.connect(path)
    step = (t1 - t0) / n
    rows = [tuple(row(f"{prefix}{i}", ("ta", "tb", "tc")[i % 3], t0 + i * step)) for i in range(n)]
    with conn:
        write_rows(conn, "INSERT", "requests", REQUEST_COLUMNS, rows)
    conn.close()
