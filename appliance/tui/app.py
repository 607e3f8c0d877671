"""The console: one feed per appliance, six screens, keys.

The feeds run as workers on the app's own event loop and hand every snapshot to
`_on_snapshot`; the app coalesces them so the screens redraw at most `MAX_REDRAWS_PER_S`
times a second however fast the daemon streams, and assigns a NEW dict to the
`appliances` reactive each time (mutating it in place would not redraw). Screens read
only that reactive; nothing on screen ever talks to the network directly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import time

from textual.app import App
from textual.binding import Binding
from textual.reactive import reactive

from appliance.tui.feed import ApplianceFeed, Link
from appliance.tui.views.overview import History, Overview, overview_from_status
from appliance.tui.screens import SCREENS

MAX_REDRAWS_PER_S = 4


@dataclass(frozen=True, slots=True)
class ApplianceState:
    """The console's last word on one appliance."""
    url: str
    link: Link
    status: dict | None = None
    overview: Overview | None = None
    received_at: float | None = None
    history: History = field(default_factory=History, compare=False)


class ApplianceConsole(App):
    TITLE = "applianced"
    CSS_PATH = "app.tcss"
    ENABLE_COMMAND_PALETTE = False
    MODES = SCREENS
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help"),
        Binding("1", "screen('overview')", "Overview", show=False),
        Binding("2", "screen('tenants')", "Tenants", show=False),
        Binding("3", "screen('carbon')", "Carbon", show=False),
        Binding("4", "screen('capacity')", "Capacity", show=False),
        Binding("5", "screen('workflows')", "Workflows", show=False),
        Binding("6", "screen('fleet')", "Fleet", show=False),
        Binding("p", "pause", "Pause"),
        Binding("r", "refresh", "Refresh"),
        Binding("a", "next_appliance", "Next box", show=False),
    ]

    appliances: reactive[dict[str, ApplianceState]] = reactive(dict)
    selected: reactive[str] = reactive("")
    paused: reactive[bool] = reactive(False)

    def __init__(self, urls: list[str], admin_key: str | None = None, *,
                 poll_interval: float = 1.0, backoff: tuple[float, float] = (0.5, 5.0),
                 tls=None):
        super().__init__()
        self.urls = [u.rstrip("/") for u in urls] or ["http://127.0.0.1:8000"]
        self.admin_key = admin_key
        self.feeds = {u: ApplianceFeed(u, admin_key, on_snapshot=self._on_snapshot,
                                       on_link=self._on_link, poll_interval=poll_interval,
                                       backoff=backoff, tls=tls) for u in self.urls}
        self._states = {u: ApplianceState(u, self.feeds[u].link) for u in self.urls}
        self._dirty = False
        self._last_flush = 0.0
        self._flush_timer = None

    # ------------------------------------------------------------ lifecycle

    def on_mount(self) -> None:
        self.selected = self.urls[0]
        self.appliances = dict(self._states)
        for url, feed in self.feeds.items():
            self.run_worker(feed.run(), name=f"feed {url}", group="feeds", exit_on_error=False)
        self.switch_mode("overview")

    # ------------------------------------------------------------ feed callbacks

    def _on_snapshot(self, url: str, status: dict) -> None:
        old = self._states[url]
        try:
            old.history.observe(status, time.time())
            ov = overview_from_status(status, old.history)
            old.history.add(ov)
        except Exception:              # a snapshot we cannot read must not take us down
            ov = old.overview
        self._states[url] = ApplianceState(url, self.feeds[url].link, status, ov, time.time(),
                                           old.history)
        self._schedule_flush()

    def _on_link(self, link: Link) -> None:
        old = self._states[link.url]
        self._states[link.url] = ApplianceState(link.url, link, old.status, old.overview,
                                                old.received_at, old.history)
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        self._dirty = True
        if self._flush_timer is not None:
            return
        wait = self._last_flush + 1 / MAX_REDRAWS_PER_S - time.monotonic()
        if wait <= 0:
            self._flush()
        else:
            self._flush_timer = self.set_timer(wait, self._flush)

    def _flush(self) -> None:
        self._flush_timer = None
        if not self._dirty or self.paused:
            return
        self._dirty = False
        self._last_flush = time.monotonic()
        self.appliances = dict(self._states)

    # ------------------------------------------------------------ actions

    def action_screen(self, mode: str) -> None:
        if self.current_mode != mode:
            self.switch_mode(mode)

    def action_help(self) -> None:
        from appliance.tui.screens.help import HelpScreen
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_pause(self) -> None:
        self.paused = not self.paused
        if not self.paused:
            self._dirty = True
            self._flush()

    def action_refresh(self) -> None:
        for feed in self.feeds.values():
            feed.refresh()
        refresh = getattr(self.screen, "refresh_data", None)
        if refresh is not None:
            refresh()

    def action_next_appliance(self) -> None:
        i = self.urls.index(self.selected) if self.selected in self.urls else -1
        self.selected = self.urls[(i + 1) % len(self.urls)]

    # ------------------------------------------------------------ helpers

    @property
    def current(self) -> ApplianceState:
        return self.appliances.get(self.selected) or self._states[self.urls[0]]


def run(urls: list[str], admin_key: str | None = None, tls=None) -> int:
    """`tls`: an ssl.SSLContext for https:// appliances (--cacert, --cert/--key), or None."""
    app = ApplianceConsole(urls, admin_key, tls=tls)
    app.run()
    return app.return_code or 0
