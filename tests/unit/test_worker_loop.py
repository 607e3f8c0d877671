"""The worker loop itself (in this process, over a real socket pair): a request that makes
the engine raise is refused on its own, and the worker keeps serving the others."""
from __future__ import annotations

import socket
import threading

from appliance.engines.messages import (
    Hello, Prefill, RequestFailed, SamplingParams, Shutdown, Tokens,
)
from appliance.worker import engine_factory, main, wire
from appliance.worker.spec import WorkerSpec


def test_an_engine_that_raises_on_one_request_keeps_serving(tiny_model, monkeypatch):
    real_build = engine_factory.build_engine

    def build(spec):
        engine = real_build(spec)
        add = engine.add

        def add_or_raise(msg, received=None):
            if msg.request_id == "poison":
                raise KeyError("an engine bug")
            return add(msg, received)

        engine.add = add_or_raise
        return engine

    monkeypatch.setattr(engine_factory, "build_engine", build)
    spec = WorkerSpec(worker="agg0", role="agg", engine="sim", devices=["cpu"],
                      device_kind="cpu", model_dir=str(tiny_model), sim_speed=1000.0)
    ours, theirs = socket.socketpair()
    events: list = []

    def daemon_side():
        params = SamplingParams(max_tokens=3, seed=1, ignore_eos=True)
        ours.sendall(wire.pack([Prefill("poison", [0, 5, 6], params, False),
                                Prefill("fine", [0, 5, 6], params, False)]))
        done = False
        while not done:
            for ev in wire.recv(ours):
                events.append(ev)
                done = done or (isinstance(ev, Tokens) and ev.finish_reason is not None)
        ours.sendall(wire.pack([Shutdown()]))

    t = threading.Thread(target=daemon_side)
    t.start()
    code = main.run(theirs.detach(), spec)     # signal handlers need the main thread
    t.join(timeout=30)
    assert code == 0
    assert isinstance(events[0], Hello)
    (failed,) = [e for e in events if isinstance(e, RequestFailed)]
    assert failed.request_id == "poison" and "KeyError" in failed.message
    assert sum(len(e.tokens) for e in events
               if isinstance(e, Tokens) and e.request_id == "fine") == 3
