"""A real daemon under failure: keys, overload, disconnects, dying workers, SIGTERM,
kill -9 of the daemon, and the simulated 8xH100 partition."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import threading
import time

import openai
import pytest

from helpers.daemons import http, pid_alive

MODEL = "tiny-llama"
MSG = [{"role": "user", "content": "Tell me a long story"}]
# The CPU roofline makes a decode step ~2.5 ms; at this speed one is ~50 ms, so a
# 200-token answer takes ~10 s: long enough to act on it mid-flight.
SLOW = ("--sim-speed", "0.05")


def kv_idle(status) -> bool:
    return all(w["kv_blocks_free"] == w["kv_blocks_total"] and w["running"] == 0
               and w["kv_blocks_handed_off"] == 0 for w in status["workers"])


def test_api_keys(daemon_factory, tiny_model):
    key = "sk-team-search-123"
    digest = hashlib.sha256(key.encode()).hexdigest()
    d = daemon_factory("--devices", "cpu", "--engine", "sim", "--sim-speed", "50",
                       model=tiny_model, config=f'[auth.keys]\n"{digest}" = "search"\n')
    with pytest.raises(openai.AuthenticationError):
        d.client(api_key="wrong").chat.completions.create(model=MODEL, messages=MSG, max_tokens=2)
    code, _, body = d.post("/v1/chat/completions", {"model": MODEL, "messages": MSG})
    assert code == 401 and body["error"]["code"] == "invalid_api_key"
    assert http("GET", d.url + "/v1/models")[0] == 401
    r = d.client(api_key=key).chat.completions.create(model=MODEL, messages=MSG, max_tokens=2)
    assert r.usage.completion_tokens == 2
    metrics = http("GET", d.url + "/metrics")[2].decode()   # loopback may scrape
    assert 'tenant="search"' in metrics and 'status="ok"' in metrics


def test_overload_is_503_with_retry_after(daemon_factory, tiny_model):
    d = daemon_factory("--devices", "cpu", "--engine", "sim", *SLOW, model=tiny_model,
                       config="[server]\nmax_inflight = 1\n")
    stream = d.client().chat.completions.create(model=MODEL, messages=MSG, max_tokens=200,
                                                stream=True)
    next(iter(stream))
    code, headers, body = d.post("/v1/chat/completions", {"model": MODEL, "messages": MSG})
    assert code == 503 and body["error"]["code"] == "overloaded"
    assert headers["Retry-After"] == "1"
    stream.close()
    # n choices are n generations: with room for one, n = 2 is refused even when idle
    d.wait_for(lambda st: st["inflight"] == 0, what="the stream's slot back")
    code, _, body = d.post("/v1/chat/completions", {"model": MODEL, "messages": MSG, "n": 2})
    assert code == 503 and "adds 2" in body["error"]["message"]
    code, _, body = d.post("/v1/chat/completions", {"model": MODEL, "messages": MSG,
                                                    "max_tokens": 2})
    assert code == 200, body


def test_admission_refuses_before_parsing_and_records_the_rejection(daemon_factory,
                                                                     tiny_model):
    """A request refused at admission is refused before its body is parsed or tokenized
    (a 1 MB prompt costs nothing), and one refused as overloaded leaves its `rejected`
    record: the demand the planner counts."""
    d = daemon_factory("--devices", "cpu", "--engine", "sim", *SLOW, model=tiny_model,
                       config="[server]\nmax_inflight = 1\nlog_requests = true\n"
                              "max_body_bytes = 4194304\n")
    stream = d.client().chat.completions.create(model=MODEL, messages=MSG, max_tokens=200,
                                                stream=True)
    next(iter(stream))
    big = {"model": MODEL, "prompt": "lorem ipsum " * 90_000, "max_tokens": 1}   # ~1 MB
    before = d.status()["prepared"]
    code, headers, body = d.post("/v1/completions", big)
    assert code == 503 and body["error"]["code"] == "overloaded"
    assert d.status()["prepared"] == before                 # not parsed, not tokenized
    stream.close()
    rid = headers["X-Request-Id"]
    records = [json.loads(line) for line in d.log_text().splitlines()
               if line.startswith("{") and '"request_id"' in line]
    rejected = [r for r in records if r["request_id"] == rid]
    assert len(rejected) == 1 and rejected[0]["status"] == "rejected", records
    assert rejected[0]["endpoint"] == "completions" and rejected[0]["prompt_tokens"] == 0
    metrics = http("GET", d.url + "/metrics")[2].decode()
    assert 'applianced_rejected_requests_total{' in metrics
    # An operator's drain: refused as cheaply, and not counted as demand turned away.
    d.wait_for(lambda st: st["inflight"] == 0, what="the stream's slot back")
    code, _, wf = d.post("/admin/v1/workflows", {"kind": "drain"})
    assert code == 201, wf
    d.wait_for(lambda st: st["admission"] == "closed", what="admission closed")
    before = d.status()["prepared"]
    code, headers, body = d.post("/v1/completions", big)
    assert code == 503 and body["error"]["code"] == "draining"
    assert d.status()["prepared"] == before
    assert headers["X-Request-Id"] not in d.log_text()


def test_client_disconnect_frees_kv(daemon_factory, tiny_model):
    d = daemon_factory("--devices", "cpu", "--engine", "sim", *SLOW, model=tiny_model)
    stream = d.client().chat.completions.create(model=MODEL, messages=MSG, max_tokens=400,
                                                stream=True)
    it = iter(stream)
    for _ in range(3):
        next(it)
    busy = d.worker("decode0")
    assert busy["running"] == 1 and busy["kv_blocks_free"] < busy["kv_blocks_total"]
    stream.close()                       # hang up mid-stream
    d.wait_for(kv_idle, what="every KV block free after the disconnect")

    # n = 3: three engine requests behind one stream; hanging up aborts all of them.
    stream = d.client().chat.completions.create(model=MODEL, messages=MSG, max_tokens=400,
                                                n=3, stream=True)
    it = iter(stream)
    seen = set()
    while len(seen) < 3:
        seen.update(ch.index for ch in next(it).choices)
    d.wait_for(lambda st: sum(w["running"] for w in st["workers"]) == 3,
               what="three choices decoding")
    stream.close()
    d.wait_for(kv_idle, what="every KV block free after an n=3 disconnect")


def test_kill_decode_worker_mid_request(daemon_factory, tiny_model):
    d = daemon_factory("--devices", "cpu", "--engine", "sim", *SLOW, model=tiny_model)
    pid = d.worker("decode0")["pid"]
    stream = d.client().chat.completions.create(model=MODEL, messages=MSG, max_tokens=400,
                                                stream=True)
    it = iter(stream)
    next(it)
    next(it)
    os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(openai.APIError) as err:
        for _ in it:
            pass
    assert time.monotonic() - started < 10
    assert "decode0 died" in str(err.value)
    status = d.wait_for(lambda s: next(w for w in s["workers"] if w["worker"] == "decode0")
                        ["state"] == "ready", what="decode0 restarted")
    decode0 = next(w for w in status["workers"] if w["worker"] == "decode0")
    assert decode0["restarts"] == 1 and decode0["pid"] != pid
    assert "signal 9" in decode0["last_exit"]
    # The prefill worker's handed-off blocks came back, and service resumes.
    d.wait_for(kv_idle, what="prefill blocks reclaimed")
    r = d.client().chat.completions.create(model=MODEL, messages=MSG, max_tokens=3)
    assert r.usage.completion_tokens == 3


def test_kill_prefill_worker_before_first_byte_is_503(daemon_factory, tiny_model):
    d = daemon_factory("--devices", "cpu", "--engine", "sim", "--sim-speed", "0.001",
                       model=tiny_model)
    pid = d.worker("prefill0")["pid"]
    result = {}

    def call():
        result["resp"] = d.post("/v1/completions", {"model": MODEL, "prompt": "a" * 3000,
                                                    "max_tokens": 5})

    t = threading.Thread(target=call)
    t.start()
    d.wait_for(lambda s: s["inflight"] == 1, what="request in flight")
    time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    t.join(20)
    code, headers, body = result["resp"]
    assert code == 503 and body["error"]["code"] == "worker_failed"
    assert "Retry-After" in headers


def test_sigterm_drains_in_flight_requests(daemon_factory, tiny_model):
    d = daemon_factory("--devices", "cpu", "--engine", "sim", "--sim-speed", "0.5",
                       model=tiny_model)
    pids = [w["pid"] for w in d.status()["workers"]]
    stream = d.client().chat.completions.create(model=MODEL, messages=MSG, max_tokens=300,
                                                stream=True, stream_options={"include_usage": True})
    it = iter(stream)
    next(it)
    d.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    # New work is refused while draining...
    code, _, body = d.post("/v1/chat/completions", {"model": MODEL, "messages": MSG})
    assert code == 503 and body["error"]["code"] == "draining"
    # ...and the request in flight finishes completely.
    chunks = list(it)
    assert chunks[-1].usage.completion_tokens == 300
    assert d.proc.wait(30) == 0
    assert not any(pid_alive(p) for p in pids)


def test_kill_9_daemon_leaves_no_orphans(daemon_factory, tiny_model):
    d = daemon_factory("--devices", "cpu", "--engine", "sim", model=tiny_model)
    pids = [w["pid"] for w in d.status()["workers"]]
    assert len(pids) == 2 and all(pid_alive(p) for p in pids)
    d.proc.kill()
    d.proc.wait()
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(pid_alive(p) for p in pids)


def test_agg_mode_matches_disagg(daemon_factory, tiny_model):
    agg = daemon_factory("--devices", "cpu", "--engine", "sim", "--mode", "agg",
                         "--sim-speed", "50", model=tiny_model)
    disagg = daemon_factory("--devices", "cpu", "--engine", "sim", "--sim-speed", "50",
                            model=tiny_model)
    status = agg.status()
    assert status["mode"] == "agg" and [w["role"] for w in status["workers"]] == ["agg"]
    a = agg.client().chat.completions.create(model=MODEL, messages=MSG, max_tokens=7, seed=1)
    b = disagg.client().chat.completions.create(model=MODEL, messages=MSG, max_tokens=7, seed=1)
    assert a.usage.completion_tokens == 7
    # The same seed continues one random stream across the handoff.
    assert a.choices[0].message.content == b.choices[0].message.content
    agg.wait_for(kv_idle, what="agg worker idle")


def test_sim_8xh100_partition_and_routing(daemon_factory, tiny_model):
    d = daemon_factory("--devices", "sim:8xH100", "--model-spec", "llama-3.1-8b",
                       "--sim-speed", "20", model=tiny_model)
    status = d.status()
    assert status["simulated"] is True
    assert [len(status["plan"][r]) for r in ("prefill", "decode")] == [4, 4]
    assert all(w["state"] == "ready" and w["simulated"] for w in status["workers"])
    client = d.client(timeout=60)
    results = []

    def one(i):
        results.append(client.completions.create(model="llama-3.1-8b", prompt=f"job {i} " * 50,
                                                 max_tokens=20))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 16 and all(r.usage.completion_tokens == 20 for r in results)
    # Workers report their iteration counts with their stats (every 50 ms): wait for them.
    def used(s):
        return {w["worker"]: w["iterations"] for w in s["workers"] if w["iterations"]}

    def spread(s):
        u = used(s)
        return (sum(1 for w in u if w.startswith("prefill")) >= 2
                and sum(1 for w in u if w.startswith("decode")) >= 2)
    d.wait_for(spread, timeout=10, what="two prefill and two decode workers used")
    d.wait_for(kv_idle, what="all sim workers idle")


def test_port_in_use_is_one_line(daemon_factory, tiny_model, tmp_path):
    import subprocess
    import sys
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "appliance", "serve", "--devices", "cpu",
                              "--engine", "sim", "--model", str(tiny_model), "--port", str(port),
                              "--state-dir", str(tmp_path)], capture_output=True, text=True,
                             timeout=60)
    assert out.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr
    assert "Traceback" not in out.stderr


def _records(d) -> list[dict]:
    import json
    return [json.loads(line) for line in d.log_text().splitlines()
            if line.startswith('{"request_id"')]


def test_request_records_and_conditional_disagg(daemon_factory, tiny_model):
    d = daemon_factory("--devices", "cpu", "--engine", "sim", "--sim-speed", "50",
                       "--log-requests", model=tiny_model,
                       config="[engine]\nconditional_disagg_tokens = 40\n")
    client = d.client()
    short = client.completions.create(model=MODEL, prompt="hi", max_tokens=4)
    long = client.completions.create(model=MODEL, prompt="word " * 100, max_tokens=4)
    deadline = time.monotonic() + 10
    while len(_records(d)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    by_tokens = {r["prompt_tokens"]: r for r in _records(d)}
    a = by_tokens[short.usage.prompt_tokens]
    b = by_tokens[long.usage.prompt_tokens]
    # A prompt under the bound is prefilled where it decodes; a longer one is handed off.
    assert (a["prefill_worker"], a["decode_worker"]) == ("decode0", "decode0")
    assert (b["prefill_worker"], b["decode_worker"]) == ("prefill0", "decode0")
    for rec, resp in ((a, short), (b, long)):
        assert rec["status"] == "ok" and rec["tenant"] == "default"
        assert rec["output_tokens"] == resp.usage.completion_tokens == 4
        assert rec["arrival"] <= rec["first_token"] <= rec["finish"]
        assert rec["simulated"] is True and rec["finish_reason"] == "length"


@pytest.mark.parametrize("breakage,needle", [
    ("arch", "MambaForCausalLM"),
    ("weights", "model.safetensors"),
])
def test_unloadable_model_fails_start_with_one_line(tiny_model, tmp_path, breakage, needle):
    import json
    import shutil
    import subprocess
    import sys
    bad = tmp_path / "bad-model"
    shutil.copytree(tiny_model, bad)
    if breakage == "arch":
        cfg = json.loads((bad / "config.json").read_text())
        cfg["architectures"] = ["MambaForCausalLM"]
        (bad / "config.json").write_text(json.dumps(cfg))
    else:
        (bad / "model.safetensors").write_bytes(b"\x00" * 100)
    out = subprocess.run([sys.executable, "-m", "appliance", "serve", "--devices", "cpu",
                          "--engine", "torch", "--model", str(bad), "--port", "1",
                          "--state-dir", str(tmp_path / "s")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("applianced: worker") and "cannot start its torch engine" in last
    assert needle in last, last


def test_context_is_capped_by_the_smallest_kv_pool(daemon_factory, tiny_model):
    # 256 KiB of KV at 4 KiB per token (tiny model, fp32) = 64 tokens = 4 blocks.
    d = daemon_factory("--devices", "cpu", "--engine", "sim", "--sim-speed", "50",
                       model=tiny_model, config="[engine]\nkv_cache_bytes = 262144\n")
    info = d.client().models.list().data[0]
    pool_tokens = d.status()["workers"][0]["kv_blocks_total"] * 16
    assert info.model_extra["max_model_len"] == pool_tokens < 4096
    code, _, body = d.post("/v1/completions", {"model": MODEL, "prompt": "hi",
                                               "max_tokens": pool_tokens})
    assert code == 400 and body["error"]["code"] == "context_length_exceeded"
    r = d.client().completions.create(model=MODEL, prompt="hi")   # default max_tokens fits
    assert r.usage.prompt_tokens + r.usage.completion_tokens == pool_tokens


def test_auto_engine_choice_without_importing_torch():
    import subprocess
    import sys
    code = ("import sys\nfrom appliance.daemon.setup import resolve_engine\n"
            "from appliance.partitions import discover\n"
            "print(resolve_engine('auto', discover('cpu')), resolve_engine('auto', discover('sim:2xH100')),"
            " 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    # The embedded default on a GPU-less box is the real engine; the daemon never loads torch.
    assert out.stdout.split() == ["torch", "sim", "False"], out.stderr


def test_default_model_is_built_once_outside_the_daemon(tmp_path):
    from helpers.daemons import start_daemon
    d = start_daemon(tmp_path, None, "--devices", "cpu", "--engine", "sim")
    try:
        weights = tmp_path / "state" / "models" / "tiny-llama" / "model.safetensors"
        assert weights.is_file()
        assert d.status()["model_dir"] == str(weights.parent)
        # Generating weights needs torch; the daemon process itself never loads it.
        maps = open(f"/proc/{d.proc.pid}/maps").read()
        assert "libtorch" not in maps
        built = weights.stat().st_mtime_ns
    finally:
        assert d.stop() == 0
    d = start_daemon(tmp_path, None, "--devices", "cpu", "--engine", "sim")
    try:
        assert weights.stat().st_mtime_ns == built          # reused, not rebuilt
        assert "generating the default model" not in d.log_text()
    finally:
        d.stop()


def test_cpu_workers_that_cannot_fit_in_memory_are_refused(tiny_model, tmp_path):
    """Each torch CPU worker holds the model in fp32 and its KV pool: the daemon adds
    them up against the memory available and refuses with the numbers, before starting
    any worker (which the OOM killer would otherwise stop, or something else instead)."""
    import subprocess
    import sys

    from appliance.config import Config
    from appliance.daemon.setup import StartupError, check_cpu_memory, worker_specs
    from appliance.models.specs import spec_from_hf_config
    from appliance.partitions import discover, plan_partition

    inv = discover("cpu")
    specs = worker_specs(Config(), inv, plan_partition(inv), "torch", tiny_model)
    weights = spec_from_hf_config(tiny_model / "config.json").params * 4
    need = 2 * (weights + (1 << 30) + (1 << 30))       # 2 workers: weights, KV, runtime
    check_cpu_memory(specs, tiny_model, int(need) + 1)
    with pytest.raises(StartupError, match=r"2 CPU worker\(s\) need 4\.0 GiB but 3\.9 GiB"):
        check_cpu_memory(specs, tiny_model, int(need) - (100 << 20))
    sims = worker_specs(Config(), inv, plan_partition(inv), "sim", tiny_model)
    check_cpu_memory(sims, tiny_model, 0)              # the simulator holds no weights

    cfg = tmp_path / "config.toml"
    cfg.write_text("[engine]\nkv_cache_bytes = 70368744177664\n")      # 64 TiB per worker
    out = subprocess.run([sys.executable, "-m", "appliance", "serve", "--devices", "cpu",
                          "--engine", "torch", "--model", str(tiny_model), "--port", "1",
                          "--state-dir", str(tmp_path / "s"), "--config", str(cfg)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert "need" in last and "GiB of memory is available" in last and "--mode agg" in last
