"""The console's screen as plain text, as a terminal without colour would show it, read
through Textual's public screenshot rather than its private compositor: the SVG that
`App.export_screenshot()` returns (Rich's `export_svg`) draws each run of characters as a
<text> element at x = column × character width, on the line its clip path names."""
from __future__ import annotations

import html
import re

from rich.cells import cell_len

RUN = re.compile(r'<text [^>]*?\bx="([\d.]+)"[^>]*?\btextLength="([\d.]+)"'
                 r'[^>]*?\bclip-path="url\(#[\w-]+-line-(\d+)\)"[^>]*>(.*?)</text>', re.S)


def screen_text(app) -> str:
    width, height = app.size
    runs = [(float(x), float(length), int(line), html.unescape(text).replace("\xa0", " "))
            for x, length, line, text in RUN.findall(app.export_screenshot())]
    rows = [[" "] * width for _ in range(height)]
    # textLength is the character width times the run's length in characters
    char_width = next((length / len(text) for _, length, _, text in runs if text), 1.0)
    for x, _, line, text in runs:
        col = round(x / char_width)
        for ch in text:
            if 0 <= line < height and 0 <= col < width:
                rows[line][col] = ch
                if cell_len(ch) == 2 and col + 1 < width:
                    rows[line][col + 1] = ""
            col += cell_len(ch)
    return "\n".join("".join(row) for row in rows) + "\n"
