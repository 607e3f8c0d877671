"""What to run, decided before any process starts: config + devices -> worker specs.

Pure functions of the config, the machine's devices and the model directory (and the
device profiles under the state dir, for `engine.max_batch_tokens = 0`); no event loop,
and no process but the one-off generation of the default model. The daemon (`daemon.main`) starts the workers `plan_setup` lists; a
workflow's `Control` derives a restarted worker's spec here too (`specs_for_plan`), so a
worker started later gets what it would have got at start-up.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import logging
import subprocess
from dataclasses import dataclass
from pathlib import Path

import psutil

from appliance.config import Config
from appliance.daemon import affinity
from appliance.daemon.supervisor import program_command
from appliance.partitions import Inventory, PartitionPlan, discover, plan_partition
from appliance.partitions import devices as host_devices   # cpu_flags, torch-free
from appliance.partitions.plan import check_engine
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


def model_max_context(model_dir: Path, model_spec: str) -> int:
    """The context the model was trained for (its spec, or its config.json)."""
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
        plan_partition(inv, tp=cfg.devices.tp, split=cfg.devices.split, mode=cfg.devices.mode,
                       cpu_threads=cfg.engine.cpu_threads)
    engine = resolve_engine(cfg.engine.kind, inv)
    check_engine(plan, engine)          # e.g. engine = torch with tp > 1: one clear line
    model = persisted.get("model")
    if model and not (Path(model["model_dir"]) / "config.json").exists():
        log.warning("ignoring the persisted model: %s has no config.json", model["model_dir"])
        model = None
    if model:
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
    from appliance.models.specs import model_spec_name
    name = e.model_name or (model_spec_name(e.model_spec) if e.model_spec else model_dir.name)
    try:
        max_context = model_max_context(model_dir, e.model_spec)
    except (ValueError, OSError) as exc:
        raise StartupError(str(exc)) from None
    budgets = (token_budgets(cfg, inv, plan, engine, model_dir, state_dir / "profiles", max_context)
               if e.max_batch_tokens == 0 else {})
    specs = worker_specs(cfg, inv, plan, engine, model_dir, budgets=budgets,
                         profiles=measured_profiles(cfg, inv, plan, engine, model_dir,
                                                    state_dir / "profiles"))
    specs = cluster_specs(cfg, plan.mode, engine, specs)
    for spec in specs:                  # built CPU kernels live with the daemon's state
        spec.kernel_dir = str(state_dir / "kernels")
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


def specs_for_plan(cfg: Config, inv: Inventory, plan: PartitionPlan, engine: str,
                   model_dir: Path, profile_dir: Path | None) -> list[WorkerSpec]:
    """`worker_specs` with each worker's prefill token budget as start-up derives it
    (`engine.max_batch_tokens = 0`: the knee of its device's profile for this model), for
    a plan or a model that changed since start-up (a repartition, a swap-model)."""
    budgets = {}
    if cfg.engine.max_batch_tokens == 0:
        try:
            max_context = model_max_context(model_dir, cfg.engine.model_spec)
        except (ValueError, OSError) as exc:
            raise StartupError(str(exc)) from None
        budgets = token_budgets(cfg, inv, plan, engine, model_dir, profile_dir, max_context)
    return worker_specs(cfg, inv, plan, engine, model_dir, budgets=budgets,
                        profiles=measured_profiles(cfg, inv, plan, engine, model_dir, profile_dir))


def measured_profiles(cfg: Config, inv: Inventory, plan: PartitionPlan, engine: str,
                      model_dir: Path, profile_dir: Path | None) -> dict:
    """Worker name -> the measured profile of its device for this model (`applianced
    profile`), for the torch engine's fair chunk. The simulator times its own steps and
    TensorRT-LLM schedules on its own, so only torch workers look."""
    if engine != "torch" or profile_dir is None or cfg.engine.prefill_chunk_tokens:
        return {}
    from appliance.models.specs import spec_from_hf_config
    from appliance.planner.profiles import load_profile
    try:
        model = spec_from_hf_config(model_dir / "config.json", name=cfg.engine.model_name or None)
    except (ValueError, OSError, KeyError):
        return {}
    devices = {d.id: d for d in inv.devices}
    out = {}
    for slot in plan.workers():
        spec = devices[slot.devices[0]].spec
        profile = load_profile(profile_dir, model.name, spec.name if spec else "cpu", plan.tp)
        if profile is not None and profile.source == "measured":
            out[slot.worker] = profile
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
            "with engine.cpu_threads = 0 (one worker), a smaller engine.kv_cache_bytes, or a "
            "smaller model")


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


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
                 budgets: dict | None = None, profiles: dict | None = None) -> list[WorkerSpec]:
    """One WorkerSpec per slot of the plan; CPU workers get their own cores
    (`cpu_core_sets` over `cores`, by default the ones the daemon could use as it started,
    `affinity.allowed_cores`). `budgets`:
    the prefill token budget per worker when `engine.max_batch_tokens` is 0 (auto).
    `profiles`: measured profiles per worker, whose ~50 ms prefill step is the worker's
    fair chunk (`engines.fair_queue`)."""
    from appliance.engines.fair_queue import chunk_for_step_time
    from appliance.planner.tuning import DEFAULT_MAX_BATCH_TOKENS, cpu_step_tokens
    e = cfg.engine
    devices = {d.id: d for d in inv.devices}
    specs = []
    slots = plan.workers()
    cpu_slots = [s.worker for s in slots if devices[s.devices[0]].kind == "cpu"]
    cores = cores or affinity.allowed_cores()
    core_sets = dict(zip(cpu_slots, cpu_core_sets(len(cpu_slots), e.cpu_threads,
                                                  cores))) if cpu_slots else {}
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
            prefill_chunk_tokens=e.prefill_chunk_tokens, dtype=e.dtype, compile=e.compile,
            cpu_kernels=e.cpu_kernels, cpu_decode_ride_rows=e.cpu_decode_ride_rows,
            fair_queuing=e.fair_queuing,
            cluster_peers=list(cfg.cluster.peers) if cfg.cluster.role != "both" else [],
            # a box of a cluster: its pool with NIXL (workers a workflow starts too)
            nixl=cfg.cluster.role != "both" and engine == "torch"))
        profile = (profiles or {}).get(slot.worker)
        last = specs[-1]
        # Disagg prefill workers only: their short steps let the decode worker start on a
        # wave's first prompts while the rest prefill on the other core. An agg worker has
        # no one to hand to, and shorter steps there only add decode steps between them
        # (measured: docs/benchmarks.md, "Against vLLM's CPU build").
        if engine == "torch" and first.kind == "cpu" and last.role == "prefill":
            last.max_batch_tokens = cpu_step_tokens(last.max_batch_tokens, e.cpu_prefill_step_ms,
                                                    profile, block_size=last.block_size)
        if profile is not None:
            last.fair_chunk_tokens = chunk_for_step_time(
                profile.prefill_s, align=last.block_size, lo=last.block_size,
                hi=max(last.block_size, last.max_batch_tokens))
    for spec in specs:
        # KV flows between the phases: a worker must see the other phase's GPUs.
        spec.peer_uuids = [u for other in specs if other.role != spec.role
                           for u in other.device_uuids if u and u not in spec.device_uuids]
    if engine == "torch" and helper_wanted(e.cpu_decode_helper):
        lend_prefill_cores(specs)
    return specs


def helper_wanted(setting: str) -> bool:
    """`engine.cpu_decode_helper`: "on", or "auto" on a CPU with AMX, the one kind it was
    measured to pay on. There one core reads ~15 GB/s and a decode step's weight stream
    takes ~30% less time with the prefill core reading beside it. On an AMD EPYC (Zen 4,
    no AMX), where one core already reads ~27-31 GB/s, it took up to 3% of the request
    rate at 8 clients and added 2-18% to the ITL (8 and 32 clients, Llama and Qwen3
    shapes): its polling sits on the core that prefills and runs the daemon
    (docs/engines/torch.md, "Borrowing the prefill core")."""
    if setting != "auto":
        return setting == "on"
    return host_has_amx()


def host_has_amx() -> bool:
    """This CPU has AMX's bf16 tiles: the host class where the `auto` settings above and
    below were measured to differ."""
    return "amx_bf16" in host_devices.cpu_flags()


def lend_prefill_cores(specs: list[WorkerSpec]) -> None:
    """Each one-core CPU decode worker may borrow a one-core CPU prefill worker's core
    while that core idles between prompts (`engines.cpu_kernels.helper_gate`): the i-th
    decode worker the i-th prefill worker's, round robin. Workers with more threads keep
    torch's path, which has no use for it."""
    def lone(role: str) -> list[WorkerSpec]:
        return [s for s in specs if s.role == role and s.device_kind == "cpu"
                and len(s.cpu_cores) == 1 and s.cpu_threads == 1]
    lenders = lone("prefill")
    slots: dict[str, int] = {}
    for i, spec in enumerate(lone("decode") if lenders else []):
        lender = lenders[i % len(lenders)]
        if lender.cpu_cores != spec.cpu_cores:
            spec.cpu_helper_core = lender.cpu_cores[0]
            spec.cpu_helper_lender = lender.worker
            spec.cpu_helper_slot = slots.get(lender.worker, 0)
            slots[lender.worker] = spec.cpu_helper_slot + 1
            lender.cpu_core_lent = True


# `engine.conditional_disagg_queue_tokens = -1` (auto) on a box whose decode workers are
# torch on the CPU: ~6 of the benchmark's 256-token prompts waiting. 512 gives the decode
# core prompts so often that its ITL rises, 2048 is rarely reached at 8 clients
# (docs/benchmarks.md, "Against vLLM's CPU build"). 1024 was the default until the daemon
# kept off the decode core (`daemon.affinity`, session 25): the prefill core then carries
# the daemon too, and 1536 against 1024 traded 4-9% of the rate at 8 clients for 20-23%
# lower ITL (both shapes, the rate still >2x vLLM's), at 32 clients within the noise.
# All of that on an AMD EPYC without AMX; with AMX auto is off (`queue_tokens`). In fp32
# on a Zen 3 (session 68; a prompt ~0.5 s of the prefill core) 1024 was level in rate
# with 1536 and its ITL longer, so 1536 holds there too.
CPU_QUEUE_TOKENS = 1536


def queue_tokens(setting: int, specs: list[WorkerSpec], amx: bool | None = None) -> int:
    """`engine.conditional_disagg_queue_tokens` as applied: auto (-1) is on only where
    it was measured to pay, torch decode workers on a CPU without AMX, whose prefill worker
    is the bound and whose decode core has time to give. With AMX (`amx`; None: this
    host's flags) the prefill core runs a 256-token prompt in ~60 ms and keeps up, and a
    decode worker's own prompts only lengthen its steps: measured there, off against
    1536, the ITL p50 at 32 clients 15% lower at the same rate, 8 clients unchanged
    (docs/benchmarks.md, session 62). On GPUs (and the simulator) it stays off unless
    set: there a decode GPU's prefill would take its own turn from its decodes."""
    if setting >= 0:
        return setting
    cpu_decode = any(s.role == "decode" and s.engine == "torch" and s.device_kind == "cpu"
                     for s in specs)
    if not cpu_decode:
        return 0
    return 0 if (host_has_amx() if amx is None else amx) else CPU_QUEUE_TOKENS


def cluster_worker_roles(cfg: Config) -> set[str]:
    """The worker roles this box runs under `cluster.role`: start-up and a workflow that
    (re)starts workers (`Control.ensure_started`) apply the same rule, so a repartition of
    a decode box never starts prefill workers there."""
    role = cfg.cluster.role
    if role == "both":
        return {"prefill", "decode", "agg"}
    if role == "decode":
        return {"decode"}
    return {"prefill", "decode"} if cfg.devices.split != "auto" else {"prefill"}


def cluster_specs(cfg: Config, mode: str, engine: str,
                  specs: list[WorkerSpec]) -> list[WorkerSpec]:
    """The workers a box of `cluster.role` runs (docs/operations/cluster.md): a decode box
    only the plan's decode workers; a prefill box (the front) only its prefill workers,
    unless `devices.split` names a decode count itself: then those stay, as the front's
    own decode capacity for when no decode box is up. Their torch workers register their
    KV pools with NIXL. "both": every worker, as planned."""
    role = cfg.cluster.role
    if role == "both":
        return specs
    if mode != "disagg":
        raise StartupError(f"cluster.role = {role!r} splits prefill and decode between boxes; "
                           "it needs devices.mode = \"disagg\"")
    keep = cluster_worker_roles(cfg)
    kept = [s for s in specs if s.role in keep]
    if not any(s.role == role for s in kept):
        raise StartupError(f"cluster.role = {role!r} but the partition plan has no {role} worker")
    for spec in kept:
        spec.nixl = engine == "torch"
    return kept


def weight_bytes(model_spec: str) -> float:
    """Bytes per weight of the served model for the simulated power model; bf16 if unknown."""
    if not model_spec:
        return 2.0
    from appliance.models.specs import lookup_model_spec
    try:
        return lookup_model_spec(model_spec).weight_bytes
    except ValueError:
        return 2.0

