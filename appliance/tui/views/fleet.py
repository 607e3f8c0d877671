"""The fleet screen's model: one row per appliance, and the fleet-wide ratio.

Computed from the daemon's JSON and nothing else; no Textual, no HTTP."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from appliance.tui.format import NA, as_dict, windowed
from appliance.tui.views.overview import Overview


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
