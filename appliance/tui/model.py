"""What the console shows, computed from the daemon's JSON and nothing else.

The admin API grows in stages (the live keys of `/admin/v1/status`, usage and carbon
come from other parts of the daemon), so every reader here takes a plain dict, tolerates
any key being absent or of the wrong type, and yields None for "not available". The
screens and `applianced status` both render these views; neither looks at raw JSON.
No Textual and no HTTP in this module.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
import math
from typing import Any, Iterable

GIB = 1024 ** 3
WINDOW = "10s"                       # the window the overview shows for windowed figures
NA = "n/a"
SPARK = "▁▂▃▄▅▆▇█"

# Worker states as the daemon names them -> what an operator reads.
WORKER_STATES = {"ready": "up", "starting": "restarting", "restarting": "restarting",
                 "stopped": "down", "failed": "down"}


# ---------------------------------------------------------------- tolerant readers

def num(value: Any) -> float | None:
    """A finite number, or None (absent, null, a string, NaN...)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def windowed(value: Any, window: str = WINDOW) -> float | None:
    """`{"1s": x, "10s": y, "60s": z}` -> y; a bare number is taken as is."""
    if isinstance(value, dict):
        return num(value.get(window))
    return num(value)


def as_dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def as_list(value: Any) -> list:
    return value if isinstance(value, list) else []


def text(value: Any, default: str = NA) -> str:
    if value is None or value == "":
        return default
    return str(value)


# ---------------------------------------------------------------- formatting

def fmt_ratio(x: float | None) -> str:
    if x is None:
        return NA
    return f"{x:.2f}:1" if x < 10 else f"{x:.1f}:1"


def fmt_pct(x: float | None) -> str:
    return NA if x is None else f"{x * 100:.0f}%"


def fmt_num(x: float | None, unit: str = "", digits: int = 1) -> str:
    if x is None:
        return NA
    if abs(x) >= 10_000:
        s = f"{x:,.0f}"
    else:
        s = f"{x:.{digits}f}"
    return f"{s} {unit}".rstrip() if unit else s


def fmt_seconds(x: float | None) -> str:
    """Latencies: ms below a second."""
    if x is None:
        return NA
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def fmt_mem(used: float | None, total: float | None) -> str:
    if total is None:
        return NA
    u = NA if used is None else f"{used / GIB:.0f}"
    return f"{u}/{total / GIB:.0f}G"


def fmt_duration(s: float | None) -> str:
    if s is None:
        return NA
    s = int(s)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 172800:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d"


def bar(frac: float | None, width: int = 10) -> str:
    """A utilization bar readable without colour: '[######....]'."""
    if frac is None:
        return "[" + "·" * width + "]"
    frac = min(max(frac, 0.0), 1.0)
    full = round(frac * width)
    return "[" + "#" * full + "." * (width - full) + "]"


def sparkline(values: Iterable[float | None], width: int = 20, top: float | None = None) -> str:
    """Block characters for the last `width` values, scaled to `top` (e.g. 1.0 for a
    utilization, so 90% always looks like 90%) or, without it, to their own max."""
    vals = list(values)[-width:]
    nums = [v for v in vals if v is not None]
    if not nums:
        return ""
    scale = top if top is not None else (max(nums) or 1.0)
    return "".join(" " if v is None else
                   SPARK[min(max(int(v / scale * (len(SPARK) - 1) + 0.5), 0), len(SPARK) - 1)]
                   for v in vals)


# ---------------------------------------------------------------- the overview

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


def _int(value: Any) -> int | None:
    x = num(value)
    return None if x is None else int(x)


def _sum_ints(values: Iterable[Any]) -> int | None:
    got = [v for v in (_int(x) for x in values) if v is not None]
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
        waiting = _int(queue.get("waiting"))
        running = _int(queue.get("running"))
        queued = _int(queue.get("queued_prefill_tokens"))
        if not queue:                                  # older daemons: sum the workers
            waiting = _sum_ints(w.get("waiting") for w in role_workers)
            running = _sum_ints(w.get("running") for w in role_workers)
            queued = _sum_ints(w.get("queued_prefill_tokens") for w in role_workers)
        n_workers = _int(gj.get("workers"))
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
        restarts=_int(w.get("restarts")), pid=_int(w.get("pid")), devices=_worker_devices(w),
        kv_free=_int(w.get("kv_blocks_free")), kv_total=_int(w.get("kv_blocks_total")),
        running=_int(w.get("running")), waiting=_int(w.get("waiting"))) for w in workers_json)
    return Overview(
        version=text(status.get("version")), site=text(status.get("site"), "local"),
        appliance=text(status.get("appliance"), ""), model=text(status.get("model")),
        engine=text(status.get("engine")), mode=text(status.get("mode")),
        ready=status.get("ready") if isinstance(status.get("ready"), bool) else None,
        draining=status.get("draining") if isinstance(status.get("draining"), bool) else None,
        inflight=_int(status.get("inflight")), uptime_s=num(status.get("uptime_s")),
        simulated=simulated, estimated="estimated" in source_words,
        ratio_gpu=ratio_gpu, ratio_energy=num(ratio.get("energy")),
        ratio_activity=num(ratio.get("activity")), ratio_window=ratio_window,
        ratio_history=hist, requests_per_s=num(status.get("requests_per_s")),
        ttft_p50=num(latency.get("ttft_p50_s")), ttft_p99=num(latency.get("ttft_p99_s")),
        itl_p50=num(latency.get("itl_p50_s")), itl_p99=num(latency.get("itl_p99_s")),
        groups=tuple(groups), workers=workers)


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

    def observe(self, status: dict, t: float) -> None:
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
            f"p99 {fmt_seconds(ov.itl_p99)}")


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


# ---------------------------------------------------------------- tenants (usage)

PERIODS = {"1h": 3600, "24h": 86400, "7d": 7 * 86400}


@dataclass(frozen=True, slots=True)
class TenantView:
    tenant: str
    gpu_seconds: float
    prefill_gpu_seconds: float
    decode_gpu_seconds: float
    cost_usage: float | None
    cost_allocation: float | None
    kwh: float | None
    kg_co2e: float | None
    share: float | None               # of all tenants' GPU-seconds
    budget_used: float | None         # the highest of the tenant's budgets, 0..1+
    requests: int | None
    simulated: bool
    measured: bool


TENANT_SORTS = ("gpu_seconds", "cost_usage", "cost_allocation", "kwh", "kg_co2e",
                "budget_used", "tenant")


def _add(a: float | None, b: Any) -> float | None:
    b = num(b)
    if b is None:
        return a
    return b if a is None else a + b


def _budget_map(usage: dict) -> dict[str, float]:
    """tenant -> highest budget used ratio, from `budgets` if the daemon gives them:
    `{"tenant": {"gpu_hours": 0.5, ...}}` or `[{"tenant", "budget", "used_ratio"}]`."""
    out: dict[str, float] = {}
    raw = usage.get("budgets")
    if isinstance(raw, dict):
        for tenant, budgets in raw.items():
            vals = [num(v) for v in as_dict(budgets).values()]
            vals = [v for v in vals if v is not None]
            if not vals and num(budgets) is not None:
                vals = [num(budgets)]
            if vals:
                out[str(tenant)] = max(vals)
    for b in as_list(raw):
        b = as_dict(b)
        used = num(b.get("used_ratio"))
        if used is not None and b.get("tenant") is not None:
            out[str(b["tenant"])] = max(out.get(str(b["tenant"]), 0.0), used)
    return out


def tenants_from_usage(usage: dict) -> list[TenantView]:
    """Rows of `/admin/v1/usage?group_by=tenant,phase` folded into one line per tenant."""
    usage = as_dict(usage)
    acc: dict[str, dict] = {}
    for row in as_list(usage.get("rows")):
        row = as_dict(row)
        tenant = text(row.get("tenant"), "(none)")
        a = acc.setdefault(tenant, {"gpu": None, "prefill": 0.0, "decode": 0.0, "cu": None,
                                    "ca": None, "j": None, "g": None, "req": None,
                                    "sim": False, "measured": True, "budget": None})
        gpu = num(row.get("gpu_seconds"))
        a["gpu"] = _add(a["gpu"], gpu)
        if row.get("phase") in ("prefill", "decode") and gpu is not None:
            a[row["phase"]] += gpu
        a["cu"] = _add(a["cu"], row.get("cost_usage"))
        a["ca"] = _add(a["ca"], row.get("cost_allocation"))
        a["j"] = _add(a["j"], row.get("energy_joules"))
        a["g"] = _add(a["g"], row.get("co2e_grams"))
        a["req"] = _add(a["req"], row.get("requests"))
        a["sim"] = a["sim"] or bool(row.get("simulated"))
        a["measured"] = a["measured"] and row.get("measured") is not False
        bu = windowed(row.get("budget_used")) if not isinstance(row.get("budget_used"), dict) \
            else max([v for v in map(num, row["budget_used"].values()) if v is not None],
                     default=None)
        if bu is not None:
            a["budget"] = bu if a["budget"] is None else max(a["budget"], bu)
    budgets = _budget_map(usage)
    total = sum(a["gpu"] or 0.0 for a in acc.values())
    out = []
    for tenant, a in acc.items():
        gpu = a["gpu"] or 0.0
        budget = a["budget"] if a["budget"] is not None else budgets.get(tenant)
        out.append(TenantView(
            tenant=tenant, gpu_seconds=gpu, prefill_gpu_seconds=a["prefill"],
            decode_gpu_seconds=a["decode"], cost_usage=a["cu"], cost_allocation=a["ca"],
            kwh=None if a["j"] is None else a["j"] / 3.6e6,
            kg_co2e=None if a["g"] is None else a["g"] / 1000,
            share=gpu / total if total > 0 else None, budget_used=budget,
            requests=None if a["req"] is None else int(a["req"]),
            simulated=a["sim"], measured=a["measured"]))
    return sort_tenants(out, "gpu_seconds", descending=True)


def sort_tenants(rows: list[TenantView], key: str, descending: bool = True) -> list[TenantView]:
    if key == "tenant":
        return sorted(rows, key=lambda r: r.tenant, reverse=descending)
    present = [r for r in rows if getattr(r, key) is not None]
    missing = [r for r in rows if getattr(r, key) is None]
    present.sort(key=lambda r: (getattr(r, key), r.tenant), reverse=descending)
    return present + sorted(missing, key=lambda r: r.tenant)   # n/a always last


def filter_tenants(rows: list[TenantView], needle: str) -> list[TenantView]:
    needle = needle.strip().lower()
    return [r for r in rows if needle in r.tenant.lower()] if needle else rows


def merge_tenants(per_appliance: Iterable[list[TenantView]]) -> list[TenantView]:
    """Tenants across a fleet: sums by tenant name, shares of the fleet's total."""
    acc: dict[str, dict] = {}
    for rows in per_appliance:
        for r in rows:
            a = acc.setdefault(r.tenant, {"gpu": 0.0, "p": 0.0, "d": 0.0, "cu": None, "ca": None,
                                          "kwh": None, "co2": None, "req": None, "sim": False,
                                          "measured": True, "budget": None})
            a["gpu"] += r.gpu_seconds
            a["p"] += r.prefill_gpu_seconds
            a["d"] += r.decode_gpu_seconds
            for k, v in (("cu", r.cost_usage), ("ca", r.cost_allocation), ("kwh", r.kwh),
                         ("co2", r.kg_co2e), ("req", r.requests)):
                a[k] = _add(a[k], v)
            a["sim"] = a["sim"] or r.simulated
            a["measured"] = a["measured"] and r.measured
            if r.budget_used is not None:
                a["budget"] = max(a["budget"] or 0.0, r.budget_used)
    total = sum(a["gpu"] for a in acc.values())
    return sort_tenants([TenantView(
        tenant=t, gpu_seconds=a["gpu"], prefill_gpu_seconds=a["p"], decode_gpu_seconds=a["d"],
        cost_usage=a["cu"], cost_allocation=a["ca"], kwh=a["kwh"], kg_co2e=a["co2"],
        share=a["gpu"] / total if total > 0 else None, budget_used=a["budget"],
        requests=None if a["req"] is None else int(a["req"]), simulated=a["sim"],
        measured=a["measured"]) for t, a in acc.items()], "gpu_seconds")


# ---------------------------------------------------------------- carbon

@dataclass(frozen=True, slots=True)
class CarbonView:
    site: str
    tenant: str
    intensity: float | None           # gCO2e/kWh now
    provenance: str                   # e.g. "static, average" or "electricitymaps, marginal, estimated"
    estimated: bool
    kg_co2e: float | None
    kwh: float | None
    sci_per_1k_tokens: float | None   # gCO2e per 1,000 tokens
    simulated: bool


def _provenance(row: dict) -> tuple[str, bool]:
    prov = row.get("provenance")
    if isinstance(prov, str):
        return prov, "estimated" in prov
    prov = as_dict(prov)
    parts = [str(prov[k]) for k in ("source", "kind", "signal") if prov.get(k)]
    estimated = bool(prov.get("estimated") or row.get("estimated"))
    if estimated:
        parts.append("estimated")
    return (", ".join(parts) or NA), estimated


def carbon_from_json(data: dict) -> list[CarbonView]:
    """Rows of `/admin/v1/carbon?group_by=site,tenant`, whatever subset of keys they carry."""
    out = []
    for row in as_list(as_dict(data).get("rows")):
        row = as_dict(row)
        prov, estimated = _provenance(row)
        intensity = num(row.get("intensity_g_per_kwh"))
        if intensity is None:
            intensity = num(row.get("intensity"))
        if intensity is None:
            intensity = num(as_dict(row.get("provenance")).get("intensity_g_per_kwh"))
        sci = num(row.get("sci_per_1k_tokens"))
        if sci is None:
            sci = num(as_dict(row.get("sci")).get("per_1k_tokens"))
        grams = num(row.get("co2e_grams"))
        joules = num(row.get("energy_joules"))
        out.append(CarbonView(
            site=text(row.get("site"), "local"), tenant=text(row.get("tenant"), "(all)"),
            intensity=intensity, provenance=prov, estimated=estimated,
            kg_co2e=None if grams is None else grams / 1000,
            kwh=None if joules is None else joules / 3.6e6, sci_per_1k_tokens=sci,
            simulated=bool(row.get("simulated"))))
    out.sort(key=lambda r: (r.site, -(r.kg_co2e or 0.0), r.tenant))
    return out


# ---------------------------------------------------------------- fleet

@dataclass(frozen=True, slots=True)
class SiteRow:
    url: str
    site: str
    appliance: str
    state: str                        # the link's state word (streaming, polling, unreachable...)
    ratio_gpu: float | None
    devices: int
    requests_per_s: float | None
    tokens_per_s: float | None
    simulated: bool


def fleet_ratio(overviews: Iterable[tuple[Overview, dict]]) -> float | None:
    """Fleet prefill:decode ratio = Σ prefill busy GPU-seconds ÷ Σ decode busy GPU-seconds
    over the window (from each status's `groups`), not a mean of per-box ratios."""
    pre = dec = 0.0
    seen = False
    for _, status in overviews:
        groups = as_dict(as_dict(status).get("groups"))
        p = windowed(as_dict(groups.get("prefill")).get("gpu_seconds"))
        d = windowed(as_dict(groups.get("decode")).get("gpu_seconds"))
        if p is None or d is None:
            continue
        seen = True
        pre += p
        dec += d
    if not seen or dec <= 0:
        return None
    return pre / dec


def site_row(url: str, state: str, ov: Overview | None) -> SiteRow:
    if ov is None:
        return SiteRow(url, NA, "", state, None, 0, None, None, False)
    toks = [g.tokens_per_s for g in ov.groups if g.tokens_per_s is not None]
    return SiteRow(url=url, site=ov.site, appliance=ov.appliance, state=state,
                   ratio_gpu=ov.ratio_gpu, devices=len(ov.devices),
                   requests_per_s=ov.requests_per_s, tokens_per_s=sum(toks) if toks else None,
                   simulated=ov.simulated)


# ---------------------------------------------------------------- capacity (the planner)

@dataclass(frozen=True, slots=True)
class PhaseSplit:
    """One phase of one split (current, recommended now, recommended at the peak)."""
    workers: int | None
    gpus: int | None
    gpus_needed: int | None
    headroom: float | None
    device: str


@dataclass(frozen=True, slots=True)
class SplitView:
    split: str                        # "P+D" or n/a
    prefill: PhaseSplit
    decode: PhaseSplit
    fits: bool | None


@dataclass(frozen=True, slots=True)
class CapacityView:
    """`/admin/v1/plan` as the Capacity screen shows it; every field may be n/a."""
    model: str
    simulated: bool
    horizon_s: float | None
    bucket_s: float | None
    method: str
    interval: tuple[float | None, float | None]
    history_buckets: int | None
    rate_mean: tuple[float | None, ...]         # λ forecast, requests/s, one per bucket
    rate_lower: tuple[float | None, ...]
    rate_upper: tuple[float | None, ...]
    rho_now: float | None
    rho_history: tuple[float | None, ...]
    rho_forecast: tuple[float | None, ...]
    rho_source: str
    current: SplitView
    recommended: SplitView
    at_peak: SplitView
    peak_in_s: float | None                     # from generated_at to the forecast peak
    bottleneck: str
    why: str
    profiles: tuple[tuple[str, str, str], ...]  # (phase, source, device)
    token_budget: int | None                    # the knee of the prefill profile
    max_batch_tokens: int | None                # what the engines run with
    max_batch_tokens_source: str
    usd_per_day: float | None
    kwh_per_day: float | None

    @property
    def profile_badge(self) -> str:
        """MEASURED when every phase's profile was measured on this box, else SIMULATED
        (a roofline or catalogue profile), n/a when the plan does not say."""
        sources = {s for _, s, _ in self.profiles if s != NA}
        if not sources:
            return NA
        return "MEASURED" if sources == {"measured"} else "SIMULATED"

    @property
    def estimated(self) -> bool:
        return "estimated" in self.rho_source or bool(self.rate_mean)


def _series(points: Any, key: str) -> tuple[float | None, ...]:
    return tuple(num(as_dict(p).get(key)) for p in as_list(points))


def _phase_split(value: Any) -> PhaseSplit:
    d = as_dict(value)
    return PhaseSplit(workers=_int(d.get("workers")), gpus=_int(d.get("gpus")),
                      gpus_needed=_int(d.get("gpus_needed")), headroom=num(d.get("headroom")),
                      device=text(d.get("device")))


def _split_view(value: Any) -> SplitView:
    d = as_dict(value)
    fits = d.get("fits")
    return SplitView(split=text(d.get("split")), prefill=_phase_split(d.get("prefill")),
                     decode=_phase_split(d.get("decode")),
                     fits=fits if isinstance(fits, bool) else None)


def capacity_from_plan(plan: Any) -> CapacityView:
    """Read `/admin/v1/plan`, whatever subset of its keys (and of their types) it has."""
    plan = as_dict(plan)
    fc = as_dict(plan.get("forecast"))
    rho = as_dict(plan.get("rho"))
    rec = as_dict(plan.get("recommended"))
    peak = as_dict(rec.get("at_peak"))
    bott = as_dict(plan.get("bottleneck"))
    tuning = as_dict(plan.get("tuning"))
    cost = as_dict(plan.get("cost"))
    interval = as_list(fc.get("interval"))
    profiles = tuple((phase, text(as_dict(p).get("source")), text(as_dict(p).get("device")))
                     for phase, p in as_dict(plan.get("profile_source")).items())
    peak_t, gen = num(peak.get("t")), num(plan.get("generated_at"))
    mbt = as_dict(tuning.get("max_batch_tokens"))
    return CapacityView(
        model=text(plan.get("model")), simulated=plan.get("simulated") is True,
        horizon_s=num(plan.get("horizon_s")), bucket_s=num(plan.get("bucket_s")),
        method=text(fc.get("method")),
        interval=(num(interval[0]) if len(interval) > 1 else None,
                  num(interval[1]) if len(interval) > 1 else None),
        history_buckets=_int(fc.get("history_buckets")),
        rate_mean=_series(fc.get("rate"), "mean"), rate_lower=_series(fc.get("rate"), "lower"),
        rate_upper=_series(fc.get("rate"), "upper"),
        rho_now=num(rho.get("now")), rho_history=_series(rho.get("history"), "value"),
        rho_forecast=_series(rho.get("forecast"), "value"), rho_source=text(rho.get("source")),
        current=_split_view(plan.get("current")), recommended=_split_view(rec),
        at_peak=_split_view(peak),
        peak_in_s=None if peak_t is None or gen is None else max(0.0, peak_t - gen),
        bottleneck=text(bott.get("phase")), why=text(bott.get("why"), ""),
        profiles=profiles, token_budget=_int(tuning.get("prefill_token_budget")),
        max_batch_tokens=_int(mbt.get("value")) if mbt else _int(tuning.get("configured_max_batch_tokens")),
        max_batch_tokens_source=(text(mbt.get("source")) if mbt else
                                 "configured" if "configured_max_batch_tokens" in tuning else NA),
        usd_per_day=num(cost.get("usd_per_day")), kwh_per_day=num(cost.get("kwh_per_day")))


def resample(values: Iterable[float | None], width: int, how: str = "mean") -> list[float | None]:
    """`width` points from a longer series: each the mean / max / min of its stretch (a
    day of minute buckets has to fit an 80-column terminal); shorter series stay as is."""
    vals = list(values)
    if len(vals) <= width or width <= 0:
        return vals
    out: list[float | None] = []
    for i in range(width):
        chunk = [v for v in vals[i * len(vals) // width:(i + 1) * len(vals) // width] if v is not None]
        if not chunk:
            out.append(None)
        elif how == "max":
            out.append(max(chunk))
        elif how == "min":
            out.append(min(chunk))
        else:
            out.append(sum(chunk) / len(chunk))
    return out


def _span(s: float | None) -> str:
    if s is None:
        return NA
    if s >= 86400 and s % 86400 == 0:
        return f"{int(s // 86400)}d"
    if s >= 3600:
        return f"{s / 3600:.0f}h"
    return f"{s / 60:.0f}m"


def _extreme(values: Iterable[float | None], pick=max) -> float | None:
    nums = [v for v in values if v is not None]
    return pick(nums) if nums else None


def _gpus(p: PhaseSplit) -> str:
    return NA if p.gpus is None else f"{p.gpus}"


def render_capacity_lines(v: CapacityView, width: int = 80) -> list[str]:
    """The Capacity screen as lines of plain text (no colour needed to read it)."""
    spark_w = max(10, min(width - 26, 120))
    lines = []
    profs = " · ".join(f"{ph} {src} ({dev})" for ph, src, dev in v.profiles) or NA
    lines.append(f"[{v.profile_badge} profile] {profs}")
    lo, hi = v.interval
    band = NA if lo is None or hi is None else f"p{lo * 100:.0f}-p{hi * 100:.0f}"
    past = NA if v.history_buckets is None else str(v.history_buckets)
    lines.append(f"FORECAST λ req/s · next {_span(v.horizon_s)} by {_span(v.bucket_s)} · "
                 f"{v.method} · {band} · fit on {past}")
    top = _extreme(v.rate_upper) or _extreme(v.rate_mean)
    if not v.rate_mean:
        lines.append("  no forecast yet")
    else:
        for label, series, how, pick in (("high", v.rate_upper, "max", max),
                                         ("mean", v.rate_mean, "mean", max),
                                         ("low", v.rate_lower, "min", min)):
            pts = resample(series, spark_w, how)
            spark = sparkline(pts, width=spark_w, top=top or None) or NA
            lines.append(f"  {label:<4} {spark:<{spark_w}} {label} {fmt_num(_extreme(series, pick), digits=2)}")
        lines.append(f"       now{'':>{max(0, spark_w - 7)}}+{_span(v.horizon_s)}")
    hist = v.rho_history[-max(4, spark_w // 3):]
    fut = resample(v.rho_forecast, max(4, spark_w - len(hist) - 3))
    rho_top = _extreme(list(hist) + list(fut))
    lines.append(f"RHO prefill÷decode GPU demand  now {fmt_num(v.rho_now, digits=2)}"
                 f"  past {fmt_num(_extreme(hist, min), digits=2)}–{fmt_num(_extreme(hist), digits=2)}"
                 f"  next {fmt_num(_extreme(v.rho_forecast, min), digits=2)}"
                 f"–{fmt_num(_extreme(v.rho_forecast), digits=2)}  (estimated)")
    lines.append(f"  past {sparkline(hist, width=len(hist), top=rho_top) or NA} │ "
                 f"next {sparkline(fut, width=len(fut), top=rho_top) or NA}")
    peak = NA if v.peak_in_s is None else f"+{_span(v.peak_in_s)}"
    lines.append(f"{'SPLIT':<10}{'current':>12}{'recommended':>14}{'at peak ' + peak:>16}")
    lines.append(f"{'P+D':<10}{v.current.split:>12}{v.recommended.split:>14}{v.at_peak.split:>16}")
    for phase in ("prefill", "decode"):
        cur, rec, pk = (getattr(s, phase) for s in (v.current, v.recommended, v.at_peak))
        need = NA if rec.gpus_needed is None else str(rec.gpus_needed)
        room = NA if rec.headroom is None else f"{rec.headroom:.2f}x"
        lines.append(f"{phase + ' GPUs':<14}{_gpus(cur):>8}{_gpus(rec):>14}{_gpus(pk):>16}"
                     f"  need {need}, headroom {room}")
    lines.append(f"BOTTLENECK {v.bottleneck}: {v.why}".rstrip(": "))
    lines.append(f"prefill token budget (profile knee) {fmt_num(v.token_budget and float(v.token_budget), digits=0)}"
                 f" · engines run {fmt_num(v.max_batch_tokens and float(v.max_batch_tokens), digits=0)}"
                 f" ({v.max_batch_tokens_source})")
    lines.append(f"cost {fmt_num(v.usd_per_day, digits=0)} $/day · {fmt_num(v.kwh_per_day, digits=0)} kWh/day (estimated)")
    return lines
