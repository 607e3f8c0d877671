"""The HTTP edges of a real daemon: every response names its request, and what aiohttp's
parser rejects before any handler (a huge URL or header, bytes that are not HTTP)
still comes back as OpenAI-shaped JSON, without echoing the input, with one log line."""
from __future__ import annotations

import json
import socket
import time

import pytest

from helpers.daemons import http, start_daemon


@pytest.fixture(scope="module")
def daemon(tiny_model, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("edges"), tiny_model, "--devices", "cpu",
                     "--engine", "sim", "--sim-speed", "50",
                     config="[server]\nmax_body_bytes = 65536\n")
    yield d
    d.stop()


def raw_exchange(port: int, data: bytes, timeout: float = 10) -> tuple[int, dict, bytes]:
    """Send raw bytes, read until the server closes: (status, headers, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass        # the server may answer and close before reading it all
        chunks = []
        try:
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:
            pass
    raw = b"".join(chunks)
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return status, headers, body


def test_every_response_carries_a_request_id(daemon):
    url = daemon.url
    cases = {
        "malformed JSON 400": daemon.post("/v1/chat/completions", raw=b"{nope"),
        "bad parameter 400": daemon.post("/v1/completions", {"model": "tiny-llama",
                                                             "prompt": "x", "top_p": 7}),
        "body too large 413": daemon.post("/v1/completions", raw=b"x" * 70000),
        "unknown route 404": http("GET", url + "/v1/nothing-here"),
        "wrong method 405": http("GET", url + "/v1/completions"),
        "/health": http("GET", url + "/health"),
        "/ready": http("GET", url + "/ready"),
        "admin status": http("GET", url + "/admin/v1/status"),
        "metrics": http("GET", url + "/metrics"),
        "completion": daemon.post("/v1/completions", {"model": "tiny-llama", "prompt": "x",
                                                      "max_tokens": 2}),
    }
    ids = {}
    for what, (status, headers, _) in cases.items():
        headers = {k.lower(): v for k, v in headers.items()}
        assert headers.get("x-request-id"), f"{what} ({status}) has no X-Request-Id"
        ids[what] = headers["x-request-id"]
    assert len(set(ids.values())) == len(ids), "request ids repeat"
    status, _, body = cases["completion"]
    assert status == 200 and ids["completion"] in body["id"]   # the generation keeps its id
    assert cases["body too large 413"][0] == 413
    assert cases["wrong method 405"][0] == 405


@pytest.mark.parametrize("what,data,status,code,filler", [
    ("64 KB URL", b"GET /" + b"a" * 65536 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414,
     "uri_too_long", b"aaaaaaaa"),
    ("100 KB header", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 100_000
     + b"\r\n\r\n", 431, "header_too_large", b"bbbbbbbb"),
    ("not HTTP", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03zzzzzzzz\r\n\r\n", 400,
     "bad_http_request", b"zzzzzzzz"),
])
def test_parser_rejections_are_json_without_echo(daemon, what, data, status, code, filler):
    got, headers, body = raw_exchange(daemon.port, data)
    assert got == status, (what, body[:200])
    assert headers["content-type"].startswith("application/json")
    err = json.loads(body)["error"]
    assert err["code"] == code and err["message"]
    assert filler not in body, "the input is echoed back"
    rid = headers["x-request-id"]
    # One log line for it, no traceback (the log is written by the daemon asynchronously).
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        lines = [ln for ln in daemon.log_text().splitlines() if rid in ln]
        if lines:
            break
        time.sleep(0.05)
    assert len(lines) == 1, lines
    assert filler not in lines[0].encode()
    assert "Traceback" not in daemon.log_text()
    # The daemon is still serving.
    assert http("GET", daemon.url + "/health")[0] == 200


def test_a_long_but_allowed_header_still_works(daemon):
    status, _, body = http("GET", daemon.url + "/health", headers={"X-Token": "t" * 12000})
    assert status == 200 and body["status"] == "ok"


def test_shutdown_says_in_one_line_what_it_drained(daemon_factory, tiny_model):
    import signal
    d = daemon_factory("--devices", "cpu", "--engine", "sim", "--sim-speed", "0.5",
                       model=tiny_model)
    stream = d.client().completions.create(model="tiny-llama", prompt="Hi", max_tokens=60,
                                           stream=True)
    it = iter(stream)
    next(it)
    d.proc.send_signal(signal.SIGTERM)
    assert len(list(it)) > 1                    # the request in flight finishes
    assert d.proc.wait(30) == 0
    lines = [ln for ln in d.log_text().splitlines() if "stopped:" in ln]
    assert len(lines) == 1, lines
    assert "drained 1 of 1 in-flight generations" in lines[0] and "exit 0" in lines[0]
