"""Two daemons on loopback serving as one (docs/operations/cluster.md): a `decode` box and a
`prefill` box (the front) with the first as its peer, the torch engine on the generated
tiny model, the KV moved by NIXL (UCX over loopback shared memory / TCP). Answers through
the front equal a single box's token for token; the decode box bills its phase under the
front's request id; killing the decode box mid-stream ends the request cleanly and the
pair serves again once it is back."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from helpers.daemons import ROOT, free_port, http, start_daemon

pytest.importorskip("openai")
try:
    from appliance.kv.nixl_transport import nixl_available
    HAVE_NIXL = nixl_available()
except Exception:  # noqa: BLE001 - whatever breaks the import: skip with the reason
    HAVE_NIXL = False
pytestmark = pytest.mark.skipif(not HAVE_NIXL, reason="NIXL is not installed: pip install "
                                "'applianced[cluster]' (nixl-cu12)")

KEY = "cluster-key-for-the-tests"
ENGINE = ["--devices", "cpu", "--engine", "torch", "--mode", "disagg"]
# 1-s accounting windows: a request's ledger row is written once the window its finish
# falls in closes (window + grace + a flush, ~13 s at the default 10-s window), and a
# loaded CI box stretched that past the tests' wait.
POOL = ("[engine]\nkv_cache_bytes = 33554432\n"
        "[accounting]\nwindow_s = 1.0\nflush_interval_s = 0.2\n")
PROMPTS = ["The quick brown fox", "Once upon a time", "In the beginning", "Hello, world",
           "A long time ago in a galaxy", "To be or not to be", "It was a dark and stormy",
           "All happy families are alike"]


def cluster_config(role: str, peer_port: int) -> str:
    return (POOL + f'[cluster]\nrole = "{role}"\npeers = ["http://127.0.0.1:{peer_port}"]\n'
            f'key = "{KEY}"\n')


class Pair:
    def __init__(self, tmp, model):
        self.tmp, self.model = tmp, model
        self.front_port, self.decode_port = free_port(), free_port()
        self.decode = self.start_decode()
        self.front = start_daemon(tmp / "front", model, *ENGINE, port=self.front_port,
                                  config=cluster_config("prefill", self.decode_port))

    def start_decode(self):
        return start_daemon(self.tmp / "decode", self.model, *ENGINE, port=self.decode_port,
                            config=cluster_config("decode", self.front_port))

    def stop(self):
        for d in (self.front, self.decode):
            d.stop()


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_model):
    p = Pair(tmp_path_factory.mktemp("cluster"), tiny_model)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def single(tmp_path_factory, tiny_model):
    d = start_daemon(tmp_path_factory.mktemp("single"), tiny_model, "--devices", "cpu",
                     "--engine", "torch", "--mode", "agg", config=POOL)
    yield d
    d.stop()


def complete(daemon, prompt, **kw):
    return daemon.client().completions.create(model=daemon.status()["model"], prompt=prompt,
                                              max_tokens=kw.pop("max_tokens", 12),
                                              temperature=0, **kw)


def test_each_box_runs_its_own_role_and_the_front_sees_its_peer(pair):
    front, dec = pair.front.status(), pair.decode.status()
    assert {w["role"] for w in front["workers"]} == {"prefill"}
    assert {w["role"] for w in dec["workers"]} == {"decode"}
    assert front["cluster"]["role"] == "prefill" and dec["cluster"]["role"] == "decode"
    (peer,) = front["cluster"]["peers"]
    assert peer["url"] == pair.decode.url and peer["role"] == "decode" and peer["up"] is True
    assert peer["rtt_ms"] > 0 and isinstance(peer["since"], float) and peer["last_error"] is None
    assert set(peer) == {"url", "role", "up", "rtt_ms", "in_flight", "kv_bytes_total",
                         "last_error", "since"}


def test_greedy_answers_through_the_front_equal_one_box(pair, single):
    for prompt in PROMPTS:
        want = complete(single, prompt).choices[0].text
        got = complete(pair.front, prompt)
        assert got.choices[0].text == want, prompt
        streamed = "".join(c.choices[0].text for c in complete(pair.front, prompt, stream=True))
        assert streamed == want, prompt
    peer = pair.front.status()["cluster"]["peers"][0]
    assert peer["kv_bytes_total"] > 0, "the KV was pulled with NIXL, not recomputed"
    assert peer["in_flight"] == 0


def test_n2_and_logprobs_work_through_the_front(pair, single):
    kw = dict(max_tokens=6, logprobs=2)
    want = complete(single, "Hello, world", **kw).choices[0]
    out = complete(pair.front, "Hello, world", n=2, **kw)
    assert len(out.choices) == 2
    for c in out.choices:
        assert c.text == want.text
        assert len(c.logprobs.tokens) == 6
        assert c.logprobs.token_logprobs == pytest.approx(want.logprobs.token_logprobs, abs=1e-4)
    chat = pair.front.client().chat.completions.create(
        model=pair.front.status()["model"], messages=[{"role": "user", "content": "hi"}],
        max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    assert len(chat.choices[0].logprobs.content) == 5


def test_the_cluster_routes_need_the_cluster_key(pair, single):
    for d in (pair.front, pair.decode):
        for headers in ({}, {"Authorization": "Bearer wrong-key-wrong-key"}):
            code, _, body = http("GET", d.url + "/cluster/v1/status", headers=headers)
            assert code == 401 and body["error"]["code"] == "invalid_cluster_key"
        code, _, _ = http("POST", d.url + "/cluster/v1/decode", b"{}",
                          {"Authorization": "Bearer nope"})
        assert code == 401
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    code, _, body = http("GET", pair.decode.url + "/cluster/v1/status", headers=auth)
    assert code == 200 and body["role"] == "decode" and body["ready"] and body["free_kv_blocks"] > 0
    code, _, body = http("POST", pair.decode.url + "/cluster/v1/decode", b'{"prompt": 1}', auth)
    assert code == 400 and body["error"]["param"] is not None
    code, _, _ = http("POST", pair.front.url + "/cluster/v1/decode", b"{}", auth)
    assert code == 403      # a front takes no decodes
    code, _, _ = http("GET", single.url + "/cluster/v1/status", headers=auth)
    assert code == 404      # a single box has no cluster routes


def ledger_row(daemon, request_id, timeout=30.0):
    db = daemon.log.parent / "state" / "ledger.db"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if db.exists():
            with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as con:
                con.row_factory = sqlite3.Row
                row = con.execute("SELECT * FROM requests WHERE request_id = ?",
                                  (request_id,)).fetchone()
            if row is not None:
                return dict(row)
        time.sleep(0.2)
    raise AssertionError(f"no ledger row for {request_id} in {db}")


def test_the_decode_box_bills_its_phase_under_the_fronts_request_id(pair):
    code, headers, body = pair.front.post("/v1/completions", {
        "model": pair.front.status()["model"], "prompt": "Once upon a time",
        "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert code == 200, body
    rid = headers["X-Request-Id"]
    front = ledger_row(pair.front, rid)
    dec = ledger_row(pair.decode, rid)
    assert dec["tenant"] == front["tenant"] and dec["model"] == front["model"]
    assert dec["endpoint"] == "cluster_decode" and dec["status"] == "ok"
    assert dec["decode_worker"] == "decode0" and front["decode_worker"] == f"peer:{pair.decode.url}"
    assert dec["prompt_tokens"] == front["prompt_tokens"]
    assert dec["output_tokens"] == 7        # the first token came from the front's prefill


def test_usage_across_both_boxes_joins_a_served_request_into_one_row(pair):
    """End to end: a request served through the pair, then `applianced usage --url FRONT
    --url DECODE --by request_id`: one row, counted once, billed by both boxes (the front's
    prefill, the decode box's decode steps)."""
    code, headers, body = pair.front.post("/v1/completions", {
        "model": pair.front.status()["model"], "prompt": "It was a bright cold day",
        "max_tokens": 16, "temperature": 0, "ignore_eos": True})
    assert code == 200, body
    rid = headers["X-Request-Id"]
    ledger_row(pair.front, rid), ledger_row(pair.decode, rid)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    deadline, row, out = time.monotonic() + 60, None, None
    while time.monotonic() < deadline:
        out = subprocess.run(
            [sys.executable, "-m", "appliance", "usage", "--url", pair.front.url, "--url",
             pair.decode.url, "--by", "request_id,tenant", "--since", "1h", "--json"],
            capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr
        rows = [r for r in json.loads(out.stdout)["rows"] if r["request_id"] == rid]
        assert len(rows) <= 1, rows
        if rows and rows[0]["boxes"] == [pair.front.url, pair.decode.url]:
            row = rows[0]
            break
        time.sleep(1)
    assert row is not None, f"no joined row billed by both boxes for {rid}: {out.stdout[-2000:]}"
    assert row["requests"] == 1 and row["gpu_seconds"] > 0


def stream_until_killed(pair, killed_after: int = 3):
    """A long streaming request; kill -9 the decode box after a few chunks. Returns what
    the client saw: (chunks, the exception or None, seconds from the kill to the end)."""
    client = pair.front.client(timeout=60)
    chunks, error, killed_at = 0, None, None
    try:
        stream = client.completions.create(
            model=pair.front.status()["model"], prompt="Tell me a story", max_tokens=2000,
            temperature=0, stream=True, extra_body={"ignore_eos": True})
        for _ in stream:
            chunks += 1
            if chunks == killed_after:
                pair.decode.stop(signal.SIGKILL)
                killed_at = time.monotonic()
    except Exception as exc:  # noqa: BLE001 - what the official client raises is the point
        error = exc
    return chunks, error, time.monotonic() - (killed_at or time.monotonic())


def test_a_decode_box_killed_mid_stream_ends_cleanly_and_serves_again_when_back(pair):
    chunks, error, after_kill = stream_until_killed(pair)
    assert error is not None, f"the stream ended normally after {chunks} chunks"
    assert after_kill < 30, "the front hung on a dead peer"
    assert "worker_failed" in str(error) or "decode peer" in str(error), repr(error)
    # the peer is down, the front has no decode worker of its own: not ready, 503s
    pair.front.wait_for(lambda s: not s["cluster"]["peers"][0]["up"], 10, "peer down")
    code, _, _ = http("GET", pair.front.url + "/ready")
    assert code == 503
    code, _, body = pair.front.post("/v1/completions", {
        "model": pair.front.status()["model"], "prompt": "hi", "max_tokens": 4})
    assert code == 503 and body["error"]["code"] == "no_worker", body
    assert "decode peer" in body["error"]["message"]
    # the prefill worker gave the dead request's KV back
    pair.front.wait_for(lambda s: s["workers"][0]["kv_blocks_handed_off"] == 0, 10,
                        "the prefill worker's blocks released")
    # back: the poll marks it up, requests succeed again
    pair.decode = pair.start_decode()
    pair.front.wait_for(lambda s: s["cluster"]["peers"][0]["up"], 20, "peer up again")
    code, _, _ = http("GET", pair.front.url + "/ready")
    assert code == 200
    out = complete(pair.front, "Hello, world")
    assert out.choices[0].text and out.choices[0].finish_reason == "length"


def test_a_decode_box_that_hangs_mid_stream_fails_its_streams_within_seconds(pair):
    """A box alive but silent (SIGSTOP): the poll finds it down within its 2-s timeout,
    and a stream from it that has gone silent ends then, not at the 60-s read timeout."""
    client = pair.front.client(timeout=60)
    stream = client.completions.create(
        model=pair.front.status()["model"], prompt="Tell me more", max_tokens=3000,
        temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks, error, stopped_at = 0, None, None
    try:
        try:
            for _ in stream:
                chunks += 1
                if chunks == 3:
                    pair.decode.proc.send_signal(signal.SIGSTOP)
                    stopped_at = time.monotonic()
        except Exception as exc:  # noqa: BLE001 - what the official client raises is the point
            error = exc
        took = time.monotonic() - stopped_at
        assert error is not None, f"the stream ended normally after {chunks} chunks"
        assert took < 15, f"{took:.1f} s to give up on a silent peer"
        assert "decode peer" in str(error) or "worker_failed" in str(error), repr(error)
        pair.front.wait_for(lambda s: s["workers"][0]["kv_blocks_handed_off"] == 0, 10,
                            "the prefill worker's blocks released")
    finally:
        pair.decode.proc.send_signal(signal.SIGCONT)
    pair.front.wait_for(lambda s: s["cluster"]["peers"][0]["up"], 20, "peer up again")
    assert complete(pair.front, "Hello, world").choices[0].text


def test_a_client_that_goes_away_aborts_its_decode_on_the_decode_box(pair):
    """The front's connection to the decode box closing (its client left, or the front
    restarted) aborts the decode there: the decode box's record of it says aborted, and
    its worker runs nothing afterwards."""
    from http.client import HTTPConnection
    # The tests before stop and restart the decode box: begin once it serves again.
    deadline = time.monotonic() + 20
    while http("GET", pair.front.url + "/ready")[0] != 200:     # a ready decode peer
        assert time.monotonic() < deadline, "the front never found its decode peer ready"
        time.sleep(0.1)
    conn = HTTPConnection("127.0.0.1", pair.front_port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": pair.front.status()["model"], "prompt": "Go on", "max_tokens": 3000,
        "temperature": 0, "stream": True, "ignore_eos": True}),
        {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    rid = resp.getheader("X-Request-Id")
    # Tokens past the first come from the decode box: it runs the request when we leave.
    chunks = []
    while len(chunks) < 3:
        line = resp.readline()
        assert line, f"the stream ended after {chunks}"
        if line.startswith(b"data: "):
            chunks.append(json.loads(line[6:]))
            assert "error" not in chunks[-1], chunks[-1]
    pair.decode.wait_for(lambda s: s["workers"][0]["inflight"] == 1, 10,
                         "the decode box running the request")
    conn.close()
    row = ledger_row(pair.decode, rid)
    assert row["status"] == "aborted" and row["endpoint"] == "cluster_decode", row
    pair.decode.wait_for(lambda s: s["workers"][0]["running"] == 0
                         and s["workers"][0]["waiting"] == 0, 15, "the decode aborted")
    assert ledger_row(pair.front, rid)["status"] == "aborted"


def test_the_simulator_serves_across_boxes_too(tmp_path, tiny_model):
    """Sim shapes can be exercised as a pair: the decode box's simulator takes the time a
    transfer takes (no bytes to pull), and its record says simulated."""
    sim = ["--devices", "cpu", "--engine", "sim", "--sim-speed", "50", "--mode", "disagg"]
    fp, dp = free_port(), free_port()
    dec = start_daemon(tmp_path / "d", tiny_model, *sim, port=dp,
                       config=cluster_config("decode", fp))
    front = None
    try:
        front = start_daemon(tmp_path / "f", tiny_model, *sim, port=fp,
                             config=cluster_config("prefill", dp))
        code, headers, body = front.post("/v1/completions", {
            "model": front.status()["model"], "prompt": "Hello", "max_tokens": 6,
            "ignore_eos": True})
        assert code == 200 and body["usage"]["completion_tokens"] == 6, body
        row = ledger_row(dec, headers["X-Request-Id"])
        assert row["endpoint"] == "cluster_decode" and row["simulated"] == 1
        assert row["output_tokens"] == 5
        assert front.status()["cluster"]["peers"][0]["kv_bytes_total"] == 0   # nothing moved
    finally:
        for d in (front, dec):
            if d is not None:
                d.stop()


def test_a_decode_worker_pulls_with_nixl_and_recomputes_when_the_pull_cannot_be_used(
        tiny_model):
    """The engines of the two boxes, in one process (NIXL moves between two agents the
    same way): a good handle is pulled (bytes moved, nothing recomputed); one past its
    deadline or from a pool the prefill worker no longer has is recomputed from the
    prompt. The tokens are a single worker's every time."""
    from appliance.engines.messages import (
        Decode, KvHandle, KvImported, Prefill, PrefillDone, RemoteKv, SamplingParams, Tokens)
    from appliance.engines.torch_engine import build_torch_engine
    from appliance.kv.nixl_transport import NixlKvHandle, to_json
    from appliance.worker.spec import WorkerSpec

    def engine(name, role, nixl=True):
        return build_torch_engine(WorkerSpec(name, role, "torch", ["cpu0"], "cpu", str(tiny_model),
                                             kv_cache_bytes=8 << 20, nixl=nixl), tiny_model)

    def run(e, msg):
        out = e.add(msg)
        while e.has_work():
            out += e.step()
        return out

    pre, dec, agg = engine("prefill0", "prefill"), engine("decode0", "decode"), \
        engine("agg0", "agg", nixl=False)
    prompt, params = list(range(5, 70)), SamplingParams(max_tokens=10, temperature=0.0)
    want = [t for ev in run(agg, Prefill("a", prompt, params, False)) if isinstance(ev, Tokens)
            for t in ev.tokens]
    pool = pre.hello_info()["nixl_pool"]
    info = json.loads(pool)

    def decode(rid, ttl=10.0, pool_id=info["pool_id"]):
        done = next(ev for ev in run(pre, Prefill(rid, prompt, params, True))
                    if isinstance(ev, PrefillDone))
        h = done.handle
        nh = NixlKvHandle(info["agent"], pool_id, rid, tuple(h.block_ids), h.num_tokens,
                          time.time() + ttl)
        kv = KvHandle(f"peer:{info['agent']}", rid, h.block_ids, h.num_tokens, h.layout,
                      payload=RemoteKv(pool, to_json(nh)), expires_at=time.monotonic() + ttl)
        events = run(dec, Decode(rid, prompt, done.first_token, params, kv))
        pre.release(rid)
        (imported,) = [e for e in events if isinstance(e, KvImported)]
        return [done.first_token] + [t for e in events if isinstance(e, Tokens)
                                     for t in e.tokens], imported

    got, imported = decode("r1")
    assert got == want and dec.kv_recomputes == 0
    assert imported.transport == "nixl" and imported.nbytes > 0 and imported.seconds > 0
    got, _ = decode("r2", ttl=-1.0)                 # past its deadline: never read
    assert got == want and dec.kv_recomputes == 1
    got, _ = decode("r3", pool_id="0" * 32)         # a pool the peer no longer has
    assert got == want and dec.kv_recomputes == 2
    assert dec.blocks.num_free == dec.blocks.num_blocks, "every block came back"


class SlowLink:
    """The decode engine's real nixl_agent, but its READs report NIXL's own states as a
    slow link would: "PROC" while `state` says so (the read is posted for real; only its
    completion is held back), then the real state; "ERR" to fail them."""

    def __init__(self, real):
        self.real, self.state, self.checks = real, "PROC", 0

    def transfer(self, xfer):
        real = self.real.transfer(xfer)
        return self.state or real

    def check_xfer_state(self, xfer):
        self.checks += 1
        return self.state or self.real.check_xfer_state(xfer)

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.fixture(scope="module")
def boxes(tiny_model):
    """A prefill and a decode torch engine with NIXL agents of their own, and a single
    agg engine for the reference answers, in this process."""
    from appliance.engines.torch_engine import build_torch_engine
    from appliance.worker.spec import WorkerSpec

    def engine(name, role, nixl=True):
        return build_torch_engine(WorkerSpec(name, role, "torch", ["cpu0"], "cpu", str(tiny_model),
                                             kv_cache_bytes=8 << 20, nixl=nixl), tiny_model)
    return engine("prefill1", "prefill"), engine("decode1", "decode"), \
        engine("agg1", "agg", nixl=False)


def _remote_decode(pre, rid, prompt, params, ttl=600.0):
    """Prefill rid on `pre` and the Decode message a decode box gets for it (a RemoteKv
    handle, as the front sends). The TTL is long unless a test is about expiry: a CI
    machine paused for a minute must not turn a held READ into a recompute."""
    from appliance.engines.messages import Decode, KvHandle, PrefillDone, Prefill, RemoteKv
    from appliance.kv.nixl_transport import NixlKvHandle, to_json
    out = pre.add(Prefill(rid, prompt, params, True))
    while pre.has_work():
        out += pre.step()
    done = next(ev for ev in out if isinstance(ev, PrefillDone))
    pool = pre.hello_info()["nixl_pool"]
    info = json.loads(pool)
    h = done.handle
    nh = NixlKvHandle(info["agent"], info["pool_id"], rid, tuple(h.block_ids), h.num_tokens,
                      time.time() + ttl)
    kv = KvHandle(f"peer:{info['agent']}", rid, h.block_ids, h.num_tokens, h.layout,
                  payload=RemoteKv(pool, to_json(nh)), expires_at=time.monotonic() + ttl)
    return done.first_token, Decode(rid, prompt, done.first_token, params, kv)


def _drain(dec, *rids):
    """Abort what a test left on the shared decode engine (a no-op when it passed) and let
    its READs end, so one failure does not fail the tests after it."""
    for rid in rids:
        dec.abort(rid)
    while dec.has_work():
        dec.step()


def _tokens(events, rid):
    from appliance.engines.messages import Tokens
    return [t for e in events if isinstance(e, Tokens) and e.request_id == rid
            for t in e.tokens]


def test_running_sequences_keep_decoding_while_a_pull_from_another_box_is_in_flight(boxes):
    """A READ held "PROC" at the NIXL boundary (a long prompt over a slow link): the
    decode worker's running sequence gets a token at every step meanwhile, the pulled one
    waits (blocks allocated, not scheduled) and joins once the READ is DONE, with the
    single box's tokens; one that ends "ERR" is recomputed, right all the same."""
    from appliance.engines import base
    from appliance.engines.messages import KvImported, Prefill, SamplingParams
    pre, dec, agg = boxes
    params = SamplingParams(max_tokens=10, temperature=0.0)
    prompt = list(range(5, 70))
    out = agg.add(Prefill("ref", prompt, params, False))
    while agg.has_work():
        out += agg.step()
    want = _tokens(out, "ref")

    link = SlowLink(dec.nixl._agent)
    dec.nixl._agent = link
    try:
        running = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        events = dec.add(Prefill("run", list(range(100, 120)), running, False))
        while not _tokens(events, "run"):
            events += dec.step()
        first, msg = _remote_decode(pre, "slow", prompt, params)
        free_before = dec.blocks.num_free
        events = dec.add(msg) + dec.step()        # a step of its own posts the READ
        assert not _tokens(events, "run") and not _tokens(events, "slow")
        for _ in range(6):
            step = dec.step()
            events += step
            assert _tokens(step, "run"), "the running sequence got no token this step"
            assert not any(isinstance(e, KvImported) for e in step)
        assert [s.request_id for s in dec.scheduler.importing] == ["slow"]
        assert dec.blocks.num_free < free_before, "its blocks are allocated while it waits"
        assert not _tokens(events, "slow") and link.checks >= 6
        link.state = None                                 # the READ completes
        while dec.has_work():
            events += dec.step()
        (imported,) = [e for e in events if isinstance(e, KvImported)]
        assert imported.request_id == "slow" and imported.transport == "nixl"
        assert imported.nbytes > 0
        assert [first] + _tokens(events, "slow") == want and dec.kv_recomputes == 0
        assert len(_tokens(events, "run")) == 40 - 1

        # Nothing else to run: a step waits a little for the READ instead of spinning.
        link.state = "PROC"
        first, msg = _remote_decode(pre, "idle", prompt, params)
        events = dec.add(msg) + dec.step()                # posts the READ
        t0 = time.perf_counter()
        assert dec.step() == [] and time.perf_counter() - t0 >= base.PULL_POLL_S
        link.state = "ERR"                                # the peer died mid-read
        while dec.has_work():
            events += dec.step()
        assert [first] + _tokens(events, "idle") == want and dec.kv_recomputes == 1
    finally:
        dec.nixl._agent = link.real
        _drain(dec, "run", "slow", "idle")
        pre.release("slow")
        pre.release("idle")
    assert dec.blocks.num_free == dec.blocks.num_blocks, "every block came back"


def test_a_request_aborted_while_its_pull_is_in_flight_frees_its_blocks_when_it_ends(boxes):
    """The READ still writes the blocks after the abort: they are freed only once it has
    ended, never handed to another request before."""
    from appliance.engines.messages import SamplingParams
    pre, dec, _ = boxes
    link = SlowLink(dec.nixl._agent)
    dec.nixl._agent = link
    try:
        _, msg = _remote_decode(pre, "gone", list(range(5, 70)),
                                SamplingParams(max_tokens=5, temperature=0.0))
        dec.add(msg)
        dec.step()
        held = dec.blocks.num_blocks - dec.blocks.num_free
        assert held > 0
        dec.abort("gone")
        assert dec.blocks.num_blocks - dec.blocks.num_free == held and dec.has_work()
        dec.step()
        assert dec.blocks.num_blocks - dec.blocks.num_free == held, "freed mid-READ"
        link.state = None
        while dec.has_work():
            assert dec.step() == []                       # nothing for a gone request
    finally:
        dec.nixl._agent = link.real
        _drain(dec, "gone")
        pre.release("gone")
    assert dec.blocks.num_free == dec.blocks.num_blocks


def test_a_pull_unfinished_at_deadline_plus_margin_is_given_up_and_its_blocks_kept(boxes):
    """A READ still "PROC" at the handle's deadline + margin (a peer that hangs): given up
    on, its request recomputed with the right answer, and its destination blocks left
    allocated to nobody (`dst_unsafe`: the READ may still land), while the worker goes on
    stepping instead of hanging. Runs last on these engines: it leaks on purpose."""
    from appliance.engines.messages import Prefill, SamplingParams
    pre, dec, agg = boxes
    params = SamplingParams(max_tokens=6, temperature=0.0)
    prompt = list(range(300, 365))
    out = agg.add(Prefill("ref2", prompt, params, False))
    while agg.has_work():
        out += agg.step()
    want = _tokens(out, "ref2")
    link, margin = SlowLink(dec.nixl._agent), dec.nixl.margin_s
    dec.nixl._agent, dec.nixl.margin_s = link, 0.2
    recomputes = dec.kv_recomputes
    try:
        first, msg = _remote_decode(pre, "hung", prompt, params, ttl=0.5)
        events = dec.add(msg)
        t0 = time.monotonic()
        while dec.has_work():
            events += dec.step()
            assert time.monotonic() - t0 < 30, "the worker hangs on the READ"
    finally:
        dec.nixl._agent, dec.nixl.margin_s = link.real, margin
        pre.release("hung")
    assert [first] + _tokens(events, "hung") == want
    assert dec.kv_recomputes == recomputes + 1
    leaked = dec.blocks.num_blocks - dec.blocks.num_free
    assert leaked == dec.blocks.blocks_for(len(prompt) + 1)


def test_a_front_with_decode_workers_of_its_own_decodes_locally_while_no_peer_is_up(
        tmp_path, tiny_model):
    """`devices.split` keeps the front's own decode worker: with its decode box down the
    front is ready and decodes locally; once the box is up, decodes go there."""
    sim = ["--devices", "cpu", "--engine", "sim", "--sim-speed", "50", "--mode", "disagg"]
    fp, dp = free_port(), free_port()
    split = '[devices]\nsplit = "1+1"\n'
    front = start_daemon(tmp_path / "f", tiny_model, *sim, port=fp,
                         config=split + cluster_config("prefill", dp))
    dec = None
    try:
        assert {w["role"] for w in front.status()["workers"]} == {"prefill", "decode"}
        assert front.status()["cluster"]["peers"][0]["up"] is False
        ask = {"model": front.status()["model"], "prompt": "Hello", "max_tokens": 4,
               "ignore_eos": True}
        code, headers, body = front.post("/v1/completions", ask)
        assert code == 200, body
        assert ledger_row(front, headers["X-Request-Id"])["decode_worker"] == "decode0"
        dec = start_daemon(tmp_path / "d", tiny_model, *sim, port=dp,
                           config=cluster_config("decode", fp))
        front.wait_for(lambda s: s["cluster"]["peers"][0]["up"], 10, "the peer up")
        code, headers, body = front.post("/v1/completions", ask)
        assert code == 200, body
        assert ledger_row(front, headers["X-Request-Id"])["decode_worker"] == f"peer:{dec.url}"
    finally:
        for d in (front, dec):
            if d is not None:
                d.stop()
