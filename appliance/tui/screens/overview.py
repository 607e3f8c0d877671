"""Screen 1, the first thing on screen: the prefill:decode ratio, then every device
under its group, then rates, latencies and workers."""
from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Sparkline, Static

from appliance.tui.format import fmt_ratio, sparkline
from appliance.tui.views.overview import (DeviceView, GroupView, Overview, device_line,
                                          group_line, rates_line, workers_grid, workers_line)
from appliance.tui.views.peers import cluster_title, peer_error_line, peer_line
from appliance.tui.widgets import Field
from appliance.tui.screens.base import ConsoleScreen


DEVICE_TEXT_WIDTH = 61             # device_line() without its sparkline


class DeviceRow(Field):
    """One device: its figures, then its utilization history on a fixed 0-100% scale
    (Textual's Sparkline scales to its own min and max, which would draw a steady 90%
    as flat as a steady 5%)."""

    def __init__(self, dev_id: str):
        super().__init__(classes="device")
        self.dev_id = dev_id

    def show(self, d: DeviceView, history: list[float], spark_width: int) -> None:
        self.update(device_line(d, sparkline(history, spark_width, top=1.0)))


class GroupHeader(Field):
    def __init__(self, group: str):
        super().__init__(classes="group")
        self.group = group


class OverviewScreen(ConsoleScreen):
    TITLE = "Overview"
    CSS_PATH = "overview.tcss"

    def __init__(self):
        super().__init__()
        self._layout: tuple = ()
        self._rebuilding = False

    def compose_body(self) -> ComposeResult:
        with VerticalScroll(id="body"):
            with Vertical(id="ratio-box"):
                yield Field(id="ratio")
                yield Sparkline([], id="ratio-spark")
            yield Field(id="rates")
            yield Field(id="peers")
            yield Vertical(id="groups")
            yield Field(id="workers")
            yield Field(id="worker-grid")

    def update_view(self) -> None:
        state = self.app.current
        ov = state.overview
        if ov is None:
            self.query_one("#ratio", Static).update("waiting for the first snapshot ...")
            return
        self.query_one("#ratio", Static).update(ratio_text(ov, state.history.ratio))
        spark = self.query_one("#ratio-spark", Sparkline)
        hist = [v for v in ov.ratio_history if v is not None][-60:]
        if list(spark.data or []) != hist:
            spark.data = hist
        self.query_one("#rates", Static).update(rates_line(ov))
        peers = self.query_one("#peers", Static)
        peers.display = ov.cluster is not None
        if ov.cluster is not None:
            peers.update(peers_text(ov))
        self.query_one("#workers", Static).update(workers_line(ov))
        self.query_one("#worker-grid", Static).update(workers_grid(ov, self.size.width))
        self._show_groups(ov.groups, state.history)

    def _show_groups(self, groups: tuple[GroupView, ...], history) -> None:
        layout = tuple((g.name, tuple(d.id for d in g.devices)) for g in groups)
        if layout != self._layout:             # devices came or went: rebuild the rows
            if not self._rebuilding:
                self._rebuilding = True
                self.run_worker(self._rebuild(layout, groups, history), group="rows",
                                exit_on_error=False)
            return
        self._fill_groups(groups, history)

    async def _rebuild(self, layout: tuple, groups: tuple[GroupView, ...], history) -> None:
        try:
            box = self.query_one("#groups", Vertical)
            await box.remove_children()
            widgets = []
            for g in groups:
                widgets.append(GroupHeader(g.name))
                widgets += [DeviceRow(d.id) for d in g.devices]
            await box.mount_all(widgets)
            self._layout = layout
        finally:
            self._rebuilding = False
        self.update_all()                     # the newest snapshot, not the one we started with

    def _fill_groups(self, groups: tuple[GroupView, ...], history) -> None:
        rows = {r.dev_id: r for r in self.query(DeviceRow)}
        headers = {h.group: h for h in self.query(GroupHeader)}
        spark_width = max(4, min(60, self.size.width - DEVICE_TEXT_WIDTH - 2))
        for g in groups:
            if g.name in headers:
                headers[g.name].update(Text(group_line(g), style="bold"))
            for d in g.devices:
                row = rows.get(d.id)
                if row is not None:
                    row.show(d, history.device(d.id), spark_width)


def peers_text(ov: Overview) -> Text:
    """The Peers panel: a title, then one line per peer, a down one in red."""
    t = Text()
    t.append(cluster_title(ov.cluster), style="bold")
    for p in ov.cluster.peers:
        t.append("\n")
        t.append(peer_line(p), style=None if p.up else "bold red")
        err = peer_error_line(p)
        if err is not None:
            t.append("\n" + err, style="red")
    return t


def ratio_text(ov: Overview, seen) -> Text:
    """The ratio, big: GPU-seconds first; when idle, the last one seen, marked so."""
    t = Text()
    t.append("PREFILL:DECODE ", style="bold")
    if ov.ratio_gpu is not None:
        t.append(fmt_ratio(ov.ratio_gpu), style="bold reverse")
        t.append(" GPU-s")
    else:
        last = next((v for v in reversed(list(seen)) if v is not None), None)
        if ov.mode == "agg":
            t.append("n/a (agg mode)")
        elif last is not None:
            t.append(fmt_ratio(last), style="bold")
            t.append(" GPU-s (last; idle now)")
        else:
            t.append("n/a (idle)")
    t.append(f"  energy {fmt_ratio(ov.ratio_energy)}  activity {fmt_ratio(ov.ratio_activity)}"
             f"  [{ov.ratio_window}]")
    return t
