"""How the console shows a value: tolerant readers of the daemon's JSON and the
formatters every screen uses.

The admin API grows in stages, so every reader takes whatever it is given, tolerates a
key being absent or of the wrong type, and yields None for "not available"; every
formatter shows None as "n/a". No Textual and no HTTP here.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

GIB = 1024 ** 3
WINDOW = "10s"                       # the window the overview shows for windowed figures
NA = "n/a"
SPARK = "▁▂▃▄▅▆▇█"

# Worker states as the daemon names them -> what an operator reads.
WORKER_STATES = {"ready": "up", "starting": "restarting", "restarting": "restarting",
                 "stopped": "down", "failed": "down"}


# ---------------------------------------------------------------- tolerant readers

def num(value: Any) -> float | None:
    """A finite number, or None (absent, null, a string, NaN...)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def windowed(value: Any, window: str = WINDOW) -> float | None:
    """`{"1s": x, "10s": y, "60s": z}` -> y; a bare number is taken as is."""
    if isinstance(value, dict):
        return num(value.get(window))
    return num(value)


def as_dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def as_list(value: Any) -> list:
    return value if isinstance(value, list) else []


def text(value: Any, default: str = NA) -> str:
    if value is None or value == "":
        return default
    return str(value)


# ---------------------------------------------------------------- formatting

def fmt_ratio(x: float | None) -> str:
    if x is None:
        return NA
    return f"{x:.2f}:1" if x < 10 else f"{x:.1f}:1"


def fmt_pct(x: float | None) -> str:
    return NA if x is None else f"{x * 100:.0f}%"


def fmt_num(x: float | None, unit: str = "", digits: int = 1) -> str:
    if x is None:
        return NA
    if abs(x) >= 10_000:
        s = f"{x:,.0f}"
    else:
        s = f"{x:.{digits}f}"
    return f"{s} {unit}".rstrip() if unit else s


def fmt_seconds(x: float | None) -> str:
    """Latencies: ms below a second."""
    if x is None:
        return NA
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def fmt_mem(used: float | None, total: float | None) -> str:
    if total is None:
        return NA
    u = NA if used is None else f"{used / GIB:.0f}"
    return f"{u}/{total / GIB:.0f}G"


def fmt_duration(s: float | None) -> str:
    if s is None:
        return NA
    s = int(s)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 172800:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d"


def bar(frac: float | None, width: int = 10) -> str:
    """A utilization bar readable without colour: '[######....]'."""
    if frac is None:
        return "[" + "·" * width + "]"
    frac = min(max(frac, 0.0), 1.0)
    full = round(frac * width)
    return "[" + "#" * full + "." * (width - full) + "]"


def sparkline(values: Iterable[float | None], width: int = 20, top: float | None = None) -> str:
    """Block characters for the last `width` values, scaled to `top` (e.g. 1.0 for a
    utilization, so 90% always looks like 90%) or, without it, to their own max."""
    vals = list(values)[-width:]
    nums = [v for v in vals if v is not None]
    if not nums:
        return ""
    scale = top if top is not None else (max(nums) or 1.0)
    return "".join(" " if v is None else
                   SPARK[min(max(int(v / scale * (len(SPARK) - 1) + 0.5), 0), len(SPARK) - 1)]
                   for v in vals)


def as_int(value: Any) -> int | None:
    x = num(value)
    return None if x is None else int(x)
