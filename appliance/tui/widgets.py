"""Widgets shared by the screens."""
from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

_NOTHING = object()


class Field(Static):
    """A Static that redraws only when what it shows has changed.

    Snapshots arrive up to four times a second and most figures do not move between
    two of them; redrawing (and re-laying-out) every Static each time is most of an
    idle console's CPU. Strings and Rich Text compare by value; for anything else (a
    Rich Table) the caller passes `key`, a value that changes when the content does.
    """

    _shown = _NOTHING

    def update(self, content="", *, key=None, layout: bool = True) -> None:
        if key is None and isinstance(content, (str, Text)):
            key = content
        if key is not None and key == self._shown:
            return
        self._shown = key if key is not None else _NOTHING
        super().update(content, layout=layout)
