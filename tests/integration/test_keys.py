"""Keys without a restart (issue 28): `applianced keys add|list|revoke` write the keys file
in the state directory; a running daemon picks a change up within a second; a revoked key
is refused on its next request while a stream on another key finishes; an expired key is
told so; config-file keys keep working, and a name in both sources stops start-up."""
from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import threading
import time

import openai
import pytest

from helpers.daemons import ROOT, free_port, http

from appliance import keystore

CONFIG_KEY, CONFIG_ADMIN = "sk-config-search", "adm-config-1"


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def keys_cli(state, *args: str, config=None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "appliance", "keys", *args, "--state-dir", str(state)]
    if config is not None:
        cmd += ["--config", str(config)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_add_list_revoke_store_only_the_digest(tmp_path):
    state = tmp_path / "state"
    out = keys_cli(state, "add", "search-prod", "--tenant", "search", "--expires", "90d",
                   "--tags", "team=search,project=ranking")
    assert out.returncode == 0, out.stderr
    key = out.stdout.strip()
    assert key.startswith("sk-") and len(key) > 40
    path = keystore.keys_path(state)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    assert key not in text and _digest(key) in text
    [record] = keystore.read(path)
    assert (record.name, record.tenant, record.admin) == ("search-prod", "search", False)
    assert record.tags == {"team": "search", "project": "ranking"}
    assert 89.9 * 86400 < record.expires - record.created < 90.1 * 86400
    # the second key of a name, a key for nobody, a bad tag: one line each, file unchanged
    for args, needle in [(("add", "search-prod", "--tenant", "search"), "exists already"),
                         (("add", "orphan"), "either a tenant's"),
                         (("add", "x", "--tenant", "t", "--tags", "colour=red"), "unknown tag"),
                         (("add", "y", "--tenant", "t", "--expires", "soon"), "malformed duration"),
                         (("revoke", "nobody"), "no key named")]:
        out = keys_cli(state, *args)
        assert out.returncode == 1 and needle in out.stderr, (args, out.stderr)
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert path.read_text() == text
    out = keys_cli(state, "add", "ops-alice", "--admin")
    assert out.returncode == 0 and out.stdout.startswith("adm-")
    out = keys_cli(state, "revoke", "search-prod")
    assert out.returncode == 0, out.stderr
    out = keys_cli(state, "list", "--json")
    rows = {r["name"]: r for r in json.loads(out.stdout)["keys"]}
    assert rows["search-prod"]["status"] == "revoked"
    assert rows["ops-alice"]["status"] == "active" and rows["ops-alice"]["admin"] is True
    out = keys_cli(state, "list")
    assert out.returncode == 0
    assert out.stdout.splitlines()[0].split() == ["NAME", "TENANT", "CREATED", "EXPIRES",
                                                  "LAST", "USED", "STATUS"]
    assert "(admin)" in out.stdout and key not in out.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand files to another user")
def test_as_root_the_files_go_to_the_state_directorys_owner(tmp_path):
    """`sudo applianced keys add` on the daemon's state directory: a root-owned 0600 keys
    file (or audit log) would lock the daemon's own user out."""
    state = tmp_path / "state"
    state.mkdir()
    os.chown(state, 65534, 65534)
    assert keys_cli(state, "add", "k1", "--tenant", "t").returncode == 0
    for name in ("keys.json", "keys.json.lock", "audit.jsonl"):
        st = (state / name).stat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (65534, 65534, 0o600), name


def test_a_config_key_name_is_not_taken_again(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(f'[auth.keys]\n"{_digest(CONFIG_KEY)}" = {{ tenant = "search", '
                      f'name = "search-prod" }}\n')
    out = keys_cli(tmp_path / "state", "add", "search-prod", "--tenant", "search", config=config)
    assert out.returncode == 1 and "already a key in the config file" in out.stderr


def test_a_name_defined_twice_stops_start_up(tmp_path, tiny_model):
    state = tmp_path / "state"
    assert keys_cli(state, "add", "search-prod", "--tenant", "search").returncode == 0
    config = tmp_path / "c.toml"
    config.write_text(f'[auth.keys]\n"{_digest(CONFIG_KEY)}" = {{ tenant = "search", '
                      f'name = "search-prod" }}\n')
    out = subprocess.run([sys.executable, "-m", "appliance", "serve", "--config", str(config),
                          "--state-dir", str(state), "--model", str(tiny_model),
                          "--devices", "cpu", "--engine", "sim", "--port", str(free_port())],
                         capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 1 and "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert "search-prod" in last and "config file and in the keys file" in last


def _wait_status(url: str, key: str, want: int, limit: float) -> float:
    """The wall time GET /v1/models with `key` first answers `want` (AssertionError past
    `limit` seconds)."""
    started = time.monotonic()
    while True:
        code, _, body = http("GET", url + "/v1/models",
                             headers={"Authorization": f"Bearer {key}"})
        if code == want:
            return time.time()
        assert time.monotonic() - started < limit, (code, body)
        time.sleep(0.02)


def test_keys_change_in_a_running_daemon(daemon_factory, tiny_model):
    config = (f'[auth]\nadmin_keys = ["{_digest(CONFIG_ADMIN)}"]\n'
              f'[auth.keys]\n"{_digest(CONFIG_KEY)}" = "search"\n')
    d = daemon_factory("--devices", "cpu", "--engine", "sim", "--sim-speed", "0.05",
                       model=tiny_model, config=config)
    state = d.log.parent / "state"
    # a config key works from the start; an unknown one does not
    _wait_status(d.url, CONFIG_KEY, 200, 1)
    assert http("GET", d.url + "/v1/models",
                headers={"Authorization": "Bearer sk-not-issued"})[0] == 401
    out = keys_cli(state, "add", "alpha-1", "--tenant", "alpha")
    assert out.returncode == 0, out.stderr
    alpha = out.stdout.strip()
    # polled twice a second; the limit has slack for a loaded box
    took = _wait_status(d.url, alpha, 200, 3) - keystore.keys_path(state).stat().st_mtime
    print(f"keys file written -> the new key's first 200 in {took:.3f} s")
    # a file admin key reaches the admin API besides the config's
    out = keys_cli(state, "add", "ops-bob", "--admin")
    bob = out.stdout.strip()
    _wait_status(d.url, alpha, 200, 1)
    deadline = time.monotonic() + 3
    while http("GET", d.url + "/admin/v1/status",
               headers={"Authorization": f"Bearer {bob}"})[0] != 200:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert http("GET", d.url + "/admin/v1/status",
                headers={"Authorization": f"Bearer {CONFIG_ADMIN}"})[0] == 200

    # a stream on the config key runs while alpha's key is revoked
    client = d.client(api_key=CONFIG_KEY)
    pieces: list[str] = []
    finish: list[str | None] = []

    def stream() -> None:
        for chunk in client.chat.completions.create(
                model="tiny-llama", max_tokens=400, stream=True,
                extra_body={"ignore_eos": True},
                messages=[{"role": "user", "content": "tell me a long story"}]):
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            if chunk.choices and chunk.choices[0].finish_reason:
                finish.append(chunk.choices[0].finish_reason)

    runner = threading.Thread(target=stream)
    stream_started = time.monotonic()
    runner.start()
    deadline = time.monotonic() + 20
    while not pieces:
        assert time.monotonic() < deadline, "the stream never started"
        time.sleep(0.01)
    assert keys_cli(state, "revoke", "alpha-1").returncode == 0
    took = _wait_status(d.url, alpha, 401, 3) - keystore.keys_path(state).stat().st_mtime
    print(f"keys file written -> the revoked key's first 401 in {took:.3f} s")
    code, _, body = http("GET", d.url + "/v1/models", headers={"Authorization": f"Bearer {alpha}"})
    assert code == 401 and body["error"]["code"] == "invalid_api_key"
    assert runner.is_alive(), "the stream ended before the revocation was seen: make it longer"
    runner.join(120)
    print(f"the stream on the other key ran {time.monotonic() - stream_started:.1f} s")
    assert finish == ["length"] and len(pieces) > 20

    # an expired key is told it expired
    out = keys_cli(state, "add", "short-lived", "--tenant", "alpha", "--expires", "1s")
    short = out.stdout.strip()
    time.sleep(1.1)
    deadline = time.monotonic() + 2
    while True:
        code, _, body = http("GET", d.url + "/v1/models",
                             headers={"Authorization": f"Bearer {short}"})
        if body.get("error", {}).get("code") == "expired_api_key" or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert code == 401 and "expired" in body["error"]["message"]
    with pytest.raises(openai.AuthenticationError, match="expired"):
        d.client(api_key=short).models.list()

    # a broken keys file: the previous keys stay, one line says why
    broken = state / "broken.json"
    broken.write_text("{not json")
    os.replace(broken, keystore.keys_path(state))         # one change, as an editor saves
    deadline = time.monotonic() + 5
    while "keys file not loaded" not in d.log_text():
        assert time.monotonic() < deadline, d.log_text()
        time.sleep(0.05)
    time.sleep(1.0)                                      # more polls: still one line
    assert http("GET", d.url + "/admin/v1/status",
                headers={"Authorization": f"Bearer {bob}"})[0] == 200
    assert d.log_text().count("keys file not loaded, the previous keys stay") == 1
    # last use reaches `keys list` (written every few seconds)
    d.stop()
    used = keystore.read_used(state)
    assert used.get("ops-bob", 0) > time.time() - 120 and "alpha-1" in used
