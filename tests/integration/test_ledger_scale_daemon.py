"""A report that runs out of its time (issue 22 §6) through a real daemon and the CLI: the
API answers 503 `report_timeout` in the OpenAI error shape, the CLI one line."""
from __future__ import annotations

import time

from helpers.ledger_rows import seed
from test_chargeback import cli, get

H = 3600.0

def test_the_api_answers_a_timed_out_report_with_an_error_and_the_cli_one_line(daemon_factory,
                                                                              tmp_path):
    future = time.time() + 3 * H
    state = tmp_path / "d0" / "state"
    state.mkdir(parents=True)
    seed(state / "ledger.db", 40_000, future, future + 600)
    d = daemon_factory("--devices", "sim:2xH100", "--model-spec", "llama-3.1-8b",
                       model=None, config="[accounting]\nreport_timeout_s = 0.000001\n")
    span = {"since": str(int(future - 60)), "until": str(int(future + 900))}
    code, _, err = get(d, "/admin/v1/usage", **span)
    assert code == 503, err
    assert err["error"]["code"] == "report_timeout" and "report_timeout_s" in err["error"]["message"]
    code, _, err = get(d, "/admin/v1/carbon", **span)
    assert code == 503 and err["error"]["code"] == "report_timeout"
    out = cli("usage", "--url", d.url, "--since", span["since"], "--until", span["until"])
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "503" in lines[0] and "Traceback" not in out.stderr
    # a report the rollups answer quickly still works under the same timeout
    code, _, ok = get(d, "/admin/v1/usage", since="1h")
    assert code == 200, ok
