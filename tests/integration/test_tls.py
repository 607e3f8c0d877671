"""TLS on the listeners (issue 28): the official client over TLS with the test CA, mutual
TLS on the admin API, plain HTTP refused in one line, a certificate rotated on disk served
to the next connection while an open one carries on, and bad files refused in one line."""
from __future__ import annotations

import hashlib
import http.client
import json
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time

import httpx
import openai
import pytest

from helpers.daemons import ROOT, free_port
from helpers.tls_pki import client_context, https, make_pki, needs_openssl, start_tls_daemon

from appliance.config import parse as parse_config
from appliance.daemon.listeners import tls_setup
from appliance.daemon.tls import TlsError

pytestmark = needs_openssl

ADMIN_KEY, TENANT_KEY = "adm-tls-1", "sk-tls-tenant-1"


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    p = make_pki(tmp_path_factory.mktemp("pki"))
    p.issue("server", "localhost")
    p.issue("server2", "localhost-rotated")
    p.issue("alice", "admin-alice", "clientAuth", san="")
    p.new_ca("rogue", "rogue CA")
    p.issue("mallory", "mallory", "clientAuth", san="", ca="rogue")
    return p


def _config(cert, key, *, client_ca=None, extra: str = "") -> str:
    return (f'[server]\ntls_cert = "{cert}"\ntls_key = "{key}"\n{extra}'
            f'[auth]\nadmin_keys = ["{_digest(ADMIN_KEY)}"]\n'
            + (f'admin_client_ca = "{client_ca}"\n' if client_ca else "")
            + f'[auth.keys]\n"{_digest(TENANT_KEY)}" = "search"\n')


@pytest.fixture(scope="module")
def tls_daemon(pki, tiny_model, tmp_path_factory):
    """A shared listener with TLS and admin_client_ca; its certificate files are copies
    the rotation test replaces."""
    tmp = tmp_path_factory.mktemp("tls-daemon")
    live = tmp / "live"
    live.mkdir()
    shutil.copy(pki.dir / "server.pem", live / "server.pem")
    shutil.copy(pki.dir / "server.key", live / "server.key")
    d = start_tls_daemon(tmp, tiny_model, client_context(pki.ca),
                         config=_config(live / "server.pem", live / "server.key",
                                        client_ca=pki.ca))
    d.live = live
    yield d
    d.stop()


def _openai(d, verify) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.url + "/v1", api_key=TENANT_KEY, max_retries=0, timeout=60,
                         http_client=httpx.Client(verify=verify))


def test_plain_http_to_the_tls_port_is_refused_in_one_line(tls_daemon):
    with socket.create_connection(("127.0.0.1", tls_daemon.port), timeout=10) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        try:
            while chunk := s.recv(4096):
                answer += chunk
        except ConnectionResetError:
            pass
    assert b"HTTP/1.1 200" not in answer and b"models" not in answer
    deadline = time.monotonic() + 5
    while "plain-HTTP" not in tls_daemon.log_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    log = tls_daemon.log_text()
    assert log.count("refused a plain-HTTP request on the TLS port") == 1, log
    assert "Traceback" not in log
    assert tls_daemon.proc.poll() is None


def test_the_openai_client_chats_over_tls_with_the_ca(tls_daemon, pki):
    client = _openai(tls_daemon, client_context(pki.ca))
    out = client.chat.completions.create(model="tiny-llama", max_tokens=8,
                                         messages=[{"role": "user", "content": "hello"}])
    assert out.choices[0].message.content is not None
    assert out.usage.completion_tokens > 0
    # streaming goes through the same TLS session machinery
    chunks = list(client.chat.completions.create(
        model="tiny-llama", max_tokens=4, stream=True,
        messages=[{"role": "user", "content": "hi"}]))
    assert chunks and chunks[-1].choices[0].finish_reason is not None


def test_without_the_ca_the_client_fails_verification(tls_daemon):
    client = _openai(tls_daemon, True)          # the system's CAs: ours is not among them
    with pytest.raises(openai.APIConnectionError) as err:
        client.models.list()
    cause = err.value.__cause__
    while cause is not None and not isinstance(cause, ssl.SSLCertVerificationError):
        cause = cause.__cause__ or cause.__context__
    assert isinstance(cause, ssl.SSLCertVerificationError)


def test_admin_api_needs_the_client_certificate_and_the_key(tls_daemon, pki):
    url = tls_daemon.url + "/admin/v1/status"
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    code, _, body = https("GET", url, client_context(pki.ca), headers=admin)
    assert code == 401 and body["error"]["code"] == "client_certificate_required", body
    alice = client_context(pki.ca, pki.dir / "alice.pem", pki.dir / "alice.key")
    code, _, body = https("GET", url, alice, headers=admin)
    assert code == 200 and body["ready"] is True
    code, _, body = https("GET", url, alice)             # the certificate alone is not enough
    assert code == 401 and body["error"]["code"] == "invalid_api_key"
    # a client certificate from another CA does not even complete the handshake
    mallory = client_context(pki.ca, pki.dir / "mallory.pem", pki.dir / "mallory.key")
    with pytest.raises((ssl.SSLError, ConnectionResetError, OSError)):
        https("GET", url, mallory, headers=admin)
    # tenants need no certificate for the OpenAI API on the shared listener
    code, _, _ = https("GET", tls_daemon.url + "/v1/models", client_context(pki.ca),
                       headers={"Authorization": f"Bearer {TENANT_KEY}"})
    assert code == 200
    # refusals are audited; the certificate's subject is the operator's identity
    code, _, _ = https("POST", tls_daemon.url + "/admin/v1/workflows", alice,
                       body=b'{"kind": "no-such-kind"}', headers=admin)
    assert code == 400
    code, _, audit = https("GET", tls_daemon.url + "/admin/v1/audit?since=0", alice,
                           headers=admin)
    assert code == 200
    failures = [e for e in audit["data"] if e["action"] == "auth.failure"]
    assert [(e["identity"], e["result"].split()[0]) for e in failures] == [
        ("a key", "401"),                          # the admin key without a certificate
        ("anonymous cert=CN=admin-alice", "401")]  # the certificate without a key
    assert "client certificate" in failures[0]["result"]
    [start] = [e for e in audit["data"] if e["action"] == "workflow.start"]
    assert start["identity"] == f"admin:{_digest(ADMIN_KEY)[:8]} cert=CN=admin-alice"
    assert start["result"].startswith("400 unknown workflow kind")
    assert all(ADMIN_KEY not in json.dumps(e) for e in audit["data"])


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "appliance", *args], capture_output=True,
                          text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_cli_status_with_cacert_and_client_certificate(tls_daemon, pki):
    common = ["--url", tls_daemon.url, "--admin-key", ADMIN_KEY]
    out = _cli("status", "--json", *common, "--cacert", str(pki.ca),
               "--cert", str(pki.dir / "alice.pem"), "--key", str(pki.dir / "alice.key"))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["ready"] is True
    out = _cli("status", *common)
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1 and "does not verify" in out.stderr, out.stderr
    out = _cli("status", *common, "--cacert", str(pki.ca))
    assert out.returncode == 1 and "client certificate" in out.stderr, out.stderr
    out = _cli("workflow", "list", *common, "--cacert", str(pki.dir / "missing.pem"))
    assert out.returncode == 1 and "--cacert" in out.stderr and "Traceback" not in out.stderr


def test_the_console_feed_reads_the_admin_api_over_mutual_tls(tls_daemon, pki):
    import asyncio

    from appliance.tui.feed import ApplianceFeed, FeedError

    async def status(ctx):
        feed = ApplianceFeed(tls_daemon.url, ADMIN_KEY, on_snapshot=lambda *a: None,
                             on_link=lambda *a: None, tls=ctx)
        try:
            return await feed.get_json("/admin/v1/status")
        finally:
            if feed._session is not None:
                await feed._session.close()

    alice = client_context(pki.ca, pki.dir / "alice.pem", pki.dir / "alice.key")
    assert asyncio.run(status(alice))["ready"] is True
    with pytest.raises(FeedError, match="401"):
        asyncio.run(status(client_context(pki.ca)))


def _served_certificate(port: int, ca) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with client_context(ca).wrap_socket(raw, server_hostname="127.0.0.1") as s:
            return s.getpeercert(binary_form=True)


def _der(path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(path.read_text())


def _replace(src, dst) -> None:
    tmp = dst.with_name(dst.name + ".new")
    shutil.copy(src, tmp)
    os.replace(tmp, dst)


def test_a_certificate_replaced_on_disk_is_served_to_the_next_connection(tls_daemon, pki):
    d, live = tls_daemon, tls_daemon.live
    assert _served_certificate(d.port, pki.ca) == _der(pki.dir / "server.pem")
    # a connection open across the rotation keeps working
    kept = http.client.HTTPSConnection("127.0.0.1", d.port, context=client_context(pki.ca))
    kept.request("GET", "/v1/models", headers={"Authorization": f"Bearer {TENANT_KEY}"})
    assert kept.getresponse().read()
    _replace(pki.dir / "server2.key", live / "server.key")
    _replace(pki.dir / "server2.pem", live / "server.pem")
    deadline = time.monotonic() + 10
    while _served_certificate(d.port, pki.ca) != _der(pki.dir / "server2.pem"):
        assert time.monotonic() < deadline, d.log_text()
        time.sleep(0.1)
    kept.request("GET", "/v1/models", headers={"Authorization": f"Bearer {TENANT_KEY}"})
    resp = kept.getresponse()
    assert resp.status == 200 and json.loads(resp.read())["data"]
    kept.close()
    # a key that does not match: the old pair stays, one line says why
    _replace(pki.dir / "alice.key", live / "server.key")
    deadline = time.monotonic() + 10
    while "does not match" not in d.log_text():
        assert time.monotonic() < deadline, d.log_text()
        time.sleep(0.1)
    assert _served_certificate(d.port, pki.ca) == _der(pki.dir / "server2.pem")
    assert d.log_text().count("still serving the previous certificate") == 1
    # SIGHUP re-reads at once (and is audited)
    _replace(pki.dir / "server.key", live / "server.key")
    _replace(pki.dir / "server.pem", live / "server.pem")
    d.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while _served_certificate(d.port, pki.ca) != _der(pki.dir / "server.pem"):
        assert time.monotonic() < deadline, d.log_text()
        time.sleep(0.1)
    assert d.proc.poll() is None
    # the audit log: each reload once (the watcher's two, SIGHUP's one)
    alice = client_context(pki.ca, pki.dir / "alice.pem", pki.dir / "alice.key")
    deadline = time.monotonic() + 5
    while True:
        _, _, audit = https("GET", d.url + "/admin/v1/audit", alice,
                            headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        reloads = [(e["action"], e["identity"], e["result"].split(":")[0])
                   for e in audit["data"] if "reload" in e["action"]]
        if (reloads and reloads[-1][0] == "reload") or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert reloads[:2] == [("tls.reload", "file watch", "reloaded"),
                           ("tls.reload", "file watch", "kept the previous")], reloads
    assert reloads[-1] == ("reload", "SIGHUP", "tls"), reloads
    # on a loaded box the watcher may see the last files before the signal lands
    assert reloads[2:-1] in ([], [("tls.reload", "file watch", "reloaded")]), reloads


def test_a_bad_pair_stops_start_up_in_one_line(pki, tiny_model, tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(_config(pki.dir / "server.pem", pki.dir / "alice.key"))
    out = subprocess.run([sys.executable, "-m", "appliance", "serve", "--config", str(config),
                          "--state-dir", str(tmp_path / "state"), "--model", str(tiny_model),
                          "--devices", "cpu", "--engine", "sim", "--port", str(free_port())],
                         capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("applianced: TLS certificate ")
    assert "does not match the certificate" in out.stderr


def test_credentials_directory_and_one_line_errors(pki, tmp_path, monkeypatch):
    creds = tmp_path / "creds"
    creds.mkdir()
    shutil.copy(pki.dir / "server.pem", creds / "tls.pem")
    shutil.copy(pki.dir / "server.key", creds / "tls.key")
    cfg = parse_config('[server]\ntls_cert = "credential:tls.pem"\ntls_key = "credential:tls.key"\n')
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    with pytest.raises(TlsError, match="no \\$CREDENTIALS_DIRECTORY"):
        tls_setup(cfg)
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    tls = tls_setup(cfg)
    assert tls.enabled and tls.api.minimum_version == ssl.TLSVersion.TLSv1_2
    assert tls.api.verify_mode == ssl.CERT_NONE
    (creds / "tls.pem").write_text("not a certificate\n")
    with pytest.raises(TlsError) as err:
        tls_setup(cfg)
    assert "\n" not in str(err.value) and "tls.pem" in str(err.value)
    shutil.copy(pki.dir / "server.pem", creds / "tls.pem")
    subprocess.run(["openssl", "pkey", "-in", str(pki.dir / "server.key"), "-aes256",
                    "-passout", "pass:secret", "-out", str(creds / "tls.key")], check=True)
    with pytest.raises(TlsError, match="the private key is encrypted"):
        tls_setup(cfg)                  # not a prompt on a terminal the daemon lacks
    with pytest.raises(ValueError, match="go together"):
        parse_config('[server]\ntls_cert = "a.pem"\n')
    with pytest.raises(ValueError, match="needs TLS"):
        parse_config(f'[auth]\nadmin_client_ca = "{pki.ca}"\n')


def test_exposed_without_tls_or_keys_warns(caplog):
    from appliance.daemon.main import warn_if_exposed
    cfg = parse_config('[server]\nhost = "0.0.0.0"\n')
    with caplog.at_level(logging.WARNING, logger="applianced"):
        warn_if_exposed(cfg, tls=False)
    text = caplog.text
    assert "without TLS" in text and "no API keys" in text and "no admin keys" in text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="applianced"):
        warn_if_exposed(parse_config(""), tls=False)
    assert caplog.text == ""


def test_a_separate_admin_listener_requires_the_client_certificate(pki, tiny_model, tmp_path):
    admin_port = free_port()
    extra = f'admin_host = "127.0.0.1"\nadmin_port = {admin_port}\n'
    d = start_tls_daemon(tmp_path, tiny_model, client_context(pki.ca),
                         config=_config(pki.dir / "server.pem", pki.dir / "server.key",
                                        client_ca=pki.ca, extra=extra))
    try:
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        alice = client_context(pki.ca, pki.dir / "alice.pem", pki.dir / "alice.key")
        admin_url = f"https://127.0.0.1:{admin_port}"
        code, _, body = https("GET", admin_url + "/admin/v1/status", alice, headers=admin)
        assert code == 200 and body["ready"] is True
        # CERT_REQUIRED: no certificate, no handshake
        with pytest.raises((ssl.SSLError, ConnectionResetError, OSError)):
            https("GET", admin_url + "/admin/v1/status", client_context(pki.ca), headers=admin)
        # the API listener serves no admin routes, the admin listener no OpenAI routes
        code, _, body = https("GET", d.url + "/admin/v1/status", client_context(pki.ca),
                              headers=admin)
        assert code == 404 and "admin listener" in body["error"]["message"]
        code, _, _ = https("GET", admin_url + "/v1/models", alice,
                           headers={"Authorization": f"Bearer {TENANT_KEY}"})
        assert code == 404
        code, _, _ = https("GET", d.url + "/v1/models", client_context(pki.ca),
                           headers={"Authorization": f"Bearer {TENANT_KEY}"})
        assert code == 200
    finally:
        d.stop()
