"""The daemon's TOML configuration: every field has a default, every mistake is one line.

Why strict: an operator who misspells `max_batch_tokens` must learn it at start-up,
not after a week of wondering why the setting did nothing.
"""
from __future__ import annotations

import dataclasses
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_CONFIG_PATH = Path("/etc/applianced/config.toml")


class ConfigError(ValueError):
    """One line naming the key and what is wrong with it."""


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 1 << 20
    max_inflight: int = 1024          # requests admitted at once; more get 503 + Retry-After
    drain_timeout_s: float = 30.0     # SIGTERM: how long in-flight requests may finish
    log_requests: bool = False        # one JSON line per finished request on stderr
    prepare_inline_bytes: int = 4096  # bodies up to this are prepared on the event loop
    # TLS: PEM files, or "credential:NAME" for a systemd credential (LoadCredential=NAME:...)
    # read from $CREDENTIALS_DIRECTORY. Both or neither. Re-read when changed, or on SIGHUP.
    tls_cert: str = ""
    tls_key: str = ""
    # A separate listener for /admin/ and /metrics (e.g. loopback or a management network);
    # admin_port = 0: the admin API shares host:port with the OpenAI API.
    admin_host: str = "127.0.0.1"
    admin_port: int = 0


@dataclass
class DevicesConfig:
    spec: str = "auto"                # auto | cpu | sim:8xH100 | sim:4xH100+4xL40S ...
    split: str = "auto"               # auto | P+D (worker counts)
    mode: str = "disagg"              # disagg | agg
    tp: int = 1


@dataclass
class EngineConfig:
    kind: str = "auto"                # auto | sim | torch | trtllm
    model: str = ""                   # checkpoint dir; "" = the generated tiny model
    model_name: str = ""              # name served on /v1/models; "" = the dir's name
    model_spec: str = ""              # simulator shape (llama-3.1-70b-fp8 ...); "" = model's config.json
    sim_speed: float = 1.0            # simulated time runs this many times faster than real
    block_size: int = 16
    max_batch_tokens: int = 8192      # prefill token budget per iteration; 0 = the profile's knee
    cpu_prefill_step_ms: int = 500    # >0: torch CPU prefill workers' budget capped so a step takes
                                      # ~this (measured profile; without one 512 tokens); 0 = no cap
    max_seqs: int = 256               # sequences per batch
    kv_cache_bytes: int = 1 << 30     # KV pool per worker on the CPU
    cpu_threads: int = 0              # CPU workers: torch threads (and cores) each; 0 = split the cores
                                      # (agg with T > 0: one worker per T cores)
    gpu_mem_fraction: float = 0.9
    reserve_ratio: float = 1.0        # share of max_tokens reserved at admission (1 = never preempt)
    handoff_timeout_s: float = 30.0   # free handed-off KV nobody picked up after this
    prefill_chunk_tokens: int = 0     # >0: prefill in chunks of this many tokens, decodes between
    fair_queuing: bool = True         # tenants share prefill steps by [tenants] weight, not arrival order
    decode_kv_gate: bool = False      # disagg: prefill a request only when the decode side has its KV room
    decode_kv_gate_wait_s: float = 10.0  # ...but hold none longer than this (then it goes on ungated)
    decode_max_seqs: int = 0          # disagg: >0: prefill a request only while fewer than this many
                                      # per decode worker are placed and unfinished; 0 = off
    conditional_disagg_tokens: int = 0  # >0: prompts shorter than this skip the prefill worker
    conditional_disagg_queue_tokens: int = -1  # >0: while this many prompt tokens wait for the
                                      # prefill workers, a decode worker prefills one itself;
                                      # 0 = off; -1 = auto (1024 for torch on the CPU, else off)
    conditional_disagg_prefill_share: float = 0.5  # ...at most this share of its time (0, 1]
    tool_parser: str = ""             # "" = from the chat template; hermes | llama3_json | mistral | harmony | none
    reasoning_parser: str = ""        # "" = from the chat template; qwen3 | none
    dtype: str = "auto"               # torch weights and KV: auto | float32 | bfloat16 | float16
    compile: str = "off"              # torch: off | decode (torch.compile a decode step's norms/adds)
    cpu_kernels: str = "auto"         # torch on the CPU: auto (C kernels where the host builds them) | off
    cpu_decode_helper: str = "auto"   # on: a one-core decode worker's matmuls borrow the prefill core while it idles | auto: on where the CPU has AMX | off
    cpu_decode_ride_rows: int = -1    # a CPU decode worker's own prompts ride on its decode steps, up to this many rows a step; -1 = auto (8), 0 = off
    daemon_cores: str = "auto"        # auto: the daemon's threads off the CPU decode workers' cores | all


@dataclass
class WorkersConfig:
    restart_backoff_s: float = 0.5
    restart_backoff_max_s: float = 30.0
    start_timeout_s: float = 600.0


@dataclass
class WorkflowsConfig:
    # repartition / swap-model / drain: how long in-flight requests may take to finish on
    # the workers being changed before they are cut off (with a clear 503).
    drain_timeout_s: float = 30.0
    # A workflow interrupted by this many daemon deaths is rolled back (compensated)
    # instead of resumed again: a step that kills the daemon must not crash-loop it.
    max_recoveries: int = 3


@dataclass
class AuthConfig:
    # SHA-256 hex digest of an API key -> tenant (the microservice that holds the key),
    # or -> { tenant = "search", team = "...", project = "...", cost_center = "..." }:
    # the tags reports group by (group_by=tag:team) and the FOCUS export's Tags carry.
    keys: dict = field(default_factory=dict)
    # SHA-256 hex digests of admin keys (the /admin/ API). None configured: loopback only.
    admin_keys: list[str] = field(default_factory=list)
    # Who may scrape /metrics: "open" (anyone), "loopback" (loopback clients; others need
    # an admin key), "admin" (an admin key, even on loopback).
    metrics_access: str = "loopback"
    # PEM CA bundle (or "credential:NAME"): with it, /admin/ needs a client certificate
    # signed by this CA (mutual TLS) besides the admin key; needs server.tls_cert.
    admin_client_ca: str = ""
    # Derived, not a key: tenant -> its tags, collected from the [auth.keys] tables.
    tenant_tags: dict = field(default_factory=dict, metadata={"derived": True})
    # Derived: digest -> the key's name in logs and the audit log (a table's `name`, else
    # "config:" and the digest's first 8 hex digits).
    key_names: dict = field(default_factory=dict, metadata={"derived": True})


@dataclass
class SiteConfig:
    # Where this appliance stands: every Prometheus series, ledger row and carbon figure
    # carries these, so a fleet can be read by site.
    name: str = "local"
    appliance: str = ""               # this appliance's name; "" = the host name
    region: str = ""                  # grid region of the site (e.g. "DE"), shown with carbon figures
    # Power usage effectiveness: facility energy / IT energy. 1.56 is the Uptime Institute
    # Global Data Center Survey 2024 average; measure your own.
    pue: float = 1.56
    # Grid intensity in gCO2e/kWh when no file is given: 480 is Ember's Global Electricity
    # Review 2024 figure for the world's 2023 average. Set your grid's.
    carbon_intensity: float = 480.0
    carbon_intensity_file: str = ""   # Electricity Maps-style CSV or JSON time series; "" = static
    carbon_intensity_kind: str = "average"   # average | marginal (what the figures mean)
    # Market-based factor in gCO2e/kWh (supplier contracts, certificates: GHG Protocol
    # Scope 2). Reported as a second column beside the location-based figures, never
    # mixed into SCI. -1 = none stated (no market-based column).
    carbon_intensity_market: float = -1.0
    # Power of the node beyond its accelerator boards (CPUs, memory, NICs, fans), in W:
    # what the boards' energy counters do not see. A DGX H100 is rated ~10.2 kW for
    # 8 × 700 W = 5.6 kW of GPUs, so ~4.6 kW at full load; state yours (0 = not counted).
    # Allocated with the idle/static share and shown as its own component.
    node_overhead_w: float = 0.0
    # Per device model (catalogue name, or "cpu"): embodied kgCO2e and lifetime in years;
    # unset = the catalogue's defaults.
    embodied_kgco2e: dict[str, float] = field(default_factory=dict)
    lifetime_years: dict[str, float] = field(default_factory=dict)


@dataclass
class AccountingConfig:
    # Per-request GPU-seconds, joules, cost and carbon, kept in the ledger (state dir).
    enabled: bool = True
    window_s: float = 10.0            # device windows: the unit of conservation
    flush_interval_s: float = 1.0     # ledger writes are batched; a kill -9 loses at most one batch
    idle_policy: str = "share"        # share (idle cost to tenants by usage) | idle (an "(idle)" row)
    # $ per device-hour by device model (catalogue name or "cpu"); unset = the catalogue's.
    usd_per_gpu_hour: dict[str, float] = field(default_factory=dict)
    usd_per_kwh: float = 0.0          # energy price on top of the device price; 0 = none
    currency: str = "USD"             # ISO 4217 code of every price here and every report
    # Versioned rate cards (docs/operations/allocation-and-carbon.md): a list of tables
    # { effective = "2027-01-01T00:00:00Z", per_device_hour = { "H100-SXM" = 3.2 },
    #   per_kwh = 0.15 }, each in force from `effective` until the next; what a card does
    # not name keeps the previous card's (the first: the two keys above).
    rate_cards: list = field(default_factory=list, metadata={"tables": True})
    calibration_min_iterations: int = 50   # per model x device x phase before weights are fitted
    retention_days: float = 90.0      # request and window rows; 0 = keep forever
    rollup_retention_days: float = 730.0   # hour rollups (never below the raw rows); 0 = forever
    retention_mb: float = 0.0         # raw rows also bounded by size (MB of the file); 0 = no bound
    report_timeout_s: float = 30.0    # a report query is stopped after this (HTTP 503); 0 = never


@dataclass
class BudgetsConfig:
    period: str = "month"             # day | week | month (UTC)
    # tenant -> limit per period
    gpu_hours: dict[str, float] = field(default_factory=dict)
    usd: dict[str, float] = field(default_factory=dict)
    kgco2e: dict[str, float] = field(default_factory=dict)
    # tenant -> what 100% of a budget does: "alert" (log and gauge only), "reject" (429
    # budget_exceeded until the next period) or "deprioritize" (lowest priority class
    # until the next period). Unnamed tenants: "alert".
    enforce: dict[str, str] = field(default_factory=dict)


@dataclass
class TenantConfig:
    # One microservice's share of the box (docs/operations/tenants.md).
    weight: float = 1.0               # fair-queuing weight: capacity shared in proportion
    priority: int = 0                 # default priority class; lower is served first (as vLLM's `priority`)
    max_concurrent: int = 0           # requests in flight at once; 0 = unlimited
    requests_per_minute: float = 0.0  # token bucket; 0 = unlimited
    tokens_per_minute: float = 0.0    # prompt + max output reserved at admission, settled at finish; 0 = unlimited


@dataclass
class PlannerConfig:
    # The SLOs the capacity planner sizes the prefill and decode pools for.
    ttft_slo_s: float = 2.0           # time to first token (mean, Kingman G/G/1 per worker)
    itl_slo_s: float = 0.05           # inter-token latency of a decode step
    quantile: float = 0.9             # plan on this upper quantile of the forecast
    horizon: str = "24h"              # default forecast horizon (e.g. 90m, 24h, 7d)
    auto_apply: bool = False          # start the repartition workflow on its own
    auto_apply_after_s: float = 900.0  # ...once the recommendation has differed this long


def parse_duration(text: str) -> float:
    """'90m', '24h', '7d', '2w', '3600s' or '3600' -> seconds (ValueError: one line)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", str(text))
    if not m:
        raise ValueError(f"malformed duration {text!r}: expected e.g. 90m, 24h, 7d, 2w")
    value = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400,
                                 "w": 604800}[m.group(2)]
    if value <= 0:
        raise ValueError(f"duration {text!r} must be positive")
    return value


@dataclass
class TelemetryConfig:
    sample_interval_s: float = 1.0    # device readings (NVML, RAPL/CPU model, simulated power)
    retain_s: float = 600.0           # readings and iteration bins kept for energy queries
    rapl_dir: str = "/sys/class/powercap"   # RAPL package counters (usually root-only)
    cpu_idle_w_per_core: float = 1.5  # CPU power model when RAPL is unreadable
    cpu_busy_w_per_core: float = 3.5


@dataclass
class TuiConfig:
    # Appliances `applianced tui` watches when no --url is given; several make a fleet.
    # Empty: the local daemon (http://127.0.0.1:8000).
    urls: list[str] = field(default_factory=list)


@dataclass
class ClusterConfig:
    # Two boxes as one (docs/operations/cluster.md). "both": today's single box (prefill
    # and decode workers here); "prefill": the front, its decodes go to `peers`;
    # "decode": takes decodes from `peers`. Roles other than "both" need the cluster
    # extra (nixl-cu12): the KV moves between boxes by NIXL READ.
    role: str = "both"
    peers: list[str] = field(default_factory=list)   # the other boxes' base URLs
    key: str = ""       # the key boxes present to each other (keep the file 0600)


CLUSTER_ROLES = ("both", "prefill", "decode")


@dataclass
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    devices: DevicesConfig = field(default_factory=DevicesConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    site: SiteConfig = field(default_factory=SiteConfig)
    accounting: AccountingConfig = field(default_factory=AccountingConfig)
    budgets: BudgetsConfig = field(default_factory=BudgetsConfig)
    tenants: dict[str, TenantConfig] = field(default_factory=dict)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    tui: TuiConfig = field(default_factory=TuiConfig)
    workflows: WorkflowsConfig = field(default_factory=WorkflowsConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    state_dir: str = ""


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def _check_value(key: str, value, typ):
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ in (int, float) and isinstance(value, bool):
        raise ConfigError(f"config: {key} must be {_TYPE_NAMES[typ]}, got {value!r}")
    if typ in _TYPE_NAMES:
        if not isinstance(value, typ):
            raise ConfigError(f"config: {key} must be {_TYPE_NAMES[typ]}, got {value!r}")
        return value
    raise ConfigError(f"config: {key} has an unsupported type")  # pragma: no cover


def _fill(obj, data: dict, prefix: str):
    fields = {f.name: f for f in dataclasses.fields(obj) if not f.metadata.get("derived")}
    hints = {f.name: f.type for f in dataclasses.fields(obj)}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(f"config: unknown key {path} (known here: {known})")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"config: {path} must be a table")
            _fill(current, value, f"{path}.")
        elif isinstance(current, dict):
            if not isinstance(value, dict):
                raise ConfigError(f"config: {path} must be a table")
            setattr(obj, key, dict(value))
        elif isinstance(current, list) and fields[key].metadata.get("tables"):
            if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
                raise ConfigError(f"config: {path} must be a list of tables")
            setattr(obj, key, [dict(v) for v in value])
        elif isinstance(current, list):
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"config: {path} must be a list of strings")
            setattr(obj, key, list(value))
        else:
            typ = {"int": int, "float": float, "str": str, "bool": bool}[hints[key]]
            setattr(obj, key, _check_value(path, value, typ))


def validate(cfg: Config) -> Config:
    _split_key_tags(cfg.auth)
    for digest in cfg.auth.admin_keys:
        if not _DIGEST.match(digest):
            raise ConfigError(f"config: auth.admin_keys: {digest!r} is not a lowercase SHA-256 hex "
                              f"digest (make one with: applianced key digest KEY)")
    _validate_tls(cfg)
    if cfg.auth.metrics_access not in ("open", "loopback", "admin"):
        raise ConfigError(f"config: auth.metrics_access must be open, loopback or admin, "
                          f"got {cfg.auth.metrics_access!r}")
    _validate_accounting(cfg)
    cfg.tenants = validate_tenants(cfg.tenants)
    for url in cfg.tui.urls:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"config: tui.urls: {url!r} is not an http:// or https:// URL")
    _validate_cluster(cfg.cluster)
    if cfg.devices.mode not in ("disagg", "agg"):
        raise ConfigError(f"config: devices.mode must be disagg or agg, got {cfg.devices.mode!r}")
    if cfg.engine.tool_parser not in ("", "hermes", "llama3_json", "mistral", "harmony", "none"):
        raise ConfigError(f"config: engine.tool_parser must be hermes, llama3_json, mistral, harmony, "
                          f"none or empty (from the chat template), got {cfg.engine.tool_parser!r}")
    if cfg.engine.reasoning_parser not in ("", "qwen3", "none"):
        raise ConfigError(f"config: engine.reasoning_parser must be qwen3, none or empty (from "
                          f"the chat template), got {cfg.engine.reasoning_parser!r}")
    if cfg.engine.kind not in ("auto", "sim", "torch", "trtllm"):
        raise ConfigError(f"config: engine.kind must be auto, sim, torch or trtllm, got {cfg.engine.kind!r}")
    positive = [("server.port", cfg.server.port), ("devices.tp", cfg.devices.tp),
                ("engine.block_size", cfg.engine.block_size),
                ("engine.max_seqs", cfg.engine.max_seqs), ("engine.sim_speed", cfg.engine.sim_speed),
                ("server.max_inflight", cfg.server.max_inflight),
                ("server.max_body_bytes", cfg.server.max_body_bytes)]
    for key, value in positive:
        if value <= 0:
            raise ConfigError(f"config: {key} must be positive, got {value}")
    if not 0 <= cfg.server.prepare_inline_bytes <= 65536:
        raise ConfigError("config: server.prepare_inline_bytes must be within 0..65536 (bigger "
                          f"bodies stall the event loop), got {cfg.server.prepare_inline_bytes}")
    t = cfg.telemetry
    if not 0.05 <= t.sample_interval_s <= 60:
        raise ConfigError(f"config: telemetry.sample_interval_s must be within 0.05..60, got {t.sample_interval_s}")
    if t.retain_s < 70:
        raise ConfigError(f"config: telemetry.retain_s must be at least 70 (the 60-s window and its history), got {t.retain_s}")
    for key in ("cpu_idle_w_per_core", "cpu_busy_w_per_core"):
        if getattr(t, key) < 0:
            raise ConfigError(f"config: telemetry.{key} must be 0 or more, got {getattr(t, key)}")
    if cfg.engine.decode_max_seqs < 0:
        raise ConfigError(f"config: engine.decode_max_seqs must be 0 (off) or more, "
                          f"got {cfg.engine.decode_max_seqs}")
    if cfg.engine.decode_kv_gate_wait_s < 0:
        raise ConfigError(f"config: engine.decode_kv_gate_wait_s must be 0 or more, "
                          f"got {cfg.engine.decode_kv_gate_wait_s}")
    if cfg.workflows.drain_timeout_s < 0:
        raise ConfigError(f"config: workflows.drain_timeout_s must be 0 or more, "
                          f"got {cfg.workflows.drain_timeout_s}")
    if cfg.workflows.max_recoveries < 1:
        raise ConfigError(f"config: workflows.max_recoveries must be 1 or more, "
                          f"got {cfg.workflows.max_recoveries}")
    if not 0 < cfg.server.port < 65536:
        raise ConfigError(f"config: server.port must be 1-65535, got {cfg.server.port}")
    if cfg.engine.max_batch_tokens < 0:
        raise ConfigError("config: engine.max_batch_tokens must be 0 (auto: the knee of the "
                          f"prefill profile) or positive, got {cfg.engine.max_batch_tokens}")
    if cfg.engine.conditional_disagg_queue_tokens < -1:
        raise ConfigError("config: engine.conditional_disagg_queue_tokens must be -1 (auto), "
                          f"0 (off) or positive, got {cfg.engine.conditional_disagg_queue_tokens}")
    if not 0.0 < cfg.engine.conditional_disagg_prefill_share <= 1.0:
        raise ConfigError("config: engine.conditional_disagg_prefill_share must be within "
                          f"(0, 1], got {cfg.engine.conditional_disagg_prefill_share}")
    if cfg.engine.cpu_decode_ride_rows < -1:
        raise ConfigError("config: engine.cpu_decode_ride_rows must be -1 (auto), 0 (off) or "
                          f"positive, got {cfg.engine.cpu_decode_ride_rows}")
    if cfg.engine.prefill_chunk_tokens < 0:
        raise ConfigError("config: engine.prefill_chunk_tokens must be 0 (off) or more, "
                          f"got {cfg.engine.prefill_chunk_tokens}")
    if cfg.engine.dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ConfigError("config: engine.dtype must be auto, float32, bfloat16 or float16, "
                          f"got {cfg.engine.dtype!r}")
    if cfg.engine.compile not in ("off", "decode"):
        raise ConfigError(f"config: engine.compile must be off or decode, got {cfg.engine.compile!r}")
    if cfg.engine.daemon_cores not in ("auto", "all"):
        raise ConfigError(f"config: engine.daemon_cores must be auto or all, "
                          f"got {cfg.engine.daemon_cores!r}")
    if cfg.engine.cpu_decode_helper not in ("auto", "on", "off"):
        raise ConfigError(f"config: engine.cpu_decode_helper must be auto, on or off, "
                          f"got {cfg.engine.cpu_decode_helper!r}")
    if cfg.engine.cpu_kernels not in ("auto", "off"):
        raise ConfigError(f"config: engine.cpu_kernels must be auto or off, "
                          f"got {cfg.engine.cpu_kernels!r}")
    if cfg.engine.cpu_prefill_step_ms < 0:
        raise ConfigError("config: engine.cpu_prefill_step_ms must be 0 (no cap) or positive, "
                          f"got {cfg.engine.cpu_prefill_step_ms}")
    if cfg.engine.cpu_threads < 0:
        raise ConfigError(f"config: engine.cpu_threads must be 0 (auto) or more, got {cfg.engine.cpu_threads}")
    if not 0.0 <= cfg.engine.reserve_ratio <= 1.0:
        raise ConfigError(f"config: engine.reserve_ratio must be within 0..1, got {cfg.engine.reserve_ratio}")
    if not 0.0 < cfg.engine.gpu_mem_fraction <= 1.0:
        raise ConfigError(f"config: engine.gpu_mem_fraction must be within (0, 1], got {cfg.engine.gpu_mem_fraction}")
    pl = cfg.planner
    for key, value in (("planner.ttft_slo_s", pl.ttft_slo_s), ("planner.itl_slo_s", pl.itl_slo_s),
                       ("planner.auto_apply_after_s", pl.auto_apply_after_s)):
        if value <= 0:
            raise ConfigError(f"config: {key} must be positive, got {value}")
    if not 0.5 <= pl.quantile < 1.0:
        raise ConfigError(f"config: planner.quantile must be within [0.5, 1), got {pl.quantile}")
    try:
        if parse_duration(pl.horizon) > 8 * 604800:
            raise ValueError("longer than 8 weeks")
    except ValueError as exc:
        raise ConfigError(f"config: planner.horizon: {exc}") from None
    return cfg


def _validate_cluster(c: ClusterConfig) -> None:
    if c.role not in CLUSTER_ROLES:
        raise ConfigError(f"config: cluster.role must be both, prefill or decode, got {c.role!r}")
    for url in c.peers:
        if not re.fullmatch(r"https?://[^/\s]+/?", url):
            raise ConfigError(f"config: cluster.peers: {url!r} is not a base URL like "
                              "https://host:port")
    if len(set(u.rstrip("/") for u in c.peers)) != len(c.peers):
        raise ConfigError("config: cluster.peers lists a box twice")
    if c.role != "both":
        if not c.peers:
            raise ConfigError(f"config: cluster.role = {c.role!r} needs cluster.peers (the "
                              f"{'decode' if c.role == 'prefill' else 'prefill'} boxes)")
        if len(c.key) < 16:
            raise ConfigError(f"config: cluster.role = {c.role!r} needs cluster.key, at least "
                              "16 characters, the same on every box of the cluster")


TAG_KEYS = ("team", "project", "cost_center")


def _validate_tls(cfg: Config) -> None:
    s = cfg.server
    if bool(s.tls_cert) != bool(s.tls_key):
        raise ConfigError("config: server.tls_cert and server.tls_key go together (set both "
                          "for TLS, neither for plain HTTP)")
    if cfg.auth.admin_client_ca and not s.tls_cert:
        raise ConfigError("config: auth.admin_client_ca needs TLS (server.tls_cert and "
                          "server.tls_key): client certificates only exist inside TLS")
    if not 0 <= s.admin_port < 65536:
        raise ConfigError(f"config: server.admin_port must be 0 (shared) or 1-65535, "
                          f"got {s.admin_port}")
    if s.admin_port and s.admin_port == s.port and s.admin_host == s.host:
        raise ConfigError("config: server.admin_port equals server.port on the same host; "
                          "use 0 to share the listener")


def _split_key_tags(auth: AuthConfig) -> None:
    """`[auth.keys]` entries are a tenant name or a table with the tenant and its tags.
    Normalised here: `keys` maps digest -> tenant (what Auth matches), `tenant_tags`
    tenant -> tags. Tags belong to the tenant: two keys of one tenant must not disagree."""
    keys: dict[str, str] = {}
    names: dict[str, str] = dict(auth.key_names)
    tags: dict[str, dict[str, str]] = dict(auth.tenant_tags)
    for digest, entry in auth.keys.items():
        if not _DIGEST.match(digest):
            raise ConfigError(f"config: auth.keys: {digest!r} is not a lowercase SHA-256 hex digest "
                              f"(make one with: applianced key digest KEY)")
        where = f"auth.keys.{digest[:12]}…"
        if isinstance(entry, dict):
            unknown = sorted(set(entry) - {"tenant", "name", *TAG_KEYS})
            if unknown:
                raise ConfigError(f"config: unknown key {where}.{unknown[0]} (known here: tenant, "
                                  f"name, {', '.join(TAG_KEYS)})")
            tenant = entry.get("tenant")
            name = entry.get("name", f"config:{digest[:8]}")
            if not isinstance(name, str) or not name:
                raise ConfigError(f"config: {where}.name must be a non-empty string, got {name!r}")
            if name in names.values():
                raise ConfigError(f"config: {where}.name {name!r} names two keys")
            names[digest] = name
            own = {k: entry[k] for k in TAG_KEYS if k in entry}
            for k, v in own.items():
                if not isinstance(v, str) or not v:
                    raise ConfigError(f"config: {where}.{k} must be a non-empty string, got {v!r}")
        else:
            tenant, own = entry, {}
            names.setdefault(digest, f"config:{digest[:8]}")
        if not isinstance(tenant, str) or not tenant:
            raise ConfigError(f"config: {where} must name a tenant (a string, or a table with "
                              f"tenant = \"...\")")
        have = tags.setdefault(tenant, {})
        for k, v in own.items():
            if have.get(k, v) != v:
                raise ConfigError(f"config: {where}: tenant {tenant!r} has {k} = {have[k]!r} on "
                                  f"another key and {v!r} here (tags belong to the tenant)")
            have[k] = v
        keys[digest] = tenant
    auth.keys = keys
    auth.key_names = names
    auth.tenant_tags = {t: v for t, v in tags.items() if v}


def _number_table(key: str, table: dict, positive: bool = True) -> None:
    for name, value in table.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config: {key}.{name} must be a number, got {value!r}")
        if value < 0 or (positive and value == 0):
            raise ConfigError(f"config: {key}.{name} must be {'positive' if positive else '0 or more'}, "
                              f"got {value}")
        table[name] = float(value)


def _validate_accounting(cfg: Config) -> None:
    site, acc, bud = cfg.site, cfg.accounting, cfg.budgets
    if site.pue < 1.0:
        raise ConfigError(f"config: site.pue must be 1.0 or more, got {site.pue}")
    if site.carbon_intensity < 0:
        raise ConfigError(f"config: site.carbon_intensity must be 0 or more, got {site.carbon_intensity}")
    if site.carbon_intensity_kind not in ("average", "marginal"):
        raise ConfigError(f"config: site.carbon_intensity_kind must be average or marginal, "
                          f"got {site.carbon_intensity_kind!r}")
    _number_table("site.embodied_kgco2e", site.embodied_kgco2e, positive=False)
    _number_table("site.lifetime_years", site.lifetime_years)
    for key, value in [("accounting.window_s", acc.window_s),
                       ("accounting.flush_interval_s", acc.flush_interval_s)]:
        if value <= 0:
            raise ConfigError(f"config: {key} must be positive, got {value}")
    if acc.idle_policy not in ("share", "idle"):
        raise ConfigError(f"config: accounting.idle_policy must be share or idle, got {acc.idle_policy!r}")
    _number_table("accounting.usd_per_gpu_hour", acc.usd_per_gpu_hour, positive=False)
    for key, value in [("accounting.usd_per_kwh", acc.usd_per_kwh),
                       ("accounting.retention_days", acc.retention_days),
                       ("accounting.rollup_retention_days", acc.rollup_retention_days),
                       ("accounting.retention_mb", acc.retention_mb),
                       ("accounting.report_timeout_s", acc.report_timeout_s),
                       ("accounting.calibration_min_iterations", acc.calibration_min_iterations)]:
        if value < 0:
            raise ConfigError(f"config: {key} must be 0 or more, got {value}")
    if not (site.carbon_intensity_market == -1.0 or site.carbon_intensity_market >= 0):
        raise ConfigError("config: site.carbon_intensity_market must be 0 or more (gCO2e/kWh), "
                          f"or -1 for none, got {site.carbon_intensity_market}")
    if site.node_overhead_w < 0:
        raise ConfigError(f"config: site.node_overhead_w must be 0 or more, got {site.node_overhead_w}")
    if not re.fullmatch(r"[A-Z]{3}", acc.currency):
        raise ConfigError(f"config: accounting.currency must be an ISO 4217 code such as USD or "
                          f"EUR, got {acc.currency!r}")
    acc.rate_cards = [_rate_card(i, c) for i, c in enumerate(acc.rate_cards)]
    starts = [c["effective"] for c in acc.rate_cards]
    if len(set(starts)) != len(starts):
        raise ConfigError("config: accounting.rate_cards: two cards have the same effective time")
    if bud.period not in ("day", "week", "month"):
        raise ConfigError(f"config: budgets.period must be day, week or month, got {bud.period!r}")
    for name in ("gpu_hours", "usd", "kgco2e"):
        _number_table(f"budgets.{name}", getattr(bud, name))
    for tenant, mode in bud.enforce.items():
        if mode not in ENFORCE_MODES:
            raise ConfigError(f"config: budgets.enforce.{tenant} must be alert, reject or "
                              f"deprioritize, got {mode!r}")


ENFORCE_MODES = ("alert", "reject", "deprioritize")


def validate_tenants(tables: dict) -> dict[str, TenantConfig]:
    """`[tenants.NAME]` tables -> TenantConfig each, every key checked like any other."""
    out: dict[str, TenantConfig] = {}
    for name, table in tables.items():
        if isinstance(table, TenantConfig):     # already checked (validate may run twice)
            tc = table
        elif not isinstance(table, dict):
            raise ConfigError(f"config: tenants.{name} must be a table ([tenants.{name}])")
        else:
            tc = TenantConfig()
            _fill(tc, table, f"tenants.{name}.")
        if tc.weight <= 0:
            raise ConfigError(f"config: tenants.{name}.weight must be positive, got {tc.weight}")
        for key in ("max_concurrent", "requests_per_minute", "tokens_per_minute"):
            if getattr(tc, key) < 0:
                raise ConfigError(f"config: tenants.{name}.{key} must be 0 (unlimited) or more, "
                                  f"got {getattr(tc, key)}")
        out[name] = tc
    return out


def _instant(value) -> float:
    """A TOML date, datetime (naive = UTC) or ISO 8601 string -> unix seconds."""
    import datetime as dt
    if isinstance(value, dt.datetime):
        return (value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)).timestamp()
    if isinstance(value, dt.date):
        return dt.datetime(value.year, value.month, value.day, tzinfo=dt.timezone.utc).timestamp()
    if isinstance(value, str):
        t = dt.datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
        return (t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)).timestamp()
    raise ValueError(value)


def _rate_card(i: int, card: dict) -> dict:
    """One `[[accounting.rate_cards]]` entry, checked: {effective: unix s,
    per_device_hour: {model: price}, per_kwh: price or None}."""
    key = f"accounting.rate_cards[{i}]"
    if "effective" in card and isinstance(card["effective"], float) and set(card) <= {
            "effective", "per_device_hour", "per_kwh"} and isinstance(
            card.get("per_device_hour", {}), dict):
        return card                     # already checked (validate runs once per parse)
    unknown = set(card) - {"effective", "per_device_hour", "per_kwh"}
    if unknown:
        raise ConfigError(f"config: unknown key {key}.{sorted(unknown)[0]} "
                          "(known here: effective, per_device_hour, per_kwh)")
    if "effective" not in card:
        raise ConfigError(f"config: {key} needs effective (the date it holds from, e.g. "
                          '"2027-01-01T00:00:00Z")')
    try:
        effective = _instant(card["effective"])
    except (ValueError, TypeError):
        raise ConfigError(f"config: {key}.effective must be a date or time (ISO 8601), "
                          f"got {card['effective']!r}") from None
    prices = card.get("per_device_hour", {})
    if not isinstance(prices, dict):
        raise ConfigError(f"config: {key}.per_device_hour must be a table of device model = price")
    prices = dict(prices)
    _number_table(f"{key}.per_device_hour", prices, positive=False)
    kwh = card.get("per_kwh")
    if kwh is not None:
        if isinstance(kwh, bool) or not isinstance(kwh, (int, float)) or kwh < 0:
            raise ConfigError(f"config: {key}.per_kwh must be a number, 0 or more, got {kwh!r}")
        kwh = float(kwh)
    return {"effective": effective, "per_device_hour": prices, "per_kwh": kwh}


def parse(text: str, origin: str = "config") -> Config:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{origin}: not valid TOML: {exc}") from None
    cfg = Config()
    try:
        _fill(cfg, data, "")
    except ConfigError as exc:
        raise ConfigError(f"{origin}: {exc}") from None
    try:
        return validate(cfg)
    except ConfigError as exc:
        raise ConfigError(f"{origin}: {exc}") from None


def load(path: str | Path | None) -> Config:
    """--config PATH, else /etc/applianced/config.toml if present, else defaults."""
    if path is None:
        if not DEFAULT_CONFIG_PATH.exists():
            return Config()
        path = DEFAULT_CONFIG_PATH
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    return parse(text, str(path))


def state_dir(cfg: Config, override: str | None = None) -> Path:
    """--state-dir, then the config, then $STATE_DIRECTORY (systemd's StateDirectory=),
    then /var/lib/applianced (root) or XDG state."""
    if override:
        return Path(override)
    if cfg.state_dir:
        return Path(cfg.state_dir)
    systemd_dir = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    if systemd_dir:
        return Path(systemd_dir)
    if os.geteuid() == 0:
        return Path("/var/lib/applianced")
    xdg = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(xdg) / "applianced"
