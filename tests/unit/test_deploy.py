"""deploy/ without Prometheus: the Grafana dashboard parses and, like the rules, asks only
for series the appliances export or the rules record. (`promtool` on the rules and the
example configs: tests/integration/test_deploy_promtool.py.)"""
from __future__ import annotations

import json
import re
import yaml

from helpers.daemons import ROOT

PROM = ROOT / "deploy" / "prometheus"
RULES = sorted((PROM / "rules").glob("*.yml"))
DASHBOARD = ROOT / "deploy" / "grafana" / "applianced-fleet.json"


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
    # The fleet ratios, tokens/s, tenant $ and gCO2e, budgets, restarts, the planner and
    # the KV transfers between boxes each have a panel.
    for needed in [":applianced_group_busy_seconds:prefill_decode_ratio_rate5m",
                   ":applianced_group_energy_joules:prefill_decode_ratio_rate5m",
                   "site_phase:applianced_phase_tokens:rate5m",
                   "tenant_basis:applianced_tenant_cost_usd:increase1h",
                   "tenant:applianced_tenant_co2e_grams:increase1h",
                   "applianced_tenant_budget_used_ratio", "applianced_worker_restarts_total",
                   "appliance:applianced_planner_recommended_workers:prefill_decode_ratio",
                   "appliance_transport:applianced_kv_transfer_bytes:rate5m",
                   "transport:applianced_kv_transfer_seconds:p99_rate5m"]:
        assert needed in used, needed
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_rules_use_only_known_series():
    known = recorded_names() | exported_series() | {"up"}
    for path in RULES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                for name in expr_names(rule["expr"]):
                    base = re.sub(r"_(bucket|sum|count)$", "", name)    # a histogram's
                    assert name in known or base in known, f"{path.name}: {name!r} in {rule['expr']!r}"
                if "record" in rule:   # level:metric:operations
                    assert re.fullmatch(r"[a-z_]*:applianced_[a-z0-9_]+:[a-z0-9_]+", rule["record"])
