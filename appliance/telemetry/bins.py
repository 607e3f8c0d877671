"""Amounts over time in fixed-width bins, kept for a bounded span.

Why bins rather than a list of iterations: a simulated 8-GPU box at 10x speed reports
thousands of iterations a second, and the status page asks for 1/10/60-s windows several
times a second. Each iteration is split across the bins it covers in proportion to its
overlap with each, so a window made of whole bins is exact (the hub ends its windows on
a bin edge); a window with ragged edges pro-rates its two edge bins.
"""
from __future__ import annotations

import math


class Bins:
    __slots__ = ("width", "n", "cols", "head")

    def __init__(self, width: float, span_s: float, columns: int):
        if width <= 0 or span_s <= 0:
            raise ValueError("bin width and span must be positive")
        self.width = width
        self.n = max(2, math.ceil(span_s / width) + 1)
        self.cols = [[0.0] * self.n for _ in range(columns)]
        self.head: int | None = None          # newest bin index written

    def index(self, t: float) -> int:
        return math.floor(t / self.width)

    def _slot(self, i: int) -> int | None:
        """The ring slot of bin i, clearing bins that the ring reuses; None = too old."""
        head = self.head
        if head is None or i > head:
            start = i - self.n + 1 if head is None else max(head + 1, i - self.n + 1)
            for j in range(start, i + 1):
                s = j % self.n
                for col in self.cols:
                    col[s] = 0.0
            self.head = i
        elif i <= head - self.n:
            return None
        return i % self.n

    def add(self, t0: float, t1: float, amounts: tuple[float, ...]) -> None:
        """Spread `amounts` (one per column) uniformly over [t0, t1); a point if t1 <= t0."""
        w = self.width
        i0 = math.floor(t0 / w)
        if t1 <= t0 or math.floor(t1 / w) == i0 or t1 <= (i0 + 1) * w:
            slot = self._slot(i0)
            if slot is not None:
                for col, a in zip(self.cols, amounts):
                    col[slot] += a
            return
        span = t1 - t0
        i1 = math.floor(t1 / w)
        for i in range(i0, i1 + 1):
            lo = t0 if i == i0 else i * w
            hi = t1 if i == i1 else (i + 1) * w
            if hi <= lo:
                continue
            slot = self._slot(i)
            if slot is None:
                continue
            f = (hi - lo) / span
            for col, a in zip(self.cols, amounts):
                if a:
                    col[slot] += a * f

    def _value(self, col: list[float], i: int) -> float:
        head = self.head
        if head is None or i > head or i <= head - self.n:
            return 0.0
        return col[i % self.n]

    def sum_bins(self, i0: int, i1: int) -> list[float]:
        """Totals per column over whole bins i0 <= i < i1."""
        head = self.head
        out = [0.0] * len(self.cols)
        if head is None:
            return out
        lo, hi = max(i0, head - self.n + 1), min(i1, head + 1)
        if hi <= lo:
            return out
        n = self.n
        a, b = lo % n, hi % n
        for k, col in enumerate(self.cols):
            if hi - lo >= n:
                out[k] = sum(col)
            elif a < b:
                out[k] = sum(col[a:b])
            else:
                out[k] = sum(col[a:]) + sum(col[:b])
        return out

    def sum(self, t0: float, t1: float) -> list[float]:
        """Totals over [t0, t1): whole bins exactly, the two edge bins pro-rated."""
        if t1 <= t0:
            return [0.0] * len(self.cols)
        w = self.width
        i0, i1 = math.floor(t0 / w), math.floor(t1 / w)
        if i0 == i1:
            f = (t1 - t0) / w
            return [self._value(col, i0) * f for col in self.cols]
        out = self.sum_bins(i0 + 1, i1)
        f0 = ((i0 + 1) * w - t0) / w
        f1 = (t1 - i1 * w) / w
        for k, col in enumerate(self.cols):
            out[k] += self._value(col, i0) * f0 + self._value(col, i1) * f1
        return out
