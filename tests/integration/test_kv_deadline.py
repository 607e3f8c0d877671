"""The KV handoff under overload, on real torch worker processes (exec'd as the daemon
starts them), with this test acting as the router: a decode worker that takes one sequence
at a time, so imports queue behind it, while the prefill worker keeps prefilling other
prompts into whatever blocks it has free. Every answer must equal the greedy reference
(or be a clean error); none may differ.

- past the handoff deadline, the prefill worker may reuse the blocks: the decode worker
  must not copy them (it recomputes the prompt instead);
- a prefill worker killed with -9 while imports from it are queued: the decode worker is
  told (PeerGone, as the daemon's WorkerPool.on_death sends it), and the restarted worker's
  new pool under the same name must never be read for the old handles.
"""
from __future__ import annotations

import os
import queue
import random
import signal
import time

import pytest
import torch

from appliance.engines.messages import (
    AttachPeer, Decode, Hello, KvImported, PeerGone, Prefill, PrefillDone, Release,
    RequestFailed, SamplingParams, Tokens, WorkerStats,
)
from appliance.worker.spec import WorkerSpec
from test_kv_handoff import WorkerProc

torch.set_num_threads(1)

BS = 16
N_NEW = 40
GREEDY = SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True)


def block_bytes(model_dir) -> int:
    import json
    cfg = json.loads((model_dir / "config.json").read_text())
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * BS * cfg["num_key_value_heads"] * hd * 4


def spec(model_dir, worker: str, role: str, blocks: int, **kw) -> WorkerSpec:
    return WorkerSpec(worker=worker, role=role, engine="torch", devices=["cpu"],
                      device_kind="cpu", model_dir=str(model_dir), block_size=BS,
                      kv_cache_bytes=blocks * block_bytes(model_dir), max_batch_tokens=512,
                      **kw)


def prompt(rng: random.Random, n: int) -> list[int]:
    return [0] + [rng.randrange(5, 4000) for _ in range(n - 1)]


PROMPTS = {f"r{i}": prompt(random.Random(i), n) for i, n in enumerate((40, 23, 35, 47, 30, 44))}


@pytest.fixture(scope="module")
def reference(tiny_model) -> dict[str, list[int]]:
    """The same requests on one in-process engine, aggregated, one at a time."""
    from appliance.engines.torch_engine import build_torch_engine
    agg = build_torch_engine(spec(tiny_model, "ref", "agg", 64), tiny_model)
    out: dict[str, list[int]] = {}
    for rid, p in PROMPTS.items():
        agg.add(Prefill(rid, p, GREEDY, handoff=False))
        while agg.has_work():
            for ev in agg.step():
                if isinstance(ev, Tokens):
                    out.setdefault(ev.request_id, []).extend(ev.tokens)
    return out


class Router:
    """What the daemon's router does for disaggregated requests, over raw sockets; plus
    fillers: prompts prefilled on the prefill worker and released at once, so its freed
    blocks are overwritten all the time."""

    def __init__(self, workers: dict[str, WorkerProc], events: queue.Queue):
        self.workers = workers
        self.events = events
        self.got: dict[str, list[int]] = {}
        self.failed: dict[str, RequestFailed] = {}
        self.finished: set[str] = set()
        self.imported: list[str] = []
        self.stats: dict[str, WorkerStats] = {}
        self.fillers = 0
        self.filler_rng = random.Random(99)
        self.on_import = None

    def filler(self) -> None:
        self.fillers += 1
        self.workers["prefill0"].send(Prefill(f"fill{self.fillers}",
                                              prompt(self.filler_rng, 44), GREEDY, handoff=True))

    def pump(self, until, timeout: float = 90.0, fill: bool = True) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out; got {self.got}, stats {self.stats}")
            try:
                wid, frame = self.events.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            w = self.workers.get(wid)
            if w is None:
                continue            # a killed incarnation's last words
            if frame is None:
                if w.proc.poll() is None:
                    continue        # the end of an earlier incarnation (killed) of wid
                raise AssertionError(f"{wid} died: {w.proc.stderr.read().decode()[-3000:]}")
            for ev in frame:
                if isinstance(ev, Hello):
                    w.hello = ev
                elif isinstance(ev, PrefillDone):
                    rid = ev.request_id
                    if rid.startswith("fill"):
                        self.workers["prefill0"].send(Release(rid))
                        if fill:
                            self.filler()
                        continue
                    self.got[rid] = [ev.first_token]
                    assert ev.handle is not None
                    self.workers["decode0"].send(Decode(rid, PROMPTS[rid], ev.first_token,
                                                        GREEDY, ev.handle))
                elif isinstance(ev, KvImported):
                    self.imported.append(ev.request_id)
                    self.workers["prefill0"].send(Release(ev.request_id))
                    if self.on_import:
                        self.on_import(ev)
                elif isinstance(ev, Tokens):
                    if ev.request_id.startswith("fill"):
                        continue
                    self.got[ev.request_id].extend(ev.tokens)
                    if ev.finish_reason:
                        self.finished.add(ev.request_id)
                elif isinstance(ev, RequestFailed):
                    self.failed[ev.request_id] = ev
                    self.finished.add(ev.request_id)
                elif isinstance(ev, WorkerStats):
                    self.stats[wid] = ev

    def check(self, reference: dict[str, list[int]]) -> None:
        wrong = {rid: (self.got[rid], reference[rid]) for rid in PROMPTS
                 if rid not in self.failed and self.got.get(rid) != reference[rid]}
        assert not wrong, f"answers differ from the greedy reference: {wrong}"
        for rid, ev in self.failed.items():      # a clean error, never a wrong answer
            assert ev.code and ev.message, ev


def start(workers: dict, events: queue.Queue, s: WorkerSpec) -> WorkerProc:
    workers[s.worker] = WorkerProc(s, events)
    return workers[s.worker]


def test_imports_queued_past_the_handoff_deadline_never_read_reused_blocks(tiny_model,
                                                                            reference):
    events: queue.Queue = queue.Queue()
    workers: dict[str, WorkerProc] = {}
    # The prefill pool holds the six prompts and little more: fillers must reuse blocks.
    need = sum(-(-(len(p) + 1) // BS) for p in PROMPTS.values())
    start(workers, events, spec(tiny_model, "prefill0", "prefill", need + 3,
                                handoff_timeout_s=0.2))
    start(workers, events, spec(tiny_model, "decode0", "decode", 64, max_seqs=1))
    r = Router(workers, events)
    try:
        r.pump(lambda: all(w.hello for w in workers.values()))
        workers["decode0"].send(AttachPeer("prefill0", workers["prefill0"].hello.peer_handle))
        for rid, p in PROMPTS.items():
            workers["prefill0"].send(Prefill(rid, p, GREEDY, handoff=True))
        r.filler()
        r.pump(lambda: r.finished == set(PROMPTS))
        r.check(reference)
        # The overload did happen: imports waited past the deadline and were recomputed.
        r.pump(lambda: "decode0" in r.stats and r.stats["decode0"].running == 0, fill=False)
        assert r.stats["decode0"].kv_recomputes >= 1, r.stats["decode0"]
        assert r.fillers >= 2
    finally:
        for w in workers.values():
            w.stop()


def test_prefill_worker_killed_while_imports_are_queued(tiny_model, reference):
    events: queue.Queue = queue.Queue()
    workers: dict[str, WorkerProc] = {}
    pspec = spec(tiny_model, "prefill0", "prefill", 64)
    start(workers, events, pspec)
    start(workers, events, spec(tiny_model, "decode0", "decode", 64, max_seqs=1))
    r = Router(workers, events)
    killed: list[WorkerProc] = []

    # The replacement is started ahead (a restart that beats the queue, as it does when
    # the decode queue is longer than a restart): the old handles' block ids then name
    # blocks of its new pool, which the old code imported from.
    spare = WorkerProc(pspec, queue.Queue())

    def kill_on_first_import(ev):
        if killed:
            return
        # One sequence decoding, the other imports queued behind it: the source dies now.
        old = workers.pop("prefill0")
        os.kill(old.proc.pid, signal.SIGKILL)
        old.proc.wait(30)
        killed.append(old)
        workers["decode0"].send(PeerGone("prefill0"))           # WorkerPool.on_death
        spare.events = events                                    # the restarted worker
        workers["prefill0"] = spare
        workers["decode0"].send(AttachPeer("prefill0", spare.hello.peer_handle))  # on_ready
        r.filler()          # its new pool fills with other KV at the same block ids

    try:
        r.pump(lambda: all(w.hello for w in workers.values()))
        spare_hello = spare.events.get(timeout=60)[1]
        spare.hello = next(e for e in spare_hello if isinstance(e, Hello))
        workers["decode0"].send(AttachPeer("prefill0", workers["prefill0"].hello.peer_handle))
        for rid, p in PROMPTS.items():
            workers["prefill0"].send(Prefill(rid, p, GREEDY, handoff=True))
        r.pump(lambda: len(r.got) == len(PROMPTS), fill=False)   # all handed off
        r.on_import = kill_on_first_import
        r.pump(lambda: r.finished == set(PROMPTS))
        assert killed
        r.check(reference)
        r.pump(lambda: "decode0" in r.stats and r.stats["decode0"].running == 0, fill=False)
        assert r.stats["decode0"].kv_recomputes >= 1, r.stats["decode0"]
    finally:
        for w in workers.values():
            w.stop()
        for w in killed:
            w.sock.close()
        if "prefill0" not in workers or workers["prefill0"] is not spare:
            spare.stop()


def test_peer_pools_go_from_prefill_to_decode_workers_only():
    """WorkerPool.on_ready introduces pools prefill -> decode only; on_death tells only the
    dead prefill worker's consumers (PeerGone). Links are real WorkerLinks, not started."""
    from appliance.daemon.workers import WorkerPool

    def s(worker, role):
        return WorkerSpec(worker=worker, role=role, engine="torch", devices=["cpu"],
                          device_kind="cpu", model_dir="/nonexistent")

    pool = WorkerPool([s("prefill0", "prefill"), s("prefill1", "prefill"),
                       s("decode0", "decode"), s("decode1", "decode"), s("agg0", "agg")],
                      on_iteration=lambda rec: None)
    sent: dict[str, list] = {name: [] for name in pool.workers}
    for name, link in pool.workers.items():
        link.state = "ready"
        link.hello = Hello(name, 1, link.role, "torch", False, ("cpu",), "L", BS, 64,
                           peer_handle=f"pool-{name}".encode())
        link.send = sent[name].append
    pool.on_ready(pool.workers["prefill0"])
    pool.on_ready(pool.workers["decode0"])
    got = {name: sorted(m.worker for m in msgs if isinstance(m, AttachPeer))
           for name, msgs in sent.items()}
    assert got == {"prefill0": [], "prefill1": [], "decode0": ["prefill0", "prefill0", "prefill1"],
                   "decode1": ["prefill0"], "agg0": []}
    for msgs in sent.values():
        msgs.clear()
    pool.on_death(pool.workers["prefill1"])
    pool.on_death(pool.workers["decode1"])
    gone = {name: [m.worker for m in msgs if isinstance(m, PeerGone)]
            for name, msgs in sent.items()}
    assert gone == {"prefill0": [], "prefill1": [], "decode0": ["prefill1"],
                    "decode1": ["prefill1"], "agg0": []}


def test_daemon_kill_9_of_the_prefill_worker_while_decode_imports_queue(tiny_model, tmp_path):
    """End to end: a real daemon (CPU torch workers, one sequence at a time each), six
    streaming greedy requests; once all are handed off, one is decoding and the others'
    imports queue behind it, the prefill worker is killed with -9. The daemon tells the decode
    worker (PeerGone) and restarts the prefill worker, whose new pool is attached while
    the imports still queue: every answer equals the greedy reference or is a clean
    error, none differs."""
    import threading

    import openai

    from appliance.daemon.tokenizer import ServedTokenizer
    from appliance.engines.torch_engine import build_torch_engine
    from helpers.daemons import start_daemon

    # Long answers (no early EOS): the imports queue for longer than the restart takes
    # (seconds, on a loaded machine), so the new pool is attached while they wait.
    n_new = 1000
    params = SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True)
    tok = ServedTokenizer(tiny_model)
    agg = build_torch_engine(spec(tiny_model, "ref", "agg", 256), tiny_model)
    want: dict[str, list[int]] = {}
    for rid, p in PROMPTS.items():
        agg.add(Prefill(rid, p, params, handoff=False))
        while agg.has_work():
            for ev in agg.step():
                if isinstance(ev, Tokens):
                    want.setdefault(ev.request_id, []).extend(ev.tokens)

    d = start_daemon(tmp_path, tiny_model, "--devices", "cpu", "--engine", "torch",
                     config="[engine]\nmax_seqs = 1\n[workers]\nrestart_backoff_s = 0.1\n")
    try:
        client = d.client(timeout=120)
        texts: dict[str, str] = {}
        errors: dict[str, BaseException] = {}
        chunks: dict[str, int] = {}
        started = threading.Event()

        def run(rid):
            try:
                text = ""
                for ev in client.completions.create(model="tiny-llama", prompt=PROMPTS[rid],
                                                    max_tokens=n_new, temperature=0,
                                                    stream=True,
                                                    extra_body={"ignore_eos": True}):
                    text += ev.choices[0].text
                    chunks[rid] = chunks.get(rid, 0) + 1
                    # One answer decoding, three or more handed off (their first token is
                    # out) whose imports queue behind it on the decode worker.
                    if sum(c == 1 for c in chunks.values()) >= 3 and max(chunks.values()) >= 3:
                        started.set()
                texts[rid] = text
            except (openai.APIError, openai.APIConnectionError) as exc:
                errors[rid] = exc

        victim = {w["worker"]: w["pid"] for w in d.status()["workers"]}["prefill0"]
        threads = [threading.Thread(target=run, args=(rid,)) for rid in PROMPTS]
        for t in threads:
            t.start()
        assert started.wait(60)
        os.kill(victim, signal.SIGKILL)
        queued = [rid for rid in PROMPTS if chunks.get(rid, 0) == 1]
        assert len(queued) >= 2, chunks
        for t in threads:
            t.join(150)
        assert not any(t.is_alive() for t in threads), "a request hung"
        wrong = {rid: (texts[rid], tok.decode(want[rid])) for rid in texts
                 if texts[rid] != tok.decode(want[rid])}
        assert not wrong, f"answers differ from the greedy reference: {wrong}"
        for rid, exc in errors.items():            # clean errors only (503 worker_failed)
            assert getattr(exc, "status_code", 503) == 503 or "worker" in str(exc), exc
        assert all(rid in texts for rid in queued), errors     # none of them failed
        d.wait_for(lambda s: all(w["state"] == "ready" for w in s["workers"]), timeout=90,
                   what="prefill0 restarted")
        decode = next(w for w in d.status()["workers"] if w["worker"] == "decode0")
        assert decode.get("kv_recomputes", 0) >= 1, (decode, sorted(texts), errors)
    finally:
        d.stop()
