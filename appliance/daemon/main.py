"""Runs the appliance: journal -> setup -> subsystems -> Service -> app -> serve -> drain.

The only module that knows every other, and the only one that builds: every subsystem
first (workers, router, telemetry, accounting link, workflow engine, planner), then the
`Service` from them, then the aiohttp app. Nothing imports it but the CLI. Everything
started is entered into one `AsyncExitStack` as it starts, so teardown is written once
and runs in reverse on every path out: a clean drain, or any start-up failure (the
journal is always closed, the workers and the accounting process always stopped).
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import sqlite3
import sys
import time
from pathlib import Path

from aiohttp import web

from appliance import keystore
from appliance.accounting.records import LogSink, RecordSink
from appliance.audit import AuditLog
from appliance.config import Config
from appliance.daemon import planner_link, systemd
from appliance.daemon.accounting_link import record_sink, start_accounting
from appliance.daemon.affinity import DaemonAffinity
from appliance.daemon.auth import Auth
from appliance.daemon.control import Control, kill_orphans
from appliance.daemon.http_parser_errors import ApplianceRunner
from appliance.daemon.key_watch import KeyWatcher
from appliance.daemon.listeners import TlsError, TlsSetup, is_loopback_host, tls_setup
from appliance.daemon.metrics import Metrics
from appliance.daemon.peers import Peers
from appliance.daemon.prepare import PreparePool
from appliance.daemon.router import Router
from appliance.daemon.server import build_app
from appliance.daemon.service import Service, labelled_tenants
from appliance.daemon.setup import (Setup, StartupError, plan_setup, queue_tokens,
                                     weight_bytes)
from appliance.daemon.state import ServedModel, ServingState, context_limits
from appliance.daemon.tenants import TenantPolicy
from appliance.daemon.workers import WorkerGone, WorkerPool
from appliance.telemetry import build_telemetry
from appliance.workflows.engine import WorkflowEngine
from appliance.workflows.journal import Journal
from appliance.workflows.kinds import Options

log = logging.getLogger("applianced")


def open_journal(state_dir: Path) -> Journal:
    try:
        return Journal(state_dir / "workflows.db")
    except sqlite3.Error as exc:
        raise StartupError(f"cannot open the workflow journal {state_dir / 'workflows.db'}: "
                           f"{exc}") from None


def build_auth(cfg: Config, state_dir: Path) -> tuple[Auth, KeyWatcher]:
    """The config's keys and the keys file's, merged (a name in both: StartupError). The
    file keys' tenant tags join the config's (for the ledger's reports), config first."""
    auth = Auth(cfg.auth.keys, cfg.auth.admin_keys, cfg.auth.metrics_access,
                key_names=cfg.auth.key_names, client_ca=bool(cfg.auth.admin_client_ca),
                admin_port=cfg.server.admin_port)
    watcher = KeyWatcher(auth, state_dir)
    try:
        watcher.load()
        records = keystore.read(watcher.path)
    except ValueError as exc:
        raise StartupError(f"keys: {exc}") from None
    for r in records:
        if r.tenant and r.tags and r.revoked is None:
            have = cfg.auth.tenant_tags.setdefault(r.tenant, {})
            for k, v in r.tags.items():
                have.setdefault(k, v)
    return auth, watcher


async def build_service(cfg: Config, setup: Setup, journal: Journal, state_dir: Path,
                        sink: RecordSink | None, stack: contextlib.AsyncExitStack,
                        auth: Auth, config_path: Path | None = None) -> Service:
    """Every subsystem, then the Service from them. Nothing is started but the
    accounting process (it must hold the ledger before any worker runs); what needs
    stopping is pushed onto `stack`."""
    e = cfg.engine
    served = ServedModel(setup.model_name, setup.model_dir, e.model_spec or None,
                         setup.max_context, tool_parser=e.tool_parser,
                         reasoning_parser=e.reasoning_parser)
    state = ServingState(served, setup.plan, cfg.server.max_inflight,
                         admission_open=journal.get_state("admission") != "closed")
    pool = WorkerPool(setup.specs, backoff_s=cfg.workers.restart_backoff_s,
                      backoff_max_s=cfg.workers.restart_backoff_max_s,
                      start_timeout_s=cfg.workers.start_timeout_s)
    pool.ready_listeners.append(
        lambda w: journal.worker_started(w.id, w.proc.pid, list(w.spec.devices)))
    # Off the CPU decode workers' cores before any helper process starts (they inherit
    # it), and again whenever a worker (re)starts: a repartition may move the decoders.
    daemon_affinity = DaemonAffinity(e.daemon_cores)
    daemon_affinity.update(setup.specs, set())
    pool.ready_listeners.append(lambda w: daemon_affinity.update(
        [x.spec for x in pool.workers.values()], {p for p in pool.pids().values() if p}))
    c = cfg.cluster
    peers = Peers(c.peers, c.key) if c.role != "both" else None
    router = Router(pool, setup.plan.mode, e.conditional_disagg_tokens, cfg.tenants,
                    fair_queuing=e.fair_queuing, role=c.role, peers=peers,
                    model_name=lambda: state.model.name, decode_kv_gate=e.decode_kv_gate,
                    decode_kv_gate_wait_s=e.decode_kv_gate_wait_s, decode_max_seqs=e.decode_max_seqs,
                    queue_tokens=queue_tokens(e.conditional_disagg_queue_tokens, setup.specs),
                    prefill_share=e.conditional_disagg_prefill_share)
    t = cfg.telemetry
    telemetry = build_telemetry(
        setup.inventory, setup.plan, worker_cores={s.worker: s.cpu_cores for s in setup.specs},
        weight_bytes=weight_bytes(e.model_spec), worker_pids=pool.pids,
        site=cfg.site.name, appliance=cfg.site.appliance,
        sample_interval_s=t.sample_interval_s, retain_s=t.retain_s, rapl_dir=t.rapl_dir,
        cpu_idle_w_per_core=t.cpu_idle_w_per_core, cpu_busy_w_per_core=t.cpu_busy_w_per_core)
    metrics = Metrics(pool, served, setup.simulated, telemetry=telemetry, site=cfg.site.name,
                      appliance=telemetry.appliance, admission=router.decode_admission)
    try:
        accounting = await start_accounting(cfg, setup, state, pool,
                                            labelled_tenants(cfg) | auth.tenants,
                                            metrics, telemetry, state_dir)
    except ValueError as exc:   # a bad carbon intensity file, an unusable ledger
        raise StartupError(str(exc)) from None
    if accounting is not None:
        # the accounting process closes the last partial window (its energy from the
        # still-running sampler), completes every finished request's row, one commit
        stack.push_async_callback(accounting.stop)
        pool.frame_tap = accounting.frame
    prepare_pool = PreparePool(served.model_dir, tool_parser=e.tool_parser,
                               inline_bytes=cfg.server.prepare_inline_bytes)
    stack.callback(prepare_pool.close)
    control = Control(cfg, setup, state, pool, router, journal, telemetry,
                      profile_dir=state_dir / "profiles")
    workflows = WorkflowEngine(journal, control,
                               Options(drain_timeout_s=cfg.workflows.drain_timeout_s),
                               max_recoveries=cfg.workflows.max_recoveries)
    planner = planner_link.start_planner(cfg, setup, state, workflows, state_dir,
                                         metrics.registry)
    tenants = TenantPolicy(cfg.tenants, cfg.budgets,
                           budget_report=accounting.budget_report if accounting else None)
    return Service(cfg, setup, state, pool=pool, router=router, metrics=metrics,
                   auth=auth,
                   sink=record_sink(sink or LogSink(enabled=cfg.server.log_requests), accounting),
                   prepare_pool=prepare_pool, telemetry=telemetry, journal=journal,
                   workflows=workflows, tenants=tenants, planner=planner,
                   accounting=accounting, config_path=config_path, peers=peers)


def warn_if_exposed(cfg: Config, auth: Auth | None = None, tls: bool = False) -> None:
    """Bound beyond loopback without keys, anyone on the network may use the API; without
    TLS, keys and prompts cross the network in clear text."""
    if is_loopback_host(cfg.server.host) and (
            not cfg.server.admin_port or is_loopback_host(cfg.server.admin_host)):
        return
    host = cfg.server.host
    if not tls:
        log.warning("listening on %s without TLS ([server] tls_cert/tls_key): API keys and "
                    "prompts cross the network in clear text", host)
    if not (auth.keys if auth else cfg.auth.keys):
        log.warning("listening on %s with no API keys ([auth.keys] or `applianced keys "
                    "add`): anyone who can reach this address may use the API", host)
    if not (auth.admin_keys if auth else cfg.auth.admin_keys):
        log.warning("listening on %s with no admin keys: the admin API answers "
                    "loopback clients only", host)


def status_line(svc: Service, phase: str) -> str:
    """What `systemctl status` shows (STATUS=): workers ready out of all, and any that are
    not, by name and state."""
    workers = list(svc.pool.workers.values())
    ready = sum(w.ready for w in workers)
    line = f"{phase} {svc.model_name}: {ready}/{len(workers)} workers ready"
    others = [f"{w.id} {w.state}" for w in workers if not w.ready]
    if others and phase == "serving":
        line += "; " + ", ".join(others[:4]) + (" ..." if len(others) > 4 else "")
    return line


async def status_loop(svc: Service, phase: list[str], every: float = 0.5) -> None:
    """Send STATUS= whenever the line changes (workers becoming ready, dying, restarting)."""
    last = None
    while True:
        line = status_line(svc, phase[0])
        if line != last:
            systemd.notify(f"STATUS={line}")
            last = line
        await asyncio.sleep(every)


def _progress_printer():
    if sys.stderr.isatty():
        return lambda line: print(f"applianced: {line}", file=sys.stderr, flush=True)
    return lambda line: log.info("%s", line)


def _cancel_all(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()


async def run_daemon(cfg: Config, state_dir: Path, sink: RecordSink | None = None,
                     config_path: Path | None = None) -> int:
    # First, before any child starts: inherited listening sockets and their variables.
    inherited = systemd.listen_sockets()
    state_dir.mkdir(parents=True, exist_ok=True)
    audit = AuditLog.in_state_dir(state_dir,
                                  journal=systemd.journal_sender("applianced-audit"))

    def tls_changed(loaded: bool, error: str) -> None:
        audit.record("tls.reload", "file watch", "reloaded" if loaded else
                     f"kept the previous: {error}", params={"cert": cfg.server.tls_cert})
    try:                # before anything slow: a bad certificate or key fails at once
        tls = tls_setup(cfg, tls_changed)
    except TlsError as exc:
        raise StartupError(str(exc)) from None
    auth, key_watcher = build_auth(cfg, state_dir)
    systemd.notify("STATUS=preparing the model")
    async with contextlib.AsyncExitStack() as stack:
        journal = open_journal(state_dir)
        stack.callback(journal.close)
        background: list[asyncio.Task] = []     # cancelled late: after accounting's stop
        stack.callback(_cancel_all, background)
        # Workers a previous daemon left behind (it died without taking them along): none
        # should survive PR_SET_PDEATHSIG; any that did would hold devices twice.
        orphans = kill_orphans(journal.recorded_workers())
        journal.forget_workers()
        persisted = {k: v for k in ("partition", "model") if (v := journal.get_state(k)) is not None}
        try:
            with systemd.KeepExtending():   # may generate the default model (seconds to minutes)
                setup = plan_setup(cfg, state_dir, progress=_progress_printer(),
                                   persisted=persisted)
        except ValueError as exc:   # bad device spec, impossible split, unknown model spec
            raise StartupError(str(exc)) from None
        if setup.inventory.note:
            log.warning("%s", setup.inventory.note)
        log.info("plan: %s", setup.plan.reason)
        svc = await build_service(cfg, setup, journal, state_dir, sink, stack, auth, config_path)
        phase = ["loading"]
        status = (asyncio.create_task(status_loop(svc, phase))
                  if os.environ.get("NOTIFY_SOCKET") else None)
        background += [status] if status else []
        runner = ApplianceRunner(build_app(svc, cfg.server.max_body_bytes, audit),
                                 svc.next_request_id,
                                 handler_cancellation=True, access_log=None)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        worker_stop_s = [2.0]           # a failed start-up: no requests to wait for

        async def stop_workers() -> None:
            await svc.pool.stop(worker_stop_s[0])
            journal.forget_workers()
        stack.push_async_callback(stop_workers)
        try:
            with systemd.KeepExtending():   # workers load weights and warm up before Hello
                await asyncio.gather(svc.pool.start(), svc.prepare_pool.start())
        except (WorkerGone, OSError) as exc:
            raise StartupError(str(exc)) from None
        svc.state.model.cap_context(context_limits(svc.pool.workers.values()))
        if svc.peers is not None:   # polled from now on; the first poll before serving
            await svc.peers.start()
            stack.push_async_callback(svc.peers.stop)
        unfinished = len(journal.list(1000, unfinished=True))
        if unfinished:
            systemd.notify(f"STATUS=reconciling {unfinished} unfinished workflow(s)")
        svc.recover(orphans)
        if svc.planner is not None:
            await stack.enter_async_context(planner_link.running(svc.planner))
        sites, where = listener_sites(cfg, runner, inherited, tls)
        for site, addr in sites:
            try:
                await site.start()
            except OSError as exc:
                raise StartupError(f"cannot listen on {addr}: {exc.strerror}") from None
            stack.push_async_callback(site.stop)
        worker_stop_s[0] = 10.0
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, reload_on_sighup, svc, tls, key_watcher, audit)
        warn_if_exposed(cfg, auth, tls.enabled)
        log.info("serving %s on %s (%s, %s%s)", svc.model_name, where, setup.engine,
                 setup.plan.mode, ", simulated" if svc.simulated else "")
        host, port = (cfg.server.host, cfg.server.port) if not inherited else _host_port(inherited[0])
        print(json.dumps({"event": "ready", "host": host, "port": port,
                          "model": svc.model_name, "engine": setup.engine,
                          "simulated": svc.simulated, "tls": tls.enabled}), file=sys.stderr, flush=True)
        phase[0] = "serving"
        tune_gc()
        systemd.notify("READY=1", f"STATUS={status_line(svc, 'serving')}")
        background.append(asyncio.create_task(systemd.watchdog_loop()))
        background.append(asyncio.create_task(svc.telemetry.run(), name="telemetry"))
        background.append(asyncio.create_task(key_watcher.run(), name="keys"))
        if tls.watcher is not None:
            background.append(asyncio.create_task(tls.watcher.run(), name="tls"))
        svc.workflows.resume_all()
        await stop.wait()
        await svc.workflows.close()
        # Drain: refuse new work, let in-flight requests finish; the stack then stops the
        # listeners, the workers, the app, the preparation pool, accounting, the journal.
        if status:
            status.cancel()
        systemd.notify("STOPPING=1", f"STATUS=draining {svc.inflight} requests")
        svc.state.draining = True
        started = time.monotonic()
        pending = svc.inflight
        deadline = started + cfg.server.drain_timeout_s
        while svc.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        cut = svc.inflight
        drained_s = time.monotonic() - started
    # One line for the operator: what the drain did and how the daemon ends.
    log.log(logging.WARNING if cut else logging.INFO,
            "stopped: drained %d of %d in-flight generations in %.1f s%s; exit 0",
            pending - cut, pending, drained_s,
            f", {cut} cut off at server.drain_timeout_s" if cut else "")
    return 0


def listener_sites(cfg: Config, runner, inherited: list, tls: TlsSetup):
    """[(site, its address)], and the API's address for the log: the inherited sockets
    (socket activation: systemd chose the address) or server.host/port, each with the
    API's TLS context; plus the admin listener when server.admin_port is set."""
    scheme = "https" if tls.enabled else "http"
    if inherited:
        sites = [(web.SockSite(runner, sock, ssl_context=tls.api), _sock_name(sock))
                 for sock in inherited]
        where = ", ".join(addr for _, addr in sites)
        log.info("listening on %s, passed by systemd (server.host/port not used)", where)
    else:
        where = f"{cfg.server.host}:{cfg.server.port}"
        sites = [(web.TCPSite(runner, cfg.server.host, cfg.server.port, reuse_address=True,
                              ssl_context=tls.api), where)]
    if cfg.server.admin_port:
        addr = f"{cfg.server.admin_host}:{cfg.server.admin_port}"
        sites.append((web.TCPSite(runner, cfg.server.admin_host, cfg.server.admin_port,
                                  reuse_address=True, ssl_context=tls.admin), addr))
        log.info("admin API on %s://%s (not on the API listener)", scheme, addr)
    return sites, f"{scheme}://{where}"


def reload_on_sighup(svc: Service, tls: TlsSetup, keys: KeyWatcher, audit: AuditLog) -> None:
    """SIGHUP: as `applianced reload` (re-read [tenants] and [budgets] from the config file;
    a bad file keeps the old limits, one log line), and re-read the TLS certificate and key
    and the keys file now (both are also picked up on their own when the files change).
    Audited as `reload`."""
    from appliance.config import ConfigError
    results = {}
    if tls.watcher is not None:
        results["tls"] = "reloaded" if tls.watcher.reload("SIGHUP") else "kept the previous"
    results["keys"] = "reloaded" if keys.poll(force=True) else "kept the previous"
    if svc.config_path is not None:      # started on the defaults: no [tenants] to re-read
        try:
            svc.reload()
            results["tenants and budgets"] = "reloaded"
        except ConfigError as exc:
            log.error("reload refused, the old limits stay: %s", exc)
            results["tenants and budgets"] = f"kept the previous: {exc}"
    audit.record("reload", "SIGHUP", ", ".join(f"{k}: {v}" for k, v in results.items()),
                 params={"signal": "SIGHUP"})


def _host_port(sock) -> tuple[str, int | None]:
    name = sock.getsockname()
    return (name[0], name[1]) if isinstance(name, tuple) else (str(name), None)


def _sock_name(sock) -> str:
    host, port = _host_port(sock)
    return f"{host}:{port}" if port is not None else host


GC_YOUNG_THRESHOLD = 10_000


def tune_gc() -> None:
    """Once serving starts: freeze what start-up built (models, config, tables: never
    garbage) out of the collector's sight, and collect the young generation every 10,000
    allocations instead of 700. A request's objects live for one round trip, tens of
    milliseconds, in which the loop allocates thousands of objects: at 700 they were
    scanned and promoted while still alive, and the ledger's windows (seconds of
    iteration records) were scanned again and again. Measured with gc.callbacks at 2,000
    requests/s, accounting on: the collector's time per request fell from ~55 to ~17 µs.
    Only cyclic garbage waits longer to be freed; reference counting frees the rest."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, 10, 10)


def serve(cfg: Config, state_dir: Path, config_path: Path | None = None) -> int:
    # Under systemd, records go to the journal with their fields (systemd.JournalHandler).
    logging.basicConfig(level=os.environ.get("APPLIANCED_LOG", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        handlers=[systemd.log_handler()])
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run
    try:
        return runner(run_daemon(cfg, state_dir, config_path=config_path))
    except StartupError as exc:
        print(f"applianced: {exc}", file=sys.stderr)
        return 1
