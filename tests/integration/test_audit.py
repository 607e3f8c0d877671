"""The audit log (issue 28): every admin action and every refused /admin authentication is
one JSON line with the right identity (never the key), read back by GET /admin/v1/audit;
the file rotates by size without losing or doubling a line between concurrent writers;
under systemd each entry also goes to the journal as applianced-audit."""
from __future__ import annotations

import getpass
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

from helpers.daemons import ROOT, http

from appliance.audit import AuditLog
from appliance.daemon import systemd

ADMIN_KEY = "adm-audit-config"


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "appliance", *args], capture_output=True,
                          text=True, timeout=60, cwd=ROOT,
                          env={**{k: v for k, v in os.environ.items() if k != "SUDO_USER"},
                               "PYTHONPATH": str(ROOT)})


def test_each_admin_action_once_with_its_identity(daemon_factory, tiny_model):
    d = daemon_factory("--devices", "cpu", "--engine", "sim", "--sim-speed", "50",
                       model=tiny_model, config=f'[auth]\nadmin_keys = ["{_digest(ADMIN_KEY)}"]\n')
    state = d.log.parent / "state"
    started = time.time()
    out = _cli("keys", "add", "ops-alice", "--admin", "--state-dir", str(state))
    assert out.returncode == 0, out.stderr
    alice = out.stdout.strip()
    alice_auth = {"Authorization": f"Bearer {alice}"}
    deadline = time.monotonic() + 3
    refused = 0                     # each 401 while the daemon had not seen the key yet
    while http("GET", d.url + "/admin/v1/status", headers=alice_auth)[0] != 200:
        refused += 1
        assert time.monotonic() < deadline
        time.sleep(0.02)
    code, _, wf = d.post("/admin/v1/workflows", {"kind": "drain"}, headers=alice_auth)
    assert code == 201, wf
    deadline = time.monotonic() + 20
    while http("GET", d.url + f"/admin/v1/workflows/{wf['id']}",
               headers=alice_auth)[2]["status"] != "succeeded":
        assert time.monotonic() < deadline, "the drain did not finish"
        time.sleep(0.05)
    code, _, body = d.post(f"/admin/v1/workflows/{wf['id']}/cancel", {},
                           headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert code == 409, body                        # finished already: refused, audited
    code, _, body = d.post("/admin/v1/workflows", {"kind": "resume"},
                           headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert code == 201, body
    code, _, _ = http("GET", d.url + "/admin/v1/status",
                      headers={"Authorization": "Bearer sk-guessed-wrong"})
    assert code == 401
    assert _cli("keys", "revoke", "ops-alice", "--state-dir", str(state)).returncode == 0
    d.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 5
    while '"action":"reload"' not in (state / "audit.jsonl").read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)

    code, _, body = http("GET", d.url + f"/admin/v1/audit?since={started - 1}",
                         headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert code == 200
    entries = body["data"]
    got = [(e["action"], e["identity"], e["result"].split()[0]) for e in entries]
    me = f"cli:{getpass.getuser()}"
    config_admin = f"admin:{_digest(ADMIN_KEY)[:8]}"
    assert got == [("key.add", me, "added")] + [("auth.failure", "a key", "401")] * refused + [
                   ("workflow.start", "ops-alice", "started"),
                   ("workflow.cancel", config_admin, "409"),
                   ("workflow.start", config_admin, "started"),
                   ("auth.failure", "a key", "401"),
                   ("key.revoke", me, "revoked"),
                   ("reload", "SIGHUP", "keys:")], got
    by_action = {}
    for e in entries:
        by_action.setdefault(e["action"], e)       # the first of each
    assert by_action["workflow.start"]["params"] == {"kind": "drain", "params": {},
                                                     "id": wf["id"]}
    assert by_action["workflow.start"]["remote"] == "127.0.0.1"
    assert by_action["auth.failure"]["params"]["path"] == "/admin/v1/status"
    everything = json.dumps(entries) + (state / "audit.jsonl").read_text()
    for secret in (alice, ADMIN_KEY, "sk-guessed-wrong"):
        assert secret not in everything
    # since= filters; a bad one is a 400
    code, _, body = http("GET", d.url + "/admin/v1/audit?since=" + str(time.time() + 60),
                         headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert code == 200 and body["data"] == []
    code, _, body = http("GET", d.url + "/admin/v1/audit?since=yesterday",
                         headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert code == 400 and body["error"]["param"] == "since"
    code, _, body = http("GET", d.url + "/admin/v1/audit?since=2020-01-01T00:00:00Z",
                         headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert [e["action"] for e in body["data"]] == [e["action"] for e in entries]
    code, _, body = http("GET", d.url + "/admin/v1/audit?since=1h",
                         headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert [e["action"] for e in body["data"]] == [e["action"] for e in entries]


WRITER = """
import sys
from appliance.audit import AuditLog
log = AuditLog(sys.argv[1], max_bytes=4096, backups=100)
for i in range(int(sys.argv[3])):
    log.record("test.write", sys.argv[2], "ok", params={"i": i})
"""


def test_rotation_by_size_keeps_every_line_once_across_writers(tmp_path):
    path = tmp_path / "audit.jsonl"
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), who, "150"], cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}) for who in "ab"]
    assert all(p.wait(60) == 0 for p in procs)
    files = sorted(tmp_path.glob("audit.jsonl*"))
    assert len(files) > 5                               # it did rotate
    assert all(f.stat().st_size <= 4096 for f in files)
    entries = AuditLog(path, max_bytes=4096, backups=100).read(limit=10000)
    for who in "ab":
        assert [e["params"]["i"] for e in entries if e["identity"] == who] == list(range(150))
    # with few backups the oldest files go, the newest lines stay
    small = AuditLog(tmp_path / "small.jsonl", max_bytes=1024, backups=2)
    for i in range(100):
        small.record("test.write", "c", "ok", params={"i": i})
    kept = [e["params"]["i"] for e in small.read()]
    assert kept == list(range(kept[0], 100)) and 0 < kept[0] < 100
    assert len(list(tmp_path.glob("small.jsonl*"))) == 3


def test_entries_go_to_the_journal_as_applianced_audit(tmp_path, monkeypatch):
    sock_path = tmp_path / "journal.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as journal:
        journal.bind(str(sock_path))
        journal.settimeout(5)
        monkeypatch.setattr(systemd, "JOURNAL_SOCKET", str(sock_path))
        monkeypatch.setattr(systemd, "stderr_is_journal", lambda: True)
        log = AuditLog(tmp_path / "audit.jsonl",
                       journal=systemd.journal_sender("applianced-audit"))
        entry = log.record("key.revoke", "cli:ops", "revoked", params={"name": "k1"})
        fields = journal.recv(65536).decode().splitlines()
    assert "SYSLOG_IDENTIFIER=applianced-audit" in fields
    assert "AUDIT_ACTION=key.revoke" in fields and "AUDIT_IDENTITY=cli:ops" in fields
    message = next(f for f in fields if f.startswith("MESSAGE="))
    assert json.loads(message[len("MESSAGE="):]) == entry
    monkeypatch.setattr(systemd, "stderr_is_journal", lambda: False)
    assert systemd.journal_sender("applianced-audit") is None


def test_an_unwritable_audit_log_does_not_fail_the_action(tmp_path, caplog):
    (tmp_path / "not-a-dir").write_text("")
    log = AuditLog(tmp_path / "not-a-dir" / "audit.jsonl")
    with caplog.at_level("ERROR", logger="applianced.audit"):
        entry = log.record("workflow.start", "ops", "started", params={"kind": "drain"})
    assert entry["action"] == "workflow.start"
    [line] = caplog.messages
    assert "not written" in line and '"action":"workflow.start"' in line
