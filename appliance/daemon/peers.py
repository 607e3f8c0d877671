"""The other boxes of a cluster as this box sees them (`[cluster] peers`).

Each peer is polled every `POLL_S` with `GET /cluster/v1/status` (the cluster key): up or
down, its round-trip time, its role, how much free decode KV it has and its KV layout.
A front sends a decode to the up decode peer with the most free KV whose layout is its
prefill workers' (`pick_peer`), and marks a peer down at once when a connection to it
fails (`mark_down`); the next successful poll marks it up again. `decode` is the client
side of `POST /cluster/v1/decode`: a stream of JSON lines (`cluster_wire`), read with a
timeout between lines so that a peer that hangs ends the request instead of holding it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import orjson

from appliance.daemon.cluster_wire import DECODE_PATH, STATUS_PATH, DecodeOrder
from appliance.daemon.workers import WorkerGone

log = logging.getLogger("applianced.cluster")

POLL_S = 1.0
POLL_TIMEOUT_S = 2.0
CONNECT_TIMEOUT_S = 3.0
# Longest wait for the next line of a decode stream. The first line comes after the KV
# pull (or a recompute of the prompt); the later ones every decode step or few.
READ_TIMEOUT_S = 60.0
SILENCE_CHECK_S = 1.0       # how often a silent stream looks at its peer's poll state


class PeerUnavailable(Exception):
    """No decode peer could take the request before its decode started (none up, or the
    chosen one refused or could not be reached): the front may decode locally."""


class PeerFailed(WorkerGone):
    """A decode peer failed after the decode started (it died, hung or sent an error):
    to the client what a local worker's death is (503, or SSE `event: error`)."""

    def __init__(self, message: str, code: str = "peer_failed"):
        super().__init__(message)
        self.code = code


@dataclass
class Peer:
    url: str
    role: str | None = None
    up: bool = False
    rtt_ms: float | None = None
    in_flight: int = 0
    kv_bytes_total: int = 0
    last_error: str | None = None
    since: float = field(default_factory=time.time)   # last up/down change (unix time)
    ready: bool = False
    free_kv_blocks: int = 0
    layout: str | None = None

    def status(self) -> dict:
        """The row of `/admin/v1/status`'s ``cluster.peers`` (the TUI's peers panel)."""
        return {"url": self.url, "role": self.role, "up": self.up,
                "rtt_ms": None if self.rtt_ms is None else round(self.rtt_ms, 3),
                "in_flight": self.in_flight, "kv_bytes_total": self.kv_bytes_total,
                "last_error": self.last_error, "since": self.since}


def pick_peer(peers: list[Peer], layout: str | None) -> Peer | None:
    """The up, ready decode peer with the most free KV (less what is in flight to it)
    whose KV layout is `layout` (None: any); ties go to the fewest in flight, then the
    configured order."""
    fit = [p for p in peers if p.up and p.ready and p.role == "decode"
           and (layout is None or p.layout == layout)]
    if not fit:
        return None
    return max(fit, key=lambda p: (p.free_kv_blocks - p.in_flight, -p.in_flight,
                                   -peers.index(p)))


class Peers:
    """The configured peers, polled; the session every request to them goes through."""

    def __init__(self, urls: list[str], key: str, poll_s: float = POLL_S,
                 read_timeout_s: float = READ_TIMEOUT_S):
        self.peers = [Peer(u.rstrip("/")) for u in urls]
        self.key = key
        self.poll_s = poll_s
        self.read_timeout_s = read_timeout_s
        self._session = None
        self._task: asyncio.Task | None = None

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.key}"}

    async def start(self) -> None:
        import aiohttp
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S))
        await self.poll()
        self._task = asyncio.create_task(self._loop(), name="cluster-peers")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self.poll()
            except Exception:   # noqa: BLE001 - the poller must outlive any one bad answer
                log.exception("cluster: polling the peers failed")

    async def poll(self) -> None:
        await asyncio.gather(*(self._poll_one(p) for p in self.peers))

    async def _poll_one(self, peer: Peer) -> None:
        import aiohttp
        t0 = time.perf_counter()
        try:
            async with self._session.get(peer.url + STATUS_PATH, headers=self.headers,
                                         timeout=aiohttp.ClientTimeout(total=POLL_TIMEOUT_S)
                                         ) as resp:
                body = await resp.json(content_type=None)
                if resp.status != 200:
                    msg = (body.get("error", {}).get("message") if isinstance(body, dict)
                           else None) or f"HTTP {resp.status}"
                    raise PeerUnavailable(f"status {resp.status}: {msg}")
        except (aiohttp.ClientError, asyncio.TimeoutError, PeerUnavailable, ValueError,
                OSError) as exc:
            self.mark_down(peer, _reason(exc))
            return
        peer.rtt_ms = (time.perf_counter() - t0) * 1000
        peer.role = body.get("role")
        peer.ready = bool(body.get("ready"))
        peer.free_kv_blocks = int(body.get("free_kv_blocks") or 0)
        peer.layout = body.get("layout")
        self.mark_up(peer)

    def mark_up(self, peer: Peer) -> None:
        if not peer.up:
            peer.up, peer.since = True, time.time()
            log.info("cluster: peer %s is up (%s)", peer.url, peer.role)
        peer.last_error = None

    def mark_down(self, peer: Peer, error: str) -> None:
        peer.last_error = error
        if peer.up:
            peer.up, peer.since = False, time.time()
            log.warning("cluster: peer %s is down: %s", peer.url, error)

    def pick(self, layout: str | None) -> Peer | None:
        return pick_peer(self.peers, layout)

    def any_decode_up(self) -> bool:
        return any(p.up and p.ready and p.role == "decode" for p in self.peers)

    def status(self) -> list[dict]:
        return [p.status() for p in self.peers]

    async def _next_line(self, resp, peer: Peer, started: float) -> bytes:
        """The stream's next line (b"" at its end). Gives up after `read_timeout_s` of
        silence, or sooner once the poll has marked the peer down since the stream began
        and nothing came for a second: a box that hangs (alive, silent) fails its streams
        within the poll's timeout, not the read timeout."""
        silent = 0.0
        while True:
            try:
                return await asyncio.wait_for(resp.content.readline(), SILENCE_CHECK_S)
            except asyncio.TimeoutError:
                silent += SILENCE_CHECK_S
                if not peer.up and peer.since >= started:
                    raise asyncio.TimeoutError(f"silent while the poll found it down "
                                               f"({peer.last_error})") from None
                if silent >= self.read_timeout_s:
                    raise asyncio.TimeoutError(f"nothing for {silent:g} s") from None

    async def decode(self, peer: Peer, order: DecodeOrder) -> AsyncIterator[dict]:
        """The peer's events for `order`, as parsed JSON lines. Raises `PeerUnavailable`
        when the peer could not be reached or refused the order (nothing started there),
        `PeerFailed` when the stream broke, timed out or ended without a finish. Closing
        the generator closes the connection: the decode box then aborts the request."""
        import aiohttp
        if self._session is None:
            raise PeerUnavailable("the cluster link is not started")
        timeout = aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S)
        peer.in_flight += 1
        try:
            try:
                resp = await self._session.post(
                    peer.url + DECODE_PATH, data=orjson.dumps(order.to_json()),
                    headers={**self.headers, "Content-Type": "application/json"},
                    timeout=timeout)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                self.mark_down(peer, _reason(exc))
                raise PeerUnavailable(f"decode peer {peer.url} unreachable: "
                                      f"{_reason(exc)}") from None
            try:
                if resp.status != 200:
                    try:
                        err = (await resp.json(content_type=None))["error"]["message"]
                    except Exception:  # noqa: BLE001 - any body: the status says enough
                        err = f"HTTP {resp.status}"
                    if resp.status in (401, 403, 404):
                        self.mark_down(peer, err)
                    raise PeerUnavailable(f"decode peer {peer.url} refused the request "
                                          f"({resp.status}): {err}")
                finished = False
                started = time.time()
                try:
                    while True:
                        line = await self._next_line(resp, peer, started)
                        if not line:
                            break
                        if not line.strip():
                            continue
                        ev = orjson.loads(line)
                        if ev.get("event") == "kv_imported":
                            peer.kv_bytes_total += int(ev.get("nbytes") or 0)
                        elif ev.get("event") == "error":
                            raise PeerFailed(f"decode peer {peer.url}: {ev.get('message')}",
                                             ev.get("code") or "peer_failed")
                        elif ev.get("finish_reason") is not None:
                            finished = True
                        yield ev
                        if finished:
                            return
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
                    self.mark_down(peer, _reason(exc))
                    raise PeerFailed(f"decode peer {peer.url} failed mid-stream: "
                                     f"{_reason(exc)}") from None
                self.mark_down(peer, "stream ended without a finish")
                raise PeerFailed(f"decode peer {peer.url} ended the stream without a finish")
            finally:
                resp.close()    # not released to the pool: the peer sees the disconnect
        finally:
            peer.in_flight -= 1


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    if not text and isinstance(exc, asyncio.TimeoutError):
        return "TimeoutError: no answer in time"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
