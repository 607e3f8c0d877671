"""The running appliance as the HTTP handlers see it.

`daemon.main` builds every subsystem first (the workers, the router, telemetry, the
accounting link, the workflow engine, the planner), then the `Service` from them, then
the aiohttp app; nothing sets an attribute on the Service afterwards. What changes while
it runs (the served model, the partition, admission) lives in `daemon.state`, in one
place each; the properties below only read it for the handlers.
"""
from __future__ import annotations

import itertools
import logging
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from appliance import __version__
from appliance.accounting.records import RecordSink, RequestRecord
from appliance.partitions import inventory_json
from appliance.telemetry import status as telemetry_status
from appliance.workflows.machine import split_of

if TYPE_CHECKING:
    from appliance.config import Config
    from appliance.daemon.accounting_link import AccountingLink
    from appliance.daemon.auth import Auth
    from appliance.daemon.metrics import Metrics
    from appliance.daemon.peers import Peers
    from appliance.daemon.router import Router
    from appliance.daemon.setup import Setup
    from appliance.daemon.state import ServingState
    from appliance.daemon.tenants import TenantPolicy
    from appliance.daemon.tokenizer import ServedTokenizer
    from appliance.daemon.workers import WorkerPool
    from appliance.partitions import PartitionPlan
    from appliance.planner.planner import Planner
    from appliance.telemetry.hub import Telemetry
    from appliance.workflows.engine import WorkflowEngine
    from appliance.workflows.journal import Journal
    from appliance.workflows.machine import ModelRef

log = logging.getLogger("applianced")


def labelled_tenants(cfg: Config) -> set[str]:
    """Tenants with series of their own in /metrics; any other is counted as "other"."""
    return set(cfg.auth.keys.values()) | {"default"}


class RequestPreparer(Protocol):
    """What the Service holds of `daemon.prepare.PreparePool`. Not imported here: the
    pool validates with `daemon.completion`, which knows the Service, and the daemon's
    imports run one way."""

    inline: int
    pooled: int
    inline_bytes: int

    async def prepare(self, raw: bytes, endpoint: str, model_name: str, max_context: int,
                      tokenizer: ServedTokenizer): ...


class Service:
    """What serves, what it admits, and where each finished request goes."""

    def __init__(self, cfg: Config, setup: Setup, state: ServingState, *, pool: WorkerPool,
                 router: Router, metrics: Metrics, auth: Auth, sink: RecordSink,
                 prepare_pool: RequestPreparer, telemetry: Telemetry,
                 journal: Journal, workflows: WorkflowEngine, tenants: TenantPolicy,
                 planner: Planner | None = None, accounting: AccountingLink | None = None,
                 config_path: Path | None = None, peers: Peers | None = None):
        self.cfg = cfg
        self.setup = setup                  # what start-up decided (never changed after)
        self.state = state                  # what changes: model, partition, admission
        self.pool = pool
        self.router = router
        self.metrics = metrics
        self.auth = auth
        self.sink = sink                    # the request log and/or the accounting link
        self.prepare_pool = prepare_pool
        self.telemetry = telemetry
        self.journal = journal
        self.workflows = workflows
        self.planner = planner              # None: it could not be built (logged)
        self.accounting = accounting        # None: [accounting] enabled = false
        self.tenants = tenants              # rate limits, enforced budgets ([tenants], [budgets])
        self.config_path = config_path      # what `applianced reload` re-reads; None: defaults
        self.peers = peers                  # the other boxes of a cluster; None: role both
        self.fingerprint = f"applianced-{__version__}-{setup.engine}"
        self.started_at = time.time()
        self.recovery: dict = {}            # what start-up found and decided (`recover`)
        self._tenants = labelled_tenants(cfg)
        self._prefix = secrets.token_hex(4)
        self._ids = itertools.count(1)
        pool.on_iteration = self._on_iteration
        pool.on_kv_transfer = metrics.kv_transfer

    # ---- what the handlers read (one place each, in `state`) --------------------------
    @property
    def simulated(self) -> bool:
        return self.setup.simulated

    @property
    def model_name(self) -> str:
        return self.state.model.name

    @property
    def max_context(self) -> int:
        return self.state.model.max_context

    @property
    def tokenizer(self) -> ServedTokenizer:
        return self.state.model.tokenizer

    @property
    def model(self) -> ModelRef:
        return self.state.model.ref

    @property
    def plan(self) -> PartitionPlan:
        return self.state.plan

    @property
    def max_inflight(self) -> int:
        return self.state.max_inflight

    @property
    def admission_open(self) -> bool:
        return self.state.admission_open

    @property
    def draining(self) -> bool:
        return self.state.draining

    @property
    def inflight(self) -> int:
        return self.state.inflight

    @property
    def preparing(self) -> int:
        return self.state.preparing

    # ---- life -------------------------------------------------------------------------
    def recover(self, orphans_killed: list[dict]) -> dict:
        """Before serving: every unfinished workflow is reconciled against the workers
        just started (redo / skip / compensate); they continue once the daemon listens."""
        self.recovery = {"orphans_killed": orphans_killed, "decisions": self.workflows.recover()}
        return self.recovery

    def next_request_id(self) -> str:
        return f"{self._prefix}{next(self._ids):08x}"

    # ---- records ----------------------------------------------------------------------
    def _on_iteration(self, rec) -> None:
        self.metrics.iteration(rec)
        try:
            self.telemetry.observe_iteration(rec)
        except Exception:   # runs in a worker's reader task: telemetry must not end it
            log.exception("telemetry: iteration record from %s not taken", rec.worker)
        self.sink.iteration(rec)

    def finished(self, comp) -> None:
        self.record(comp.record())

    def rejected(self, endpoint: str, tenant: str, request_id: str, arrival: float,
                 message: str, reason: str = "overloaded") -> None:
        """The record of a request refused at admission before it was parsed (overloaded,
        rate-limited, over budget): no tokens, no worker, status "rejected", the reason
        in `finish_reason`. It costs nothing; the ledger counts it for its tenant."""
        self.record(RequestRecord(
            request_id=request_id, tenant=tenant, model=self.model_name, endpoint=endpoint,
            prompt_tokens=0, output_tokens=0, cached_tokens=0, arrival=arrival,
            first_token=None, finish=time.time(), prefill_worker=None, decode_worker=None,
            status="rejected", finish_reason=reason, error=message, simulated=self.simulated))

    def record(self, rec: RequestRecord) -> None:
        """A finished request (served, failed, aborted or rejected) to everything that
        counts it: /metrics, the planner's trends, telemetry's latency window, the sink."""
        # a key added at run time (the keys file) labels its tenant too
        tenant_label = rec.tenant if (rec.tenant in self._tenants
                                      or rec.tenant in self.auth.tenants) else "other"
        self.metrics.request(rec, tenant_label)
        policy = False
        if rec.status == "rejected":
            reason = rec.finish_reason or "overloaded"
            self.metrics.tenant_rejected(tenant_label, reason)
            if reason == "overloaded":
                self.metrics.rejected()
                self.tenants.count_rejected(rec.tenant, reason)
            else:   # a limit refused it, not capacity: not demand for the planner to size for
                policy = True
        if self.planner is not None and not policy:
            self.planner.observe(rec)
        try:
            self.telemetry.observe_request(rec)
        except Exception:
            log.exception("telemetry: request record not taken")
        try:
            self.sink.request(rec)
        except Exception:   # a broken sink must not break serving
            log.exception("request sink failed")

    # ---- reload -----------------------------------------------------------------------
    def reload(self) -> dict:
        """`applianced reload` / SIGHUP: re-read [tenants] and [budgets] from the config
        file, validated first. A bad file raises ConfigError (one line) and changes
        nothing; other sections need a restart and are not applied."""
        from appliance import config as config_mod
        if self.config_path is None:
            raise config_mod.ConfigError(
                "no config file to reload (the daemon started with the defaults; start it "
                "with --config FILE)")
        new = config_mod.load(self.config_path)
        # the live config too: what reads cfg.tenants (fair queuing's weights) sees it
        self.cfg.tenants, self.cfg.budgets = new.tenants, new.budgets
        self.tenants.reload(new.tenants, new.budgets)
        self.router.gate.set_tenants(new.tenants)     # weights, classes, max_concurrent
        if self.accounting is not None:
            self.accounting.set_budgets(new.budgets)
        log.info("reloaded [tenants] and [budgets] from %s: %d tenant table(s), %d enforced "
                 "budget(s)", self.config_path, len(new.tenants),
                 sum(m != "alert" for m in new.budgets.enforce.values()))
        return {"reloaded": str(self.config_path), "tenants": sorted(new.tenants),
                "budgets": {"period": new.budgets.period, "enforce": dict(new.budgets.enforce)},
                "reloads": self.tenants.reloads,
                "note": "only [tenants] and [budgets] are applied; other sections need a restart"}

    # ---- status -----------------------------------------------------------------------
    def status(self) -> dict:
        """The inventory, plan and workers, with the telemetry hub's live keys; each device
        row gets its live readings merged in."""
        s = self.setup
        workers = [{**w.status(), "routed": w.id in self.router.routed}
                   for w in self.pool.workers.values()]
        try:
            live = telemetry_status.status_fields(self.telemetry, workers)
        except Exception:   # the inventory and workers are still worth showing
            log.exception("telemetry: live status failed")
            live = {"devices": []}
        live_devices = {d["id"]: d for d in live.pop("devices")}
        inv = inventory_json(s.inventory, self.plan)
        inv["devices"] = [{**d, **live_devices.get(d["id"], {})} for d in inv["devices"]]
        return {
            "version": __version__, "simulated": self.simulated, "engine": s.engine,
            "model": self.model_name, "model_dir": str(self.state.model.model_dir),
            "max_context": self.max_context,
            "mode": self.plan.mode, "uptime_s": round(time.time() - self.started_at, 3),
            "ready": self.router.ready(), "draining": self.draining or not self.admission_open,
            "admission": "open" if self.admission_open else "closed", "inflight": self.inflight,
            "preparing": self.preparing,
            "prepared": {"inline": self.prepare_pool.inline, "pooled": self.prepare_pool.pooled,
                         "inline_bytes": self.prepare_pool.inline_bytes},
            "max_batch_tokens": s.batch_tokens,
            # where a decode worker prefills prompts itself, as applied (0: never)
            "conditional_disagg": {"prompt_tokens": self.router.conditional_tokens,
                                   "queue_tokens": self.router.queue_tokens,
                                   "prefill_share": self.router.prefill_share},
            # engine.decode_max_seqs and engine.decode_kv_gate, as applied, and what they hold
            "decode_admission": self.router.decode_admission(),
            **inv,
            "partition": split_of(self.plan),
            "workers": workers,
            **live,
            "workflows": {**self.workflows.summary(), "recovery": self.recovery},
            "cluster": {"role": self.cfg.cluster.role,
                        "peers": self.peers.status() if self.peers is not None else []},
        }
