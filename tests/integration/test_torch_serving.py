"""The real PyTorch engine behind the real daemon: greedy output through the HTTP API is
token-for-token what `transformers` generates, in disagg mode (KV handed from the
prefill worker's pool to the decode worker's through shared memory) and in agg mode."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import openai
import pytest

from appliance.cli import core_ranges
from appliance.daemon.tokenizer import ServedTokenizer
from helpers.daemons import ROOT, start_daemon

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MODEL = "tiny-llama"
SHARED = ("import os, sys\nfrom pathlib import Path\n\ndef load_config(path):\n"
          "    with open(path) as f:\n        return f.read()\n")
PROMPTS = [
    "Hello",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",      # > 1 block
    SHARED + "\nclass Parser:\n",                                         # these two share
    SHARED + "\ndef main():\n",                                           # full blocks
]


@pytest.fixture(scope="module")
def tok(tiny_model):
    return ServedTokenizer(tiny_model)


@pytest.fixture(scope="module")
def reference(tiny_model):
    """What transformers' greedy generate gives on the same files."""
    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model.eval()
    cache = {}

    def generate(ids: list[int], n: int) -> list[int]:
        key = (tuple(ids), n)
        if key not in cache:
            with torch.inference_mode():
                out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                     pad_token_id=1)
            cache[key] = out[0, len(ids):].tolist()
        return cache[key]

    return generate


@pytest.fixture(scope="module")
def disagg(tiny_model, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("torch-disagg"), tiny_model, "--devices", "cpu",
                     "--engine", "torch")
    yield d
    d.stop()


@pytest.fixture(scope="module")
def agg(tiny_model, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("torch-agg"), tiny_model, "--devices", "cpu",
                     "--engine", "torch", "--mode", "agg")
    yield d
    d.stop()


def complete(daemon, ids: list[int], n: int, **kw):
    return daemon.client().completions.create(model=MODEL, prompt=ids, max_tokens=n,
                                              temperature=0, **kw)


def idle(status) -> bool:
    return all(w["kv_blocks_free"] == w["kv_blocks_total"] and w["kv_blocks_handed_off"] == 0
               and w["running"] == 0 for w in status["workers"])


def test_status_says_torch_and_not_simulated(disagg):
    status = disagg.status()
    assert status["engine"] == "torch" and status["simulated"] is False
    assert {w["role"] for w in status["workers"]} == {"prefill", "decode"}


def test_cpu_workers_run_on_their_own_cores(disagg, tiny_model, tmp_path):
    # By default the two workers split the cores this process may use (one each here),
    # and each engine runs as many torch threads as it has cores.
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // 2)
    workers = {w["worker"]: w for w in disagg.status()["workers"]}
    for name, first in (("prefill0", 0), ("decode0", per)):
        w = workers[name]
        want = [cores[(first + i) % len(cores)] for i in range(per)]
        assert w["cpu_cores"] == want and w["threads"] == per, w
        assert sorted(os.sched_getaffinity(w["pid"])) == want
    shown = subprocess.run([sys.executable, "-m", "appliance", "status", "--url", disagg.url],
                           capture_output=True, text=True, timeout=60, cwd=ROOT).stdout
    line = next(ln for ln in shown.splitlines() if ln.startswith("decode0"))
    assert f"cpu0 cores {core_ranges(workers['decode0']['cpu_cores'])}" in line, shown
    # engine.cpu_threads: agg workers with two threads each, on two cores where there are
    # (one per two cores: one worker on this 2-core box).
    d = start_daemon(tmp_path / "agg2", tiny_model, "--devices", "cpu", "--engine", "torch",
                     "--mode", "agg", config="[engine]\ncpu_threads = 2\n")
    try:
        w = d.status()["workers"][0]
        assert len(d.status()["workers"]) == max(1, len(cores) // 2)
        assert w["threads"] == 2 and len(w["cpu_cores"]) == min(2, len(cores))
        assert sorted(os.sched_getaffinity(w["pid"])) == w["cpu_cores"]
        r = complete(d, [5, 6, 7, 8], 4)
        assert r.usage.completion_tokens == 4
    finally:
        d.stop()


def test_the_daemon_keeps_off_the_decode_workers_cores(disagg, tok, reference):
    # engine.daemon_cores = "auto": every thread of the daemon and of its helper processes
    # (the accounting process, the tokenizer pool) on the cores no decode worker has,
    # while the workers keep their own; with one core there is nowhere else to go.
    cores = sorted(os.sched_getaffinity(0))
    workers = {w["worker"]: w for w in disagg.status()["workers"]}
    decode = set(workers["decode0"]["cpu_cores"])
    want = [c for c in cores if c not in decode] or cores
    ids = tok.encode(PROMPTS[1])
    assert complete(disagg, ids, 4).choices[0].text == tok.decode(reference(ids, 4))
    import psutil
    daemon = psutil.Process(disagg.proc.pid)
    pids = {w["pid"] for w in workers.values()}
    helpers = [p for p in daemon.children() if p.pid not in pids]
    assert helpers, "the accounting process should run beside the daemon"
    for proc in [daemon, *helpers]:
        threads = [t.id for t in proc.threads()]
        assert len(threads) >= 1
        for tid in threads:
            assert sorted(os.sched_getaffinity(tid)) == want, (proc.cmdline()[-3:], tid)
    for w in workers.values():        # the workers are not bounded by the daemon's cores
        assert sorted(os.sched_getaffinity(w["pid"])) == w["cpu_cores"]


def test_agg_one_single_threaded_worker_per_core(tiny_model, tok, reference, tmp_path):
    """`--mode agg` with engine.cpu_threads = 1: one agg worker per core, each on its own
    core with one thread; requests sent together are spread over them, and each gives
    transformers' greedy tokens, with prompts chunked into mixed steps."""
    cores = sorted(os.sched_getaffinity(0))
    d = start_daemon(tmp_path / "agg-per-core", tiny_model, "--devices", "cpu", "--engine",
                     "torch", "--mode", "agg",
                     config="[engine]\ncpu_threads = 1\nprefill_chunk_tokens = 16\n")
    try:
        workers = d.status()["workers"]
        assert [w["worker"] for w in workers] == [f"agg{i}" for i in range(len(cores))]
        assert [w["cpu_cores"] for w in workers] == [[c] for c in cores]
        assert {w["threads"] for w in workers} == {1}
        for w in workers:
            assert sorted(os.sched_getaffinity(w["pid"])) == w["cpu_cores"]
        before = {w["worker"]: w["iterations"] or 0 for w in workers}
        asked = [tok.encode(p) for p in PROMPTS] * 2
        got: dict[int, str] = {}

        def run(i: int) -> None:
            got[i] = complete(d, asked[i], 24).choices[0].text

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(asked))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for i, ids in enumerate(asked):
            assert got.get(i) == tok.decode(reference(ids, 24)), i
        deadline = time.monotonic() + 10      # stats arrive every 50 ms while busy
        while True:
            after = {w["worker"]: w["iterations"] or 0 for w in d.status()["workers"]}
            busy = [name for name in after if after[name] > before[name]]
            if len(busy) >= min(2, len(cores)) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert len(busy) >= min(2, len(cores)), (before, after)
    finally:
        d.stop()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_transformers_in_both_modes(disagg, agg, tok, reference, prompt):
    ids = tok.encode(prompt)
    want = reference(ids, 24)
    for daemon in (disagg, agg):
        r = complete(daemon, ids, 24)
        assert r.usage.completion_tokens == len(want)
        assert r.choices[0].text == tok.decode(want), daemon.status()["mode"]
        assert r.model_extra["simulated"] is False


def test_chat_greedy_matches_transformers(disagg, tok, reference):
    messages = [{"role": "user", "content": "Write a haiku about pipes."}]
    want = reference(tok.encode_chat(messages), 16)
    r = disagg.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                                temperature=0)
    assert r.choices[0].message.content == tok.decode(want)


def test_shared_prefix_hits_the_prefix_cache(disagg, tok):
    a, b = tok.encode(PROMPTS[2]), tok.encode(PROMPTS[3])
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert common >= 32
    complete(disagg, a, 2)
    r = complete(disagg, b, 2)
    assert r.usage.prompt_tokens_details.cached_tokens == (common // 16) * 16


def test_seeded_sampling_repeats_across_modes(disagg, agg, tok):
    ids = tok.encode("import numpy as np\n")
    runs = [disagg.client().completions.create(model=MODEL, prompt=ids, max_tokens=20,
                                               temperature=0.9, seed=1234).choices[0].text,
            disagg.client().completions.create(model=MODEL, prompt=ids, max_tokens=20,
                                               temperature=0.9, seed=1234).choices[0].text,
            agg.client().completions.create(model=MODEL, prompt=ids, max_tokens=20,
                                            temperature=0.9, seed=1234).choices[0].text]
    assert runs[0] == runs[1] == runs[2]
    other = disagg.client().completions.create(model=MODEL, prompt=ids, max_tokens=20,
                                               temperature=0.9, seed=99).choices[0].text
    assert other != runs[0]


def test_logprobs_are_the_models_through_the_api(disagg, agg, tok, tiny_model, reference):
    """Chat and completions, streamed and not, disagg and agg: each token's logprob and
    top alternatives are transformers' log-softmax on the same greedy path."""
    ids = tok.encode(PROMPTS[1])
    want = reference(ids, 8)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([ids + want])).logits[0, len(ids) - 1:-1].float()
    ref = torch.log_softmax(logits, -1)
    ref_top = ref.argsort(-1, descending=True)[:, :3]
    for daemon in (disagg, agg):
        c = daemon.client()
        r = c.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0,
                                 logprobs=3)
        lp = r.choices[0].logprobs
        assert "".join(lp.tokens) == r.choices[0].text == tok.decode(want)
        assert lp.tokens == [tok.decode([t]) for t in want]
        assert lp.text_offset == [sum(len(x) for x in lp.tokens[:i]) for i in range(8)]
        for i, t in enumerate(want):
            assert lp.token_logprobs[i] == pytest.approx(float(ref[i, t]), abs=1e-4)
            assert list(lp.top_logprobs[i]) == [tok.decode([int(a)]) for a in ref_top[i]]

        stream = c.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0,
                                      logprobs=3, stream=True)
        chunks = [ch.choices[0].logprobs for ch in stream if ch.choices[0].logprobs]
        assert sum((x.tokens for x in chunks), []) == lp.tokens
        assert sum((x.text_offset for x in chunks), []) == lp.text_offset

        messages = [{"role": "user", "content": "pipes"}]
        chat_ids = tok.encode_chat(messages)
        chat_want = reference(chat_ids, 6)
        full = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                         temperature=0, logprobs=True, top_logprobs=2)
        content = full.choices[0].logprobs.content
        assert [e.token for e in content] == [tok.decode([t]) for t in chat_want]
        assert all(bytes(e.bytes) == e.token.encode() and len(e.top_logprobs) == 2
                   for e in content)
        streamed = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                             temperature=0, logprobs=True, top_logprobs=2,
                                             stream=True)
        got = [e for ch in streamed if ch.choices and ch.choices[0].logprobs
               for e in ch.choices[0].logprobs.content]
        assert [(e.token, e.logprob) for e in got] == [(e.token, e.logprob) for e in content]


def test_echo_scores_the_prompt_like_transformers(disagg, agg, tok, tiny_model, reference):
    """What evaluation harnesses send to score text: echo, logprobs, max_tokens 0."""
    text = PROMPTS[2]
    ids = tok.encode(text)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    want = [float(ref[p, ids[p + 1]]) for p in range(len(ids) - 1)]
    complete(disagg, ids, 2)     # the prompt's blocks are in the prefix cache now
    for daemon in (disagg, agg):
        c = daemon.client()
        r = c.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True,
                                 logprobs=1, temperature=0)
        lp = r.choices[0].logprobs
        assert r.choices[0].text == text and r.usage.completion_tokens == 0
        assert lp.tokens == [tok.decode([t]) for t in ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
        assert [list(d) for d in lp.top_logprobs[1:]] == [
            [tok.decode([int(ref[p].argmax())])] for p in range(len(ids) - 1)]

        gen = reference(ids, 5)
        r = c.completions.create(model=MODEL, prompt=ids, max_tokens=5, echo=True, logprobs=0,
                                 temperature=0)
        assert r.choices[0].text == tok.decode(ids) + tok.decode(gen)
        assert len(r.choices[0].logprobs.tokens) == len(ids) + 5
        assert r.usage.completion_tokens == 5
        stream = c.completions.create(model=MODEL, prompt=ids, max_tokens=5, echo=True,
                                      temperature=0, stream=True)
        assert "".join(ch.choices[0].text for ch in stream) == r.choices[0].text


def test_stop_string_cuts_the_logprobs_where_it_ends(agg, tok, reference):
    ids = tok.encode(PROMPTS[1])
    want = reference(ids, 12)
    texts = [tok.decode([t]) for t in want]
    k = next(i for i in range(3, 12) if texts[i].strip())       # a visible token to stop on
    stop = texts[k].strip()
    cut = tok.decode(want[:k + 1])
    if stop in tok.decode(want[:k]):
        pytest.skip("the stop string occurs earlier; pick another prompt")
    r = agg.client().completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                        logprobs=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == cut[:cut.index(stop)]
    assert r.choices[0].logprobs.tokens == texts[:k + 1]


def test_n_choices_run_side_by_side_and_free_everything(disagg, tok, reference):
    ids = tok.encode(PROMPTS[1])
    c = disagg.client()
    greedy = c.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, n=3)
    assert [ch.text for ch in greedy.choices] == [tok.decode(reference(ids, 8))] * 3
    assert greedy.usage.completion_tokens == 24 and greedy.usage.prompt_tokens == len(ids)
    # A prompt no other test sends: choices 1 and 2 start after choice 0's prefill and
    # take its full blocks from the prefix cache instead of computing the prompt again.
    fresh = tok.encode("# n choices share one prefill\n" + SHARED + "\nclass Cache:\n")
    r = c.completions.create(model=MODEL, prompt=fresh, max_tokens=4, temperature=0, n=3)
    assert r.usage.prompt_tokens_details.cached_tokens == (len(fresh) - 1) // 16 * 16 > 0
    seeded = c.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=1.0,
                                  seed=21, n=4)
    texts = [ch.text for ch in seeded.choices]
    for i in (0, 2):    # choice i is what n = 1 gives with seed + i
        alone = c.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=1.0,
                                     seed=21 + i)
        assert texts[i] == alone.choices[0].text
    assert len(set(texts)) == 4
    deadline = time.monotonic() + 10
    while not idle(disagg.status()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert idle(disagg.status())


def test_fifty_concurrent_handoffs(disagg, tok, reference):
    prompts = [tok.encode(f"# task {i}\n" + "x = " * (i % 7 + 1) + str(i)) for i in range(50)]
    lengths = [6 + i % 11 for i in range(50)]
    results: dict[int, str] = {}
    errors = []

    def one(i):
        try:
            results[i] = complete(disagg, prompts[i], lengths[i]).choices[0].text
        except Exception as exc:   # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors and len(results) == 50
    for i in range(50):
        assert results[i] == tok.decode(reference(prompts[i], lengths[i])), i
    disagg.wait_for(idle, what="every block free in both workers")


def test_kill_decode_worker_holding_handed_off_kv(tiny_model, tmp_path, tok):
    d = start_daemon(tmp_path, tiny_model, "--devices", "cpu", "--engine", "torch")
    try:
        pid = d.worker("decode0")["pid"]
        stream = d.client().completions.create(
            model=MODEL, prompt=tok.encode("long story " * 20), max_tokens=3000, temperature=0,
            stream=True, extra_body={"ignore_eos": True})
        it = iter(stream)
        next(it)
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(openai.APIError):
            for _ in it:
                pass
        assert time.monotonic() - started < 15
        d.wait_for(lambda s: all(w["state"] == "ready" for w in s["workers"]),
                   what="decode worker restarted", timeout=60)
        d.wait_for(idle, what="prefill worker's blocks reclaimed")
        r = complete(d, tok.encode("Hello"), 5)
        assert r.usage.completion_tokens >= 1
    finally:
        d.stop()
