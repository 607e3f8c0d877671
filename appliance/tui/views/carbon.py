"""The carbon screen's model: carbon per site and tenant from `/admin/v1/carbon`, each
figure with its provenance (measured, estimated, simulated).

Computed from the daemon's JSON and nothing else; no Textual, no HTTP."""
from __future__ import annotations

from dataclasses import dataclass

from appliance.tui.format import NA, as_dict, as_list, num, text


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
