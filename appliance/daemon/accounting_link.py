"""Connects the accounting package to the running daemon: builds the accounting spec from
the config and the partition plan, starts the accounting process
(`appliance.accounting.process`, why a process is said there), forwards it the records
the daemon gets anyway, answers its energy questions from the telemetry hub, and feeds
the tenant series of /metrics and the budgets of the usage API from its reports.

The energy meter is the telemetry hub (`appliance.telemetry.hub.Telemetry`, an
`accounting.attribution.EnergyReader`) when the daemon has one; without it energy is
"not measured" and GPU-seconds, cost and embodied carbon still add up.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from appliance.accounting.accountant import Site
from appliance.accounting.allocation import Method
from appliance.accounting.attribution import DeviceInfo, EnergyReader, take_readings
from appliance.accounting.budgets import Budgets
from appliance.accounting.carbon import CarbonIntensity, EmbodiedCarbon
from appliance.accounting.cost import PriceBook, RateCard
from appliance.accounting.ledger import LedgerReader
from appliance.accounting.reconcile import SAMPLE_S, Counters, reconcile
from appliance.accounting.process import (
    FORWARD_S, LOCK_TIMEOUT_S, AccountingSpec, AccountingStartFailed, AskStatus, ReadMeter,
    Records, Report, Serving, SetBudgets, Start, Started, Stop,
)
from appliance.accounting.records import FanoutSink, LogSink, RecordSink, RequestRecord
from appliance.config import BudgetsConfig, Config
from appliance.daemon import supervisor
from appliance.daemon.metrics import ReconciliationGauge, TenantMetrics
from appliance.daemon.supervisor import program_command
from appliance.engines.messages import IterationRecord
from appliance.telemetry.status import metric_values
from appliance.worker import wire

if TYPE_CHECKING:
    from appliance.daemon.metrics import Metrics
    from appliance.daemon.setup import Setup
    from appliance.daemon.state import ServingState
    from appliance.daemon.workers import WorkerPool
    from appliance.telemetry.hub import Telemetry

log = logging.getLogger("applianced.accounting")

LEDGER_FILE = "ledger.db"      # shared with the planner's trend tables (own tables, own connection)
START_TIMEOUT_S = LOCK_TIMEOUT_S + 60.0
STOP_TIMEOUT_S = 60.0
STATUS_TIMEOUT_S = 2.0         # a busy accounting process: the last tick's report instead
# While the accounting process is down (it died; it is being restarted) records wait
# in the daemon, up to this many of each kind; beyond, the oldest are dropped and counted.
BUFFER_MAX = 500_000
RESTART_DELAY_S = 0.5           # then doubling, up to
RESTART_DELAY_MAX_S = 30.0
GAUGE_SPAN_S = 300.0           # the reconciliation gauge looks at the last 5 minutes
GAUGE_EVERY_S = 10.0


def device_infos(setup: Setup, plan=None) -> list[DeviceInfo]:
    """The devices the plan uses, each with as many slots as workers run on it."""
    slots: dict[str, int] = {}
    for slot in (plan or setup.plan).workers():
        for d in slot.devices:
            slots[d] = slots.get(d, 0) + 1
    out = []
    for d in setup.inventory.devices:
        if d.id not in slots:
            continue
        model = d.spec.name if d.spec is not None else ("cpu" if d.kind == "cpu" else d.name)
        out.append(DeviceInfo(d.id, model, d.kind, d.simulated, slots[d.id],
                              d.spec.idle_w if d.spec is not None else None))
    return out


def site_of(cfg: Config) -> Site:
    s = cfg.site
    if s.carbon_intensity_file:
        intensity = CarbonIntensity.from_file(Path(s.carbon_intensity_file).expanduser(),
                                              s.carbon_intensity_kind)
    else:
        intensity = CarbonIntensity(s.carbon_intensity, s.carbon_intensity_kind)
    return Site(s.name, s.appliance or socket.gethostname(), s.region, s.pue, intensity)


def prices_of(cfg: Config) -> PriceBook:
    a = cfg.accounting
    return PriceBook(a.usd_per_gpu_hour, a.usd_per_kwh, a.idle_policy, a.currency,
                     [RateCard(c["effective"], c["per_device_hour"], c["per_kwh"])
                      for c in a.rate_cards])


def method_of(cfg: Config, site: Site, prices: PriceBook, embodied: EmbodiedCarbon) -> Method:
    """What the usage and carbon reports price and count with (query time)."""
    s = cfg.site
    return Method(prices, embodied, site.pue, site.intensity,
                  None if s.carbon_intensity_market < 0 else s.carbon_intensity_market,
                  s.node_overhead_w, dict(cfg.auth.tenant_tags))


class AccountingLink:
    """The daemon's end of the accounting process, behind the record sink seam.

    On the event loop per request: one list append (`request`), and per worker frame
    that holds iteration records one more (`frame`); every FORWARD_S one pickle and one
    write. What the admin API reads: `ledger` (a read connection), `site`, `prices`,
    `status()`, `budget_report()`."""

    def __init__(self, spec: AccountingSpec, meter: Callable[[], EnergyReader | None],
                 metrics: TenantMetrics, state_dir: Path,
                 busy_device_s: Callable[[], float] | None = None,
                 energy_counters: Callable[[], list[tuple[str, float, float]]] | None = None,
                 gauge: ReconciliationGauge | None = None,
                 serving: Callable[[], tuple] | None = None):
        self.spec = spec
        self.site = spec.site
        self.prices = spec.prices
        self.method: Method | None = None       # set by start_accounting: the reports' pricing
        self.meter = meter
        self.metrics = metrics
        self.state_dir = state_dir
        self.ledger: LedgerReader | None = None
        self.report_timeout_s = 30.0        # [accounting] report_timeout_s (LedgerReader)
        self.proc: asyncio.subprocess.Process | None = None
        self.writer: asyncio.StreamWriter | None = None
        self._frames: list[bytes] = []
        self._requests: list[RequestRecord] = []
        self._status: dict = {}
        self._budgets: list[dict] = []
        self._budgets_of: dict[str, list[dict]] = {}   # by tenant: admission looks one up
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._exited = asyncio.Event()
        self.restarts = 0
        self.dropped = 0
        self.last_exit: str | None = None
        self._asked = 0
        self._answered: dict[int, asyncio.Future] = {}
        # What was sent lately, replayed to a restarted process: it resumes where the
        # ledger's committed windows end, so the windows the dead one had open are
        # closed again from these (replayed records it had accounted are dropped).
        self._recent: deque[tuple[float, Records]] = deque()
        self.replay_s = 2 * (spec.window_s + spec.grace_s + spec.tick_s
                             + spec.flush_interval_s) + 5.0
        # Reconciliation: the daemon's own counters, sampled (accounting/reconcile.py).
        self.counters = Counters()
        self.busy_device_s = busy_device_s
        self.energy_counters = energy_counters
        self.gauge = gauge
        # A window is in the ledger once it is closed (window + grace + a tick) and
        # committed (a flush); a second's margin.
        self.lag_s = spec.window_s + spec.grace_s + spec.tick_s + spec.flush_interval_s + 1.0
        # (signature, build Serving): what the workers serve, watched every FORWARD_S
        self.serving = serving
        self._served: tuple | None = None
        self._serving_msg: Serving | None = None

    # ---- RecordSink + frame tap (event loop, hot path) --------------------------
    def request(self, rec: RequestRecord) -> None:
        self._requests.append(rec)

    def iteration(self, rec: IterationRecord) -> None:
        pass                    # they travel inside their frames (`frame`)

    def frame(self, body: bytes) -> None:
        self._frames.append(body)

    # ---- lifecycle ------------------------------------------------------------------
    async def start(self) -> None:
        """Start the process and wait until it has opened the ledger. Raises ValueError
        with one line when it cannot."""
        self.proc, reader, writer = await supervisor.spawn(
            lambda fd: program_command() + ["accountant", "--fd", str(fd)])
        writer.write(wire.pack(Start(dataclasses.replace(self.spec, resume=self.restarts > 0))))
        if self._serving_msg is not None:
            writer.write(wire.pack(self._serving_msg))
        if self.restarts:
            # before anything new can be sent (no await in between): the process reads
            # the replay right after Start, in the order it was first sent
            for _, msg in self._recent:
                writer.write(wire.pack(msg))
        self.writer = writer
        first = await supervisor.first_message(reader, START_TIMEOUT_S)
        if not isinstance(first, Started):
            self.writer.close()
            await supervisor.reap(self.proc)
            why = first.message if isinstance(first, AccountingStartFailed) else (
                f"it exited ({self.proc.returncode})" if self.proc.returncode is not None
                else "it did not answer")
            raise ValueError(f"cannot start accounting on the ledger "
                             f"{self.state_dir / LEDGER_FILE}: {why}")
        self._apply(first.report)
        self._exited.clear()
        if self.ledger is None:
            self.ledger = LedgerReader(self.state_dir / LEDGER_FILE, self.report_timeout_s)
        loop_tasks = [asyncio.create_task(self._read(reader), name="accounting-read")]
        if not self._tasks:
            loop_tasks.append(asyncio.create_task(self._forward(), name="accounting-forward"))
            loop_tasks.append(asyncio.create_task(self._sample(), name="accounting-counters"))
        self._tasks = [t for t in self._tasks if not t.done()] + loop_tasks

    async def stop(self) -> None:
        """Send what is left, let the process close its last window and commit (it may
        still read energy from us meanwhile), then wait for it."""
        self._stopping = True
        self._send_records()
        if self.writer is not None and not self.writer.is_closing():
            self.writer.write(wire.pack(Stop()))
        if self.proc is not None and self.proc.returncode is None:
            try:
                await asyncio.wait_for(self._exited.wait(), STOP_TIMEOUT_S)
                await asyncio.wait_for(self.proc.wait(), 5)
            except asyncio.TimeoutError:
                log.error("accounting: the process did not finish in %g s; killing it "
                          "(its last batch may be lost)", STOP_TIMEOUT_S)
                self.proc.kill()
                await self.proc.wait()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.ledger is not None:
            self.ledger.close()

    # ---- traffic ----------------------------------------------------------------------
    async def _forward(self) -> None:
        last = 0.0
        while True:
            await asyncio.sleep(FORWARD_S)
            now = time.monotonic()
            # a heartbeat once a second even when idle: the ledger's covered_until moves on
            if self._frames or self._requests or now - last >= 1.0:
                if self._send_records():
                    last = now

    def _send_records(self) -> bool:
        w = self.writer
        if w is None or w.is_closing():
            self._cap()
            return False
        if self.serving is not None:
            signature, build = self.serving()
            if signature != self._served:
                # records of the old set-up go first, then the change
                self._served = signature
                if self._serving_msg is not None or self._frames:
                    self._flush(w)
                self._serving_msg = build()
                w.write(wire.pack(self._serving_msg))
        return self._flush(w)

    def _flush(self, w) -> bool:
        frames, self._frames = self._frames, []
        requests, self._requests = self._requests, []
        msg = Records(time.time(), frames, requests)
        w.write(wire.pack(msg))
        recent = self._recent
        if frames or requests:
            recent.append((msg.sent_at, msg))
        while recent and recent[0][0] < msg.sent_at - self.replay_s:
            recent.popleft()
        return True

    def _cap(self) -> None:
        for buf in (self._frames, self._requests):
            if len(buf) > BUFFER_MAX:
                self.dropped += len(buf) - BUFFER_MAX
                del buf[:len(buf) - BUFFER_MAX]

    async def _read(self, reader: asyncio.StreamReader) -> None:
        while True:
            msg = await wire.recv_async(reader)
            if msg is None:
                break
            if isinstance(msg, ReadMeter):
                readings = take_readings(self.meter(), msg.devices, msg.spans)
                if self.writer is not None and not self.writer.is_closing():
                    self.writer.write(wire.pack(readings))
            elif isinstance(msg, Report):
                self._apply(msg)
        await self._ended()

    def _apply(self, report: Report) -> None:
        for n in [n for n in self._answered if n <= report.answers]:
            fut = self._answered.pop(n)
            if not fut.done():
                fut.set_result(None)
        self._status = report.status
        self._budgets = report.budgets
        by_tenant: dict[str, list[dict]] = {}
        for b in report.budgets:
            by_tenant.setdefault(b["tenant"], []).append(b)
        self._budgets_of = by_tenant
        for tenant, usage in report.tenants.items():
            self.metrics.add(tenant, usage)
        for b in report.budgets:
            self.metrics.budget(b["tenant"], b["budget"], b["used_ratio"])

    async def _ended(self) -> None:
        proc = self.proc
        if self.writer is not None:
            self.writer.close()
        self.writer = None
        self.last_exit = await supervisor.reap(proc)
        self._exited.set()
        if self._stopping:
            return
        log.error("accounting: the process ended (%s); restarting it (records wait here)",
                  self.last_exit)

        def attempt() -> None:
            self.restarts += 1

        await supervisor.restart(self.start, delay=RESTART_DELAY_S, max_delay=RESTART_DELAY_MAX_S,
                                 stopping=lambda: self._stopping, failures=(ValueError, OSError),
                                 on_failure=lambda exc: log.error("accounting: %s", exc),
                                 on_attempt=attempt)

    # ---- reconciliation ----------------------------------------------------------------
    def sample_counters(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        if self.busy_device_s is not None:
            self.counters.sample_busy(now, self.busy_device_s())
        if self.energy_counters is not None:
            for device, t, joules in self.energy_counters():
                self.counters.sample_energy(device, t, joules)

    def reconciliation(self, since: float, until: float, now: float | None = None):
        """Ledger vs the daemon's counters over [since, until) (runs SQL: call it off
        the event loop)."""
        now = time.time() if now is None else now
        return reconcile(self.ledger.query, self.counters, [d.id for d in self.spec.devices],
                         since, until, now, self.lag_s)

    async def _sample(self) -> None:
        next_gauge = time.monotonic() + GAUGE_EVERY_S
        while True:
            try:
                self.sample_counters()
                if self.gauge is not None and self.ledger is not None \
                        and time.monotonic() >= next_gauge:
                    next_gauge = time.monotonic() + GAUGE_EVERY_S
                    now = time.time()
                    r = await asyncio.to_thread(self.reconciliation, now - GAUGE_SPAN_S, now, now)
                    j = r.as_json()
                    self.gauge.set(j["gpu_seconds"]["gap"], j["energy_joules"]["gap"])
            except Exception:       # a bad sample must not end the sampling
                log.exception("accounting: reconciliation sampling failed")
            await asyncio.sleep(SAMPLE_S)

    # ---- what the admin API reads ---------------------------------------------------
    async def fresh_status(self) -> dict:
        """`status()` as of now: what was sent before this call is counted (a report
        ticks only once a second)."""
        if self._send_records():
            self._asked += 1
            fut = self._answered[self._asked] = asyncio.get_running_loop().create_future()
            self.writer.write(wire.pack(AskStatus(self._asked)))
            try:
                await asyncio.wait_for(fut, STATUS_TIMEOUT_S)
            except asyncio.TimeoutError:
                self._answered.pop(self._asked, None)
        return self.status()

    def status(self) -> dict:
        s = dict(self._status)
        s["link"] = {"state": "running" if self.writer is not None else "down",
                     "pid": self.proc.pid if self.proc and self.proc.returncode is None else None,
                     "restarts": self.restarts, "last_exit": self.last_exit,
                     "dropped_records": self.dropped, "forward_s": FORWARD_S}
        return s

    def budget_report(self, tenant: str | None = None) -> list[dict]:
        if tenant is not None:      # per request (enforced budgets): one look-up
            return self._budgets_of.get(tenant, [])
        return list(self._budgets)

    def set_budgets(self, cfg: BudgetsConfig) -> None:
        """A reload: the accounting process counts against the new limits from now on
        (and a restarted one starts with them)."""
        budgets = budgets_of(cfg)
        self.spec = dataclasses.replace(
            self.spec, budgets=budgets,
            labelled_tenants=frozenset(self.spec.labelled_tenants | budgets.tenants()))
        if self.writer is not None and not self.writer.is_closing():
            self.writer.write(wire.pack(SetBudgets(budgets)))


def budgets_of(b: BudgetsConfig) -> Budgets:
    return Budgets(b.period, {"gpu_hours": b.gpu_hours, "usd": b.usd, "kgco2e": b.kgco2e})


def serving_of(setup: Setup, state: ServingState, pool: WorkerPool) -> Callable[[], tuple]:
    """(signature, build): the signature changes when the plan, the served model or a
    worker's loaded model does; build() says which model each worker serves and which
    devices the plan uses. A worker loaded with a model not yet routed (the first half
    of a swap) is named after its model spec or directory until routing switches."""
    names: dict[tuple, str] = {}

    def now() -> tuple:
        loads = tuple(sorted((w.id, (str(w.spec.model_dir), w.spec.model_spec or None))
                             for w in list(pool.workers.values())))
        signature = (id(state.plan), state.model.name, loads)

        def build() -> Serving:
            served = state.model
            names[(str(served.model_dir), served.model_spec or None)] = served.name
            workers = {wid: names.get(ld) or ld[1] or Path(ld[0]).name for wid, ld in loads}
            return Serving(workers, device_infos(setup, state.plan))
        return signature, build
    return now


def busy_counter(metrics: Metrics, pool: WorkerPool) -> Callable[[], float]:
    """Σ over workers of `applianced_engine_busy_seconds_total` × the worker's devices:
    device-seconds inside engine iterations, as /metrics counts them."""
    ndev: dict[str, int] = {}

    def read() -> float:
        total = 0.0
        for metric in metrics.busy.collect():
            for sample in metric.samples:
                if not sample.name.endswith("_total"):
                    continue
                worker = sample.labels["worker"]
                w = pool.workers.get(worker)
                if w is not None:
                    ndev[worker] = len(w.spec.devices)
                total += sample.value * ndev.get(worker, 1)
        return total
    return read


def energy_counter(telemetry: Telemetry | None) -> Callable[[], list[tuple[str, float, float]]]:
    """Each device's cumulative energy reading (`applianced_device_energy_joules_total`)
    with the time it was read."""
    def read() -> list[tuple[str, float, float]]:
        if telemetry is None:
            return []
        return [(d["device"], d["t"], d["energy_j"]) for d in metric_values(telemetry)["devices"]
                if d.get("energy_j") is not None and d.get("t") is not None]
    return read


async def start_accounting(cfg: Config, setup: Setup, state: ServingState, pool: WorkerPool,
                           tenants: set[str], metrics: Metrics, telemetry: Telemetry | None,
                           state_dir: Path) -> AccountingLink | None:
    """Start the accounting process (None when accounting is off). Raises ValueError
    with one line (a bad intensity file, an unusable ledger) before any worker starts;
    the caller puts the link behind the daemon's record sink and frame tap."""
    if not cfg.accounting.enabled:
        return None
    a = cfg.accounting
    site = site_of(cfg)
    budgets = budgets_of(cfg.budgets)
    prices = prices_of(cfg)
    embodied = EmbodiedCarbon(cfg.site.embodied_kgco2e, cfg.site.lifetime_years)
    spec = AccountingSpec(
        devices=device_infos(setup), model=state.model.name, site=site,
        ledger_path=str(state_dir / LEDGER_FILE), prices=prices, embodied=embodied,
        budgets=budgets, labelled_tenants=frozenset(set(tenants) | budgets.tenants()),
        flush_interval_s=a.flush_interval_s, retention_days=a.retention_days,
        rollup_retention_days=a.rollup_retention_days, retention_mb=a.retention_mb,
        window_s=a.window_s,
        calibration_min_iterations=a.calibration_min_iterations,
        metered=telemetry is not None)
    link = AccountingLink(spec, lambda: telemetry, TenantMetrics(metrics.registry, setup.simulated),
                          state_dir, busy_device_s=busy_counter(metrics, pool),
                          energy_counters=energy_counter(telemetry),
                          gauge=ReconciliationGauge(metrics.registry, setup.simulated),
                          serving=serving_of(setup, state, pool))
    link.method = method_of(cfg, site, prices, embodied)
    link.report_timeout_s = a.report_timeout_s
    try:
        await link.start()
    except OSError as exc:
        raise ValueError(f"cannot start accounting: {exc}") from None
    log.info("accounting: ledger %s, %g s windows, site %s (PUE %g, intensity %s), "
             "process pid %s", state_dir / LEDGER_FILE, a.window_s, site.name, site.pue,
             cfg.site.carbon_intensity_file or f"{cfg.site.carbon_intensity:g} g/kWh static",
             link.proc.pid)
    return link


def record_sink(base: RecordSink, link: AccountingLink | None) -> RecordSink:
    """Where finished requests and iterations go: the ledger's link, beside the request
    log of --log-requests if that is on."""
    if link is None:
        return base
    log_off = isinstance(base, LogSink) and not base.enabled
    return link if log_off else FanoutSink(base, link)
