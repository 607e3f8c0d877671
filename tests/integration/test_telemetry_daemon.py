"""Live telemetry on real daemons: the prefill:decode ratio under prefill- and
decode-heavy load on a simulated 8xH100, /admin/v1/stream, the /metrics series with
site/appliance/simulated labels, and the CPU's energy source on a torch daemon."""
from __future__ import annotations

import json
import socket
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers.daemons import http

SIM = ("--devices", "sim:8xH100", "--model-spec", "llama-3.1-70b-fp8", "--sim-speed", "10")
MODEL = "llama-3.1-70b-fp8"


@pytest.fixture(scope="module")
def sim_daemon(tmp_path_factory, tiny_model):
    from helpers.daemons import start_daemon
    d = start_daemon(tmp_path_factory.mktemp("sim8"), tiny_model, *SIM,
                     config='[site]\nname = "lab-west"\n')
    yield d
    d.stop()


def _load(d, prompt_tokens: int, max_tokens: int, requests: int, concurrency: int = 8):
    client = d.client()
    def one(k):
        # A different first token per request: no prefix-cache hits, every prompt prefilled.
        prompt = [300 + k] + [(7 * i) % 200 + 10 for i in range(prompt_tokens - 1)]
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                      extra_body={"ignore_eos": True})
        return r.usage.completion_tokens

    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(one, range(requests)))
    assert done == [max_tokens] * requests


def _window_empty(st) -> bool:
    return all(g["gpu_seconds"]["10s"] == 0 for g in st["groups"].values())


def test_ratio_follows_the_load(sim_daemon):
    d = sim_daemon
    # Decode-heavy: short prompts, long answers.
    _load(d, prompt_tokens=16, max_tokens=200, requests=16)
    # The newest iterations reach the windows on the next 0.1-s bin edge: wait for them.
    st = d.wait_for(lambda s: s["ratio"]["gpu_seconds"] is not None
                    and s["groups"]["decode"]["gpu_seconds"]["10s"] > 0
                    and s["groups"]["decode"]["tokens_per_s"]["10s"] > 0
                    and s["ratio"]["energy"] is not None
                    and s["latency"]["itl_p50_s"] and s["requests_per_s"],
                    timeout=10, what="the decode-heavy load in the 10-s window")
    r = st["ratio"]
    assert r["window"] == "10s" and r["gpu_seconds"] is not None
    assert r["gpu_seconds"] < 1, r
    assert r["energy"] is not None and r["energy"] < 1.2
    dec = st["groups"]["decode"]
    assert dec["gpu_seconds"]["10s"] > 0 and dec["tokens_per_s"]["10s"] > 0
    assert st["latency"]["itl_p50_s"] > 0 and st["requests_per_s"] > 0
    # Let the 10-s window empty, then prefill-heavy: long prompts, 2-token answers (a
    # 1-token answer finishes on the prefill worker and never reaches decode at all).
    d.wait_for(_window_empty, timeout=30, what="an empty 10-s window")
    _load(d, prompt_tokens=3000, max_tokens=2, requests=24)
    # Windows end on the last 0.1-s bin edge: the newest iterations show a moment later,
    # and the ratios, their history and the energy a telemetry tick after that. Wait for
    # each figure asserted below, not for one of them.
    def prefill_heavy(s):
        return (s["groups"]["prefill"]["tokens_per_s"]["60s"] * 60 >= 24 * 3000 * 0.999
                and (s["ratio"]["gpu_seconds"] or 0) > 1 and (s["ratio"]["energy"] or 0) > 1
                and any(v is not None for _, v in s["ratio"]["history"])
                and s["latency"]["ttft_p50_s"])
    st = d.wait_for(prefill_heavy, timeout=10,
                    what="every prompt token in the 60-s window, and the ratios after it")
    assert st["ratio"]["gpu_seconds"] > 1, st["ratio"]
    assert st["ratio"]["energy"] > 1, st["ratio"]
    pre = st["groups"]["prefill"]
    assert pre["devices"] == ["sim0", "sim1", "sim2", "sim3"] and pre["workers"] == 4
    assert st["latency"]["ttft_p99_s"] >= st["latency"]["ttft_p50_s"] > 0
    assert any(v is not None for _, v in st["ratio"]["history"])
    # Devices carry their live readings, all marked simulated.
    dev = next(x for x in st["devices"] if x["id"] == "sim0")
    assert dev["simulated"] and dev["source"] == "simulated" and dev["group"] == "prefill"
    assert dev["worker"] == "prefill0" and dev["power_w"] >= 70.0 and dev["energy_j"] > 0
    assert dev["mem_total_bytes"] == 80 * 2**30 and set(dev["busy_fraction"]) == {"1s", "10s", "60s"}
    assert st["site"] == "lab-west" and st["appliance"] == socket.gethostname()
    assert st["sources"]["energy"] == "simulated"


def _series(text: str, name: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            out[labels] = float(value)
    return out


def test_metrics_carry_the_new_series_and_labels(sim_daemon):
    d = sim_daemon
    _load(d, prompt_tokens=500, max_tokens=8, requests=4)
    code, _, text = http("GET", d.url + "/metrics")
    text = text.decode()
    assert code == 200
    host = socket.gethostname()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            assert f'appliance="{host}"' in line and 'site="lab-west"' in line, line
            assert 'simulated="true"' in line, line
    busy = _series(text, "applianced_group_busy_seconds_total")
    key = f'applianced_group_busy_seconds_total{{appliance="{host}",group="prefill",simulated="true",site="lab-west"}}'
    assert busy[key] > 0
    assert sum(_series(text, "applianced_group_energy_joules_total").values()) > 0
    assert len(_series(text, "applianced_device_power_watts")) == 8
    assert len(_series(text, "applianced_device_energy_joules_total")) == 8
    assert len(_series(text, "applianced_device_utilization_ratio")) == 8
    assert any('device="sim5",group="decode"' in k
               for k in _series(text, "applianced_device_power_watts"))
    tokens = _series(text, "applianced_phase_tokens_total")
    assert {("phase=\"prefill\"" in k) for k in tokens} == {True, False}
    assert all(v > 0 for v in tokens.values())
    assert _series(text, "applianced_inter_token_latency_seconds_count")
    assert set(_series(text, "applianced_group_devices").values()) == {4.0}
    assert set(_series(text, "applianced_group_workers").values()) == {4.0}


def _read_events(url: str, count: int, timeout: float = 30) -> tuple[list[dict], int]:
    events, comments = [], 0
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        while len(events) < count:
            line = resp.readline().decode()
            assert line, "stream ended early"
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
            elif line.startswith(":"):
                comments += 1
    return events, comments


def test_stream_delivers_snapshots(sim_daemon):
    d = sim_daemon
    events, comments = _read_events(d.url + "/admin/v1/stream?interval=0.25", 6)
    assert comments >= 1                      # the opening keepalive
    for ev in events:
        assert {"groups", "ratio", "devices", "workers", "latency", "sources"} <= set(ev)
        assert ev["site"] == "lab-west"
    # Snapshots are taken one after another: uptimes strictly increase.
    ups = [ev["uptime_s"] for ev in events]
    assert ups == sorted(ups) and len(set(ups)) == len(ups)
    # Never faster than asked (a slow machine can only make the gaps longer).
    assert min(b - a for a, b in zip(ups, ups[1:])) >= 0.2     # build-time jitter aside
    for bad in ("0.1", "5", "fast"):
        code, _, body = http("GET", d.url + f"/admin/v1/stream?interval={bad}")
        assert code == 400 and body["error"]["param"] == "interval", body


def test_cpu_daemon_reports_the_cpu_energy_source(daemon_factory, tiny_model):
    d = daemon_factory("--devices", "cpu", model=tiny_model)
    d.wait_for(lambda s: s["devices"][0].get("power_w") is not None, timeout=20,
               what="two CPU readings")
    client = d.client()
    # ignore_eos: a sampled end-of-sequence as the first token would finish the request on
    # the prefill worker, and the decode figures waited for below would never come.
    r = client.chat.completions.create(model="tiny-llama", max_tokens=8,
                                       messages=[{"role": "user", "content": "Hello"}],
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 8
    # Wait for every figure asserted below, not for one of them: on a loaded machine the
    # groups' windows fill a tick apart.
    def ready(s):
        g = s["groups"]
        return ((g["prefill"].get("cpu_seconds") or {}).get("60s")
                and g["prefill"]["gpu_seconds"]["60s"] > 0
                and g["decode"]["gpu_seconds"]["60s"] > 0
                and g["decode"]["energy_joules"]["60s"] > 0
                and s["devices"][0].get("energy_j", 0) > 0)
    st = d.wait_for(ready, timeout=20, what="both groups' device time, energy and CPU time")
    cpu = st["devices"][0]
    assert cpu["id"] == "cpu0" and cpu["source"] in ("estimated", "measured")
    assert cpu["simulated"] is False and cpu["group"] == "decode+prefill"
    assert st["sources"]["energy"] == cpu["source"]
    assert st["groups"]["prefill"]["gpu_seconds"]["60s"] > 0
    assert st["groups"]["decode"]["gpu_seconds"]["60s"] > 0
    assert cpu["energy_j"] > 0 and 0 <= cpu["util"] <= 1
    assert st["groups"]["decode"]["energy_joules"]["60s"] > 0
    code, _, text = http("GET", d.url + "/metrics")
    assert 'simulated="false"' in text.decode() and "applianced_device_power_watts{" in text.decode()


def test_status_cli_shows_groups_and_ratio(sim_daemon):
    import subprocess
    import sys
    from helpers.daemons import ROOT
    out = subprocess.run([sys.executable, "-m", "appliance", "status", "--url", sim_daemon.url],
                         capture_output=True, text=True, cwd=ROOT, timeout=60,
                         env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(line.startswith("PREFILL ") and "busy" in line and "%" in line
               for line in lines), out.stdout
    assert any(line.startswith("DECODE ") for line in lines)
    assert any(line.startswith("prefill:decode ") and "GPU-s" in line and "energy" in line
               for line in lines)
    assert "[SIMULATED]" in out.stdout
