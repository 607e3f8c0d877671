"""deploy/: the Prometheus rules pass `promtool check rules` and their unit tests
(`promtool test rules`, synthetic series with known answers), the example configs pass
`promtool check config`, and the Grafana dashboard parses and asks only for series the
appliances export or the rules record."""
from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml

from conftest import ROOT

PROM = ROOT / "deploy" / "prometheus"
RULES = sorted((PROM / "rules").glob("*.yml"))
DASHBOARD = ROOT / "deploy" / "grafana" / "applianced-fleet.json"

promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                              reason="no promtool (make test installs Debian's prometheus)")


def run(*cmd: str, cwd=PROM) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)


def recorded_names() -> set[str]:
    return {rule["record"] for path in RULES for group in yaml.safe_load(path.read_text())["groups"]
            for rule in group["rules"] if "record" in rule}


def exported_series() -> set[str]:
    """The appliance's series as the manual's fleet page lists them (the contract)."""
    page = (ROOT / "docs" / "operations" / "fleet.md").read_text()
    section = page.split("## Series each appliance exports", 1)[1].split("\n## ", 1)[0]
    names = set(re.findall(r"`(applianced_[a-z0-9_]+)[{`]", section))
    assert len(names) >= 15, names
    return names


@promtool
def test_rules_check():
    out = run("promtool", "check", "rules", *map(str, RULES))
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("SUCCESS") == len(RULES)


@promtool
def test_rules_unit_tests():
    out = run("promtool", "test", "rules", "tests/applianced_test.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


@promtool
def test_rules_unit_tests_fail_when_a_rule_is_wrong(tmp_path):
    """The unit tests can fail: the fleet ratio computed as a mean of site ratios (a
    plausible mistake) is caught."""
    shutil.copytree(PROM / "rules", tmp_path / "rules")
    shutil.copytree(PROM / "tests", tmp_path / "tests")
    path = tmp_path / "rules" / "applianced-recording.yml"
    data = yaml.safe_load(path.read_text())
    for group in data["groups"]:
        for rule in group["rules"]:
            if rule.get("record") == ":applianced_group_busy_seconds:prefill_decode_ratio_rate5m":
                rule["expr"] = ("avg by (simulated) "
                                "(site:applianced_group_busy_seconds:prefill_decode_ratio_rate5m)")
    path.write_text(yaml.safe_dump(data))
    out = run("promtool", "test", "rules", "tests/applianced_test.yml", cwd=tmp_path)
    assert out.returncode != 0 and "prefill_decode_ratio_rate5m" in out.stdout + out.stderr


@promtool
@pytest.mark.parametrize("name, agent", [("prometheus.yml", False), ("agent.yml", True)])
def test_example_configs_check(tmp_path, name, agent):
    key = tmp_path / "key"
    key.write_text("not-a-real-key\n")
    text = re.sub(r"/etc/prometheus/[a-z-]+", str(key), (PROM / name).read_text())
    (tmp_path / name).write_text(text)
    shutil.copytree(PROM / "rules", tmp_path / "rules")
    out = run("promtool", "check", "config", *(["--agent"] if agent else []), str(tmp_path / name))
    assert out.returncode == 0, out.stdout + out.stderr
    if not agent:
        assert "2 rule files found" in out.stdout


def expr_names(expr: str) -> set[str]:
    """Metric and rule names in a PromQL expression (not functions, labels or keywords)."""
    expr = re.sub(r'"[^"]*"', '""', expr)                 # label values
    expr = re.sub(r"\[[^\]]*\]", "", expr)                # range durations
    expr = re.sub(r"\{[^}]*\}", "{}", expr)               # label matchers
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
        rest = expr[m.end():].lstrip()
        if rest.startswith("("):                           # a function or aggregation
            continue
        if m.group() in ("and", "or", "unless", "bool", "offset", "le"):
            continue
        names.add(m.group())
    return names


def test_expr_names_finds_series_not_functions():
    assert expr_names('histogram_quantile(0.99, sum by (site, le) '
                      '(rate(applianced_x_bucket{site=~"$site"}[5m])))') == {"applianced_x_bucket"}
    assert expr_names("a:b:c / (d > 0) or increase(e[1h])") == {"a:b:c", "d", "e"}


def test_dashboard_parses_and_uses_only_known_series():
    dash = json.loads(DASHBOARD.read_text())
    known = recorded_names() | exported_series()
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    assert len(exprs) >= 10
    used = set()
    for expr in exprs:
        for name in expr_names(expr.replace("label_values(", "(").replace(", site)", ")")):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            assert name in known or base in known, f"{name!r} in {expr!r}"
            used.add(name)
    # The fleet ratios, tokens/s, tenant $ and gCO2e, budgets, restarts and the planner
    # each have a panel.
    for needed in [":applianced_group_busy_seconds:prefill_decode_ratio_rate5m",
                   ":applianced_group_energy_joules:prefill_decode_ratio_rate5m",
                   "site_phase:applianced_phase_tokens:rate5m",
                   "tenant_basis:applianced_tenant_cost_usd:increase1h",
                   "tenant:applianced_tenant_co2e_grams:increase1h",
                   "applianced_tenant_budget_used_ratio", "applianced_worker_restarts_total",
                   "appliance:applianced_planner_recommended_workers:prefill_decode_ratio"]:
        assert needed in used, needed
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_rules_use_only_known_series():
    known = recorded_names() | exported_series() | {"up"}
    for path in RULES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                for name in expr_names(rule["expr"]):
                    assert name in known, f"{path.name}: {name!r} in {rule['expr']!r}"
                if "record" in rule:   # level:metric:operations
                    assert re.fullmatch(r"[a-z_]*:applianced_[a-z0-9_]+:[a-z0-9_]+", rule["record"])
