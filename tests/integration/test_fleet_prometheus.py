"""A real Prometheus (Debian's package) on loopback scrapes two simulated appliances at
two sites with the admin key as bearer credentials, and evaluates deploy/prometheus/
rules as shipped (only their evaluation interval shortened to 1 s).

The fleet ratio test needs the telemetry series (`applianced_group_busy_seconds_total`
...); it is skipped, saying so, on a daemon that does not export them yet."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from helpers.daemons import ROOT, free_port, http, start_daemon

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None,
                                reason="no prometheus (make test installs Debian's package)")

ADMIN_KEY = "fleet-test-admin-key"
SITES = {"dc1": ("box-h100", "sim:8xH100"), "edge": ("box-mixed", "sim:4xA100-80GB+4xL40S")}


class Prometheus:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path):
        self.proc, self.url, self.log = proc, url, log

    def api(self, path: str, **params):
        query = urllib.parse.urlencode(params)
        code, _, body = http("GET", f"{self.url}/api/v1/{path}" + (f"?{query}" if query else ""))
        assert code == 200 and body["status"] == "success", body
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        return self.api("query", **params)["result"]

    def wait(self, what: str, predicate, timeout: float = 60):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = predicate()
            if last:
                return last
            time.sleep(0.5)
        raise AssertionError(f"timed out waiting for {what}; last: {last}\n"
                             + self.log.read_text()[-3000:])


def metrics(url: str) -> str:
    code, _, body = http("GET", url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert code == 200
    return body.decode() if isinstance(body, bytes) else str(body)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("fleet")
    digest = hashlib.sha256(ADMIN_KEY.encode()).hexdigest()
    daemons = {}
    try:
        for site, (name, devices) in SITES.items():
            cfg = (f'[site]\nname = "{site}"\nappliance = "{name}"\n'
                   f'[auth]\nadmin_keys = ["{digest}"]\nmetrics_access = "admin"\n')
            daemons[site] = start_daemon(tmp / site, tiny_model, "--devices", devices,
                                         "--engine", "sim", "--model-spec", "llama-3.1-8b",
                                         "--sim-speed", "20", config=cfg)
        # The rules as shipped, evaluated every second instead of every 30 s / 1 min.
        rules = []
        for path in sorted((ROOT / "deploy/prometheus/rules").glob("*.yml")):
            data = yaml.safe_load(path.read_text())
            for group in data["groups"]:
                group["interval"] = "1s"
            (tmp / path.name).write_text(yaml.safe_dump(data))
            rules.append(str(tmp / path.name))
        key = tmp / "admin-key"
        key.write_text(ADMIN_KEY + "\n")
        key.chmod(0o600)
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": rules,
            "scrape_configs": [{
                "job_name": "applianced", "honor_labels": True,
                "authorization": {"type": "Bearer", "credentials_file": str(key)},
                "static_configs": [{"targets": [d.url.removeprefix("http://")
                                                for d in daemons.values()]}],
            }],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        log = tmp / "prometheus.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                ["prometheus", f"--config.file={tmp / 'prometheus.yml'}",
                 f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
                 "--storage.tsdb.retention.time=1h"],
                stdout=out, stderr=subprocess.STDOUT, cwd=tmp)
        prom = Prometheus(proc, f"http://127.0.0.1:{port}", log)
        try:
            def ready():
                if proc.poll() is not None:
                    raise AssertionError("prometheus exited:\n" + log.read_text()[-3000:])
                try:
                    return http("GET", prom.url + "/-/ready", timeout=2)[0] == 200
                except OSError:
                    return False
            prom.wait("prometheus to start", ready)
            yield prom, daemons
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    finally:
        for d in daemons.values():
            d.stop()


def test_prometheus_scrapes_both_appliances_with_the_admin_key_and_loads_the_rules(fleet):
    prom, daemons = fleet
    # Without the key the scrape is refused: up == 1 below means the bearer credentials work.
    assert http("GET", daemons["dc1"].url + "/metrics")[0] in (401, 403)
    up = prom.wait("both targets up", lambda: (
        r if len(r := prom.query('up{job="applianced"} == 1')) == 2 else None))
    assert {s["metric"]["instance"] for s in up} == {d.url.removeprefix("http://")
                                                     for d in daemons.values()}
    workers = prom.query('count by (instance) (applianced_worker_up == 1)')
    assert sorted(int(s["value"][1]) for s in workers) == [8, 8]
    groups = prom.api("rules")["groups"]
    names = {g["name"] for g in groups}
    assert {"applianced-fleet", "applianced-tenants", "applianced-planner",
            "applianced-alerts"} <= names
    prom.wait("every rule evaluated", lambda: all(
        r.get("lastEvaluation", "").startswith("20") and r["health"] == "ok"
        for g in prom.api("rules")["groups"] for r in g["rules"]))
    for g in prom.api("rules")["groups"]:
        for r in g["rules"]:
            assert r["health"] == "ok", (r["name"], r.get("lastError"))


def counters(text: str, name: str) -> dict[str, float]:
    """Sum of `name` by its group label from a daemon's own /metrics."""
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                group = sample.labels["group"]
                out[group] = out.get(group, 0.0) + sample.value
    return out


def test_recorded_fleet_ratio_equals_the_appliances_own_counters(fleet):
    prom, daemons = fleet
    if any("applianced_group_busy_seconds_total" not in metrics(d.url) for d in daemons.values()):
        pytest.skip("the daemons do not export applianced_group_busy_seconds_total yet "
                    "(the telemetry stream adds it)")
    prom.wait("both targets up", lambda: len(prom.query('up{job="applianced"} == 1')) == 2)
    time.sleep(3)    # a few scrapes of the idle counters first: the baseline of rate()
    before = {site: {kind: counters(metrics(d.url), f"applianced_group_{metric}_total")
                     for kind, metric in [("busy", "busy_seconds"), ("energy", "energy_joules")]}
              for site, d in daemons.items()}

    def load(d):
        client = d.client()

        def one(i):
            r = client.chat.completions.create(
                model="llama-3.1-8b", max_tokens=32 + 8 * (i % 4),
                messages=[{"role": "user", "content": "word " * (50 + 40 * i)}])
            return r.usage.completion_tokens
        with ThreadPoolExecutor(8) as pool:
            return sum(pool.map(one, range(24)))
    with ThreadPoolExecutor(2) as pool:
        assert all(n > 0 for n in pool.map(load, daemons.values()))

    # Idle again: wait until the appliances' busy counters stop moving (the last
    # iteration records reach the daemon just after the last tokens). Energy keeps
    # growing at idle power, so it is read at the same moment but never settles.
    def settled(d):
        last = None
        for _ in range(60):
            text = metrics(d.url)
            busy = counters(text, "applianced_group_busy_seconds_total")
            if busy == last:
                return {"busy": busy, "energy": counters(text, "applianced_group_energy_joules_total")}
            last = busy
            time.sleep(1)
        raise AssertionError(f"busy counters of {d.url} still moving")
    own = {site: settled(d) for site, d in daemons.items()}
    for site in daemons:
        assert own[site]["busy"].get("prefill", 0) > 0 and own[site]["busy"].get("decode", 0) > 0

    def caught_up():
        for site in daemons:
            got = prom.query(f'sum by (group) (applianced_group_busy_seconds_total{{site="{site}"}})')
            vals = {s["metric"]["group"]: float(s["value"][1]) for s in got}
            if any(abs(vals.get(g, -1) - v) > 1e-9 * max(1, v) for g, v in own[site]["busy"].items()):
                return False
        return True
    prom.wait("Prometheus to scrape the final counters", caught_up)
    time.sleep(2.5)    # and to evaluate the rules over them

    at = time.time()
    for metric, kind in [("busy_seconds", "busy"), ("energy_joules", "energy")]:
        fleet_ratio = prom.query(f":applianced_group_{metric}:prefill_decode_ratio_rate5m", at)
        assert [s["metric"] for s in fleet_ratio] == [{"__name__": f":applianced_group_{metric}:prefill_decode_ratio_rate5m",
                                                       "simulated": "true"}]
        recorded = float(fleet_ratio[0]["value"][1])
        # Exactly what the per-site rates recorded in the same evaluation give: Σ prefill /
        # Σ decode, not a mean of the sites' ratios.
        rates = {(s["metric"]["site"], s["metric"]["group"]): float(s["value"][1])
                 for s in prom.query(f"site_group:applianced_group_{metric}:rate5m", at)}
        assert recorded == pytest.approx(
            sum(v for (_, g), v in rates.items() if g == "prefill")
            / sum(v for (_, g), v in rates.items() if g == "decode"), rel=1e-9)
        # Each site's busy ratio is its own appliance's counters' ratio: both group series
        # come from the same scrapes, so rate()'s extrapolation cancels, and the counters
        # stood still before and after the load. Energy grows at idle power all along, so
        # our own two readings span another interval than the window's scrapes: its deltas
        # are taken from the scraped samples themselves (the appliance's own counter
        # values), leaving only rate()'s extrapolation at the window's start, which differs
        # per series when a counter does not start at 0 (it is capped where each counter
        # would reach zero): within 30% (seen: up to 19% on a loaded machine).
        tolerance = 1e-6 if kind == "busy" else 0.30
        for site in daemons:
            site_ratio = prom.query(f'site:applianced_group_{metric}:prefill_decode_ratio_rate5m{{site="{site}"}}', at)
            if kind == "busy":
                delta = {g: own[site][kind][g] - before[site][kind].get(g, 0.0)
                         for g in ("prefill", "decode")}
            else:
                raw = prom.query(f'applianced_group_{metric}_total{{site="{site}"}}[5m]', at)
                delta = {s["metric"]["group"]: float(s["values"][-1][1]) - float(s["values"][0][1])
                         for s in raw}
            assert float(site_ratio[0]["value"][1]) == pytest.approx(
                delta["prefill"] / delta["decode"], rel=tolerance), (
                f"{site}: (the group counters must exist from start-up, at 0, for rate() "
                f"to see every increment)")
        # The fleet ratio against the two appliances' own counters: equal up to rate()'s
        # per-target extrapolation (the two targets are scraped at different instants,
        # at most one 1 s interval over the ~20 s the counters moved). Energy, which also
        # grows at idle power outside our two readings, within the same 30% as above
        # (seen: 0.81 against 0.67 when the suite ran on a loaded machine).
        moved = {g: sum(own[s][kind][g] - before[s][kind].get(g, 0.0) for s in daemons)
                 for g in ("prefill", "decode")}
        assert recorded == pytest.approx(moved["prefill"] / moved["decode"],
                                         rel=0.05 if kind == "busy" else 0.30)
    tokens = {s["metric"]["phase"]: float(s["value"][1])
              for s in prom.query("phase:applianced_phase_tokens:rate5m", at)}
    assert tokens.get("prefill", 0) > 0 and tokens.get("decode", 0) > 0
