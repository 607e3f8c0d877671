"""The worker wire: every message pickles as (class, field values) and comes back equal;
a worker's iteration records travel in a frame of their own after its other events."""
from __future__ import annotations

import dataclasses
import inspect
import pickle
import socket

from appliance.accounting.records import RequestRecord
from appliance.engines import messages
from appliance.engines.messages import IterationRecord, Tokens, WorkerStats
from appliance.worker import wire
from appliance.worker.main import HeldRecords, frames

WIRE_CLASSES = [c for _, c in inspect.getmembers(messages, inspect.isclass)
                if dataclasses.is_dataclass(c) and c.__module__ == messages.__name__] + [RequestRecord]


def test_every_message_round_trips_by_its_fields():
    assert len(WIRE_CLASSES) >= 16
    for cls in WIRE_CLASSES:
        fields = dataclasses.fields(cls)
        values = {f.name: (f"{cls.__name__}.{f.name}", i) for i, f in enumerate(fields)}
        obj = cls(**values)
        assert "__reduce__" in cls.__dict__, f"{cls.__name__} pickles through dataclasses' getstate"
        back = pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        assert type(back) is cls and back == obj
        assert [getattr(back, f.name) for f in fields] == [values[f.name] for f in fields]


def test_iteration_records_travel_in_a_frame_of_their_own():
    rec = IterationRecord("d0", "decode", 1.0, 0.01, ("cpu0",), True, [("r1", 1, 9), ("r2", 1, 4)])
    toks = [Tokens("r1", [5]), Tokens("r2", [7], "stop")]
    stats = WorkerStats("d0", 0, 2, 0, 10, 8, 0, 3, 0.5, 0, 0)
    a, b = socket.socketpair()
    try:
        for events, records, want in (([*toks, stats], [rec], [[*toks, stats], [rec]]),
                                      ([], [rec, rec], [[rec, rec]]),
                                      (toks, [], [toks])):
            a.sendall(frames(events, records))
            got = [wire.recv(b) for _ in want]
            assert got == want
            b.setblocking(False)        # nothing more was sent
            try:
                assert b.recv(1) == b""
                raise AssertionError("an extra frame")
            except BlockingIOError:
                pass
            b.setblocking(True)
    finally:
        a.close()
        b.close()


def test_held_records_go_out_together_and_name_each_request_once():
    """Steps' records wait for the stats; in one frame a request id decoding in every
    step is pickled once (the frame of 16 steps is far smaller than 16 frames)."""
    held = HeldRecords()
    ids = [f"chatcmpl-{i:024x}" for i in range(32)]
    steps = [IterationRecord("d0", "decode", float(k), 0.01, ("cpu0",), True,
                             [(r, 1, 100 + k) for r in ids]) for k in range(16)]
    toks = Tokens(ids[0], [5])
    for rec in steps:
        assert held.split([toks, rec]) == [toks]
    assert held.split([toks]) == [toks]
    together = held.take()
    assert together == steps and held.take() == []
    one_frame = len(frames([], together))
    apart = sum(len(frames([], [rec])) for rec in steps)
    assert one_frame < apart / 2, (one_frame, apart)
    back = pickle.loads(frames([], together)[wire.HEADER.size:])
    assert back == steps
    assert back[0].entries[0][0] is back[1].entries[0][0]      # one str per request id
