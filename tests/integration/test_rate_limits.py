"""Per-tenant rate limits (issue 27 §2): token buckets, OpenAI's 429 and x-ratelimit-*
headers, the official client backing off, the tenants view, and reload without restart
(admin API, `applianced reload`, SIGHUP) with a real config file edited on disk."""
from __future__ import annotations

import hashlib
import json
import re
import signal
import sqlite3
import subprocess
import sys
import time

import openai
import pytest

from appliance import config
from appliance.config import BudgetsConfig, ConfigError, TenantConfig
from appliance.daemon.tenants import TenantPolicy, TokenBucket, duration
from helpers.daemons import ROOT, http, start_daemon


class Clock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


# ---- the pieces --------------------------------------------------------------------------

def test_reset_durations_are_written_as_openai_writes_them():
    assert duration(0.02) == "20ms"
    assert duration(1.0) == "1s"
    assert duration(1.5) == "1.5s"
    assert duration(8.641) == "8.641s"
    assert duration(360) == "6m0s"
    assert duration(3723) == "1h2m3s"
    assert duration(0) == "0s"


def test_token_bucket_refills_at_limit_per_minute():
    b = TokenBucket(60, now=0.0)            # 60 a minute: one a second, a minute's burst
    for _ in range(60):
        assert b.take(1, 0.0) == 0.0
    assert b.take(1, 0.0) == pytest.approx(1.0)     # nothing taken: wait a second
    assert b.remaining(0.5) == 0
    assert b.take(1, 1.0) == 0.0
    assert b.reset_s(1.0) == pytest.approx(60.0)     # empty: a minute until full
    b.give(-30, 1.0)                                  # settled above the reservation: debt
    assert b.take(1, 20.0) == pytest.approx(12.0)


def test_requests_per_minute_refuse_then_admit_after_the_wait():
    clock = Clock()
    policy = TenantPolicy({"alpha": TenantConfig(requests_per_minute=3)}, BudgetsConfig(),
                          clock=clock)
    assert [policy.admit("alpha") for _ in range(3)] == [None, None, None]
    r = policy.admit("alpha")
    assert r is not None and r.code == "rate_limit_exceeded" and r.reason == "rate_limit_requests"
    assert r.retry_after_s == pytest.approx(20.0)
    assert r.headers["x-ratelimit-limit-requests"] == "3"
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    assert r.headers["x-ratelimit-reset-requests"] == "1m0s"
    assert "requests per minute" in r.message and "20s" in r.message
    assert policy.admit("beta") is None     # another tenant, no table, no default: unlimited
    clock.t += 20.0
    assert policy.admit("alpha") is None
    assert policy.view()[0]["rejected"] == {"rate_limit_requests": 1}


def test_default_table_applies_to_unnamed_tenants_each_with_its_own_bucket():
    policy = TenantPolicy({"default": TenantConfig(requests_per_minute=1)}, BudgetsConfig(),
                          clock=Clock())
    assert policy.admit("a") is None and policy.admit("b") is None
    assert policy.admit("a") is not None and policy.admit("b") is not None


def test_tokens_reserved_at_admission_and_settled_at_finish():
    clock = Clock()
    policy = TenantPolicy({"alpha": TenantConfig(tokens_per_minute=100)}, BudgetsConfig(),
                          clock=clock)
    res, refused = policy.reserve("alpha", 80)
    assert refused is None
    policy.started("alpha")
    _, refused = policy.reserve("alpha", 30)
    assert refused is not None and refused.reason == "rate_limit_tokens"
    assert refused.retry_after_s == pytest.approx(6.0)      # 10 short, 100/60 a second
    policy.finished("alpha", res, 40)   # used 40 of the 80 reserved: 40 back
    res2, refused = policy.reserve("alpha", 30)
    assert refused is None and res2.tokens == 30
    # more than a whole minute's allowance can never fit: refused, no point retrying
    _, refused = policy.reserve("alpha", 101)
    assert refused.retry_after_s is None and "too large" in refused.message
    row = policy.view()[0]
    assert row["rate"] == {"requests_per_minute": 1, "tokens_per_minute": 40}
    assert row["inflight"] == 0
    clock.t += 62.0         # the last minute no longer holds it
    assert policy.view()[0]["rate"] == {"requests_per_minute": 0, "tokens_per_minute": 0}


def test_reload_keeps_what_was_used():
    clock = Clock()
    policy = TenantPolicy({"alpha": TenantConfig(requests_per_minute=10)}, BudgetsConfig(),
                          clock=clock)
    for _ in range(8):
        assert policy.admit("alpha") is None
    policy.apply({"alpha": TenantConfig(requests_per_minute=20)}, BudgetsConfig())
    assert policy.headers("alpha")["x-ratelimit-remaining-requests"] == "12"
    policy.apply({}, BudgetsConfig())       # limit removed: unlimited, no headers
    assert policy.headers("alpha") == {}
    assert all(policy.admit("alpha") is None for _ in range(50))


# ---- the config ------------------------------------------------------------------------

def test_tenant_tables_parse_with_the_shared_defaults():
    cfg = config.parse('[tenants.search]\nweight = 2\nrequests_per_minute = 600\n'
                       '[tenants.default]\ntokens_per_minute = 1000\n'
                       '[budgets]\nenforce = { search = "reject" }\n')
    assert cfg.tenants["search"] == TenantConfig(weight=2.0, requests_per_minute=600.0)
    assert cfg.tenants["default"] == TenantConfig(tokens_per_minute=1000.0)
    assert cfg.budgets.enforce == {"search": "reject"}
    d = TenantConfig()
    assert (d.weight, d.priority, d.max_concurrent, d.requests_per_minute,
            d.tokens_per_minute) == (1.0, 0, 0, 0.0, 0.0)


@pytest.mark.parametrize("text, needle", [
    ('[tenants.a]\nrpm = 3\n', "unknown key tenants.a.rpm"),
    ('[tenants.a]\nrequests_per_minute = -1\n', "tenants.a.requests_per_minute must be 0"),
    ('[tenants.a]\nweight = 0\n', "tenants.a.weight must be positive"),
    ('[tenants.a]\npriority = "high"\n', "tenants.a.priority must be an integer"),
    ('[tenants]\na = 3\n', "tenants.a must be a table"),
    ('[budgets]\nenforce = { a = "block" }\n', "budgets.enforce.a must be alert, reject or"),
])
def test_bad_tenant_config_is_one_line(text, needle):
    with pytest.raises(ConfigError) as exc:
        config.parse(text)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


# ---- a real daemon -----------------------------------------------------------------------

KEY_A, KEY_B = "key-alpha", "key-beta"


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _config(alpha_rpm: str) -> str:
    return f"""
[auth.keys]
{_digest(KEY_A)} = "alpha"
{_digest(KEY_B)} = "beta"

[accounting]
window_s = 1.0

[tenants.alpha]
requests_per_minute = {alpha_rpm}
tokens_per_minute = 3000
priority = 1
"""


@pytest.fixture(scope="module")
def limited(tiny_model, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("limits"), tiny_model, "--devices", "cpu",
                     "--engine", "sim", "--sim-speed", "50", config=_config("60"))
    yield d
    d.stop(signal.SIGKILL)


def _chat(d, key: str, max_tokens: int = 1):
    return d.post("/v1/chat/completions", {
        "model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens}, headers={"Authorization": f"Bearer {key}"})


def _tenant(d, name: str) -> dict:
    code, _, body = http("GET", d.url + "/admin/v1/tenants")
    assert code == 200, body
    return next(t for t in body["tenants"] if t["tenant"] == name)


def _exhaust(d) -> tuple[int, dict, dict]:
    """Requests as alpha until the first 429 (a minute's burst of 60, refilled at one a
    second meanwhile: bounded)."""
    for _ in range(200):
        code, headers, body = _chat(d, KEY_A)
        if code == 429:
            return code, headers, body
        assert code == 200, body
    raise AssertionError("no 429 after 200 requests at 60 a minute")


def test_limit_answers_429_with_openai_headers_and_spares_other_tenants(limited):
    d = limited
    code, headers, body = _chat(d, KEY_A)
    assert code == 200, body
    h = {k.lower(): v for k, v in headers.items()}
    assert h["x-ratelimit-limit-requests"] == "60"
    assert 0 <= int(h["x-ratelimit-remaining-requests"]) < 60
    assert re.fullmatch(r"\d+(\.\d+)?(ms|s)|\d+m\d+s", h["x-ratelimit-reset-requests"])
    assert h["x-ratelimit-limit-tokens"] == "3000"
    assert re.fullmatch(r"\d+", h["x-ratelimit-remaining-tokens"])
    code, headers, body = _exhaust(d)
    h = {k.lower(): v for k, v in headers.items()}
    assert body["error"]["code"] == "rate_limit_exceeded"
    assert body["error"]["type"] == "requests"
    assert "alpha" in body["error"]["message"]
    assert h["retry-after"] == "1" and 0 < int(h["retry-after-ms"]) <= 1000
    assert h["x-ratelimit-remaining-requests"] == "0"
    # refused before the body is read: a body that is not even JSON gets the 429
    code, _, body = d.post("/v1/chat/completions", raw=b"{not json",
                           headers={"Authorization": f"Bearer {KEY_A}"})
    assert code == 429 and body["error"]["code"] == "rate_limit_exceeded"
    # beta has no table and no default: never limited, even now
    code, headers, body = _chat(d, KEY_B)
    assert code == 200, body
    assert not any(k.lower().startswith("x-ratelimit") for k in headers)
    row = _tenant(d, "alpha")
    assert row["rejected"].get("rate_limit_requests", 0) >= 1
    assert row["limits"] == {"requests_per_minute": 60.0, "tokens_per_minute": 3000.0}
    assert row["priority"] == 1 and row["queue_depth"] == 0   # no max_concurrent: none wait
    assert row["rate"]["requests_per_minute"] >= 60


def test_official_client_backs_off_on_429_and_succeeds(limited):
    d = limited
    before = _tenant(d, "alpha")["rejected"].get("rate_limit_requests", 0)
    _exhaust(d)                                     # one 429 here; the bucket is empty
    client = openai.OpenAI(base_url=d.url + "/v1", api_key=KEY_A, max_retries=5, timeout=30)
    t0 = time.monotonic()
    out = client.chat.completions.create(model="tiny-llama", max_tokens=1,
                                         messages=[{"role": "user", "content": "hi"}])
    took = time.monotonic() - t0
    assert out.choices[0].finish_reason in ("stop", "length")
    # the client was refused at least once, then waited Retry-After and got through
    assert _tenant(d, "alpha")["rejected"]["rate_limit_requests"] >= before + 2
    assert took < 20, f"the client took {took:.1f} s to get through"
    # without retries the same client sees the error as OpenAI's
    client0 = openai.OpenAI(base_url=d.url + "/v1", api_key=KEY_A, max_retries=0, timeout=30)
    with pytest.raises(openai.RateLimitError) as exc:
        for _ in range(200):
            client0.chat.completions.create(model="tiny-llama", max_tokens=1,
                                            messages=[{"role": "user", "content": "hi"}])
    assert exc.value.code == "rate_limit_exceeded"
    assert exc.value.response.headers["x-ratelimit-remaining-requests"] == "0"


def test_streamed_responses_carry_the_headers(limited):
    for _ in range(40):     # alpha may be out of request tokens: wait for one
        code, headers, body = limited.post("/v1/chat/completions", {
            "model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2, "stream": True}, headers={"Authorization": f"Bearer {KEY_A}"})
        if code != 429:
            break
        time.sleep(0.5)
    h = {k.lower(): v for k, v in headers.items()}
    assert code == 200 and h["content-type"].startswith("text/event-stream")
    assert h["x-ratelimit-limit-requests"] == "60" and h["x-ratelimit-limit-tokens"] == "3000"
    assert body.endswith(b"data: [DONE]\n\n")


def test_tokens_per_minute_refuses_a_request_too_large(limited):
    code, headers, body = _chat(limited, KEY_B, max_tokens=1)
    assert code == 200
    for _ in range(40):     # alpha may be out of request tokens: wait for one
        code, headers, body = _chat(limited, KEY_A, max_tokens=3500)
        if body.get("error", {}).get("type") != "requests":
            break
        time.sleep(0.5)
    assert code == 429 and body["error"]["type"] == "tokens", body
    assert body["error"]["code"] == "rate_limit_exceeded"
    assert "too large" in body["error"]["message"]
    assert "retry-after" not in {k.lower() for k in headers}


def test_refusals_are_in_metrics_and_in_the_ledger(limited):
    d = limited
    _exhaust(d)
    code, _, text = http("GET", d.url + "/metrics")
    text = text.decode() if isinstance(text, bytes) else str(text)
    m = re.search(r'applianced_tenant_rejected_total\{[^}]*reason="rate_limit_requests"[^}]*'
                  r'tenant="alpha"[^}]*\} (\d+(\.\d+)?)', text) or re.search(
        r'applianced_tenant_rejected_total\{[^}]*tenant="alpha"[^}]*reason="rate_limit_requests"'
        r'[^}]*\} (\d+(\.\d+)?)', text)
    assert m and float(m.group(1)) >= 1, text[-2000:]
    ledger = d.log.parent / "state" / "ledger.db"
    deadline = time.monotonic() + 30
    rows = []
    while time.monotonic() < deadline:
        con = sqlite3.connect(ledger, timeout=5)
        try:
            rows = con.execute(
                "SELECT count(*), sum(prefill_gpu_s + decode_gpu_s), "
                "sum(prefill_cost_allocation + decode_cost_allocation) FROM requests "
                "WHERE tenant = 'alpha' AND status = 'rejected' "
                "AND finish_reason = 'rate_limit_requests'").fetchall()
        finally:
            con.close()
        if rows and rows[0][0]:
            break
        time.sleep(0.5)
    n, gpu_s, cost = rows[0]
    assert n >= 1 and gpu_s == 0 and cost == 0     # counted, and they cost nothing
    code, _, usage = http("GET", d.url + "/admin/v1/usage?group_by=tenant,phase&since=1h")
    assert code == 200 and usage["rejected"]["alpha"]["rate_limit_requests"] >= 1


def test_tenants_command_prints_the_view(limited):
    out = subprocess.run([sys.executable, "-m", "appliance", "tenants", "--url", limited.url],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("alpha"))
    assert "/60" in line and "/3000" in line and line.split()[6] == "0"   # queue: none waits
    # The queue column's note: both of the router's queues are counted.
    assert "waiting at the router, for a max_concurrent slot or" in out.stdout
    assert "for a worker with room" in out.stdout


# ---- reload ------------------------------------------------------------------------------

def test_reload_from_the_file_on_disk_admin_cli_and_sighup(tiny_model, tmp_path):
    d = start_daemon(tmp_path, tiny_model, "--devices", "cpu", "--engine", "sim",
                     "--sim-speed", "50", config=_config("60"))
    try:
        path = tmp_path / "config.toml"
        assert _tenant(d, "alpha")["limits"]["requests_per_minute"] == 60
        # 1. the admin endpoint, after editing the file
        path.write_text(_config("2"))
        code, _, body = d.post("/admin/v1/reload", {})
        assert code == 200, body
        assert body["tenants"] == ["alpha"] and "restart" in body["note"]
        assert _tenant(d, "alpha")["limits"]["requests_per_minute"] == 2
        codes = [_chat(d, KEY_A)[0] for _ in range(3)]
        assert codes == [200, 200, 429]
        # 2. a bad file: refused with one line, the old limits stay
        path.write_text(_config("-5"))
        code, _, body = d.post("/admin/v1/reload", {})
        assert code == 400 and body["error"]["code"] == "invalid_config"
        assert "tenants.alpha.requests_per_minute" in body["error"]["message"]
        cli = [sys.executable, "-m", "appliance", "reload", "--url", d.url]
        out = subprocess.run(cli, capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert out.returncode == 1
        assert out.stderr.count("\n") == 1 and "old limits stay" in out.stderr
        assert _tenant(d, "alpha")["limits"]["requests_per_minute"] == 2
        # 3. the CLI with a good file
        path.write_text(_config("600"))
        out = subprocess.run(cli, capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "reloaded" in out.stdout and "alpha" in out.stdout
        assert _tenant(d, "alpha")["limits"]["requests_per_minute"] == 600
        # 4. SIGHUP: a good file, then a bad one (a log line, the limits stay)
        path.write_text(_config("7"))
        d.proc.send_signal(signal.SIGHUP)
        _wait(lambda: _tenant(d, "alpha")["limits"]["requests_per_minute"] == 7)
        path.write_text(_config("7") + "\n[tenants.alpha.oops]\n")
        d.proc.send_signal(signal.SIGHUP)
        _wait(lambda: "reload refused, the old limits stay" in d.log_text())
        assert _tenant(d, "alpha")["limits"]["requests_per_minute"] == 7
        assert d.proc.poll() is None
        line = next(x for x in d.log_text().splitlines() if "reload refused" in x)
        assert "tenants.alpha" in line
        # 5. `systemctl reload`: the unit's ExecReload line, as systemd would run it
        path.write_text(_config("9"))
        exec_reload = _unit_exec_reload().replace("$MAINPID", str(d.proc.pid)).split()
        assert exec_reload[0] == "/opt/applianced/applianced"
        out = subprocess.run([sys.executable, "-m", "appliance", *exec_reload[1:]],
                             capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert out.returncode == 0, out.stderr
        _wait(lambda: _tenant(d, "alpha")["limits"]["requests_per_minute"] == 9)
        out = subprocess.run([sys.executable, "-m", "appliance", "reload", "--pid", "999999999"],
                             capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert out.returncode == 1 and out.stderr.count("\n") == 1 and "no process" in out.stderr
    finally:
        d.stop(signal.SIGKILL)


def _unit_exec_reload() -> str:
    text = (ROOT / "systemd" / "applianced.service").read_text()
    return re.search(r"^ExecReload=(.+)$", text, re.M).group(1)


def _wait(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError("timed out")


def test_tenants_json_lists_configured_tenants_without_traffic():
    policy = TenantPolicy({"alpha": TenantConfig(weight=3, max_concurrent=4)},
                          BudgetsConfig(enforce={"beta": "reject"}), clock=Clock())
    rows = {r["tenant"]: r for r in policy.view()}
    assert set(rows) == {"alpha", "beta"}
    assert rows["alpha"]["weight"] == 3 and rows["alpha"]["max_concurrent"] == 4
    assert rows["beta"]["budget"]["enforce"] == "reject"
    assert rows["beta"]["budget"]["tracked"] is False
    json.dumps(rows)


def test_tui_tenants_screen_shows_refusals_from_the_usage_report():
    from rich.console import Console

    from appliance.tui.screens.tenants import tenant_table
    from appliance.tui.views.tenants import tenants_from_usage
    usage = {"rows": [{"tenant": "batch", "phase": "prefill", "gpu_seconds": 50.0},
                      {"tenant": "search", "phase": "decode", "gpu_seconds": 5.0}],
             "rejected": {"batch": {"rate_limit_requests": 3, "budget_exceeded": 1},
                          "ghost": {"overloaded": 2}}}
    rows = {r.tenant: r for r in tenants_from_usage(usage)}
    assert (rows["batch"].rejected, rows["search"].rejected, rows["ghost"].rejected) == (4, 0, 2)
    console = Console(width=80, record=True)
    console.print(tenant_table(list(rows.values()), "gpu_seconds", True))
    lines = console.export_text().splitlines()
    assert lines[0].split()[-1] == "refused"
    assert next(ln for ln in lines if ln.startswith("batch")).split()[-1] == "4"
    # an older daemon without `rejected`: no column, n/a nowhere invented
    old = tenants_from_usage({"rows": usage["rows"]})
    assert all(r.rejected is None for r in old)
    console = Console(width=80, record=True)
    console.print(tenant_table(old, "gpu_seconds", True))
    assert "refused" not in console.export_text()
