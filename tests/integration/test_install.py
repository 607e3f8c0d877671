"""`make install` into a DESTDIR: binary, units, sysusers file, default config and the
generated model land in their FHS places; a second install keeps the operator's config.
The commented default config is docs/configuration.md's block and parses to the defaults."""
from __future__ import annotations

import filecmp
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.daemons import ROOT

from appliance import config

BINARY = ROOT / "dist" / "applianced" / "applianced"
sys.path.insert(0, str(ROOT / "packaging"))


def run_make(*args: str) -> subprocess.CompletedProcess:
    # The running interpreter's venv; DEPS= so make installs nothing into it.
    return subprocess.run(["make", "--no-print-directory", *args, f"VENV={sys.prefix}", "DEPS="],
                          cwd=ROOT, capture_output=True, text=True, timeout=1800)


@pytest.mark.skipif(not BINARY.exists(), reason="no dist/applianced: run make binary")
def test_make_install_into_a_destdir(tmp_path, tiny_model):
    dest = tmp_path / "root"
    try:
        check_install(dest, tiny_model)
    finally:
        shutil.rmtree(dest, ignore_errors=True)     # ~700 MB per staged tree


def check_install(dest: Path, tiny_model: Path) -> None:
    out = run_make("install", f"DESTDIR={dest}")
    assert out.returncode == 0, out.stdout + out.stderr
    binary = dest / "opt/applianced/applianced"
    assert os.access(binary, os.X_OK)
    assert (dest / "opt/applianced/_internal").is_dir()
    assert (dest / "opt/applianced/README.md").is_file()     # the unit's Documentation=
    assert (dest / "opt/applianced/docs/configuration.md").is_file()   # the manual beside it
    assert os.readlink(dest / "usr/local/bin/applianced") == "/opt/applianced/applianced"
    assert filecmp.cmp(dest / "etc/systemd/system/applianced.service", ROOT / "systemd/applianced.service")
    assert filecmp.cmp(dest / "etc/systemd/system/applianced.socket", ROOT / "systemd/applianced.socket")
    assert filecmp.cmp(dest / "usr/lib/sysusers.d/applianced.conf", ROOT / "systemd/applianced.sysusers")
    cfg = dest / "etc/applianced/config.toml"
    assert config.load(cfg) == config.Config()
    model = dest / "var/lib/applianced/models/tiny-llama"
    for name in ("model.safetensors", "tokenizer.json"):
        assert (hashlib.sha256((model / name).read_bytes()).hexdigest()
                == hashlib.sha256((tiny_model / name).read_bytes()).hexdigest())
    ran = subprocess.run([str(binary), "config", "check", str(cfg)], capture_output=True,
                         text=True, timeout=60)
    assert ran.returncode == 0 and ran.stdout.strip() == f"{cfg}: ok", ran.stderr

    # Upgrade: the tree is replaced, the operator's config is kept, the model reused.
    cfg.write_text('[server]\nport = 9000\n')
    stamp = (model / "model.safetensors").stat().st_mtime_ns
    (dest / "opt/applianced/stale-file").write_text("from the old version")
    out = run_make("install", f"DESTDIR={dest}")
    assert out.returncode == 0, out.stdout + out.stderr
    assert config.load(cfg).server.port == 9000
    assert (model / "model.safetensors").stat().st_mtime_ns == stamp
    assert not (dest / "opt/applianced/stale-file").exists()
    assert not (dest / "opt/applianced.new").exists() and not (dest / "opt/applianced.old").exists()
