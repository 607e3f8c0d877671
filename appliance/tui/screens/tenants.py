"""Screen 2: who spends the GPU budget (`/admin/v1/usage?group_by=tenant,phase`), by
tenant or by a tag on the tenants' keys (`g`: team, project, cost centre)."""
from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Input, Static

from appliance.tui.format import NA, fmt_num, fmt_pct
from appliance.tui.views.tenants import (GROUPS, PERIODS, TENANT_SORTS, TenantView, filter_tenants,
                                         sort_tenants, tenants_from_usage)
from appliance.tui.widgets import Field
from appliance.tui.screens.fetching import FetchingScreen

SORT_LABELS = {"gpu_seconds": "GPU-s", "cost_usage": "$ usage", "cost_allocation": "$ alloc",
               "kwh": "kWh", "kg_co2e": "kgCO2e", "budget_used": "budget", "rejected": "refused",
               "tenant": "tenant"}


def money(x: float | None) -> str:
    return NA if x is None else f"${x:,.2f}"


def tenant_table(rows: list[TenantView], sort_key: str, descending: bool,
                 group: str = "tenant") -> Table:
    arrow = "↓" if descending else "↑"
    table = Table(box=None, pad_edge=False, expand=True, header_style="bold")
    heads = [("tenant", "left"), ("gpu_seconds", "right"), ("split", "right"),
             ("share", "right"), ("cost_usage", "right"), ("cost_allocation", "right"),
             ("kwh", "right"), ("kg_co2e", "right"), ("budget_used", "right")]
    # refused requests (rate limits, budgets, overload): a column once there are any
    refused = any(r.rejected for r in rows)
    if refused:
        heads.append(("rejected", "right"))
    for key, justify in heads:
        label = SORT_LABELS.get(key, {"split": "P/D", "share": "share"}.get(key, key))
        if key == "tenant" and group != "tenant":
            label = group[4:]
        if key == sort_key:
            label += arrow
        table.add_column(label, justify=justify, no_wrap=True, overflow="ellipsis",
                         min_width=None if key == "tenant" else len(label),
                         ratio=1 if key == "tenant" else None)
    for r in rows:
        split = (f"{r.prefill_gpu_seconds / r.gpu_seconds * 100:.0f}/"
                 f"{r.decode_gpu_seconds / r.gpu_seconds * 100:.0f}") if r.gpu_seconds else NA
        budget = fmt_pct(r.budget_used)
        if r.budget_used is not None and r.budget_used >= 1.0:
            budget += "!"
        elif r.budget_used is not None and r.budget_used >= 0.8:
            budget += "*"
        cells = [r.tenant, fmt_num(r.gpu_seconds), split, fmt_pct(r.share),
                 money(r.cost_usage), money(r.cost_allocation),
                 fmt_num(r.kwh, digits=3), fmt_num(r.kg_co2e, digits=3), budget]
        if refused:
            cells.append(NA if r.rejected is None else str(r.rejected))
        table.add_row(*cells)
    return table


class TenantsScreen(FetchingScreen):
    TITLE = "Tenants"
    CSS_PATH = "tenants.tcss"
    BINDINGS = [
        Binding("s", "sort", "Sort"),
        Binding("S", "reverse", "Reverse", show=False),
        Binding("t", "period", "Period"),
        Binding("g", "group", "Group"),
        Binding("slash", "filter", "Filter"),
        Binding("escape", "clear_filter", "Clear filter", show=False),
    ]

    def __init__(self):
        super().__init__()
        self.period = "24h"
        self.group = "tenant"
        self.sort_key = "gpu_seconds"
        self.descending = True
        self.needle = ""
        self.rows: list[TenantView] = []

    def compose_body(self) -> ComposeResult:
        yield Field(id="tenants-head")
        with VerticalScroll(id="tenants-body"):
            yield Field(id="tenants-table")
        yield Input(placeholder="filter tenants (Enter applies, Esc clears)", id="tenants-filter")

    def request(self):
        return "/admin/v1/usage", {"group_by": f"{self.group},phase", "since": self.period}

    def extra_badges(self) -> list[str]:
        out = []
        if any(r.simulated for r in self.rows):
            out.append("SIMULATED")
        if any(not r.measured for r in self.rows):
            out.append("ESTIMATED")
        return out

    def update_view(self) -> None:
        url = self.app.selected
        answer = self.data.get(url)
        head = Text(f"period {self.period} (t)  by {self.group} (g)  sort {SORT_LABELS[self.sort_key]} "
                    f"{'desc' if self.descending else 'asc'} (s/S)")
        if self.needle:
            head.append(f"  filter '{self.needle}' (/, Esc)")
        if url in self.errors:
            head.append(f"\n{self.errors[url]}", style="bold")
        self.query_one("#tenants-head", Static).update(head)
        body = self.query_one("#tenants-table", Static)
        if not self.fetched:
            body.update("loading usage ...")
            return
        if answer is None and url not in self.errors:
            self.rows = []
            body.update("Usage by tenant: not available yet (this daemon has no /admin/v1/usage).")
            return
        self.rows = tenants_from_usage(answer or {}, self.group)
        rows = filter_tenants(sort_tenants(self.rows, self.sort_key, self.descending), self.needle)
        if not rows:
            body.update("no usage in this period" + (" matching the filter" if self.needle else ""))
            return
        body.update(tenant_table(rows, self.sort_key, self.descending, self.group),
                    key=(tuple(rows), self.sort_key, self.descending, self.group))

    # ------------------------------------------------------------ keys

    def action_sort(self) -> None:
        i = TENANT_SORTS.index(self.sort_key)
        self.sort_key = TENANT_SORTS[(i + 1) % len(TENANT_SORTS)]
        self.descending = self.sort_key != "tenant"
        self.update_all()

    def action_reverse(self) -> None:
        self.descending = not self.descending
        self.update_all()

    def action_period(self) -> None:
        keys = list(PERIODS)
        self.period = keys[(keys.index(self.period) + 1) % len(keys)]
        self.fetched = False
        self.update_all()
        self.refresh_data()

    def action_group(self) -> None:
        """Next grouping: tenant, then each key tag; the report is fetched anew."""
        self.group = GROUPS[(GROUPS.index(self.group) + 1) % len(GROUPS)]
        self.fetched = False
        self.update_all()
        self.refresh_data()

    def action_filter(self) -> None:
        box = self.query_one("#tenants-filter", Input)
        box.value = self.needle
        box.display = True
        box.focus()

    def action_clear_filter(self) -> None:
        self.needle = ""
        box = self.query_one("#tenants-filter", Input)
        box.display = False
        self.set_focus(None)
        self.update_all()

    def on_input_changed(self, event: Input.Changed) -> None:
        self.needle = event.value
        self.update_all()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.needle = event.value
        event.input.display = False
        self.set_focus(None)
        self.update_all()
