"""Wires the appliance together and runs it: devices -> plan -> workers -> router -> HTTP.

The only module that knows every other; nothing imports it but the CLI.
"""
from __future__ import annotations

import asyncio
import gc
import importlib.util
import itertools
import json
import logging
import os
import secrets
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
from aiohttp import web

from appliance import __version__
from appliance.accounting.records import LogSink, RecordSink
from appliance.config import Config
from appliance.daemon import accounting_link, systemd
from appliance.daemon.auth import Auth
from appliance.daemon.control import Control, kill_orphans
from appliance.daemon.metrics import Metrics
from appliance.daemon.prepare import PreparePool
from appliance.daemon.http_parser_errors import ApplianceRunner
from appliance.daemon.router import Router
from appliance.daemon.server import build_app
from appliance.daemon.tokenizer import ServedTokenizer
from appliance.daemon.workers import WorkerGone, WorkerPool, program_command
from appliance.partitions import Inventory, PartitionPlan, discover, inventory_json, plan_partition
from appliance.workflows.engine import WorkflowEngine
from appliance.workflows.journal import Journal
from appliance.workflows.kinds import Options
from appliance.workflows.machine import ModelRef, split_of
from appliance.telemetry import build_telemetry
from appliance.worker.spec import WorkerSpec

log = logging.getLogger("applianced")


class StartupError(Exception):
    """One line for the operator; the daemon exits 1."""


@dataclass
class Setup:
    """Everything decided before any process starts (also what `devices` prints)."""

    inventory: Inventory
    plan: PartitionPlan
    engine: str
    model_dir: Path
    model_name: str
    max_context: int
    specs: list[WorkerSpec]
    batch_tokens: dict | None = None     # engine.max_batch_tokens as applied (status, plan)

    @property
    def simulated(self) -> bool:
        return self.engine == "sim" or any(d.simulated for d in self.inventory.devices)


def resolve_engine(kind: str, inv: Inventory) -> str:
    """`auto`: simulated devices -> sim; the CPU -> torch when torch is installed, else
    sim; real GPUs -> TensorRT-LLM if installed, else torch. Checked without importing:
    the daemon itself never loads torch."""
    if kind != "auto":
        return kind
    if inv.source == "sim":
        return "sim"
    has_torch = (importlib.util.find_spec("torch") is not None
                 and importlib.util.find_spec("appliance.engines.torch_engine") is not None)
    if inv.source == "cpu":
        return "torch" if has_torch else "sim"
    return "trtllm" if importlib.util.find_spec("tensorrt_llm") else "torch"


def _max_context(model_dir: Path, model_spec: str) -> int:
    from appliance.models.specs import lookup_model_spec, spec_from_hf_config
    spec = lookup_model_spec(model_spec) if model_spec else spec_from_hf_config(model_dir / "config.json")
    return spec.max_context


def default_model(state_dir: Path, progress=None) -> Path:
    """The generated tiny model under the state dir, built once, in a child process:
    making weights loads torch, which the daemon itself never needs (~250 MB of RSS)."""
    from appliance.models.tiny import DEFAULT_MODEL_NAME, is_complete
    path = state_dir / "models" / DEFAULT_MODEL_NAME
    if not is_complete(path):
        if progress:
            progress(f"generating the default model in {path} (once)")
        done = subprocess.run(program_command() + ["model", "ensure-default", str(state_dir)],
                              stdin=subprocess.DEVNULL)
        if done.returncode != 0 or not is_complete(path):
            raise StartupError(f"could not generate the default model in {path}")
    return path


def persisted_plan(inv: Inventory, cfg: Config, data: dict | None) -> PartitionPlan | None:
    """The partition a workflow persisted, if it still fits this machine and config
    (the same mode and tp, every device present): it overrides devices.split."""
    if not data:
        return None
    from appliance.workflows.machine import plan_from_json
    try:
        plan = plan_from_json(data)
    except (KeyError, TypeError, ValueError):
        log.warning("ignoring a malformed persisted partition")
        return None
    usable = {d.id for d in inv.devices if not d.lost}
    missing = sorted({d for s in plan.workers() for d in s.devices} - usable)
    if plan.mode != cfg.devices.mode or plan.tp != cfg.devices.tp or missing:
        why = f"devices {missing} are not here" if missing else \
            f"it is {plan.mode} tp={plan.tp}, the config says {cfg.devices.mode} tp={cfg.devices.tp}"
        log.warning("ignoring the persisted partition (%s): planning from the config", why)
        return None
    return plan


def plan_setup(cfg: Config, state_dir: Path, progress=None, persisted: dict | None = None) -> Setup:
    """What to run. `persisted` (from the workflow journal: partition, model) overrides
    the config's devices.split and engine.model/model_spec: a workflow's change survives
    restarts."""
    persisted = persisted or {}
    inv = discover(cfg.devices.spec)
    plan = persisted_plan(inv, cfg, persisted.get("partition")) or \
        plan_partition(inv, tp=cfg.devices.tp, split=cfg.devices.split, mode=cfg.devices.mode)
    engine = resolve_engine(cfg.engine.kind, inv)
    model = persisted.get("model")
    if model and not (Path(model["model_dir"]) / "config.json").exists():
        log.warning("ignoring the persisted model: %s has no config.json", model["model_dir"])
        model = None
    if model:
        import dataclasses
        cfg.engine = dataclasses.replace(cfg.engine, model=model["model_dir"],
                                         model_spec=model.get("model_spec") or "",
                                         model_name=model["name"])
    if cfg.engine.model:
        model_dir = Path(cfg.engine.model).expanduser()
        if not (model_dir / "config.json").exists():
            raise StartupError(f"model directory {model_dir} has no config.json")
    else:
        model_dir = default_model(state_dir, progress)
    if not (model_dir / "tokenizer.json").exists():
        raise StartupError(f"model directory {model_dir} has no tokenizer.json")
    e = cfg.engine
    name = e.model_name or e.model_spec or model_dir.name
    try:
        max_context = _max_context(model_dir, e.model_spec)
    except (ValueError, OSError) as exc:
        raise StartupError(str(exc)) from None
    budgets = (token_budgets(cfg, inv, plan, engine, model_dir, state_dir / "profiles", max_context)
               if e.max_batch_tokens == 0 else {})
    specs = worker_specs(cfg, inv, plan, engine, model_dir, budgets=budgets)
    check_cpu_memory(specs, model_dir, psutil.virtual_memory().available)
    from appliance.planner.tuning import batch_tokens_json
    applied = batch_tokens_json(e.max_batch_tokens, {s.worker: (s.role, s.max_batch_tokens)
                                                     for s in specs}, budgets)
    return Setup(inv, plan, engine, model_dir, name, max_context, specs, applied)


def token_budgets(cfg: Config, inv: Inventory, plan: PartitionPlan, engine: str,
                  model_dir: Path, profile_dir: Path | None, max_context: int) -> dict:
    """`engine.max_batch_tokens = 0`: each worker's prefill token budget from the profile
    of its device (`appliance.planner.tuning`), worker name -> TokenBudget."""
    from appliance.models.specs import lookup_model_spec, spec_from_hf_config
    from appliance.planner.tuning import token_budget
    e = cfg.engine
    try:
        model = (lookup_model_spec(e.model_spec) if e.model_spec
                 else spec_from_hf_config(model_dir / "config.json"))
    except (ValueError, OSError, KeyError) as exc:
        raise StartupError(f"engine.max_batch_tokens = 0 needs the model's shape: {exc}") from None
    # TensorRT-LLM's max_num_tokens bounds one step: a longer prompt fails unless chunked.
    floor = max_context if engine == "trtllm" and e.prefill_chunk_tokens == 0 else 0
    devices = {d.id: d for d in inv.devices}
    by_device: dict = {}
    out = {}
    for slot in plan.workers():
        spec = devices[slot.devices[0]].spec
        key = spec.name if spec is not None else "cpu"
        if key not in by_device:
            by_device[key] = token_budget(model, spec, plan.tp, profile_dir,
                                          mem_fraction=e.gpu_mem_fraction, floor=floor)
        out[slot.worker] = by_device[key]
    return out


# What a torch CPU worker holds besides its weights and KV pool: the interpreter, torch,
# oneDNN's scratch, the kept-free heap of `cpu_heap` (measured: 0.3-0.5 GiB on the tiny
# model; the heap can keep up to 1 GiB more under load).
CPU_WORKER_OVERHEAD_BYTES = 1 << 30


def check_cpu_memory(specs: list[WorkerSpec], model_dir: Path, available: int) -> None:
    """Every torch worker on the CPU holds the whole model in fp32 plus its KV pool.
    Refuse to start what cannot fit, with the numbers, rather than let the kernel's OOM
    killer pick a victim in the middle of loading (the daemon, possibly)."""
    cpu = [s for s in specs if s.engine == "torch" and s.device_kind == "cpu"]
    if not cpu:
        return
    from appliance.models.specs import spec_from_hf_config
    try:
        weights = spec_from_hf_config(model_dir / "config.json").params * 4
    except (ValueError, KeyError, OSError):
        return      # not a shape we can size: the worker reports what is wrong with it
    each = [weights + s.kv_cache_bytes + CPU_WORKER_OVERHEAD_BYTES for s in cpu]
    if sum(each) > available:
        raise StartupError(
            f"{len(cpu)} CPU worker(s) need {_size(sum(each))} but {_size(available)} of "
            f"memory is available: each holds {_size(weights)} of fp32 weights, a "
            f"{_size(cpu[0].kv_cache_bytes)} KV pool and ~1 GiB of runtime. Use --mode agg "
            "(one worker), a smaller engine.kv_cache_bytes, or a smaller model")


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


def allowed_cores() -> list[int]:
    """The CPU ids this process may run on (its cpuset / affinity); workers inherit it."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def cpu_core_sets(workers: int, threads: int, cores: list[int]) -> list[list[int]]:
    """The cores each of `workers` CPU workers is pinned to: `threads` each, or with 0 the
    cores split evenly (at least one each; a remainder stays idle). Disjoint while there
    are enough cores, so a prefill never takes cycles from the decode steps beside it;
    with too few, workers share them round robin."""
    per = threads or max(1, len(cores) // workers)
    return [sorted({cores[(w * per + i) % len(cores)] for i in range(per)})
            for w in range(workers)]


def worker_specs(cfg: Config, inv: Inventory, plan: PartitionPlan, engine: str,
                 model_dir: Path, cores: list[int] | None = None,
                 budgets: dict | None = None) -> list[WorkerSpec]:
    """One WorkerSpec per slot of the plan; CPU workers get their own cores
    (`cpu_core_sets` over `cores`, by default the ones this process may use). `budgets`:
    the prefill token budget per worker when `engine.max_batch_tokens` is 0 (auto)."""
    from appliance.planner.tuning import DEFAULT_MAX_BATCH_TOKENS
    e = cfg.engine
    devices = {d.id: d for d in inv.devices}
    specs = []
    slots = plan.workers()
    cpu_slots = [s.worker for s in slots if devices[s.devices[0]].kind == "cpu"]
    core_sets = dict(zip(cpu_slots, cpu_core_sets(len(cpu_slots), e.cpu_threads,
                                                  cores or allowed_cores()))) if cpu_slots else {}
    for slot in slots:
        first = devices[slot.devices[0]]
        pinned = core_sets.get(slot.worker, [])
        specs.append(WorkerSpec(
            worker=slot.worker, role=slot.role, engine=engine, devices=list(slot.devices),
            device_kind=first.kind, model_dir=str(model_dir),
            gpu_name=first.spec.name if first.spec else None,
            device_uuids=[devices[d].uuid or "" for d in slot.devices],
            cpu_cores=pinned, cpu_threads=e.cpu_threads or max(1, len(pinned)),
            model_spec=e.model_spec or None, sim_speed=e.sim_speed, block_size=e.block_size,
            max_batch_tokens=(e.max_batch_tokens if e.max_batch_tokens > 0 else
                              budgets[slot.worker].tokens if budgets and slot.worker in budgets
                              else DEFAULT_MAX_BATCH_TOKENS), max_seqs=e.max_seqs,
            kv_cache_bytes=e.kv_cache_bytes, gpu_mem_fraction=e.gpu_mem_fraction,
            handoff_timeout_s=e.handoff_timeout_s, reserve_ratio=e.reserve_ratio,
            prefill_chunk_tokens=e.prefill_chunk_tokens))
    for spec in specs:
        # KV flows between the phases: a worker must see the other phase's GPUs.
        spec.peer_uuids = [u for other in specs if other.role != spec.role
                           for u in other.device_uuids if u and u not in spec.device_uuids]
    return specs


class Service:
    """The running appliance, as the HTTP handlers see it."""

    def __init__(self, cfg: Config, setup: Setup, sink: RecordSink | None = None):
        self.cfg = cfg
        self.setup = setup
        self.model_name = setup.model_name
        self.max_context = setup.max_context
        self.simulated = setup.simulated
        self.fingerprint = f"applianced-{__version__}-{setup.engine}"
        self.tokenizer = ServedTokenizer(setup.model_dir)
        self.prepare_pool = PreparePool(setup.model_dir, tokenizer=self.tokenizer,
                                        inline_bytes=cfg.server.prepare_inline_bytes)
        self.sink = sink or LogSink(enabled=cfg.server.log_requests)
        self.accountant = None          # accounting_link.attach sets it (accounting enabled)
        self.pool = WorkerPool(setup.specs, self._on_iteration,
                               backoff_s=cfg.workers.restart_backoff_s,
                               backoff_max_s=cfg.workers.restart_backoff_max_s,
                               start_timeout_s=cfg.workers.start_timeout_s)
        self.router = Router(self.pool, setup.plan.mode, cfg.engine.conditional_disagg_tokens)
        self.telemetry = build_telemetry(
            setup.inventory, setup.plan,
            worker_cores={s.worker: s.cpu_cores for s in setup.specs},
            weight_bytes=_weight_bytes(cfg.engine.model_spec), worker_pids=self._worker_pids,
            site=cfg.site.name, appliance=cfg.site.appliance,
            sample_interval_s=cfg.telemetry.sample_interval_s, retain_s=cfg.telemetry.retain_s,
            rapl_dir=cfg.telemetry.rapl_dir,
            cpu_idle_w_per_core=cfg.telemetry.cpu_idle_w_per_core,
            cpu_busy_w_per_core=cfg.telemetry.cpu_busy_w_per_core)
        self.metrics = Metrics(self.pool, self.model_name, self.simulated,
                               telemetry=self.telemetry, site=cfg.site.name,
                               appliance=self.telemetry.appliance)
        self.auth = Auth(cfg.auth.keys, cfg.auth.admin_keys, cfg.auth.metrics_access)
        self._tenants = set(cfg.auth.keys.values()) | {"default"}
        self.max_inflight = cfg.server.max_inflight
        self.inflight = 0
        self.preparing = 0                # requests being parsed and tokenized right now
        self.draining = False
        self.started_at = time.time()
        self.plan = setup.plan                 # the live partition (workflows change it)
        self.model = ModelRef(setup.model_name, str(setup.model_dir), cfg.engine.model_spec or None)
        self.admission_open = True             # False: drained by an operator (workflow)
        self.journal: Journal | None = None
        self.workflows: WorkflowEngine | None = None
        self.recovery: dict = {}               # what start-up found and decided
        self._prefix = secrets.token_hex(4)
        self._ids = itertools.count(1)

    def fit_context_to_pools(self) -> None:
        """A request must fit every worker it may land on, not just the model's context:
        cap the served context (validation, the default max_tokens, /v1/models) to the
        smallest KV pool and to what each engine says it serves exactly (the torch engine
        caps a sliding-window model at its window)."""
        limits = []
        for w in self.pool.workers.values():
            if not w.hello:
                continue
            if w.hello.kv_blocks_total:
                limits.append((w.hello.kv_blocks_total * w.hello.block_size, "the smallest KV pool"))
            if w.hello.max_context:
                limits.append((w.hello.max_context, f"the {w.hello.engine} engine"))
        if limits and min(limits)[0] < self.max_context:
            self.max_context, why = min(limits)
            log.info("context capped to %d tokens by %s", self.max_context, why)

    def set_model(self, model: ModelRef, workers: list[str]) -> None:
        """Serve `model` from now on (the routing switch of swap-model): its name on
        /v1/models, its tokenizer, its context capped by the pools of `workers`."""
        if model.model_dir != self.model.model_dir:
            self.tokenizer = ServedTokenizer(Path(model.model_dir))
        self.setup.model_dir = Path(model.model_dir)
        self.model_name = self.setup.model_name = self.metrics.model = model.name
        self.model = model
        try:
            self.max_context = _max_context(Path(model.model_dir), model.model_spec or "")
        except (ValueError, OSError):
            pass
        limits = [lim for n in workers if (w := self.pool.workers.get(n)) and w.hello
                  for lim in (w.hello.kv_blocks_total * w.hello.block_size, w.hello.max_context)
                  if lim]
        if limits:
            self.max_context = min(self.max_context, min(limits))

    def next_request_id(self) -> str:
        return f"{self._prefix}{next(self._ids):08x}"

    def _worker_pids(self) -> dict[str, int | None]:
        """Worker id -> pid of its live process (read by the CPU sampler's thread)."""
        return {w.id: (w.proc.pid if w.proc is not None and w.proc.returncode is None else None)
                for w in list(self.pool.workers.values())}

    def _on_iteration(self, rec) -> None:
        self.metrics.iteration(rec)
        try:
            self.telemetry.observe_iteration(rec)
        except Exception:   # runs in a worker's reader task: telemetry must not end it
            log.exception("telemetry: iteration record from %s not taken", rec.worker)
        self.sink.iteration(rec)

    def finished(self, comp) -> None:
        rec = comp.record()
        tenant_label = rec.tenant if rec.tenant in self._tenants else "other"
        self.metrics.request(rec, tenant_label)
        if (planner := getattr(self, "planner", None)) is not None: planner.observe(rec)  # noqa: E701
        try:
            self.telemetry.observe_request(rec)
        except Exception:
            log.exception("telemetry: request record not taken")
        try:
            self.sink.request(rec)
        except Exception:   # a broken sink must not break serving
            log.exception("request sink failed")

    def status(self) -> dict:
        """The inventory, plan and workers, with the telemetry hub's live keys; each device
        row gets its live readings merged in."""
        s = self.setup
        workers = [{**w.status(), "routed": w.id in self.router.routed}
                   for w in self.pool.workers.values()]
        try:
            live = self.telemetry.status_fields(workers)
        except Exception:   # the inventory and workers are still worth showing
            log.exception("telemetry: live status failed")
            live = {"devices": []}
        live_devices = {d["id"]: d for d in live.pop("devices")}
        inv = inventory_json(s.inventory, self.plan)
        inv["devices"] = [{**d, **live_devices.get(d["id"], {})} for d in inv["devices"]]
        return {
            "version": __version__, "simulated": self.simulated, "engine": s.engine,
            "model": self.model_name, "model_dir": str(s.model_dir), "max_context": self.max_context,
            "mode": self.plan.mode, "uptime_s": round(time.time() - self.started_at, 3),
            "ready": self.router.ready(), "draining": self.draining or not self.admission_open,
            "admission": "open" if self.admission_open else "closed", "inflight": self.inflight,
            "preparing": self.preparing,
            "prepared": {"inline": self.prepare_pool.inline, "pooled": self.prepare_pool.pooled,
                         "inline_bytes": self.prepare_pool.inline_bytes},
            "max_batch_tokens": s.batch_tokens,
            **inv,
            "partition": split_of(self.plan),
            "workers": workers,
            **live,
            **({"workflows": {**self.workflows.summary(), "recovery": self.recovery}}
               if self.workflows else {}),
        }


def _weight_bytes(model_spec: str) -> float:
    """Bytes per weight of the served model for the simulated power model; bf16 if unknown."""
    if not model_spec:
        return 2.0
    from appliance.models.specs import lookup_model_spec
    try:
        return lookup_model_spec(model_spec).weight_bytes
    except ValueError:
        return 2.0


def warn_if_exposed(cfg: Config) -> None:
    """Bound beyond loopback without keys, anyone on the network may use the API."""
    import ipaddress
    try:
        loopback = ipaddress.ip_address(cfg.server.host).is_loopback
    except ValueError:
        loopback = cfg.server.host == "localhost"
    if loopback:
        return
    if not cfg.auth.keys:
        log.warning("listening on %s with no [auth.keys]: anyone who can reach this address "
                    "may use the API", cfg.server.host)
    if not cfg.auth.admin_keys:
        log.warning("listening on %s with no [auth] admin_keys: the admin API answers "
                    "loopback clients only", cfg.server.host)


def status_line(svc: "Service", phase: str) -> str:
    """What `systemctl status` shows (STATUS=): workers ready out of all, and any that are
    not, by name and state."""
    workers = list(svc.pool.workers.values())
    ready = sum(w.ready for w in workers)
    line = f"{phase} {svc.model_name}: {ready}/{len(workers)} workers ready"
    others = [f"{w.id} {w.state}" for w in workers if not w.ready]
    if others and phase == "serving":
        line += "; " + ", ".join(others[:4]) + (" ..." if len(others) > 4 else "")
    return line


async def status_loop(svc: "Service", phase: list[str], every: float = 0.5) -> None:
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


async def run_daemon(cfg: Config, state_dir: Path, sink: RecordSink | None = None) -> int:
    # First, before any child starts: inherited listening sockets and their variables.
    inherited = systemd.listen_sockets()
    state_dir.mkdir(parents=True, exist_ok=True)
    systemd.notify("STATUS=preparing the model")
    try:
        journal = Journal(state_dir / "workflows.db")
    except sqlite3.Error as exc:
        raise StartupError(f"cannot open the workflow journal {state_dir / 'workflows.db'}: "
                           f"{exc}") from None
    # Workers a previous daemon left behind (it died without taking them along): none
    # should survive PR_SET_PDEATHSIG; any that did would hold devices twice.
    orphans = kill_orphans(journal.recorded_workers())
    journal.forget_workers()
    persisted = {k: v for k in ("partition", "model") if (v := journal.get_state(k)) is not None}
    try:
        with systemd.KeepExtending():   # may generate the default model (seconds to minutes)
            setup = plan_setup(cfg, state_dir, progress=_progress_printer(), persisted=persisted)
    except ValueError as exc:   # bad device spec, impossible split, unknown model spec
        raise StartupError(str(exc)) from None
    if setup.inventory.note:
        log.warning("%s", setup.inventory.note)
    log.info("plan: %s", setup.plan.reason)
    svc = Service(cfg, setup, sink)
    svc.state_dir = state_dir
    svc.journal = journal
    svc.admission_open = journal.get_state("admission") != "closed"
    svc.pool.ready_listeners.append(
        lambda w: journal.worker_started(w.id, w.proc.pid, list(w.spec.devices)))
    try:
        accountant = await accounting_link.attach(svc, state_dir)
    except ValueError as exc:   # a bad carbon intensity file, an unusable ledger
        raise StartupError(str(exc)) from None
    phase = ["loading"]
    status = asyncio.create_task(status_loop(svc, phase)) if os.environ.get("NOTIFY_SOCKET") else None
    try:
        with systemd.KeepExtending():   # workers load weights and warm up before Hello
            await asyncio.gather(svc.pool.start(), svc.prepare_pool.start())
    except (WorkerGone, OSError) as exc:
        if status:
            status.cancel()
        await svc.pool.stop(2)
        svc.prepare_pool.close()
        if accountant is not None:
            await accountant.stop()
        raise StartupError(str(exc)) from None
    svc.fit_context_to_pools()
    # Before serving: every unfinished workflow is reconciled against the workers just
    # started (redo / skip / compensate); they continue once the daemon listens.
    svc.workflows = WorkflowEngine(journal, Control(svc),
                                   Options(drain_timeout_s=cfg.workflows.drain_timeout_s),
                                   max_recoveries=cfg.workflows.max_recoveries)
    unfinished = len(journal.list(1000, unfinished=True))
    if unfinished:
        systemd.notify(f"STATUS=reconciling {unfinished} unfinished workflow(s)")
    svc.recovery = {"orphans_killed": orphans, "decisions": svc.workflows.recover()}
    app = build_app(svc, cfg.server.max_body_bytes)
    runner = ApplianceRunner(app, svc.next_request_id, handler_cancellation=True, access_log=None)
    await runner.setup()
    if inherited:   # socket activation (systemd/applianced.socket): systemd chose the address
        sites = [web.SockSite(runner, sock) for sock in inherited]
        where = ", ".join(_sock_name(sock) for sock in inherited)
        log.info("listening on %s, passed by systemd (server.host/port not used)", where)
    else:
        sites = [web.TCPSite(runner, cfg.server.host, cfg.server.port, reuse_address=True)]
        where = f"{cfg.server.host}:{cfg.server.port}"
    try:
        for site in sites:
            await site.start()
    except OSError as exc:
        if status:
            status.cancel()
        await svc.pool.stop(2)
        await runner.cleanup()
        svc.prepare_pool.close()
        if accountant is not None:
            await accountant.stop()
        raise StartupError(f"cannot listen on {where}: {exc.strerror}") from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    warn_if_exposed(cfg)
    log.info("serving %s on %s (%s, %s%s)", svc.model_name, where, setup.engine,
             setup.plan.mode, ", simulated" if svc.simulated else "")
    host, port = (cfg.server.host, cfg.server.port) if not inherited else _host_port(inherited[0])
    print(json.dumps({"event": "ready", "host": host, "port": port,
                      "model": svc.model_name, "engine": setup.engine,
                      "simulated": svc.simulated}), file=sys.stderr, flush=True)
    phase[0] = "serving"
    tune_gc()
    systemd.notify("READY=1", f"STATUS={status_line(svc, 'serving')}")
    watchdog = asyncio.create_task(systemd.watchdog_loop())
    sampler = asyncio.create_task(svc.telemetry.run(), name="telemetry")
    svc.workflows.resume_all()
    await stop.wait()
    await svc.workflows.close()
    # Drain: refuse new work, let in-flight requests finish, then stop workers.
    if status:
        status.cancel()
    systemd.notify("STOPPING=1", f"STATUS=draining {svc.inflight} requests")
    svc.draining = True
    started = time.monotonic()
    pending = svc.inflight
    deadline = started + cfg.server.drain_timeout_s
    while svc.inflight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    cut = svc.inflight
    drained_s = time.monotonic() - started
    watchdog.cancel()
    for site in sites:
        await site.stop()
    await svc.pool.stop()
    journal.forget_workers()
    await runner.cleanup()
    svc.prepare_pool.close()
    if accountant is not None:
        # the accounting process closes the last partial window (its energy from the
        # still-running sampler), completes every finished request's row, one commit
        await accountant.stop()
    sampler.cancel()
    journal.close()
    # One line for the operator: what the drain did and how the daemon ends.
    log.log(logging.WARNING if cut else logging.INFO,
            "stopped: drained %d of %d in-flight generations in %.1f s%s; exit 0",
            pending - cut, pending, drained_s,
            f", {cut} cut off at server.drain_timeout_s" if cut else "")
    return 0


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


def serve(cfg: Config, state_dir: Path) -> int:
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
        return runner(run_daemon(cfg, state_dir))
    except StartupError as exc:
        print(f"applianced: {exc}", file=sys.stderr)
        return 1
