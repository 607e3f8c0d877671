"""Durable admin workflows on real daemons: each workflow killed (SIGKILL, by fault
injection) before and after each of its steps, restarted on the same state directory,
and checked against reality; random-time kill -9; cancel; drain timeouts."""
from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import threading
import time
import uuid
from pathlib import Path

import openai
import pytest

from helpers.daemons import http, pid_alive, start_daemon

SIM = ("--devices", "sim:8xH100", "--model-spec", "llama-3.1-70b-fp8", "--sim-speed", "50")
MODEL = "llama-3.1-70b-fp8"
CONFIG = "[workflows]\ndrain_timeout_s = 10.0\n[workers]\nrestart_backoff_s = 0.1\n"
TAG = "APPLIANCED_TEST_TAG"
MODEL_DIR: Path | None = None       # the session's generated tokenizer (set below)


@pytest.fixture(autouse=True)
def _model_dir(tiny_model):
    """Sim daemons still need a tokenizer: share the session's generated one instead of
    generating a model in every fresh state directory."""
    global MODEL_DIR
    MODEL_DIR = tiny_model

REPARTITION_STEPS = ["validate", "drain_affected", "wait_inflight", "stop_affected",
                     "start_new", "warm_up", "health_check", "switch_routing", "persist"]
SWAP_STEPS = ["validate", "drain_first", "wait_first", "load_first", "switch_routing",
              "wait_second", "load_second", "route_all", "persist"]
DRAIN_STEPS = ["close_admission", "persist", "wait_inflight"]
RESUME_STEPS = ["open_admission", "persist"]

# 4+4 -> 6+2: sim4 and sim5 move to prefill; the decode workers on sim6, sim7 keep
# their names and serve throughout.
PLAN_4_4 = {"prefill0": ["sim0"], "prefill1": ["sim1"], "prefill2": ["sim2"],
            "prefill3": ["sim3"], "decode0": ["sim4"], "decode1": ["sim5"],
            "decode2": ["sim6"], "decode3": ["sim7"]}
PLAN_6_2 = {"prefill0": ["sim0"], "prefill1": ["sim1"], "prefill2": ["sim2"],
            "prefill3": ["sim3"], "prefill4": ["sim4"], "prefill5": ["sim5"],
            "decode2": ["sim6"], "decode3": ["sim7"]}


def boot(root: Path, fault: str | None = None):
    """A daemon on root/state whose processes carry a tag of their own (to find
    survivors of it later)."""
    tag = uuid.uuid4().hex
    env = {TAG: tag}
    if fault:
        env["APPLIANCED_FAULT"] = fault
    d = start_daemon(root, MODEL_DIR, *SIM, config=CONFIG, env=env)
    d.tag = tag
    return d


def tagged_pids(tag: str) -> list[int]:
    """Live processes (not zombies) whose environment carries the tag."""
    needle = f"{TAG}={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0") and pid_alive(int(entry)):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def start(d, kind: str, params: dict | None = None) -> str:
    code, _, body = d.post("/admin/v1/workflows", {"kind": kind, "params": params or {}})
    assert code == 201, body
    return body["id"]


def workflow(d, wid: str) -> dict:
    code, _, body = http("GET", f"{d.url}/admin/v1/workflows/{wid}")
    assert code == 200, body
    return body


def wait_finished(d, wid: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        wf = workflow(d, wid)
        if wf["status"] in ("succeeded", "failed", "cancelled", "compensated"):
            return wf
        time.sleep(0.05)
    raise AssertionError(f"workflow {wid} did not finish: {json.dumps(workflow(d, wid))}")


def journal_state(root: Path, key: str):
    db = sqlite3.connect(root / "state" / "workflows.db")
    try:
        row = db.execute("SELECT value FROM state WHERE key = ?", (key,)).fetchone()
    finally:
        db.close()
    return None if row is None else json.loads(row[0])


def plan_workers(plan: dict) -> dict[str, list[str]]:
    return {s["worker"]: s["devices"] for r in ("prefill", "decode", "agg") for s in plan[r]}


def check_workers(d, expected: dict[str, list[str]]) -> dict:
    """Exactly the expected workers, ready, routed, children of this daemon, each device
    held by exactly one of them."""
    status = d.wait_for(lambda s: all(w["state"] == "ready" for w in s["workers"]),
                        what="every worker ready")
    workers = {w["worker"]: w for w in status["workers"]}
    assert {n: w["devices"] for n, w in workers.items()} == expected
    assert all(w["routed"] for w in workers.values()), workers
    held = [dev for w in workers.values() for dev in w["devices"]]
    assert sorted(held) == sorted(set(held)), f"a device held twice: {held}"
    for w in workers.values():
        with open(f"/proc/{w['pid']}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        assert ppid == d.proc.pid, f"{w['worker']} (pid {w['pid']}) is not this daemon's child"
    return status


def assert_no_survivors(tag: str) -> None:
    deadline = time.monotonic() + 10
    while tagged_pids(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tagged_pids(tag) == [], "processes of the killed daemon survive it"


def serve_ok(d, model: str = MODEL, n: int = 3) -> None:
    client = d.client(timeout=30)
    for i in range(n):
        r = client.completions.create(model=model, prompt=f"after recovery {i}", max_tokens=4)
        assert r.usage.completion_tokens == 4


class Load:
    """A light, steady client load: one request at a time, outcomes recorded."""

    def __init__(self, d, model: str = MODEL):
        self.d = d
        self.model = model
        self.ok = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        client = self.d.client(timeout=15)
        while not self._stop.is_set():
            try:
                model = client.models.list().data[0].id
                client.completions.create(model=model, prompt="steady load", max_tokens=4)
                self.ok += 1
            except (openai.APIError, openai.APIConnectionError, IndexError) as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
                if self.d.proc.poll() is not None:
                    return
                time.sleep(0.02)

    def stop(self):
        self._stop.set()
        self._thread.join(20)
        return self


def crash_and_recover(tmp_path, kind, params, step, when, before=None):
    """Start `kind` under load with a fault at step/when; the daemon must die there.
    Restart it on the same state dir and return (daemon, finished workflow)."""
    first = boot(tmp_path / "a", fault=f"workflow:{kind}:{step}:{when}")
    if before:
        before(first)
    load = Load(first)
    wid = start(first, kind, params)
    try:
        first.proc.wait(30)
    except Exception:
        first.stop(signal.SIGKILL)
        raise AssertionError(f"the fault at {kind}:{step}:{when} did not kill the daemon")
    load.stop()
    assert first.proc.returncode == -signal.SIGKILL
    assert f"killing the daemon {when} {kind}:{step}" in first.log_text()
    assert_no_survivors(first.tag)
    second = restart(tmp_path / "a")
    return second, wait_finished(second, wid), wid


def restart(root: Path, config: str = CONFIG, env: dict | None = None, timeout: float = 120):
    """start_daemon, but up means the admin API answers: a drained daemon is up and
    still says 503 on /ready."""
    import subprocess
    import sys
    from helpers.daemons import ROOT, Daemon, free_port
    port = free_port()
    (root / "config.toml").write_text(config)
    cmd = [sys.executable, "-m", "appliance", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--state-dir", str(root / "state"), "--model", str(MODEL_DIR),
           "--config", str(root / "config.toml"), *SIM]
    log = root / f"daemon-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    d = Daemon(proc, port, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"daemon exited with {proc.returncode}:\n{d.log_text()}")
        try:
            if http("GET", d.url + "/admin/v1/status", timeout=2)[0] == 200:
                return d
        except OSError:
            pass
        time.sleep(0.05)
    d.stop(signal.SIGKILL)
    raise AssertionError(f"daemon not up after {timeout}s:\n{d.log_text()}")


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("step", REPARTITION_STEPS)
def test_repartition_survives_a_crash_at_every_step(tmp_path, step, when):
    d, wf, _ = crash_and_recover(tmp_path, "repartition", {"split": "6+2"}, step, when)
    try:
        assert wf["status"] == "succeeded", wf
        assert wf["recoveries"] == 1
        # Reconciled against reality: the new daemon started the persisted (old)
        # partition, so the drain is redone, unless the crash came before it or after
        # the new partition was persisted.
        attempts = {s["name"]: s["attempts"] for s in wf["steps"]}
        redone = step != "validate" and (step, when) != ("persist", "after")
        assert attempts["drain_affected"] == (2 if redone else 1), attempts
        assert attempts["persist"] == (2 if (step, when) == ("persist", "before") else 1)
        status = check_workers(d, PLAN_6_2)
        assert status["partition"] == "6+2"
        assert plan_workers(journal_state(tmp_path / "a", "partition")) == PLAN_6_2
        assert plan_workers(status["plan"]) == PLAN_6_2
        serve_ok(d)
    finally:
        d.stop()


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("step", SWAP_STEPS)
def test_swap_model_survives_a_crash_at_every_step(tmp_path, step, when):
    d, wf, _ = crash_and_recover(tmp_path, "swap-model", {"model": "llama-3.1-8b"}, step, when)
    try:
        assert wf["status"] == "succeeded", wf
        attempts = {s["name"]: s["attempts"] for s in wf["steps"]}
        redone = step != "validate" and (step, when) != ("persist", "after")
        assert attempts["drain_first"] == (2 if redone else 1), attempts
        check_workers(d, PLAN_4_4)
        assert all(w["engine"] == "sim" for w in d.status()["workers"])
        code, _, models = http("GET", d.url + "/v1/models")
        assert [m["id"] for m in models["data"]] == ["llama-3.1-8b"]
        assert journal_state(tmp_path / "a", "model")["name"] == "llama-3.1-8b"
        assert d.status()["model"] == "llama-3.1-8b"
        serve_ok(d, "llama-3.1-8b")
    finally:
        d.stop()


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("step", DRAIN_STEPS)
def test_drain_survives_a_crash_at_every_step(tmp_path, step, when):
    d, wf, _ = crash_and_recover(tmp_path, "drain", {}, step, when)
    try:
        assert wf["status"] == "succeeded", wf
        check_workers(d, PLAN_4_4)
        code, headers, body = d.post("/v1/completions", {"model": MODEL, "prompt": "x"})
        assert code == 503 and body["error"]["code"] == "draining" and headers["Retry-After"]
        assert http("GET", d.url + "/ready")[0] == 503
        assert journal_state(tmp_path / "a", "admission") == "closed"
        assert wait_finished(d, start(d, "resume"))["status"] == "succeeded"
        serve_ok(d)
    finally:
        d.stop()


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("step", RESUME_STEPS)
def test_resume_survives_a_crash_at_every_step(tmp_path, step, when):
    def drained(d):
        assert wait_finished(d, start(d, "drain"))["status"] == "succeeded"
    d, wf, _ = crash_and_recover(tmp_path, "resume", {}, step, when, before=drained)
    try:
        assert wf["status"] == "succeeded", wf
        check_workers(d, PLAN_4_4)
        assert journal_state(tmp_path / "a", "admission") == "open"
        assert d.status()["admission"] == "open"
        serve_ok(d)
    finally:
        d.stop()


def test_repartition_under_load_keeps_serving_and_persists(tmp_path):
    d = boot(tmp_path / "a")
    try:
        load = Load(d)
        time.sleep(0.3)
        wf = wait_finished(d, start(d, "repartition", {"split": "6+2"}))
        time.sleep(0.3)
        load.stop()
        assert wf["status"] == "succeeded"
        assert [s["status"] for s in wf["steps"]] == ["succeeded"] * len(REPARTITION_STEPS)
        assert load.ok > 5 and load.errors == []        # unaffected workers served throughout
        check_workers(d, PLAN_6_2)
        groups = d.status()["groups"]                   # telemetry follows the partition
        assert groups["prefill"]["devices"] == [f"sim{i}" for i in range(6)]
        assert groups["decode"]["devices"] == ["sim6", "sim7"] and groups["decode"]["workers"] == 2
        # back again: fresh names for the decode workers, no clash with live ones
        wf = wait_finished(d, start(d, "repartition", {"split": "4+4"}))
        assert wf["status"] == "succeeded"
        back = {n: dev for n, dev in PLAN_6_2.items() if n not in ("prefill4", "prefill5")}
        back.update({"decode0": ["sim4"], "decode1": ["sim5"]})
        check_workers(d, back)
    finally:
        d.stop()
    # A restart keeps the partition (over the config's devices.split = auto).
    d = start_daemon(tmp_path / "a", MODEL_DIR, *SIM, config=CONFIG)
    try:
        check_workers(d, back)
    finally:
        d.stop()


def test_swap_model_under_load_keeps_serving(tmp_path):
    d = boot(tmp_path / "a")
    try:
        load = Load(d)
        time.sleep(0.3)
        wf = wait_finished(d, start(d, "swap-model", {"model": "llama-3.1-8b",
                                                      "model_name": "small"}))
        time.sleep(0.3)
        load.stop()
        assert wf["status"] == "succeeded", wf
        # Half the workers served the old model while the other half loaded the new one:
        # no request failed for want of a worker. (A request naming the model just
        # switched away from is a clean 404.)
        assert load.ok > 5
        assert all(e.startswith("NotFoundError") and "does not exist" in e
                   for e in load.errors), load.errors
        assert [m["id"] for m in http("GET", d.url + "/v1/models")[2]["data"]] == ["small"]
        first, second = wf["steps"][0]["result"]["first"], wf["steps"][0]["result"]["second"]
        assert sorted(first + second) == sorted(PLAN_4_4)
        assert {n[:-1] for n in first} == {n[:-1] for n in second} == {"prefill", "decode"}
        check_workers(d, PLAN_4_4)
        serve_ok(d, "small")
    finally:
        d.stop()


def test_bad_requests_and_one_partition_change_at_a_time(tmp_path):
    d = boot(tmp_path / "a")
    try:
        for body, needle in [({"kind": "explode"}, "unknown workflow kind"),
                             ({"kind": "repartition", "params": {}}, "params.split"),
                             ({"kind": "repartition", "params": {"split": "9+9"}}, "needs 18"),
                             ({"kind": "repartition", "params": {"split": "4+4"}}, "already"),
                             ({"kind": "swap-model", "params": {"model": "nope-1b"}},
                              "neither a model directory nor a known model spec"),
                             ({"kind": "swap-model", "params": {"model": str(tmp_path)}},
                              "needs config.json and tokenizer.json"),
                             ({"kind": "swap-model", "params": {"model": MODEL}},
                              "already serves"),
                             ({"kind": "drain", "params": {"x": 1}}, "no params"),
                             ({"kind": "drain", "extra": 1}, "unknown fields")]:
            code, _, err = d.post("/admin/v1/workflows", body)
            assert code == 400 and needle in err["error"]["message"], (body, err)
        code, _, err = d.post("/admin/v1/workflows", raw=b"{nope")
        assert code == 400 and err["error"]["code"] == "invalid_json"
        code, _, err = http("GET", d.url + "/admin/v1/workflows/wf-nope")
        assert code == 404 and err["error"]["code"] == "workflow_not_found"
        code, _, err = d.post("/admin/v1/workflows/wf-nope/cancel", {})
        assert code == 404
        # a long request pins decode0/decode1 long enough to try a second workflow
        streams = long_streams(d, 6)
        wid = start(d, "repartition", {"split": "6+2"})
        code, _, err = d.post("/admin/v1/workflows", {"kind": "swap-model",
                                                      "params": {"model": "llama-3.1-8b"}})
        assert code == 409 and wid in err["error"]["message"], err
        assert "one workers workflow runs at a time" in err["error"]["message"]
        close_all(streams)
        assert wait_finished(d, wid)["status"] == "succeeded"
        code, _, err = d.post(f"/admin/v1/workflows/{wid}/cancel", {})
        assert code == 409 and "already succeeded" in err["error"]["message"]
        listed = http("GET", d.url + "/admin/v1/workflows")[2]["data"]
        assert [w["id"] for w in listed] == [wid]
    finally:
        d.stop()


def long_streams(d, n: int, max_tokens: int = 4000):
    """n streaming requests that run for seconds; return them once each has a token."""
    client = d.client(timeout=120)
    streams = []
    for i in range(n):
        s = client.completions.create(model=MODEL, prompt=f"long {i}", max_tokens=max_tokens,
                                      stream=True, extra_body={"ignore_eos": True})
        it = iter(s)
        next(it)
        streams.append((s, it))
    return streams


def close_all(streams):
    for s, _ in streams:
        s.close()


def test_cancel_in_the_middle_compensates(tmp_path):
    d = boot(tmp_path / "a")
    try:
        streams = long_streams(d, 8)
        placed = d.status()["workers"]
        assert any(w["inflight"] for w in placed if w["worker"] in ("decode0", "decode1"))
        wid = start(d, "repartition", {"split": "6+2"})
        # it waits for the requests on decode0/decode1: cancel it there
        deadline = time.monotonic() + 10
        while workflow(d, wid)["steps"][2]["status"] != "running":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        code, _, body = d.post(f"/admin/v1/workflows/{wid}/cancel", {})
        assert code == 200 and body["cancel_requested"]
        close_all(streams)
        wf = wait_finished(d, wid)
        assert wf["status"] == "cancelled" and wf["phase"] == "compensating"
        names = [s["name"] for s in wf["steps"]]
        assert names[-5:] == ["undo_route_old", "undo_stop_new", "undo_start_old",
                              "undo_route_all", "undo_persist"]
        assert all(s["status"] == "skipped" for s in wf["steps"][3:len(REPARTITION_STEPS)])
        check_workers(d, PLAN_4_4)
        assert d.status()["partition"] == "4+4"
        serve_ok(d)
    finally:
        d.stop()


def test_drain_timeout_cuts_requests_off_with_a_clear_error(tmp_path):
    d = start_daemon(tmp_path / "a", MODEL_DIR, *SIM,
                     config="[workflows]\ndrain_timeout_s = 0.3\n")
    try:
        streams = long_streams(d, 8)
        victims = [(s, it) for (s, it), w in zip(streams, range(8))]
        wid = start(d, "repartition", {"split": "6+2"})
        wf = wait_finished(d, wid)
        assert wf["status"] == "succeeded"
        waited = wf["steps"][2]["result"]
        assert waited["timed_out"] and waited["inflight"] >= 1
        errors = []
        for s, it in victims:
            try:
                for _ in it:
                    pass
            except openai.APIError as exc:
                errors.append(str(exc))
            finally:
                s.close()
        assert errors and all(f"stopped by workflow {wid}" in e for e in errors), errors
        check_workers(d, PLAN_6_2)
    finally:
        d.stop()


def test_a_step_that_kills_the_daemon_every_time_is_compensated(tmp_path):
    fault = "workflow:repartition:start_new:after"
    cfg = CONFIG.replace("[workers]", "max_recoveries = 2\n[workers]")
    first = start_daemon(tmp_path / "a", MODEL_DIR, *SIM, config=cfg, env={"APPLIANCED_FAULT": fault})
    wid = start(first, "repartition", {"split": "6+2"})
    assert first.proc.wait(30) == -signal.SIGKILL
    # the same fault again: resumed, the workflow kills the daemon a second time
    try:
        second = start_daemon(tmp_path / "a", MODEL_DIR, *SIM, config=cfg,
                              env={"APPLIANCED_FAULT": fault}, timeout=30)
    except AssertionError as exc:       # died before it answered /ready
        assert "killing the daemon after repartition:start_new" in str(exc)
    else:
        assert second.proc.wait(30) == -signal.SIGKILL
    d = start_daemon(tmp_path / "a", MODEL_DIR, *SIM, config=cfg, env={"APPLIANCED_FAULT": fault})
    try:
        wf = wait_finished(d, wid)
        assert wf["status"] == "compensated", wf
        assert "interrupted by 2 daemon deaths" in wf["error"], wf["error"]
        check_workers(d, PLAN_4_4)
        assert d.status()["partition"] == "4+4"
        serve_ok(d)
    finally:
        d.stop()


def test_random_kill_9_loop(tmp_path):
    rng = random.Random(14)
    splits = ["6+2", "4+4", "5+3", "4+4"]
    root = tmp_path / "a"
    interrupted = 0
    for i, split in enumerate(splits):
        d = boot(root)
        load = Load(d)
        wid = start(d, "repartition", {"split": split})
        time.sleep(rng.uniform(0.0, 0.25))
        d.proc.kill()
        d.proc.wait()
        load.stop()
        assert_no_survivors(d.tag)
        d = start_daemon(root, MODEL_DIR, *SIM, config=CONFIG)
        try:
            wf = wait_finished(d, wid)
            assert wf["status"] == "succeeded", wf
            interrupted += wf["recoveries"]
            status = d.status()
            assert status["partition"] == split
            persisted = journal_state(root, "partition")
            check_workers(d, plan_workers(persisted))
            assert plan_workers(status["plan"]) == plan_workers(persisted)
            serve_ok(d, n=1)
        finally:
            d.stop()
    assert interrupted >= 1, "no kill landed inside a workflow"


def test_cli(tmp_path):
    import subprocess
    import sys
    from helpers.daemons import ROOT
    d = boot(tmp_path / "a")

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "appliance", "workflow", *args,
                               "--url", d.url], capture_output=True, text=True, timeout=60,
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        out = cli("start", "drain", "--wait")
        assert out.returncode == 0, out.stderr
        assert "SUCCEEDED" in out.stdout and "close_admission" in out.stdout
        wid = out.stdout.split()[0]
        assert d.status()["admission"] == "closed"
        out = cli("list")
        assert out.returncode == 0 and wid in out.stdout and "succeeded" in out.stdout
        out = cli("show", wid)
        assert out.returncode == 0
        rows = [line.split() for line in out.stdout.splitlines()[2:]]
        assert [r[1] for r in rows] == DRAIN_STEPS and all(r[2] == "succeeded" for r in rows)
        out = cli("start", "resume")
        assert out.returncode == 0 and out.stdout.split()[0].startswith("wf-")
        d.wait_for(lambda st: st["admission"] == "open", what="resumed")
        for args, needle in [(("start", "repartition"), "needs --split"),
                             (("start", "drain", "--split", "6+2"), "applies to repartition"),
                             (("start", "repartition", "--split", "7+7"), "HTTP 400"),
                             (("cancel", "wf-nope"), "HTTP 404"),
                             (("cancel", wid), "already succeeded")]:
            out = cli(*args)
            assert out.returncode == 1 and needle in out.stderr, (args, out.stderr)
            assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    finally:
        d.stop()


def test_swap_model_to_a_checkpoint_directory_on_one_worker_per_role(tmp_path):
    """The CPU's 1+1: no half can keep serving, so the whole appliance reloads (and says
    so in the step's result); the new directory's name is served after."""
    import shutil
    other = tmp_path / "other-llama"
    shutil.copytree(MODEL_DIR, other)
    d = start_daemon(tmp_path / "a", MODEL_DIR, "--devices", "cpu", "--engine", "sim",
                     "--sim-speed", "50", config=CONFIG)
    try:
        wf = wait_finished(d, start(d, "swap-model", {"model": str(other)}))
        assert wf["status"] == "succeeded", wf
        ctx = wf["steps"][0]["result"]
        assert sorted(ctx["first"]) == ["decode0", "prefill0"] and ctx["second"] == []
        assert "503" in wf["steps"][1]["result"]["note"]
        assert [m["id"] for m in http("GET", d.url + "/v1/models")[2]["data"]] == ["other-llama"]
        status = d.status()
        assert status["model_dir"] == str(other.resolve())
        serve_ok(d, "other-llama")
    finally:
        d.stop()
    d = start_daemon(tmp_path / "a", MODEL_DIR, "--devices", "cpu", "--engine", "sim",
                     "--sim-speed", "50", config=CONFIG)
    try:    # persisted over the command line's --model
        assert d.status()["model"] == "other-llama"
    finally:
        d.stop()


def test_cancel_a_swap_after_the_switch_reloads_the_old_model(tmp_path):
    """Cancelled once half the workers run the new model and serve it: the undo steps
    route the old model's half back, reload the other half with the old model, and the
    appliance ends as it began."""
    d = start_daemon(tmp_path / "a", MODEL_DIR, *SIM, config="[workflows]\ndrain_timeout_s = 1.5\n")
    try:
        streams = long_streams(d, 8, max_tokens=30000)
        wid = start(d, "swap-model", {"model": "llama-3.1-8b"})
        deadline = time.monotonic() + 30
        while workflow(d, wid)["steps"][SWAP_STEPS.index("wait_second")]["status"] != "running":
            assert time.monotonic() < deadline, workflow(d, wid)
            time.sleep(0.02)
        assert http("GET", d.url + "/v1/models")[2]["data"][0]["id"] == "llama-3.1-8b"
        code, _, body = d.post(f"/admin/v1/workflows/{wid}/cancel", {})
        assert code == 200
        wf = wait_finished(d, wid)
        close_all(streams)
        assert wf["status"] == "cancelled", wf
        steps = {s["name"]: s for s in wf["steps"]}
        assert steps["load_second"]["status"] == "skipped"
        first = steps["validate"]["result"]["first"]
        assert sorted(steps["undo_reload"]["result"]["loaded"]) == sorted(first)
        assert all(steps[n]["status"] == "succeeded" for n in
                   ("undo_route_old", "undo_reload", "undo_route_all", "undo_persist"))
        assert [m["id"] for m in http("GET", d.url + "/v1/models")[2]["data"]] == [MODEL]
        check_workers(d, PLAN_4_4)
        assert journal_state(tmp_path / "a", "model")["name"] == MODEL
        serve_ok(d)
    finally:
        d.stop()


def test_a_model_that_cannot_load_is_rolled_back(tmp_path):
    """llama-3.1-70b in bf16 (140 GB) does not fit one 80 GB H100: the first half's
    workers refuse to start, the workflow compensates, the old model serves on."""
    d = boot(tmp_path / "a")
    try:
        load = Load(d)
        wf = wait_finished(d, start(d, "swap-model", {"model": "llama-3.1-70b"}))
        load.stop()
        assert wf["status"] == "compensated", wf
        assert "load_first failed" in wf["error"] and "no room for KV" in wf["error"]
        steps = {s["name"]: s for s in wf["steps"]}
        assert steps["load_first"]["status"] == "failed"
        assert steps["switch_routing"]["status"] == "skipped"
        assert [m["id"] for m in http("GET", d.url + "/v1/models")[2]["data"]] == [MODEL]
        check_workers(d, PLAN_4_4)
        assert journal_state(tmp_path / "a", "model")["name"] == MODEL    # undo_persist
        assert load.ok > 0 and load.errors == []    # the other half served throughout
        serve_ok(d)
    finally:
        d.stop()
