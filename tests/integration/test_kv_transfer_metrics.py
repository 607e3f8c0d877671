"""`applianced_kv_transfer_bytes_total{transport}` and `applianced_kv_transfer_seconds`
on real daemons: the CPU torch engine's prefill -> decode handoff over /dev/shm (bytes
= the prompt's whole blocks in the pool's layout), and the simulator's modelled transfer,
labelled simulated."""
from __future__ import annotations

import json
import math

from prometheus_client.parser import text_string_to_metric_families

from appliance.models.shape import LlamaShape
from helpers.daemons import http


def kv_series(url: str) -> dict[tuple[str, str], dict[str, float]]:
    """(metric sample name, transport) -> {simulated label: value}."""
    code, _, text = http("GET", url + "/metrics")
    assert code == 200
    out: dict[tuple[str, str], dict[str, float]] = {}
    for fam in text_string_to_metric_families(text.decode()):
        if not fam.name.startswith("applianced_kv_transfer"):
            continue
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                continue
            out.setdefault((s.name, s.labels["transport"]), {})[s.labels["simulated"]] = s.value
    return out


def complete(d, prompt: str) -> int:
    """A greedy completion that decodes (max_tokens > 1: a 1-token answer never leaves the
    prefill worker); its prompt tokens."""
    model = d.status()["model"]
    code, _, body = d.post("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 3,
                                               "temperature": 0})
    assert code == 200, body
    return body["usage"]["prompt_tokens"]


def test_torch_cpu_handoff_counts_the_prompts_pool_bytes(daemon_factory, tiny_model):
    # a small KV pool per worker: the test needs a few blocks, the machine may be shared
    d = daemon_factory("--devices", "cpu", "--engine", "torch", model=tiny_model,
                       config="[engine]\nkv_cache_bytes = 67108864\n")
    roles = sorted(w["role"] for w in d.status()["workers"])
    assert roles == ["decode", "prefill"], roles
    shape = LlamaShape.from_hf_config(json.loads((tiny_model / "config.json").read_text()))
    bs = 16                                           # engine.block_size's default
    block_bytes = 2 * shape.num_layers * bs * shape.num_kv_heads * shape.head_dim * 4  # fp32
    prompts = ["The quick brown fox jumps over the lazy dog " * k for k in (1, 3, 7)]
    expected = 0
    for p in prompts:
        expected += math.ceil(complete(d, p) / bs) * block_bytes
    m = kv_series(d.url)
    assert m[("applianced_kv_transfer_bytes_total", "shm")] == {"false": expected}
    assert m[("applianced_kv_transfer_seconds_count", "shm")] == {"false": len(prompts)}
    seconds = m[("applianced_kv_transfer_seconds_sum", "shm")]["false"]
    assert 0 < seconds < 5
    assert not any(t == "sim" for _, t in m)


def test_simulator_transfer_is_modelled_and_labelled_simulated(daemon_factory, tiny_model):
    d = daemon_factory("--devices", "sim:2xH100", "--engine", "sim", "--sim-speed", "50",
                       model=tiny_model)
    first = complete(d, "hello there " * 4)
    m = kv_series(d.url)
    assert m[("applianced_kv_transfer_seconds_count", "sim")] == {"true": 1}
    one = m[("applianced_kv_transfer_bytes_total", "sim")]["true"]
    assert one > 0
    second = complete(d, "hello there " * 40)
    m = kv_series(d.url)
    assert m[("applianced_kv_transfer_seconds_count", "sim")] == {"true": 2}
    # modelled bytes are per token: the second prompt's share is in proportion
    both = m[("applianced_kv_transfer_bytes_total", "sim")]["true"]
    assert abs((both - one) - one * second / first) <= 1
    assert m[("applianced_kv_transfer_seconds_sum", "sim")]["true"] > 0
