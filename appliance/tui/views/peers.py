"""The Peers panel's model: the other boxes of a two-box cluster, from the `cluster`
section of `/admin/v1/status`, and the KV transfer rate per peer.

The daemon reports each peer's cumulative `kv_bytes_total`; a rate needs two snapshots,
so `PeerRates` (fed every snapshot, like the overview's `History`) keeps the last few
and derives GB/s over its window. Absent on old daemons, and hidden for a single box
(role "both" and no peers). No Textual, no HTTP."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from appliance.tui.format import NA, as_dict, as_int, as_list, num, text


@dataclass(frozen=True, slots=True)
class PeerView:
    url: str
    role: str | None
    up: bool
    rtt_ms: float | None
    in_flight: int | None
    kv_bytes_total: int | None
    kv_gb_per_s: float | None         # from kv_bytes_total deltas; None until two snapshots
    last_error: str | None
    since: float | None               # time.time() the peer's up/down state began


@dataclass(frozen=True, slots=True)
class ClusterView:
    role: str
    peers: tuple[PeerView, ...]

    @property
    def down(self) -> int:
        return sum(1 for p in self.peers if not p.up)


@dataclass
class PeerRates:
    """Each peer's (time, kv_bytes_total) over the last `window_s`, for its GB/s."""
    window_s: float = 10.0
    seen: dict[str, deque] = field(default_factory=dict)

    def observe(self, status: Any, t: float) -> None:
        for p in as_list(as_dict(as_dict(status).get("cluster")).get("peers")):
            p = as_dict(p)
            total = as_int(p.get("kv_bytes_total"))
            url = p.get("url")
            if total is None or not isinstance(url, str):
                continue
            points = self.seen.setdefault(url, deque(maxlen=64))
            if points and total < points[-1][1]:      # the counter restarted with the box
                points.clear()
            points.append((t, total))
            while len(points) > 2 and t - points[1][0] >= self.window_s:
                points.popleft()

    def gb_per_s(self, url: str) -> float | None:
        points = self.seen.get(url)
        if not points or len(points) < 2:
            return None
        (t0, b0), (t1, b1) = points[0], points[-1]
        return (b1 - b0) / (t1 - t0) / 1e9 if t1 > t0 else None


def cluster_from_status(status: Any, rates: PeerRates | None = None) -> ClusterView | None:
    """The panel's model, or None when there is nothing to show (an old daemon, or a
    single box: role "both" with no peers)."""
    c = as_dict(as_dict(status).get("cluster"))
    if not c:
        return None
    role = text(c.get("role"), "both")
    peers = []
    for p in as_list(c.get("peers")):
        p = as_dict(p)
        url = text(p.get("url"), "?")
        err = p.get("last_error")
        peers.append(PeerView(
            url=url, role=p.get("role") if isinstance(p.get("role"), str) else None,
            up=p.get("up") is True, rtt_ms=num(p.get("rtt_ms")),
            in_flight=as_int(p.get("in_flight")), kv_bytes_total=as_int(p.get("kv_bytes_total")),
            kv_gb_per_s=rates.gb_per_s(url) if rates is not None else None,
            last_error=err if isinstance(err, str) and err else None, since=num(p.get("since"))))
    if role == "both" and not peers:
        return None
    return ClusterView(role=role, peers=tuple(peers))


def cluster_title(c: ClusterView) -> str:
    up = len(c.peers) - c.down
    return f"PEERS  this box: {c.role}  {up} of {len(c.peers)} up"


def peer_line(p: PeerView, url_width: int = 24) -> str:
    """One peer: state, its role, RTT, handoffs in flight, KV GB/s."""
    state = "up" if p.up else "DOWN"
    rtt = NA if p.rtt_ms is None else f"{p.rtt_ms:.1f} ms"
    gbs = NA if p.kv_gb_per_s is None else f"{p.kv_gb_per_s:.2f}"
    url = p.url if len(p.url) <= url_width else "…" + p.url[-(url_width - 1):]
    return (f"  {url:<{url_width}} {text(p.role, '?'):<8} {state:<4} rtt {rtt:>8}  "
            f"in flight {text(p.in_flight, NA):>3}  KV {gbs:>5} GB/s")


def peer_error_line(p: PeerView) -> str | None:
    """Why a down peer is down, on a line of its own (an error can be long)."""
    return f"    last error: {p.last_error}" if not p.up and p.last_error else None


def peer_lines(c: ClusterView) -> list[str]:
    out = [cluster_title(c)]
    for p in c.peers:
        out.append(peer_line(p))
        err = peer_error_line(p)
        if err is not None:
            out.append(err)
    return out
