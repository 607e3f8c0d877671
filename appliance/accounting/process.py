"""The accounting process: the `Accountant` and its ledger, beside the daemon.

Why a process of its own: the daemon's event loop is the appliance's one serial
resource. Inside it the accountant cost ~70 µs of CPU per request at 2,000 requests/s
(the window arithmetic, building rows, the ledger writer's turns at the GIL, the
collector walking seconds of retained iteration records): a 15% loss where the engine
costs nothing. Here the daemon only appends what it already has to two lists, and
writes them out every `FORWARD_S`.

What crosses the socketpair (length-prefixed pickles, `appliance.worker.wire`):
- daemon -> accounting: `Start` (first), `Records` (every worker frame that carries an
  iteration record, forwarded unopened, and the finished requests' records), `Readings`
  (the daemon's energy meter, answering `ReadMeter`), `AskStatus`, `SetBudgets`
  (a reload), `Stop`.
- accounting -> daemon: `Started` or `AccountingStartFailed`, `ReadMeter` (once per tick that
  closes windows), `Report` (every tick and for each `AskStatus`: status, per-tenant sums
  for /metrics, budgets).

Durability: when the daemon goes away, even by kill -9, its end of the socket closes;
this process then closes the last window and commits everything it was sent before it
exits. A restarted daemon's accounting process waits for it (a lock beside the ledger)
before it opens the ledger.
"""
from __future__ import annotations

import fcntl
import gc
import logging
import os
import pickle
import queue
import signal
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from appliance.accounting.accountant import GRACE_S, Accountant, FinalRow, Site
from appliance.accounting.attribution import DeviceInfo, Readings
from appliance.accounting.budgets import Budgets
from appliance.accounting.carbon import EmbodiedCarbon
from appliance.accounting.cost import PriceBook
from appliance.accounting.ledger import Ledger
from appliance.accounting.records import RequestRecord
from appliance.engines.messages import IterationRecord
from appliance.worker import wire

log = logging.getLogger("applianced.accounting")

FORWARD_S = 0.02            # the daemon writes what it gathered this often
METER_TIMEOUT_S = 10.0      # a daemon that does not answer: those windows' energy is unknown
LOCK_TIMEOUT_S = 60.0       # how long to wait for a previous accounting process's last commit
GC_EVERY_S = 60.0           # automatic collection is off (tune_gc): a full one this often
NICE = 19


@dataclass
class AccountingSpec:
    """Everything the accounting process is built from (the daemon reads the config)."""

    devices: list[DeviceInfo]
    model: str
    site: Site
    ledger_path: str
    prices: PriceBook
    embodied: EmbodiedCarbon
    budgets: Budgets
    labelled_tenants: frozenset[str]    # tenants named in /metrics; the rest are "other"
    flush_interval_s: float = 1.0
    retention_days: float = 90.0
    rollup_retention_days: float = 730.0
    retention_mb: float = 0.0
    window_s: float = 10.0
    calibration_min_iterations: int = 50
    metered: bool = True                # the daemon has an energy meter to ask
    tick_s: float = 1.0
    grace_s: float = GRACE_S
    # Set by the daemon when it restarts this process: resume at the end of the
    # ledger's last window (the daemon replays its recent records), not at now.
    resume: bool = False


@dataclass(slots=True)
class Start:
    spec: AccountingSpec


@dataclass(slots=True)
class Records:
    sent_at: float                      # every record the daemon had at this time is here
    frames: list[bytes]                 # worker frames (pickled event lists)
    requests: list[RequestRecord]


@dataclass(slots=True)
class Serving:
    """The partition or the served model changed (a workflow): which model each worker
    serves now, and the devices the plan uses (new ones are accounted from now on)."""

    workers: dict[str, str]
    devices: list[DeviceInfo]


@dataclass(slots=True)
class SetBudgets:
    """`applianced reload`: the [budgets] limits changed (usage so far is kept)."""

    budgets: Budgets


@dataclass(slots=True)
class Stop:
    pass


@dataclass(slots=True)
class Started:
    report: "Report"


@dataclass(slots=True)
class AccountingStartFailed:
    message: str


@dataclass(slots=True)
class ReadMeter:
    devices: list[str]
    spans: list[tuple[float, float]]


@dataclass(slots=True)
class TenantUsage:
    """One tenant's final figures since the last report: the /metrics counters' deltas."""

    gpu_s: list[float] = field(default_factory=lambda: [0.0, 0.0])
    joules: list[float | None] = field(default_factory=lambda: [None, None])
    cost_usage: float = 0.0
    cost_allocation: float = 0.0
    co2e_g: float = 0.0
    requests: int = 0

    def add(self, row: FinalRow) -> None:
        for i in (0, 1):
            self.gpu_s[i] += row.gpu_s[i]
            if row.joules[i] is not None:
                self.joules[i] = (self.joules[i] or 0.0) + row.joules[i]
        self.cost_usage += row.cost_usage
        self.cost_allocation += row.cost_allocation
        self.co2e_g += row.co2e_g
        self.requests += 1


@dataclass(slots=True)
class Report:
    status: dict
    tenants: dict[str, TenantUsage]
    budgets: list[dict]                 # Budgets.report(): every tenant's states and alerts
    answers: int = 0                    # the last `AskStatus.n` taken before this report


@dataclass(slots=True)
class AskStatus:
    """A report now: the admin API shows what was sent before it (e.g. `pending`)."""

    n: int


def lock_path(ledger_path: str | Path) -> Path:
    return Path(str(ledger_path) + ".lock")


def take_lock(path: Path, timeout: float = LOCK_TIMEOUT_S):
    """Hold `path` exclusively for this process's life (the kernel lets go when it ends).
    Waits while a previous accounting process finishes its last commit."""
    f = open(path, "a+")
    deadline = time.monotonic() + timeout
    said = False
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return f
        except BlockingIOError:
            if time.monotonic() > deadline:
                f.close()
                raise RuntimeError(f"another accounting process still holds {path} "
                                   f"after {timeout:g} s") from None
            if not said:
                log.warning("accounting: waiting for the previous run's accounting process "
                            "to commit its last rows (%s)", path)
                said = True
            time.sleep(0.1)


RESUME_MAX_S = 3600.0       # a ledger whose last window is older than this starts afresh


def resume_point(ledger: Ledger, devices: list[str], now: float | None = None) -> float | None:
    """Where a restarted accounting process picks up: the end of the last window the
    previous one committed for every device (the earliest device's, should a commit have
    split a tick), if it is recent. The windows it had not committed are closed again
    here from the records the daemon replays; none is counted twice (a window closed
    again replaces its row: same device, same start)."""
    now = time.time() if now is None else now
    marks = ", ".join("?" * len(devices))
    try:
        ((end,),) = ledger.query(
            f'SELECT min(e) FROM (SELECT max("end") AS e FROM device_windows '
            f'WHERE device IN ({marks}) GROUP BY device)', tuple(devices))
    except Exception:
        return None
    if end is None or not (now - RESUME_MAX_S < end <= now):
        return None
    return float(end)


class Host:
    """The accountant, fed from the socket, ticking on its own clock."""

    def __init__(self, spec: AccountingSpec, sock: socket.socket, inbox: queue.SimpleQueue):
        self.spec = spec
        self.sock = sock
        self.inbox = inbox
        self.deferred: deque = deque()      # messages that came while waiting for readings
        self.eof = False
        self.normal_nice = os.getpriority(os.PRIO_PROCESS, 0)   # the daemon's, inherited
        self._lock = take_lock(lock_path(spec.ledger_path))
        self.ledger = Ledger(Path(spec.ledger_path), spec.flush_interval_s, spec.retention_days,
                             spec.rollup_retention_days, spec.retention_mb)
        self.totals: dict[str, TenantUsage] = {}
        start = resume_point(self.ledger, [d.id for d in spec.devices]) if spec.resume else None
        self.acc = Accountant(
            spec.devices, spec.model, spec.site, self.ledger, spec.prices, spec.embodied,
            budgets=spec.budgets, read_meter=self._read_meter if spec.metered else None,
            window_s=spec.window_s, calibration_min_iterations=spec.calibration_min_iterations,
            on_final=self._final, grace_s=spec.grace_s, start=start,
            resumed=start is not None)
        self.acc.load_budgets()
        # nothing is closed until the daemon's first records (or heartbeat) are in
        self.acc.received(self.acc.attributor.started)
        self.ledger.start()
        self.records = 0
        self.frames = 0
        self.asked = 0

    def _send(self, msg) -> bool:
        try:
            self.sock.sendall(wire.pack(msg))
            return True
        except OSError:
            return False

    def _final(self, row: FinalRow) -> None:
        t = row.record.tenant
        label = t if t in self.spec.labelled_tenants else "other"
        usage = self.totals.get(label)
        if usage is None:
            usage = self.totals[label] = TenantUsage()
        usage.add(row)

    def _read_meter(self, devices: list[str], spans: list[tuple[float, float]]) -> Readings | None:
        if self.eof or not self._send(ReadMeter(devices, spans)):
            return None
        deadline = time.monotonic() + METER_TIMEOUT_S
        while True:
            try:
                msg = self.inbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                log.warning("accounting: the daemon did not answer for energy readings in "
                            "%g s; those windows' energy is not measured", METER_TIMEOUT_S)
                return None
            if isinstance(msg, Readings):
                return msg
            self.deferred.append(msg)
            if msg is None:                 # the daemon is gone
                self.eof = True
                return None

    def _take(self, msg: Records) -> None:
        acc = self.acc
        for body in msg.frames:
            for ev in pickle.loads(body):
                if type(ev) is IterationRecord:
                    acc.iteration(ev)
        for rec in msg.requests:
            acc.request(rec)
        self.frames += len(msg.frames)
        self.records += len(msg.requests)
        # after the rows are queued: a batch taken from now on holds them
        self.ledger.received_until = msg.sent_at
        acc.received(msg.sent_at)

    def status(self) -> dict:
        s = self.acc.status()
        s["process"] = {"pid": os.getpid(), "cpu_s": time.process_time(),
                        "frames": self.frames, "requests": self.records}
        return s

    def report(self) -> Report:
        totals, self.totals = self.totals, {}
        budgets = self.acc.budgets.report() if self.acc.budgets is not None else []
        return Report(self.status(), totals, budgets, self.asked)

    def serve(self) -> int:
        tick_s = self.spec.tick_s
        next_tick = time.monotonic() + tick_s
        next_gc = time.monotonic() + GC_EVERY_S
        while True:
            if self.deferred:
                msg = self.deferred.popleft()
            else:
                try:
                    msg = self.inbox.get(timeout=max(0.0, next_tick - time.monotonic()))
                except queue.Empty:
                    msg = ()
            if msg is None:
                self.eof = True
                break
            if isinstance(msg, Stop):
                break
            if isinstance(msg, Records):
                self._take(msg)
            elif isinstance(msg, Serving):
                self.acc.attributor.serve(msg.workers, msg.devices)
            elif isinstance(msg, AskStatus):
                self.asked = msg.n
                self._send(self.report())
            elif isinstance(msg, SetBudgets):
                self.acc.set_budgets(msg.budgets)
                self._send(self.report())
            if time.monotonic() >= next_tick:
                try:
                    self.acc.tick()
                except Exception:           # a bad window must not end the ledger
                    log.exception("accounting tick failed")
                self._send(self.report())
                next_tick = max(next_tick + tick_s, time.monotonic())
                if time.monotonic() >= next_gc:
                    gc.collect()
                    next_gc = time.monotonic() + GC_EVERY_S
        # Stop, or the daemon is gone: the last partial window, every finished request's
        # final row, one commit (its energy read from the daemon while it still answers).
        back_to_normal_priority(self.normal_nice)
        self.acc.stop()
        if not self.eof:
            self._send(self.report())
        return 0


def set_priority(nice: int) -> bool:
    """Every thread of this process at `nice` (on Linux a nice value is a thread's own:
    a process-wide call would leave the reader and the ledger writer where they were).
    False when the system refuses (a lower value than now needs CAP_SYS_NICE or
    RLIMIT_NICE, which the systemd unit grants down to 0: LimitNICE=+0)."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    ok = True
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:
            pass                        # a thread that ended meanwhile
        except OSError:
            ok = False
    return ok


def lower_priority() -> None:
    """Serving first: once started, this process runs at nice 19, on what the daemon
    and the workers leave. Under CPU saturation its input waits in the socket and it
    catches up when load eases; on a GPU box CPU is rarely short. Not before it has
    started: a daemon starting up waits for it (the ledger's lock, then `Started`), and
    at nice 19 beside busy processes that wait measured up to a minute (two nice-0 busy
    loops on 2 cores, kill -9 to the restarted daemon's ready: 7-62 s, 6-10 s now)."""
    set_priority(NICE)


def back_to_normal_priority(normal: int) -> None:
    """Serving is over (the daemon stops, or it is gone): nothing is served to yield to,
    and someone waits for this process's last commit, the stopping daemon (then it is
    killed, its last batch lost) or a restarted one (the ledger's lock). It finishes at
    the daemon's priority where the system lets it (root, or the unit's LimitNICE=+0)."""
    if not set_priority(normal):
        log.warning("accounting: finishing the last commit at nice %d (not allowed back to "
                    "%d: see LimitNICE= in the systemd unit)",
                    os.getpriority(os.PRIO_PROCESS, 0), normal)


def tune_gc() -> None:
    """No automatic collection here: the accountant holds a window's iteration records
    (seconds of them) and every open request's charge, and at 2,000 requests/s the young
    generation's collections walked them for ~17 µs of CPU per request, a third of this
    process's work. What it builds (records, dicts, tuples of numbers) holds no cycles,
    so reference counting frees it; `Host.serve` runs one full collection a minute for
    whatever cycle an exception or a library leaves."""
    gc.collect()
    gc.freeze()
    gc.disable()


def _reader(sock: socket.socket, inbox: queue.SimpleQueue) -> None:
    while True:
        try:
            msg = wire.recv(sock)
        except (OSError, EOFError, pickle.UnpicklingError):
            msg = None
        inbox.put(msg)
        if msg is None:
            return


def run(fd: int) -> int:
    """`applianced accountant --fd N`: started by the daemon, ends on Stop or when the
    daemon's end of the socket closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # the daemon decides when we stop
    logging.basicConfig(level=os.environ.get("APPLIANCED_LOG", "INFO"), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.set_inheritable(fd, False)
    sock = socket.socket(fileno=fd)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_reader, args=(sock, inbox), name="accounting-reader",
                     daemon=True).start()
    first = inbox.get()
    if not isinstance(first, Start):
        return 2
    try:
        host = Host(first.spec, sock, inbox)
    except Exception as exc:    # an unusable ledger, a lock held too long: one line
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        try:
            sock.sendall(wire.pack(AccountingStartFailed(message)))
        except OSError:
            pass
        return 3
    tune_gc()
    if not host._send(Started(host.report())):
        host.eof = True
    lower_priority()
    return host.serve()
