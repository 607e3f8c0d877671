"""Budgets that stop (issue 27 §3): at 100% a rejecting budget answers 429
`budget_exceeded` naming the budget, period, used/limit and when it resets, and admits
again at the next period; a deprioritizing one puts the tenant's requests in the lowest
priority class until then; "alert" only alerts. The period boundary is crossed with an
injected clock (no sleeping for a day); the daemon test uses a tiny real budget."""
from __future__ import annotations

import hashlib
import re
import signal
import sqlite3
import time
from datetime import datetime, timedelta, timezone

import openai
import pytest

from appliance.accounting.budgets import Budgets
from appliance.config import BudgetsConfig, TenantConfig
from appliance.daemon.tenants import LOWEST_PRIORITY, TenantPolicy, next_period_start
from helpers.daemons import http, start_daemon


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _spent_budgets(period: str = "day") -> Budgets:
    """A real budget book as the accounting process keeps it, with alpha and beta over
    their GPU-hour limits today and gamma under."""
    now = time.time()
    b = Budgets(period, {"gpu_hours": {"alpha": 1e-6, "beta": 1e-6, "gamma": 1.0}}, now=now)
    for tenant in ("alpha", "beta", "gamma"):
        b.add(tenant, now, {"gpu_hours": 2e-6})
    return b


def _policy(enforce: dict, clock: Clock, tenants: dict | None = None) -> TenantPolicy:
    book = _spent_budgets()
    return TenantPolicy(tenants or {}, BudgetsConfig(period="day", enforce=enforce),
                        budget_report=book.report, clock=clock)


def test_rejecting_budget_refuses_with_a_clear_message_and_resumes_next_period():
    now = time.time()
    clock = Clock(now)
    policy = _policy({"alpha": "reject"}, clock)
    r = policy.admit("alpha")
    assert r is not None and r.code == "budget_exceeded" and r.reason == "budget_exceeded"
    resets = next_period_start("day", now)
    stamp = datetime.fromtimestamp(resets, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert "alpha" in r.message and "daily gpu_hours budget" in r.message
    assert "2e-06 of 1e-06 used" in r.message and stamp in r.message
    assert r.retry_after_s == pytest.approx(resets - now)
    assert policy.admit("gamma") is None        # under its limit
    # the next day: admitted again, before the accounting process has even rolled over
    clock.t = resets + 1.0
    assert policy.admit("alpha") is None
    assert policy.view()[0]["budget"]["spent"] is False
    assert policy.states["alpha"].rejected == {"budget_exceeded": 1}


def test_deprioritizing_budget_lowers_the_priority_class_until_the_period_ends():
    now = time.time()
    clock = Clock(now)
    policy = _policy({"beta": "deprioritize"}, clock, {"beta": TenantConfig(priority=2)})
    assert policy.admit("beta") is None         # served, not refused
    assert policy.priority("beta") == (LOWEST_PRIORITY, True)
    # what the request takes to the scheduler (GenerationRequest.priority), whatever it asked
    assert policy.request_priority("beta", None) == LOWEST_PRIORITY
    assert policy.request_priority("beta", -5) == LOWEST_PRIORITY
    assert policy.request_priority("gamma", 3) == 3     # not deprioritizing: as asked
    row = next(r for r in policy.view() if r["tenant"] == "beta")
    assert row["effective_priority"] == LOWEST_PRIORITY and row["deprioritized"]
    assert row["priority"] == 2
    clock.t = next_period_start("day", now) + 1.0
    assert policy.priority("beta") == (2, False)
    assert policy.request_priority("beta", None) is None   # the tenant's class again


def test_alerting_budget_never_stops_anyone():
    policy = _policy({}, Clock(time.time()))
    assert policy.admit("alpha") is None and policy.priority("alpha") == (0, False)
    row = next(r for r in policy.view() if r["tenant"] == "alpha")
    assert row["budget"]["enforce"] == "alert" and row["budget"]["spent"] is True
    assert row["budget"]["budgets"][0]["used"] == pytest.approx(2e-6)


@pytest.mark.parametrize("period, t, expect", [
    ("day", "2026-11-24T13:00:00", "2026-11-25T00:00:00"),
    ("week", "2026-11-24T13:00:00", "2026-11-30T00:00:00"),      # Tuesday -> Monday
    ("month", "2026-12-31T23:59:00", "2027-01-01T00:00:00"),
])
def test_next_period_start(period, t, expect):
    ts = datetime.fromisoformat(t).replace(tzinfo=timezone.utc).timestamp()
    want = datetime.fromisoformat(expect).replace(tzinfo=timezone.utc).timestamp()
    assert next_period_start(period, ts) == want


def test_accountant_keeps_usage_across_a_budget_reload(tmp_path):
    """`applianced reload` sends the accounting process new limits: what it counted
    this period stays (a raised limit un-spends a budget; it does not forget usage)."""
    from appliance.accounting.accountant import Accountant, Site
    from appliance.accounting.carbon import CarbonIntensity, EmbodiedCarbon
    from appliance.accounting.cost import PriceBook
    from appliance.accounting.ledger import Ledger
    ledger = Ledger(tmp_path / "ledger.db", 1.0, 90.0, 730.0)
    try:
        acc = Accountant([], "m", Site("s", "a", "", 1.0, CarbonIntensity(0.0)), ledger,
                         PriceBook({}, 0.0), EmbodiedCarbon({}, {}), budgets=_spent_budgets())
        acc.set_budgets(Budgets("day", {"gpu_hours": {"alpha": 1.0, "delta": 5.0}}))
        states = {(s["tenant"], s["budget"]): s for s in acc.budgets.report()}
        assert states[("alpha", "gpu_hours")]["used"] == pytest.approx(2e-6)
        assert states[("alpha", "gpu_hours")]["used_ratio"] < 1.0
        assert states[("delta", "gpu_hours")]["used"] == 0.0
        assert ("beta", "gpu_hours") not in states
        assert "delta" in acc._budget_tenants
    finally:
        ledger.stop()


# ---- a real daemon with a tiny real budget -------------------------------------------

KEY_A, KEY_B = "budget-alpha", "budget-beta"


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


CONFIG = f"""
[auth.keys]
{_digest(KEY_A)} = "alpha"
{_digest(KEY_B)} = "beta"

[accounting]
window_s = 1.0

[budgets]
period = "day"
gpu_hours = {{ alpha = 1e-9, beta = 1e-9 }}
enforce = {{ alpha = "reject", beta = "deprioritize" }}
"""


def _tenant(d, name: str) -> dict:
    code, _, body = http("GET", d.url + "/admin/v1/tenants")
    assert code == 200, body
    return next(t for t in body["tenants"] if t["tenant"] == name)


def test_daemon_enforces_tiny_budgets(tiny_model, tmp_path):
    d = start_daemon(tmp_path, tiny_model, "--devices", "cpu", "--engine", "sim",
                     "--sim-speed", "50", config=CONFIG)
    try:
        alpha = openai.OpenAI(base_url=d.url + "/v1", api_key=KEY_A, max_retries=0, timeout=30)
        beta = openai.OpenAI(base_url=d.url + "/v1", api_key=KEY_B, max_retries=0, timeout=30)
        msg = [{"role": "user", "content": "spend a little"}]
        alpha.chat.completions.create(model="tiny-llama", max_tokens=4, messages=msg)
        beta.chat.completions.create(model="tiny-llama", max_tokens=4, messages=msg)
        # the requests' rows become final once their 1-s window closes; then the budget
        # report (once a second) says both are spent
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if _tenant(d, "alpha")["budget"]["spent"] and _tenant(d, "beta")["budget"]["spent"]:
                break
            time.sleep(0.3)
        else:
            raise AssertionError(f"budgets never spent: {_tenant(d, 'alpha')}")
        with pytest.raises(openai.RateLimitError) as exc:
            alpha.chat.completions.create(model="tiny-llama", max_tokens=4, messages=msg)
        err = exc.value
        assert err.code == "budget_exceeded"
        assert err.response.status_code == 429
        text = err.body["message"]
        assert re.search(r"daily gpu_hours budget is spent \([\d.e+-]+ of 1e-09 used\); "
                         r"it resets at \d{4}-\d\d-\d\dT00:00:00Z", text), text
        retry = int(err.response.headers["retry-after"])
        tomorrow = (datetime.now(timezone.utc) + timedelta(days=1)).replace(
            hour=0, minute=0, second=0, microsecond=0)
        assert abs(retry - (tomorrow.timestamp() - time.time())) < 120
        # beta is served, in the lowest priority class
        out = beta.chat.completions.create(model="tiny-llama", max_tokens=4, messages=msg)
        assert out.choices[0].message.content is not None
        row = _tenant(d, "beta")
        assert row["deprioritized"] and row["effective_priority"] == LOWEST_PRIORITY
        assert _tenant(d, "alpha")["rejected"] == {"budget_exceeded": 1}
        # the refusal is in the ledger for alpha, at no cost, and in /metrics
        ledger = d.log.parent / "state" / "ledger.db"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            con = sqlite3.connect(ledger, timeout=5)
            try:
                rows = con.execute(
                    "SELECT prefill_gpu_s + decode_gpu_s, prefill_cost_allocation + "
                    "decode_cost_allocation FROM requests WHERE tenant = "
                    "'alpha' AND status = 'rejected' AND finish_reason = 'budget_exceeded'"
                ).fetchall()
            finally:
                con.close()
            if rows:
                break
            time.sleep(0.3)
        assert rows == [(0.0, 0.0)]
        _, _, metrics = http("GET", d.url + "/metrics")
        assert re.search(r'applianced_tenant_rejected_total\{(?=[^}]*tenant="alpha")'
                         r'(?=[^}]*reason="budget_exceeded")[^}]*\} 1\.0', metrics.decode())
        # a reload raises alpha's limit: the accounting process takes it, keeps the usage,
        # and alpha is served again
        used = _tenant(d, "alpha")["budget"]["budgets"][0]["used"]
        (tmp_path / "config.toml").write_text(CONFIG.replace("alpha = 1e-9", "alpha = 1000.0"))
        code, _, body = d.post("/admin/v1/reload", {})
        assert code == 200, body
        deadline = time.monotonic() + 20
        while _tenant(d, "alpha")["budget"]["spent"] and time.monotonic() < deadline:
            time.sleep(0.2)
        b = _tenant(d, "alpha")["budget"]["budgets"][0]
        assert b["limit"] == 1000.0 and b["used"] >= used > 0
        alpha.chat.completions.create(model="tiny-llama", max_tokens=4, messages=msg)
    finally:
        d.stop(signal.SIGKILL)
