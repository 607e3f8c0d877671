"""systemd integration without systemd: the units' settings, and which inherited
sockets are this process's (the real sockets and systemd's tools are in
tests/integration/test_systemd.py)."""
from __future__ import annotations

import configparser
import os
import re

from helpers.daemons import ROOT

from appliance.config import ServerConfig
from appliance.daemon import systemd

SYSTEMD_DIR = ROOT / "systemd"


def test_listen_sockets_only_for_this_pid(monkeypatch):
    monkeypatch.setenv("LISTEN_PID", str(os.getpid() + 1))
    monkeypatch.setenv("LISTEN_FDS", "1")
    monkeypatch.setenv("LISTEN_FDNAMES", "http")
    assert systemd.listen_sockets() == []
    # The variables are gone either way: the daemon's workers must not see them.
    assert not {"LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"} & set(os.environ)


# ---- the units -------------------------------------------------------------------------

def unit_settings(path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None,
                                       comment_prefixes=("#", ";"))
    parser.optionxform = str
    parser.read_string(path.read_text())
    return parser


def test_service_settings():
    svc = unit_settings(SYSTEMD_DIR / "applianced.service")["Service"]
    text = (SYSTEMD_DIR / "applianced.service").read_text()
    assert svc["Type"] == "notify" and svc["NotifyAccess"] == "main"
    assert svc["KillMode"] == "mixed"
    assert "PrivateDevices" not in svc and svc["DevicePolicy"] == "closed"
    assert re.search(r"^DeviceAllow=char-nvidia-frontend rw$", text, re.M)
    assert re.search(r"^DeviceAllow=char-nvidia-uvm rw$", text, re.M)
    assert svc["User"] == "applianced" and "DynamicUser" not in svc
    assert svc["StateDirectory"] == "applianced" and svc["ConfigurationDirectory"] == "applianced"
    assert int(svc["WatchdogSec"]) > 0
    # the accounting process may go back from nice 19 to 0 (appliance.accounting.process)
    assert svc["LimitNICE"] == "+0"
    # Stopping drains requests, then stops workers (WorkerPool.stop waits up to 10 s).
    assert int(svc["TimeoutStopSec"]) > ServerConfig().drain_timeout_s + 10
    sock = unit_settings(SYSTEMD_DIR / "applianced.socket")["Socket"]
    assert sock["ListenStream"] == f"{ServerConfig().host}:{ServerConfig().port}"
