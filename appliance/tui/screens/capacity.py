"""Screen 4, Capacity: what the planner (`/admin/v1/plan`) says the box needs.

The λ forecast over the horizon with its prediction interval, ρ's past and forecast, the
current split against the recommended one now and at the forecast peak, GPUs per phase,
the bottleneck in words, and where the profiles came from. The reading and the layout
are `capacity_from_plan` / `render_capacity_lines` in the model (plain text, no colour
needed); this screen only fetches and shows them.
"""
from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from appliance.tui.views.capacity import CapacityView, capacity_from_plan, render_capacity_lines
from appliance.tui.widgets import Field
from appliance.tui.screens.fetching import FetchingScreen

PATH = "/admin/v1/plan"


class CapacityScreen(FetchingScreen):
    TITLE = "Capacity"
    CSS_PATH = "capacity.tcss"

    def __init__(self):
        super().__init__()
        self.view: CapacityView | None = None

    def compose_body(self) -> ComposeResult:
        with VerticalScroll(id="capacity-body"):
            yield Field(id="capacity-content")

    def request(self):
        return PATH, None

    def extra_badges(self) -> list[str]:
        v = self.view
        if v is None:
            return []
        out = []
        if v.simulated or v.profile_badge == "SIMULATED":
            out.append("SIMULATED")
        if v.estimated:
            out.append("ESTIMATED")
        return out

    def update_view(self) -> None:
        url = self.app.selected
        body = self.query_one("#capacity-content", Static)
        answer = self.data.get(url)
        if not self.fetched:
            body.update(f"Capacity: asking {PATH} ...")
            return
        if answer is None:
            self.view = None
            body.update(f"Capacity: {self.errors[url]}" if url in self.errors else
                        f"Capacity: not available yet (this daemon has no {PATH}).")
            return
        self.view = capacity_from_plan(answer)
        lines = render_capacity_lines(self.view, max(40, self.app.size.width - 2))
        if url in self.errors:
            lines.insert(0, f"(last answer; now: {self.errors[url]})")
        body.update(Text("\n".join(lines)))      # Text: "[...]" is not markup
