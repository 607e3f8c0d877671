"""Big requests are prepared off the event loop (in the prepare pool's processes), the
pool's processes never outlive the daemon, and after a model swap every request is
tokenized for the new model."""
from __future__ import annotations

import json
import signal
import threading
import time

import psutil

from appliance.daemon.tokenizer import ServedTokenizer
from helpers.daemons import http, pid_alive

BIG_CONTEXT = ("--model-spec", "llama-3.1-70b-fp8")     # 131,072 tokens: big bodies pass the bound
BIG_KV = "[engine]\nkv_cache_bytes = 32000000000\n"     # simulated: nothing is allocated


def cjk_body(model: str, chars: int = 330_000) -> bytes:
    text = "".join(chr(0x4E00 + (i * 7919) % 20_000) for i in range(chars))
    return json.dumps({"model": model, "prompt": text, "max_tokens": 1},
                      ensure_ascii=False).encode()


def test_health_answers_while_a_big_body_is_prepared(daemon_factory, tiny_model):
    d = daemon_factory("--devices", "cpu", "--engine", "sim", *BIG_CONTEXT, model=tiny_model,
                       config=BIG_KV)
    model = http("GET", d.url + "/v1/models")[2]["data"][0]["id"]
    order: list[str] = []
    big: dict = {}

    def send_big():
        big["status"], _, big["body"] = d.post("/v1/completions", raw=cjk_body(model))
        order.append("big")

    t = threading.Thread(target=send_big)
    t.start()
    # The daemon answers its status while it prepares the body (tokenizing takes ~1 s) ...
    d.wait_for(lambda s: s.get("preparing") == 1 or not t.is_alive(), timeout=30,
               what="the big body in preparation")
    assert t.is_alive(), "the status was not answered while the big body was prepared"
    # ... and /health too.
    status, headers, _ = http("GET", d.url + "/health")
    order.append("health")
    t.join(60)
    assert status == 200
    # The big request was really tokenized (a million tokens, more than the context).
    assert big["status"] == 400, big
    assert big["body"]["error"]["code"] == "context_length_exceeded"
    assert "990001 tokens" in big["body"]["error"]["message"]
    assert order == ["health", "big"], "a /health sent after the big body waited for it"

    # The pool's processes never outlive the daemon, even killed with -9.
    workers = {w["pid"] for w in d.status()["workers"]}
    children = [p.pid for p in psutil.Process(d.proc.pid).children() if p.pid not in workers]
    assert children, "no prepare processes"
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(pid_alive(p) for p in children)


def test_small_bodies_are_prepared_inline_and_big_ones_in_the_pool(daemon_factory, tiny_model):
    """Below `server.prepare_inline_bytes` the executor's round trip costs more than the
    work: those bodies are prepared on the event loop, with the same result."""
    d = daemon_factory("--devices", "cpu", "--engine", "sim", model=tiny_model,
                       config="[server]\nprepare_inline_bytes = 2048\n")
    model = http("GET", d.url + "/v1/models")[2]["data"][0]["id"]

    def usage(words: int) -> tuple[int, dict]:
        body = json.dumps({"model": model, "max_tokens": 1,
                           "messages": [{"role": "user", "content": "hello " * words}]})
        status, _, out = d.post("/v1/chat/completions", raw=body.encode())
        assert status == 200, out
        return len(body), out["usage"]

    assert d.status()["prepared"] == {"inline": 0, "pooled": 0, "inline_bytes": 2048}
    size, small = usage(10)
    assert size <= 2048 and d.status()["prepared"]["inline"] == 1
    size, big = usage(400)
    assert size > 2048 and d.status()["prepared"] == {"inline": 1, "pooled": 1,
                                                      "inline_bytes": 2048}
    # Same tokenizer, same chat template either way.
    tok = ServedTokenizer(tiny_model)
    for words, got in ((10, small), (400, big)):
        expected = tok.encode_chat([{"role": "user", "content": "hello " * words}], limit=4096)
        assert got["prompt_tokens"] == len(expected)
    # An error prepared inline is the same OpenAI error JSON as from the pool.
    status, _, out = d.post("/v1/chat/completions",
                            raw=json.dumps({"model": "nope", "messages": []}).encode())
    assert status in (400, 404) and out["error"]["message"]


def test_after_a_model_swap_requests_are_tokenized_for_the_new_model(daemon_factory, tiny_model,
                                                                     tmp_path):
    """A swap-model workflow to a checkpoint whose tokenizer differs (one added token,
    "hello hello"): from then on a small body (prepared on the event loop) and a big one
    (in the pool's children, started with the old model's tokenizer) are both tokenized
    with the new model's tokenizer."""
    import shutil
    from tokenizers import Tokenizer
    other = tmp_path / "other-llama"
    shutil.copytree(tiny_model, other)
    changed = Tokenizer.from_file(str(other / "tokenizer.json"))
    changed.add_tokens(["hello hello"])
    changed.save(str(other / "tokenizer.json"))
    old, new = ServedTokenizer(tiny_model), ServedTokenizer(other)
    d = daemon_factory("--devices", "cpu", "--engine", "sim", "--sim-speed", "50",
                       model=tiny_model, config="[server]\nprepare_inline_bytes = 2048\n"
                                                "[workflows]\ndrain_timeout_s = 10.0\n")

    def prompt_tokens(model: str, words: int) -> int:
        body = json.dumps({"model": model, "max_tokens": 1,
                           "messages": [{"role": "user", "content": "hello " * words}]})
        status, _, out = d.post("/v1/chat/completions", raw=body.encode())
        assert status == 200, out
        return out["usage"]["prompt_tokens"]

    def expected(tok: ServedTokenizer, words: int) -> int:
        return len(tok.encode_chat([{"role": "user", "content": "hello " * words}], limit=4096))

    assert prompt_tokens("tiny-llama", 400) == expected(old, 400)     # the children are up
    code, _, body = d.post("/admin/v1/workflows", {"kind": "swap-model",
                                                   "params": {"model": str(other)}})
    assert code == 201, body
    d.wait_for(lambda s: s.get("model") == "other-llama", timeout=120, what="the swap")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        wf = http("GET", f"{d.url}/admin/v1/workflows/{body['id']}")[2]
        if wf["status"] in ("succeeded", "failed", "cancelled", "compensated"):
            break
        time.sleep(0.1)
    assert wf["status"] == "succeeded", wf
    before = d.status()["prepared"]
    for words in (10, 400):                 # inline, then in a child
        assert expected(new, words) < expected(old, words)
        assert prompt_tokens("other-llama", words) == expected(new, words), words
    after = d.status()["prepared"]
    assert (after["inline"] - before["inline"], after["pooled"] - before["pooled"]) == (1, 1)
