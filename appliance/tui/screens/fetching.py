"""Screens whose figures come from their own request (usage, carbon, plan, workflows),
fetched while the screen is on view, every `EVERY` seconds and on `r`."""
from __future__ import annotations

from textual import work

from appliance.tui.feed import FeedError
from appliance.tui.screens.base import ConsoleScreen

EVERY = 10.0


class FetchingScreen(ConsoleScreen):
    def __init__(self):
        super().__init__()
        self.data: dict[str, dict | None] = {}     # url -> last answer (None: route absent)
        self.errors: dict[str, str] = {}
        self.fetched = False
        self._timer = None

    def on_screen_resume(self) -> None:
        super().on_screen_resume()
        self.refresh_data()
        if self._timer is None:
            self._timer = self.set_interval(EVERY, self.refresh_data)
        else:
            self._timer.resume()

    def on_screen_suspend(self) -> None:
        if self._timer is not None:
            self._timer.pause()

    def urls(self) -> list[str]:
        """Which appliances this screen asks (the selected one, unless it is the fleet's)."""
        return [self.app.selected]

    def request(self) -> tuple[str, dict | None]:
        raise NotImplementedError

    def refresh_data(self) -> None:
        self._fetch()

    @work(exclusive=True, group="fetch", exit_on_error=False)
    async def _fetch(self) -> None:
        path, params = self.request()
        data, errors = {}, {}
        for url in self.urls():
            feed = self.app.feeds[url]
            try:
                data[url] = await feed.get_json(path, params)
            except FeedError as exc:
                errors[url] = str(exc)
                data[url] = self.data.get(url)        # keep the last good answer
        self.data, self.errors, self.fetched = data, errors, True
        self.update_all()
