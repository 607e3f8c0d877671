"""Connects the accounting package to the running daemon: builds the `Accountant` from the
config and the partition plan, puts it behind the record sink seam (beside the request
log of --log-requests), feeds the tenant series of /metrics, and ticks it once a second.

The energy meter is the telemetry hub (`svc.telemetry`, CONTRACTS.md) when the daemon
has one; without it energy is "not measured" and GPU-seconds, cost and embodied carbon
still add up.
"""
from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from appliance.accounting.accountant import Accountant, FinalRow, Site
from appliance.accounting.attribution import DeviceInfo
from appliance.accounting.budgets import Budgets
from appliance.accounting.carbon import CarbonIntensity, EmbodiedCarbon
from appliance.accounting.cost import PriceBook
from appliance.accounting.ledger import Ledger
from appliance.accounting.records import FanoutSink
from appliance.config import Config
from appliance.daemon.metrics import TenantMetrics

if TYPE_CHECKING:
    from appliance.daemon.app import Service, Setup

log = logging.getLogger("applianced.accounting")

LEDGER_FILE = "ledger.db"      # shared with the planner's trend tables (own tables, own connection)


def device_infos(setup: Setup) -> list[DeviceInfo]:
    """The devices the plan uses, each with as many slots as workers run on it."""
    slots: dict[str, int] = {}
    for slot in setup.plan.workers():
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


def attach(svc: Service, state_dir: Path) -> Accountant | None:
    """Build the accountant and put it behind svc.sink. Raises ValueError with one line
    (a bad intensity file, an unusable ledger) before any worker starts."""
    cfg = svc.cfg
    if not cfg.accounting.enabled:
        return None
    a = cfg.accounting
    site = site_of(cfg)
    try:
        ledger = Ledger(state_dir / LEDGER_FILE, a.flush_interval_s, a.retention_days,
                        a.rollup_retention_days)
    except Exception as exc:    # sqlite3.Error, OSError: one line, not a traceback
        raise ValueError(f"cannot open the ledger {state_dir / LEDGER_FILE}: {exc}") from None
    b = cfg.budgets
    budgets = Budgets(b.period, {"gpu_hours": b.gpu_hours, "usd": b.usd, "kgco2e": b.kgco2e})
    tenants = set(svc._tenants) | budgets.tenants()
    metrics = TenantMetrics(svc.metrics.registry, svc.simulated)

    def final(row: FinalRow) -> None:
        metrics.final(row, row.record.tenant if row.record.tenant in tenants else "other")

    def budget(states: list) -> None:
        for s in states:
            metrics.budget(s.tenant, s.budget, s.ratio)

    acc = Accountant(device_infos(svc.setup), svc.model_name, site, ledger,
                     PriceBook(a.usd_per_gpu_hour, a.usd_per_kwh, a.idle_policy),
                     EmbodiedCarbon(cfg.site.embodied_kgco2e, cfg.site.lifetime_years),
                     budgets=budgets, meter=lambda: getattr(svc, "telemetry", None),
                     window_s=a.window_s, calibration_min_iterations=a.calibration_min_iterations,
                     on_final=final, on_budget=budget)
    acc.load_budgets()
    for s in budgets.states.values():
        metrics.budget(s.tenant, s.budget, s.ratio)
    ledger.start()
    svc.sink = FanoutSink(svc.sink, acc)
    svc.accountant = acc
    log.info("accounting: ledger %s, %g s windows, site %s (PUE %g, intensity %s)",
             ledger.path, a.window_s, site.name, site.pue,
             cfg.site.carbon_intensity_file or f"{cfg.site.carbon_intensity:g} g/kWh static")
    return acc


async def tick_loop(acc: Accountant, period_s: float = 1.0) -> None:
    while True:
        await asyncio.sleep(period_s)
        try:
            acc.tick()
        except Exception:       # accounting must never take serving down
            log.exception("accounting tick failed")
