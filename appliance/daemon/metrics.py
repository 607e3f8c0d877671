"""Prometheus series. The daemon owns the one registry; workers report over IPC.

Worker gauges are read at scrape time from the live worker table (a custom
collector), so a scrape never sees a stale copy; so are the telemetry hub's group and
device series. Every series carries `simulated` so a fleet dashboard can never mix
simulated numbers with measured ones unknowingly, and `site` and `appliance` (added to
every sample at render time) so a fleet can be read by site.
"""
from __future__ import annotations

from prometheus_client import (
    CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric

from appliance.accounting.records import RequestRecord
from appliance.engines.messages import IterationRecord, KvImported
from appliance.telemetry.status import metric_values

disable_created_metrics()   # *_created series only add noise to an appliance's scrape

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# Inter-token latency: tens of microseconds (a simulated GPU sped up) to a CPU's ~100 ms.
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.25, 0.5, 1)
# One request's KV transfer: ~0.1 ms (a short prompt over NVLink or shm) to seconds (a
# long prompt across boxes over TCP).
KV_TRANSFER_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                       0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class TelemetryCollector:
    """Group and device series from the telemetry hub, read at scrape time."""

    def __init__(self, telemetry, simulated: bool):
        self.telemetry = telemetry
        self.sim = "true" if simulated else "false"

    def collect(self):
        v = metric_values(self.telemetry)
        sim = self.sim
        busy = CounterMetricFamily("applianced_group_busy_seconds",
                                   "Device-seconds inside engine iterations, per group",
                                   labels=["group", "simulated"])
        energy = CounterMetricFamily("applianced_group_energy_joules",
                                     "Energy drawn by the group's devices",
                                     labels=["group", "simulated"])
        devices = GaugeMetricFamily("applianced_group_devices", "Devices in the group",
                                    labels=["group", "simulated"])
        workers = GaugeMetricFamily("applianced_group_workers", "Workers in the group",
                                    labels=["group", "simulated"])
        for g, x in v["group_busy_seconds"].items():
            busy.add_metric([g, sim], x)
        for g, x in v["group_energy_joules"].items():
            energy.add_metric([g, sim], x)
        for g, x in v["group_devices"].items():
            devices.add_metric([g, sim], x)
        for g, x in v["group_workers"].items():
            workers.add_metric([g, sim], x)
        tokens = CounterMetricFamily("applianced_phase_tokens",
                                     "Tokens processed by engine iterations, per phase",
                                     labels=["phase", "simulated"])
        for phase, x in v["phase_tokens"].items():
            tokens.add_metric([phase, sim], x)
        dev_energy = CounterMetricFamily("applianced_device_energy_joules",
                                         "Energy drawn by the device since the daemon started",
                                         labels=["device", "group", "simulated"])
        dev_power = GaugeMetricFamily("applianced_device_power_watts", "Device power (latest reading)",
                                      labels=["device", "group", "simulated"])
        dev_util = GaugeMetricFamily("applianced_device_utilization_ratio",
                                     "Device utilization 0..1 (latest reading)",
                                     labels=["device", "group", "simulated"])
        for d in v["devices"]:
            labels = [d["device"], d["group"], sim]
            if d["energy_j"] is not None:
                dev_energy.add_metric(labels, d["energy_j"])
            if d["power_w"] is not None:
                dev_power.add_metric(labels, d["power_w"])
            if d["util"] is not None:
                dev_util.add_metric(labels, d["util"])
        return [busy, energy, devices, workers, tokens, dev_energy, dev_power, dev_util]


class SiteLabels:
    """A registry view that adds `site` and `appliance` to every sample it renders."""

    def __init__(self, registry: CollectorRegistry, site: str, appliance: str):
        self.registry = registry
        self.labels = {"site": site, "appliance": appliance}

    def collect(self):
        extra = self.labels
        for m in self.registry.collect():
            out = Metric(m.name, m.documentation, m.type, m.unit)
            out.samples = [s._replace(labels={**s.labels, **extra}) for s in m.samples]
            yield out


class WorkerCollector:
    def __init__(self, pool, simulated: bool):
        self.pool = pool
        self.sim = "true" if simulated else "false"

    def collect(self):
        up = GaugeMetricFamily("applianced_worker_up", "1 if the worker process is ready",
                               labels=["worker", "role", "simulated"])
        restarts = CounterMetricFamily("applianced_worker_restarts", "Worker restarts",
                                       labels=["worker", "role", "simulated"])
        kv = GaugeMetricFamily("applianced_kv_blocks", "KV blocks by state",
                               labels=["worker", "role", "state", "simulated"])
        queued = GaugeMetricFamily("applianced_worker_queued_prefill_tokens",
                                   "Prompt tokens waiting for prefill",
                                   labels=["worker", "role", "simulated"])
        running = GaugeMetricFamily("applianced_worker_running_sequences",
                                    "Sequences in the running batch",
                                    labels=["worker", "role", "simulated"])
        borrowed = CounterMetricFamily(
            "applianced_worker_borrowed_core_steps", "CPU decode steps whose matmuls shared "
            "the prefill worker's idle core (engine.cpu_decode_helper)",
            labels=["worker", "role", "core", "simulated"])
        unborrowed = CounterMetricFamily(
            "applianced_worker_unborrowed_core_steps", "CPU decode steps that could have "
            "shared the prefill worker's core but did not: reason lender_busy (a prompt ran "
            "there, only without the shared page) or core_taken (the helper held a step up)",
            labels=["worker", "role", "core", "reason", "simulated"])
        taken_back = CounterMetricFamily(
            "applianced_worker_borrowed_core_taken_back", "Weight groups and attention items "
            "a CPU decode step took back from the helper on the prefill worker's core and "
            "computed itself, the helper preempted inside them",
            labels=["worker", "role", "core", "simulated"])
        for w in self.pool.workers.values():
            labels = [w.id, w.role, self.sim]
            up.add_metric(labels, 1.0 if w.ready else 0.0)
            restarts.add_metric(labels, float(w.restarts))
            s = w.stats
            if s is not None:
                kv.add_metric([w.id, w.role, "free", self.sim], s.kv_blocks_free)
                kv.add_metric([w.id, w.role, "used", self.sim], s.kv_blocks_total - s.kv_blocks_free)
                kv.add_metric([w.id, w.role, "handed_off", self.sim], s.kv_blocks_handed_off)
                queued.add_metric(labels, s.queued_prefill_tokens)
                running.add_metric(labels, s.running)
                if s.borrowed_core >= 0:
                    borrowed.add_metric([w.id, w.role, str(s.borrowed_core), self.sim],
                                        float(s.borrowed_core_steps))
                    taken_back.add_metric([w.id, w.role, str(s.borrowed_core), self.sim],
                                          float(s.borrowed_core_taken_back))
                    for reason, n in (("lender_busy", s.borrowed_core_lender_busy_steps),
                                      ("core_taken", s.borrowed_core_taken_steps)):
                        unborrowed.add_metric(
                            [w.id, w.role, str(s.borrowed_core), reason, self.sim], float(n))
        return [up, restarts, kv, queued, running, borrowed, unborrowed, taken_back]


class AdmissionCollector:
    """The router's queue, read at scrape time from `admission()` (`Router.decode_admission`):
    a fleet sees requests held before their prefill, which no worker's own queue shows."""

    def __init__(self, admission, simulated: bool):
        self.admission = admission
        self.sim = "true" if simulated else "false"

    def collect(self):
        a = self.admission()
        waiting = GaugeMetricFamily(
            "applianced_router_waiting_requests", "Requests waiting at the router for a "
            "first-stage worker with room, or for room on the decode side "
            "(engine.decode_max_seqs, engine.decode_kv_gate)", labels=["simulated"])
        waiting.add_metric([self.sim], a["waiting"])
        counted = GaugeMetricFamily(
            "applianced_decode_admission_counted_requests", "Requests placed and unfinished "
            "that count against engine.decode_max_seqs and engine.decode_kv_gate (0 when "
            "both are off)", labels=["simulated"])
        counted.add_metric([self.sim], a["counted"])
        return [waiting, counted]


class Metrics:
    def __init__(self, pool, served, simulated: bool, *, telemetry=None,
                 site: str = "local", appliance: str = "", admission=None):
        """`served`: the served model (`state.ServedModel`), whose name labels the series."""
        self.registry = CollectorRegistry()
        self._view = SiteLabels(self.registry, site, appliance)
        self.served = served
        self.sim = "true" if simulated else "false"
        r = self.registry
        self.requests = Counter("applianced_requests", "Finished requests",
                                ["model", "tenant", "status", "simulated"], registry=r)
        self.prompt_tokens = Counter("applianced_prompt_tokens", "Prompt tokens of finished requests",
                                     ["model", "tenant", "simulated"], registry=r)
        self.output_tokens = Counter("applianced_output_tokens", "Generated tokens",
                                     ["model", "tenant", "simulated"], registry=r)
        self.ttft = Histogram("applianced_time_to_first_token_seconds", "Arrival to first token",
                              ["model", "simulated"], buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("applianced_inter_token_latency_seconds",
                             "Per request: (finish - first token) / (output tokens - 1)",
                             ["model", "simulated"], buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("applianced_request_duration_seconds", "Arrival to finish",
                             ["model", "simulated"], buckets=LATENCY_BUCKETS, registry=r)
        self.iterations = Counter("applianced_engine_iterations", "Engine iterations",
                                  ["worker", "phase", "simulated"], registry=r)
        self.busy = Counter("applianced_engine_busy_seconds", "Wall time inside engine iterations",
                            ["worker", "phase", "simulated"], registry=r)
        self.rejections = Counter("applianced_rejected_requests", "Requests refused as overloaded",
                                  ["model", "simulated"], registry=r)
        self.tenant_rejections = Counter(
            "applianced_tenant_rejected", "Requests refused per tenant and reason (overloaded, "
            "rate_limit_requests, rate_limit_tokens, budget_exceeded)",
            ["tenant", "reason", "simulated"], registry=r)
        self.kv_bytes = Counter(
            "applianced_kv_transfer_bytes", "KV bytes imported by decode workers, per "
            "transport (shm, cuda_ipc, nixl; sim = modelled by the simulator)",
            ["transport", "simulated"], registry=r)
        self.kv_seconds = Histogram(
            "applianced_kv_transfer_seconds", "One request's KV import, per transport "
            "(sim = modelled time)", ["transport", "simulated"],
            buckets=KV_TRANSFER_BUCKETS, registry=r)
        r.register(WorkerCollector(pool, simulated))
        if admission is not None:
            r.register(AdmissionCollector(admission, simulated))
        if telemetry is not None:
            r.register(TelemetryCollector(telemetry, simulated))
        # Label children, looked up once per label set: `labels()` costs more than the
        # increment itself (validation, a lock, a tuple key), and these run per request
        # or per iteration. The label sets are few (tenants are the configured ones and
        # "other"), so the caches stay small.
        self._iter_children: dict[tuple[str, str], tuple] = {}
        self._request_children: dict[tuple[str, str, str], tuple] = {}
        self._latency_children: dict[str, list] = {}
        self._kv_children: dict[str, tuple] = {}

    @property
    def model(self) -> str:
        return self.served.name

    def iteration(self, rec: IterationRecord) -> None:
        key = (rec.worker, rec.phase)
        children = self._iter_children.get(key)
        if children is None:
            children = (self.iterations.labels(rec.worker, rec.phase, self.sim),
                        self.busy.labels(rec.worker, rec.phase, self.sim))
            self._iter_children[key] = children
        children[0].inc()
        children[1].inc(rec.wall_s)

    def kv_transfer(self, ev: KvImported) -> None:
        # "sim" is modelled whatever the daemon runs on: labelled simulated either way.
        children = self._kv_children.get(ev.transport)
        if children is None:
            sim = "true" if ev.transport == "sim" else self.sim
            children = self._kv_children[ev.transport] = (
                self.kv_bytes.labels(ev.transport, sim), self.kv_seconds.labels(ev.transport, sim))
        children[0].inc(ev.nbytes)
        children[1].observe(ev.seconds)

    def _counters(self, model: str, tenant_label: str, status: str) -> tuple:
        """(requests, prompt tokens, output tokens) children for a finished request."""
        if len(self._request_children) > 10_000:    # (a guard: the label sets are few)
            self._request_children.clear()
        sim = self.sim
        children = self._request_children[(model, tenant_label, status)] = (
            self.requests.labels(model, tenant_label, status, sim),
            self.prompt_tokens.labels(model, tenant_label, sim),
            self.output_tokens.labels(model, tenant_label, sim))
        return children

    def _latency(self, model: str, which: int):
        """The TTFT (0), ITL (1) or duration (2) histogram's child for `model`, made when
        first observed (so a series appears with its first sample, as before the cache)."""
        hists = self._latency_children.get(model)
        if hists is None:
            hists = self._latency_children[model] = [None, None, None]
        child = hists[which]
        if child is None:
            child = hists[which] = (self.ttft, self.itl, self.e2e)[which].labels(model, self.sim)
        return child

    def request(self, rec: RequestRecord, tenant_label: str) -> None:
        model = self.model      # (read each time: a model swap changes it)
        counters = (self._request_children.get((model, tenant_label, rec.status))
                    or self._counters(model, tenant_label, rec.status))
        counters[0].inc()
        counters[1].inc(rec.prompt_tokens)
        counters[2].inc(rec.output_tokens)
        if rec.first_token is not None:
            self._latency(model, 0).observe(rec.first_token - rec.arrival)
            per_choice = rec.output_tokens // max(1, rec.choices)
            if per_choice >= 2:
                self._latency(model, 1).observe((rec.finish - rec.first_token) / (per_choice - 1))
        if rec.status == "ok":
            self._latency(model, 2).observe(rec.finish - rec.arrival)

    def rejected(self) -> None:
        self.rejections.labels(self.model, self.sim).inc()

    def tenant_rejected(self, tenant_label: str, reason: str) -> None:
        self.tenant_rejections.labels(tenant_label, reason, self.sim).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self._view), CONTENT_TYPE_LATEST


class ReconciliationGauge:
    """`applianced_ledger_reconciliation_gap{quantity}`: the ledger against the daemon's
    own counters over the last few minutes, a signed fraction (accounting/reconcile.py).
    A quantity with no figure (no energy meter) is left out, not shown as 0."""

    def __init__(self, registry: CollectorRegistry, simulated: bool):
        self.sim = "true" if simulated else "false"
        self.gaps: dict[str, float | None] = {}
        registry.register(self)

    def set(self, gpu_seconds: float | None, energy_joules: float | None) -> None:
        self.gaps = {"gpu_seconds": gpu_seconds, "energy_joules": energy_joules}

    def collect(self):
        fam = GaugeMetricFamily("applianced_ledger_reconciliation_gap",
                                "(ledger - independent counter) / counter over the last 5 min",
                                labels=["quantity", "simulated"])
        for quantity, value in list(self.gaps.items()):
            if value is not None:
                fam.add_metric([quantity, self.sim], value)
        return [fam]


class TenantMetrics:
    """The chargeback series (`applianced_tenant_*`): counters per tenant (configured
    tenants only, the rest as "other", so a stray key cannot explode the series count), fed when a
    request's ledger row is final (summed per tenant by the accounting process, added
    once a second), and the budget gauge. A collector over plain sums, read at scrape
    time."""

    def __init__(self, registry: CollectorRegistry, simulated: bool):
        # site and appliance are added to every sample by the registry's SiteLabels view
        self.base = ["true" if simulated else "false"]
        self.gpu_s: dict[tuple[str, str], float] = {}
        self.energy: dict[tuple[str, str], float] = {}
        self.cost: dict[tuple[str, str], float] = {}
        self.co2e: dict[str, float] = {}
        self.ratio: dict[tuple[str, str], float] = {}
        registry.register(self)

    def add(self, tenant: str, usage) -> None:
        """Add a tenant's final figures since the accounting process's last report
        (a `TenantUsage`)."""
        for i, phase in enumerate(("prefill", "decode")):
            key = (tenant, phase)
            self.gpu_s[key] = self.gpu_s.get(key, 0.0) + usage.gpu_s[i]
            if usage.joules[i] is not None:
                self.energy[key] = self.energy.get(key, 0.0) + usage.joules[i]
        for basis, value in (("usage", usage.cost_usage), ("allocation", usage.cost_allocation)):
            self.cost[(tenant, basis)] = self.cost.get((tenant, basis), 0.0) + value
        self.co2e[tenant] = self.co2e.get(tenant, 0.0) + usage.co2e_g

    def budget(self, tenant: str, budget: str, ratio: float) -> None:
        self.ratio[(tenant, budget)] = ratio

    def collect(self):
        base = ["simulated"]
        out = []
        for name, doc, labels, values, cls in (
                ("applianced_tenant_gpu_seconds", "Attributed device-seconds",
                 ["tenant", "phase"], self.gpu_s, CounterMetricFamily),
                ("applianced_tenant_energy_joules", "Attributed energy (measured only)",
                 ["tenant", "phase"], self.energy, CounterMetricFamily),
                ("applianced_tenant_cost_usd", "Cost by basis (usage | allocation)",
                 ["tenant", "basis"], self.cost, CounterMetricFamily),
                ("applianced_tenant_co2e_grams", "Operational + embodied gCO2e",
                 ["tenant"], self.co2e, CounterMetricFamily),
                ("applianced_tenant_budget_used_ratio", "Share of the period's budget used (1 = all)",
                 ["tenant", "budget"], self.ratio, GaugeMetricFamily)):
            fam = cls(name, doc, labels=labels + base)
            for key, value in list(values.items()):
                key = key if isinstance(key, tuple) else (key,)
                fam.add_metric([*key, *self.base], value)
            out.append(fam)
        return out
