"""`[cluster]`: the role a box plays when two boxes serve as one (docs/operations/cluster.md).
The keys are validated with one-line errors; a role other than "both" without NIXL
installed stops `serve` before anything starts, with one line saying what to install."""
from __future__ import annotations

import subprocess
import sys

import pytest

from appliance import config
from helpers.daemons import ROOT

KEY = "k" * 24


def test_default_is_a_single_box_and_a_prefill_front_parses():
    assert config.Config().cluster.role == "both"
    assert config.parse("").cluster.peers == []
    cfg = config.parse(f'[cluster]\nrole = "prefill"\npeers = ["https://decode-1:8000"]\n'
                       f'key = "{KEY}"\n')
    assert (cfg.cluster.role, cfg.cluster.peers, cfg.cluster.key) == (
        "prefill", ["https://decode-1:8000"], KEY)


@pytest.mark.parametrize("body, needle", [
    ('role = "front"', "cluster.role must be both, prefill or decode"),
    ('role = 1', "cluster.role must be a string"),
    ('peers = ["decode-1:8000"]', "is not a base URL"),
    ('peers = ["https://a:1/v1"]', "is not a base URL"),
    ('peers = ["https://a:1", "https://a:1/"]', "lists a box twice"),
    (f'role = "decode"\nkey = "{KEY}"', "needs cluster.peers (the prefill boxes)"),
    ('role = "prefill"\npeers = ["https://a:1"]', "needs cluster.key"),
    ('role = "prefill"\npeers = ["https://a:1"]\nkey = "short"', "at least 16 characters"),
    ('ports = 1', "unknown key cluster.ports"),
])
def test_bad_cluster_keys_are_one_line_errors(body, needle):
    with pytest.raises(config.ConfigError, match=None) as err:
        config.parse(f"[cluster]\n{body}\n")
    assert needle in str(err.value) and "\n" not in str(err.value)


# `serve` as the CLI runs it, with the nixl packages made unfindable in that process.
SERVE_WITHOUT_NIXL = """
import sys
sys.modules["nixl"] = sys.modules["nixl_cu12"] = None
from appliance.cli import main
sys.exit(main(["serve", "--config", sys.argv[1], "--state-dir", sys.argv[2]]))
"""


def test_a_cluster_role_without_nixl_stops_serve_with_one_line(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[cluster]\nrole = "decode"\npeers = ["http://127.0.0.1:9"]\nkey = "{KEY}"\n')
    out = subprocess.run([sys.executable, "-c", SERVE_WITHOUT_NIXL, str(cfg), str(tmp_path / "s")],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 1
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "cluster.role = 'decode'" in lines[0] and "pip install 'applianced[cluster]'" in lines[0]
    assert not (tmp_path / "s").exists(), "nothing may start (no state dir made)"


def _config_check(cfg, without_nixl: bool = False) -> subprocess.CompletedProcess:
    pre = 'sys.modules["nixl"] = sys.modules["nixl_cu12"] = None\n' if without_nixl else ""
    code = (f"import sys\n{pre}from appliance.cli import main\n"
            "sys.exit(main(['config', 'check', sys.argv[1]]))\n")
    return subprocess.run([sys.executable, "-c", code, str(cfg)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


def test_config_check_of_a_cluster_role_proves_nixl_moves_bytes(tmp_path):
    from appliance.kv.nixl_transport import INSTALL_HINT, nixl_available
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[cluster]\nrole = "prefill"\npeers = ["http://127.0.0.1:9"]\nkey = "{KEY}"\n')
    out = _config_check(cfg, without_nixl=True)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "needs NIXL, which fails here" in lines[0] and INSTALL_HINT in lines[0]
    if not nixl_available():
        pytest.skip(f"{INSTALL_HINT}: the loopback read needs it")
    out = _config_check(cfg)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"{cfg}: ok; NIXL read 128 KiB between two local agents over "
                                 "UCX, exact, in ")
    plain = tmp_path / "one-box.toml"
    plain.write_text("[cluster]\nrole = \"both\"\n")
    out = _config_check(plain, without_nixl=True)        # a single box needs no NIXL
    assert out.returncode == 0 and out.stdout.strip() == f"{plain}: ok"
