"""The `applianced` command line as a process: the devices contract, status, version,
config check, init-tiny, and one-line errors instead of tracebacks."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from appliance.daemon.tokenizer import ServedTokenizer
from helpers.daemons import ROOT


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "appliance", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def one_line_error(out: subprocess.CompletedProcess, needle: str) -> None:
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    assert needle in lines[0], lines[0]


def test_devices_json_contract():
    out = cli("devices", "--devices", "sim:8xH100", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert {"id", "name", "kind", "simulated"} <= set(data["devices"][0])
    assert all(d["kind"] == "sim" and d["simulated"] for d in data["devices"])
    plan = data["plan"]
    assert plan["mode"] == "disagg"
    assert [len(plan["prefill"]), len(plan["decode"])] == [4, 4]
    assert {"worker", "devices"} == set(plan["prefill"][0])
    used = [d for g in ("prefill", "decode") for w in plan[g] for d in w["devices"]]
    assert sorted(used) == sorted(d["id"] for d in data["devices"])


def test_devices_human_output_marks_simulation():
    out = cli("devices", "--devices", "sim:2xA100-80GB", "--mode", "agg")
    assert out.returncode == 0, out.stderr
    assert "(simulated)" in out.stdout and "agg0" in out.stdout


@pytest.mark.parametrize("args,needle", [
    (("devices", "--devices", "sim:8xH100", "--split", "5+4"), "9"),
    (("devices", "--devices", "sim:8xH100", "--split", "4+0"), "decode"),
    (("devices", "--devices", "sim:8xH100", "--tp", "3"), "divisible"),
    (("devices", "--devices", "sim:8xZ999"), "Z999"),
    (("devices", "--devices", "sim:eight"), "sim:"),
])
def test_bad_devices_and_splits_are_one_line(args, needle):
    one_line_error(cli(*args), needle)


def test_status_without_daemon_is_one_line():
    one_line_error(cli("status", "--url", "http://127.0.0.1:9"), "no daemon at")


def test_version_and_key_digest():
    assert cli("version").stdout.startswith("applianced ")
    out = cli("key", "digest", "secret")
    assert out.stdout.strip() == "2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b"


def test_config_check(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text('[server]\nport = 9000\n[engine]\nsim_speed = 2\n[auth.keys]\n'
                    '"2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b" = "svc"\n')
    assert cli("config", "check", str(good)).returncode == 0
    for text, needle in [
        ("[server]\nprot = 9000\n", "unknown key server.prot"),
        ("[engine]\nblock_size = 'big'\n", "engine.block_size must be an integer"),
        ("[devices]\nmode = 'fast'\n", "devices.mode"),
        ("[server\n", "not valid TOML"),
        ("[auth.keys]\nsecret = 'svc'\n", "SHA-256"),
        ("[engine]\nreserve_ratio = 2.0\n", "reserve_ratio"),
        ("[engine]\nprefill_chunk_tokens = -1\n", "prefill_chunk_tokens must be 0 (off) or more"),
        ("[engine]\ncpu_threads = -2\n", "cpu_threads must be 0 (auto) or more"),
    ]:
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        one_line_error(cli("config", "check", str(bad)), needle)
    one_line_error(cli("config", "check", str(tmp_path / "missing.toml")), "cannot read")


def test_serve_rejects_bad_config_before_starting(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[workers]\nrestart_backoff = 1\n")
    one_line_error(cli("serve", "--config", str(bad), "--state-dir", str(tmp_path)),
                   "unknown key workers.restart_backoff")


def test_model_init_tiny_cli(tmp_path):
    out = cli("model", "init-tiny", str(tmp_path / "m"), "--seed", "3")
    assert out.returncode == 0, out.stderr
    tok = ServedTokenizer(tmp_path / "m")
    assert tok.decode(tok.encode("héllo wörld")) == "héllo wörld"
