"""Screen 6: every appliance given with `--url` at once: the fleet's ratio, one row per
appliance by site, and the top tenants across the fleet."""
from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from appliance.tui.format import fmt_num, fmt_pct, fmt_ratio
from appliance.tui.views.fleet import fleet_ratio, site_row
from appliance.tui.views.tenants import merge_tenants, tenants_from_usage
from appliance.tui.widgets import Field
from appliance.tui.screens.fetching import FetchingScreen
from appliance.tui.screens.tenants import money

TOP_TENANTS = 5


class FleetScreen(FetchingScreen):
    TITLE = "Fleet"
    CSS_PATH = "fleet.tcss"

    def compose_body(self) -> ComposeResult:
        with VerticalScroll(id="fleet-body"):
            yield Field(id="fleet-ratio")
            yield Field(id="fleet-sites")
            yield Field("top tenants, last 24h", classes="section")
            yield Field(id="fleet-tenants")

    def urls(self) -> list[str]:
        return [u for u, s in self.app.appliances.items() if s.link.up]

    def request(self):
        return "/admin/v1/usage", {"group_by": "tenant,phase", "since": "24h"}

    def update_view(self) -> None:
        states = list(self.app.appliances.values())
        pairs = [(s.overview, s.status) for s in states if s.overview is not None]
        up = sum(1 for s in states if s.link.up)
        ratio = Text()
        ratio.append("FLEET PREFILL:DECODE ", style="bold")
        ratio.append(fmt_ratio(fleet_ratio(pairs)), style="bold reverse")
        ratio.append(f" GPU-s  ({up}/{len(states)} appliances reachable)")
        self.query_one("#fleet-ratio", Static).update(ratio)

        table = Table(box=None, pad_edge=False, expand=True, header_style="bold")
        for label, justify, ratio in [("site", "left", 1), ("appliance", "left", 1),
                                      ("url", "left", 2), ("link", "left", 0),
                                      ("P:D", "right", 0), ("dev", "right", 0),
                                      ("req/s", "right", 0), ("tok/s", "right", 0)]:
            table.add_column(label, justify=justify, no_wrap=True, overflow="ellipsis",
                             min_width=None if ratio else max(len(label), 7),
                             ratio=ratio or None)
        rows = sorted((site_row(s.url, s.link.state, s.overview) for s in states),
                      key=lambda r: (r.site, r.appliance, r.url))
        for r in rows:
            table.add_row(r.site, r.appliance or "-",
                          r.url, r.state, fmt_ratio(r.ratio_gpu), str(r.devices),
                          fmt_num(r.requests_per_s), fmt_num(r.tokens_per_s, digits=0))
        self.query_one("#fleet-sites", Static).update(table, key=tuple(rows))

        tenants_box = self.query_one("#fleet-tenants", Static)
        answers = [a for a in self.data.values() if a is not None]
        if not self.fetched:
            tenants_box.update("loading usage ...")
            return
        if not answers:
            tenants_box.update("not available yet (no appliance answers /admin/v1/usage)")
            return
        merged = merge_tenants(tenants_from_usage(a) for a in answers)[:TOP_TENANTS]
        t = Table(box=None, pad_edge=False, expand=True, header_style="bold")
        for label in ("tenant", "GPU-s", "share", "$ usage", "kgCO2e"):
            t.add_column(label, justify="left" if label == "tenant" else "right", no_wrap=True)
        for r in merged:
            t.add_row(r.tenant, fmt_num(r.gpu_seconds), fmt_pct(r.share), money(r.cost_usage),
                      fmt_num(r.kg_co2e, digits=3))
        tenants_box.update(t, key=tuple(merged))
