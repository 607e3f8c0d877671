"""Screen 3: carbon by site and tenant (`/admin/v1/carbon?group_by=site,tenant`):
the grid intensity now and where it comes from, and SCI per 1,000 tokens."""
from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from appliance.tui.format import fmt_num
from appliance.tui.views.carbon import CarbonView, carbon_from_json
from appliance.tui.widgets import Field
from appliance.tui.screens.fetching import FetchingScreen


def carbon_table(rows: list[CarbonView]) -> Table:
    table = Table(box=None, pad_edge=False, expand=True, header_style="bold")
    for label, justify, ratio in [("site", "left", 1), ("tenant", "left", 2),
                                  ("gCO2e/kWh", "right", 0), ("provenance", "left", 2),
                                  ("kWh", "right", 0), ("kgCO2e", "right", 0),
                                  ("SCI g/1k tok", "right", 0)]:
        table.add_column(label, justify=justify, no_wrap=True, overflow="ellipsis",
                         min_width=len(label) if ratio == 0 else None, ratio=ratio or None)
    for r in rows:
        table.add_row(r.site, r.tenant, fmt_num(r.intensity, digits=0), r.provenance,
                      fmt_num(r.kwh, digits=3), fmt_num(r.kg_co2e, digits=3),
                      fmt_num(r.sci_per_1k_tokens, digits=2))
    return table


class CarbonScreen(FetchingScreen):
    TITLE = "Carbon"
    CSS_PATH = "carbon.tcss"

    def __init__(self):
        super().__init__()
        self.rows: list[CarbonView] = []

    def compose_body(self) -> ComposeResult:
        yield Field(id="carbon-head")
        with VerticalScroll(id="carbon-body"):
            yield Field(id="carbon-table")

    def request(self):
        return "/admin/v1/carbon", {"group_by": "site,tenant"}

    def extra_badges(self) -> list[str]:
        out = []
        if any(r.simulated for r in self.rows):
            out.append("SIMULATED")
        if any(r.estimated for r in self.rows):
            out.append("ESTIMATED")
        return out

    def update_view(self) -> None:
        url = self.app.selected
        self.query_one("#carbon-head", Static).update(
            self.errors.get(url, "operational + embodied carbon; provenance of each intensity"))
        body = self.query_one("#carbon-table", Static)
        if not self.fetched:
            body.update("loading carbon ...")
            return
        answer = self.data.get(url)
        if answer is None and url not in self.errors:
            self.rows = []
            body.update("Carbon: not available yet (this daemon has no /admin/v1/carbon).")
            return
        self.rows = carbon_from_json(answer or {})
        if self.rows:
            body.update(carbon_table(self.rows), key=tuple(self.rows))
        else:
            body.update("no carbon figures yet")
