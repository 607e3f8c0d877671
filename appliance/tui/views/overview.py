"""The overview screen's model: devices, groups and workers from `/admin/v1/status`,
the history behind its sparklines, and the plain text `applianced status` prints.

Computed from the daemon's JSON and nothing else; no Textual, no HTTP."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable

from appliance.tui.views.peers import ClusterView, PeerRates, cluster_from_status, peer_lines
from appliance.tui.format import (
    NA, WINDOW, WORKER_STATES, as_dict, as_int, as_list, bar, fmt_duration, fmt_mem,
    fmt_num, fmt_pct, fmt_ratio, fmt_seconds, num, sparkline, text, windowed,
)


@dataclass(frozen=True, slots=True)
class DeviceView:
    id: str
    name: str
    group: str                        # prefill | decode | agg | unassigned
    worker: str | None
    util: float | None
    power_w: float | None
    mem_used: float | None
    mem_total: float | None
    busy: float | None                # busy fraction over WINDOW
    simulated: bool
    source: str | None                # measured | estimated | simulated


@dataclass(frozen=True, slots=True)
class GroupView:
    name: str
    devices: tuple[DeviceView, ...]
    workers: int
    busy: float | None
    tokens_per_s: float | None
    power_w: float | None
    waiting: int | None
    running: int | None
    queued_prefill_tokens: int | None


@dataclass(frozen=True, slots=True)
class WorkerRow:
    worker: str
    role: str
    state: str                        # up | restarting | down (or the daemon's own word)
    restarts: int | None
    pid: int | None
    devices: str = ""                 # "sim0" or "cpu0 cores 0-3"
    kv_free: int | None = None
    kv_total: int | None = None
    running: int | None = None
    waiting: int | None = None


def core_ranges(cores: list[int]) -> str:
    """[0, 1, 2, 3, 8] -> '0-3,8' (how taskset and cpusets write them)."""
    runs: list[list[int]] = []
    for c in sorted(cores):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _worker_devices(w: dict) -> str:
    devices = ",".join(str(d) for d in as_list(w.get("devices")))
    cores = [c for c in as_list(w.get("cpu_cores")) if isinstance(c, int)]
    if cores:
        devices += f" cores {core_ranges(cores)}"
    return devices


@dataclass(frozen=True, slots=True)
class Overview:
    version: str
    site: str
    appliance: str
    model: str
    engine: str
    mode: str
    ready: bool | None
    draining: bool | None
    inflight: int | None
    uptime_s: float | None
    simulated: bool
    estimated: bool
    ratio_gpu: float | None
    ratio_energy: float | None
    ratio_activity: float | None
    ratio_window: str
    ratio_history: tuple[float, ...]
    requests_per_s: float | None
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    groups: tuple[GroupView, ...]
    workers: tuple[WorkerRow, ...]
    cluster: ClusterView | None = None   # the Peers panel; None: a single box
    # requests waiting at the router before their prefill (a worker with room, or the
    # decode side's: engine.decode_max_seqs / decode_kv_gate); None: not reported
    held: int | None = None

    def group(self, name: str) -> GroupView | None:
        return next((g for g in self.groups if g.name == name), None)

    @property
    def devices(self) -> tuple[DeviceView, ...]:
        return tuple(d for g in self.groups for d in g.devices)


def _plan_assignments(plan: dict) -> dict[str, tuple[str, str]]:
    """device id -> (group, worker) from the partition plan."""
    out: dict[str, tuple[str, str]] = {}
    for group in ("prefill", "decode", "agg"):
        for w in as_list(plan.get(group)):
            w = as_dict(w)
            for dev in as_list(w.get("devices")):
                out[str(dev)] = (group, text(w.get("worker"), ""))
    return out


def _sum_ints(values: Iterable[Any]) -> int | None:
    got = [v for v in (as_int(x) for x in values) if v is not None]
    return sum(got) if got else None


def overview_from_status(status: dict, history: "History | None" = None) -> Overview:
    """Read one `/admin/v1/status` snapshot (any subset of the contract's keys)."""
    status = as_dict(status)
    plan = as_dict(status.get("plan"))
    assigned = _plan_assignments(plan)
    groups_json = as_dict(status.get("groups"))
    workers_json = [as_dict(w) for w in as_list(status.get("workers"))]

    derived = history.derived_busy() if history is not None else {}
    devices: list[DeviceView] = []
    for d in as_list(status.get("devices")):
        d = as_dict(d)
        dev_id = text(d.get("id"), "?")
        group, worker = assigned.get(dev_id, ("unassigned", None))
        group = text(d.get("group"), group)
        worker = d.get("worker") or worker or None
        mem_total = num(d.get("mem_total_bytes"))
        if mem_total is None:
            mem_total = num(d.get("memory_bytes")) or None
        devices.append(DeviceView(
            id=dev_id, name=text(d.get("name"), ""), group=group, worker=worker,
            util=num(d.get("util")), power_w=num(d.get("power_w")),
            mem_used=num(d.get("mem_used_bytes")), mem_total=mem_total,
            busy=windowed(d.get("busy_fraction")) if "busy_fraction" in d else derived.get(worker),
            simulated=bool(d.get("simulated")),
            source=d.get("source") if isinstance(d.get("source"), str) else None))

    order = ["prefill", "decode", "agg", "unassigned"]
    names = [g for g in order if g in groups_json or any(d.group == g for d in devices)]
    names += sorted({d.group for d in devices} - set(names))
    if str(status.get("mode")) == "disagg":          # both halves shown even when empty
        names = ["prefill", "decode"] + [n for n in names if n not in ("prefill", "decode")]
    groups: list[GroupView] = []
    for name in names:
        gj = as_dict(groups_json.get(name))
        queue = as_dict(gj.get("queue"))
        role_workers = [w for w in workers_json if w.get("role") == name]
        waiting = as_int(queue.get("waiting"))
        running = as_int(queue.get("running"))
        queued = as_int(queue.get("queued_prefill_tokens"))
        if not queue:                                  # older daemons: sum the workers
            waiting = _sum_ints(w.get("waiting") for w in role_workers)
            running = _sum_ints(w.get("running") for w in role_workers)
            queued = _sum_ints(w.get("queued_prefill_tokens") for w in role_workers)
        n_workers = as_int(gj.get("workers"))
        busy = windowed(gj.get("busy_fraction"))
        if "busy_fraction" not in gj:
            fracs = [derived[w["worker"]] for w in role_workers if w.get("worker") in derived]
            busy = sum(fracs) / len(fracs) if fracs else None
        groups.append(GroupView(
            name=name, devices=tuple(d for d in devices if d.group == name),
            workers=n_workers if n_workers is not None else len(role_workers),
            busy=busy, tokens_per_s=windowed(gj.get("tokens_per_s")),
            power_w=num(gj.get("power_w")), waiting=waiting, running=running,
            queued_prefill_tokens=queued))

    ratio = as_dict(status.get("ratio"))
    ratio_window = text(ratio.get("window"), WINDOW)
    ratio_gpu = num(ratio.get("gpu_seconds"))
    if "ratio" not in status and history is not None and status.get("mode") != "agg":
        ratio_gpu = history.derived_ratio()     # older daemons: from the workers' busy time
        ratio_window = f"{WINDOW}, derived"
    hist = tuple(v for v in (num(p[1]) if isinstance(p, (list, tuple)) and len(p) == 2 else None
                             for p in as_list(ratio.get("history"))) if v is not None)
    if not hist and history is not None:
        hist = tuple(v for v in history.ratio if v is not None)
    latency = as_dict(status.get("latency"))
    sources = as_dict(status.get("sources"))
    source_words = [v for v in sources.values() if isinstance(v, str)]
    source_words += [d.source for d in devices if d.source]
    simulated = bool(status.get("simulated")) or any(d.simulated for d in devices) \
        or "simulated" in source_words
    workers = tuple(WorkerRow(
        worker=text(w.get("worker"), "?"), role=text(w.get("role"), "?"),
        state=WORKER_STATES.get(str(w.get("state")), text(w.get("state"))),
        restarts=as_int(w.get("restarts")), pid=as_int(w.get("pid")), devices=_worker_devices(w),
        kv_free=as_int(w.get("kv_blocks_free")), kv_total=as_int(w.get("kv_blocks_total")),
        running=as_int(w.get("running")), waiting=as_int(w.get("waiting"))) for w in workers_json)
    return Overview(
        version=text(status.get("version")), site=text(status.get("site"), "local"),
        appliance=text(status.get("appliance"), ""), model=text(status.get("model")),
        engine=text(status.get("engine")), mode=text(status.get("mode")),
        ready=status.get("ready") if isinstance(status.get("ready"), bool) else None,
        draining=status.get("draining") if isinstance(status.get("draining"), bool) else None,
        inflight=as_int(status.get("inflight")), uptime_s=num(status.get("uptime_s")),
        simulated=simulated, estimated="estimated" in source_words,
        ratio_gpu=ratio_gpu, ratio_energy=num(ratio.get("energy")),
        ratio_activity=num(ratio.get("activity")), ratio_window=ratio_window,
        ratio_history=hist, requests_per_s=num(status.get("requests_per_s")),
        ttft_p50=num(latency.get("ttft_p50_s")), ttft_p99=num(latency.get("ttft_p99_s")),
        itl_p50=num(latency.get("itl_p50_s")), itl_p99=num(latency.get("itl_p99_s")),
        groups=tuple(groups), workers=workers,
        cluster=cluster_from_status(status, history.peers if history is not None else None),
        held=as_int(as_dict(status.get("decode_admission")).get("waiting")))


@dataclass
class History:
    """What the console remembers between snapshots of one appliance: sparklines, and
    the workers' cumulative busy time, from which busy fractions and the GPU-seconds
    ratio are derived while the daemon does not report them itself (same definition:
    device-seconds inside engine iterations over the window)."""
    size: int = 60
    window_s: float = 10.0
    ratio: deque = field(default_factory=lambda: deque(maxlen=60))
    devices: dict[str, deque] = field(default_factory=dict)
    busy: deque = field(default_factory=lambda: deque(maxlen=64))   # (t, {worker: (busy_s, role, n_dev)})
    peers: PeerRates = field(default_factory=PeerRates)              # each peer's KV GB/s

    def observe(self, status: dict, t: float) -> None:
        self.peers.observe(status, t)
        snap = {}
        for w in as_list(as_dict(status).get("workers")):
            w = as_dict(w)
            busy = num(w.get("busy_s"))
            if busy is not None and w.get("worker"):
                snap[str(w["worker"])] = (busy, str(w.get("role")),
                                          max(len(as_list(w.get("devices"))), 1))
        if snap:
            self.busy.append((t, snap))
            while len(self.busy) > 2 and t - self.busy[1][0] >= self.window_s:
                self.busy.popleft()

    def derived_busy(self) -> dict[str, float]:
        """worker -> busy fraction over the window (empty until two snapshots)."""
        if len(self.busy) < 2:
            return {}
        (t0, a), (t1, b) = self.busy[0], self.busy[-1]
        if t1 - t0 <= 0:
            return {}
        return {w: min(max((b[w][0] - a[w][0]) / (t1 - t0), 0.0), 1.0)
                for w in b if w in a and b[w][0] >= a[w][0]}

    def derived_ratio(self) -> float | None:
        """Prefill ÷ decode busy device-seconds over the window; None when decode was idle."""
        if len(self.busy) < 2:
            return None
        (_, a), (_, b) = self.busy[0], self.busy[-1]
        side = {"prefill": 0.0, "decode": 0.0}
        for w, (busy, role, n_dev) in b.items():
            if w in a and role in side and busy >= a[w][0]:
                side[role] += (busy - a[w][0]) * n_dev
        return side["prefill"] / side["decode"] if side["decode"] > 0 else None

    def add(self, ov: Overview) -> None:
        self.ratio.append(ov.ratio_gpu)
        for d in ov.devices:
            value = d.util if d.util is not None else d.busy
            self.devices.setdefault(d.id, deque(maxlen=self.size)).append(value)

    def device(self, dev_id: str) -> list[float]:
        return [v if v is not None else 0.0 for v in self.devices.get(dev_id, ())]


def title_line(ov: Overview) -> str:
    where = ov.site + (f"/{ov.appliance}" if ov.appliance else "")
    state = NA if ov.ready is None else ("ready" if ov.ready else "NOT ready")
    if ov.draining:
        state += ", draining"
    return (f"{where} · {ov.model} on {ov.engine} · {ov.mode} · {state} · "
            f"{ov.inflight if ov.inflight is not None else NA} in flight · "
            f"up {fmt_duration(ov.uptime_s)}")


def badges(ov: Overview) -> list[str]:
    out = []
    if ov.simulated:
        out.append("SIMULATED")
    if ov.estimated:
        out.append("ESTIMATED")
    return out


def ratio_line(ov: Overview) -> str:
    return (f"prefill:decode  GPU-s {fmt_ratio(ov.ratio_gpu)}  energy {fmt_ratio(ov.ratio_energy)}"
            f"  activity {fmt_ratio(ov.ratio_activity)}  ({ov.ratio_window})")


def rates_line(ov: Overview) -> str:
    return (f"req/s {fmt_num(ov.requests_per_s)}  TTFT p50 {fmt_seconds(ov.ttft_p50)} "
            f"p99 {fmt_seconds(ov.ttft_p99)}  ITL p50 {fmt_seconds(ov.itl_p50)} "
            f"p99 {fmt_seconds(ov.itl_p99)}"
            + (f"  {ov.held} held at the router" if ov.held else ""))


def group_line(g: GroupView) -> str:
    line = (f"{g.name.upper():<8} {len(g.devices)} dev  busy {fmt_pct(g.busy)}  "
            f"{fmt_num(g.tokens_per_s, digits=0)} tok/s  queue {text(g.waiting)} wait "
            f"{text(g.running)} run")
    if g.name in ("prefill", "agg") and g.queued_prefill_tokens:
        line += f" {g.queued_prefill_tokens} tok"
    if g.power_w is not None:
        line += f"  {g.power_w:.0f} W"
    return line


def device_line(d: DeviceView, spark: str = "", name_width: int = 9) -> str:
    power = NA if d.power_w is None else f"{d.power_w:.0f}W"
    return (f"  {d.id:<6} {d.name[:name_width]:<{name_width}} {bar(d.util, 10)} "
            f"{fmt_pct(d.util):>4} {power:>5} {fmt_mem(d.mem_used, d.mem_total):>8} "
            f"busy {fmt_pct(d.busy):>4} {spark}").rstrip()


def workers_line(ov: Overview) -> str:
    counts: dict[str, int] = {}
    for w in ov.workers:
        counts[w.state] = counts.get(w.state, 0) + 1
    restarts = sum(w.restarts or 0 for w in ov.workers)
    summary = " ".join(f"{n} {s}" for s, n in counts.items()) or "none"
    line = f"workers  {summary}  restarts {restarts}"
    troubled = [f"{w.worker} {w.state}" for w in ov.workers if w.state != "up"]
    if troubled:
        line += "  (" + ", ".join(troubled) + ")"
    return line


def workers_grid(ov: Overview, width: int) -> str:
    """Every worker as `name state r=restarts`, as many to a line as fit."""
    cells = [f"{w.worker} {w.state} r={text(w.restarts, '?')}" for w in ov.workers]
    if not cells:
        return ""
    cell = max(len(c) for c in cells) + 2
    per_line = max(1, (width - 2) // cell)
    return "\n".join("  " + "".join(c.ljust(cell) for c in cells[i:i + per_line]).rstrip()
                     for i in range(0, len(cells), per_line))


def render_overview_text(ov: Overview, history: History | None = None) -> str:
    """The overview once, as plain text: what `applianced status` prints."""
    tags = " ".join(f"[{b}]" for b in badges(ov))
    lines = [f"applianced {ov.version}  {title_line(ov)}  {tags}".rstrip(), ratio_line(ov)]
    if ov.ratio_history:
        lines[-1] += "  " + sparkline(ov.ratio_history, 20)
    lines.append(rates_line(ov))
    for g in ov.groups:
        lines.append(group_line(g))
        for d in g.devices:
            spark = sparkline(history.device(d.id), 12, top=1.0) if history else ""
            lines.append(device_line(d, spark))
    lines.append(workers_line(ov))
    lines += worker_table(ov)
    if ov.cluster is not None:
        lines += peer_lines(ov.cluster)
    return "\n".join(lines)


def worker_table(ov: Overview) -> list[str]:
    """One line per worker, starting with its name (scripts grep for it)."""
    width = max([len(w.devices) for w in ov.workers] + [7])
    lines = [f"{'worker':<10} {'role':<8} {'state':<10} {'pid':>7} {'devices':<{width}} "
             f"{'KV free/total':>15} {'run':>4} {'wait':>5} {'restarts':>8}"]
    for w in ov.workers:
        kv = f"{w.kv_free}/{w.kv_total}" if w.kv_total is not None else "-"
        lines.append(f"{w.worker:<10} {w.role:<8} {w.state:<10} {text(w.pid, '-'):>7} "
                     f"{w.devices:<{width}} {kv:>15} {text(w.running, '-'):>4} "
                     f"{text(w.waiting, '-'):>5} {text(w.restarts, '-'):>8}")
    return lines
