"""What every screen shares: the title bar with its badges, the link banner, the footer.

A screen re-renders from `app.appliances` only while it is the current one (and once
when it comes back), so the screens not on view cost nothing. Rendering errors are
caught here and shown as one line: a monitor must never put a traceback on screen.
"""
from __future__ import annotations

import time

from rich.text import Text
from textual.app import ComposeResult
from textual.screen import Screen
from textual.widgets import Footer, Static

from appliance.tui.format import fmt_duration
from appliance.tui.views.overview import badges
from appliance.tui.widgets import Field


class ConsoleScreen(Screen):
    TITLE = ""

    def compose(self) -> ComposeResult:
        yield Field(id="bar", classes="bar")
        yield Field(id="banner", classes="banner")
        yield from self.compose_body()
        yield Footer()

    def compose_body(self) -> ComposeResult:
        yield from ()

    def on_mount(self) -> None:
        self.watch(self.app, "appliances", self._changed, init=False)
        self.watch(self.app, "paused", self._changed, init=False)
        self.watch(self.app, "selected", self._changed, init=False)
        self.update_all()

    def on_screen_resume(self) -> None:
        self.update_all()

    def _changed(self, _value=None) -> None:
        if self.is_current:
            self.update_all()

    def update_all(self) -> None:
        try:
            self.update_view()               # first: it decides the screen's own badges
            self.update_header()
        except Exception as exc:       # noqa: BLE001 - shown, never raised
            self.query_one("#banner", Static).update(f"display error: {type(exc).__name__}: {exc}")
            self.query_one("#banner", Static).display = True

    # ------------------------------------------------------------ overridable

    def update_view(self) -> None:
        """Render the screen's body from `self.app.appliances`."""

    def extra_badges(self) -> list[str]:
        """Badges for figures this screen shows beyond the overview (tenants, carbon)."""
        return []

    def refresh_data(self) -> None:
        """`r`: fetch what this screen fetches on its own, now."""

    # ------------------------------------------------------------ header and banner

    def update_header(self) -> None:
        app = self.app
        state = app.current
        ov = state.overview
        tags = badges(ov) if ov is not None else []
        if len(app.urls) > 1 or self.TITLE == "Fleet":
            tags = sorted({t for s in app.appliances.values() if s.overview
                           for t in badges(s.overview)} | set(tags))
        bar = Text()
        for tag in tags + [t for t in self.extra_badges() if t not in tags]:
            bar.append(f" {tag} ", style="reverse bold")     # first: never cut off
            bar.append(" ")
        if app.paused:
            bar.append(" PAUSED ", style="reverse")
            bar.append(" ")
        bar.append(self.TITLE, style="bold")
        if ov is not None:
            where = ov.site + (f"/{ov.appliance}" if ov.appliance else "")
            bar.append(f" · {where} · {ov.model}")
        bar.append(f" · {state.link.state}")
        if len(app.urls) > 1:
            bar.append(f" · box {app.urls.index(state.url) + 1}/{len(app.urls)} (a)")
        bar.append(" · applianced")
        bar.no_wrap = True
        bar.overflow = "ellipsis"
        self.query_one("#bar", Static).update(bar)

        lines = []
        now = time.time()
        for s in app.appliances.values():
            link = s.link
            if link.up:
                continue
            if link.state == "connecting":
                lines.append(f"connecting to {s.url} ...")
                continue
            word = "unreachable" if link.state == "unreachable" else "refused the console"
            line = f"{s.url} {word}"
            if link.detail:
                line += f": {link.detail}"
            if link.retry_in is not None:
                line += f"; retrying (backoff {link.retry_in:.1f}s)"
            if s.received_at is not None:
                line += f"; figures below are {fmt_duration(now - s.received_at)} old"
            lines.append(line)
        banner = self.query_one("#banner", Static)
        banner.update("\n".join(lines))
        banner.display = bool(lines)
