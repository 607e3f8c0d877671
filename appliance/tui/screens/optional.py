"""Screens 4 and 5, Capacity and Workflows: the planner and workflow issues fill them.
Until their APIs exist they say "not available yet"; when the daemon answers, they show
what it returns as a plain table, so an operator sees the data the day it lands."""
from __future__ import annotations

import json

from rich.table import Table
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from appliance.tui.widgets import Field
from appliance.tui.screens.fetching import FetchingScreen


def _cell(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, (list, dict)):
        s = str(value)
        return s if len(s) <= 40 else s[:39] + "…"
    return str(value)


def generic_table(data: dict) -> Table:
    """The first list of objects as rows (their keys as columns), else key: value pairs."""
    rows = next((v for v in data.values() if isinstance(v, list) and v
                 and all(isinstance(r, dict) for r in v)), None)
    table = Table(box=None, pad_edge=False, expand=True, header_style="bold")
    if rows is not None:
        columns: list[str] = []
        for r in rows:
            columns += [k for k in r if k not in columns]
        columns = columns[:8]
        for c in columns:
            table.add_column(c, no_wrap=True, overflow="ellipsis")
        for r in rows:
            table.add_row(*(_cell(r.get(c)) for c in columns))
    scalars = {k: v for k, v in data.items() if not isinstance(v, (list, dict))}
    if rows is None or scalars:
        if rows is None:
            table.add_column("key", no_wrap=True)
            table.add_column("value", overflow="fold")
            for k, v in data.items():
                table.add_row(k, _cell(v))
        else:
            table.caption = "  ".join(f"{k}: {_cell(v)}" for k, v in scalars.items())
    return table


class OptionalApiScreen(FetchingScreen):
    PATH = ""
    CSS_PATH = "optional.tcss"

    def compose_body(self) -> ComposeResult:
        with VerticalScroll(classes="optional-body"):
            yield Field(classes="optional-content note")

    def request(self):
        return self.PATH, None

    def update_view(self) -> None:
        url = self.app.selected
        body = self.query_one(".optional-content", Static)
        if not self.fetched:
            body.update(f"{self.TITLE}: asking {self.PATH} ...")
        elif url in self.errors and self.data.get(url) is None:
            body.update(f"{self.TITLE}: {self.errors[url]}")
        elif self.data.get(url) is None:
            body.update(f"{self.TITLE}: not available yet (this daemon has no {self.PATH}).")
        else:
            body.update(generic_table(self.data[url]),
                        key=json.dumps(self.data[url], sort_keys=True, default=str))


class WorkflowsScreen(OptionalApiScreen):
    TITLE = "Workflows"
    PATH = "/admin/v1/workflows"
