"""One appliance's live snapshots, over HTTP only.

`ApplianceFeed.run()` reads the SSE stream `/admin/v1/stream`; when the daemon has no
stream (404) or the stream breaks, it polls `/admin/v1/status` instead; when the daemon
cannot be reached it says so and tries again with a growing backoff. It never raises:
every failure becomes a `Link` state the console shows, because a monitor that dies
when the thing it monitors dies is no monitor. Like Dolphie's poller, the next poll is
scheduled only after the last one finished, so a slow daemon is never piled on.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
import json
import time
from typing import Any, Callable

import aiohttp

STREAM = "/admin/v1/stream"
STATUS = "/admin/v1/status"


@dataclass(frozen=True, slots=True)
class Link:
    """How the console is connected to one appliance, right now."""
    url: str
    state: str                        # connecting | streaming | polling | unreachable | refused
    detail: str = ""                  # one line: why unreachable / refused
    since: float = 0.0                # time.time() the state began
    retry_in: float | None = None     # seconds until the next attempt (unreachable / refused)

    @property
    def up(self) -> bool:
        return self.state in ("streaming", "polling")


class FeedError(Exception):
    """One line: why a request to the daemon gave nothing usable."""


class ApplianceFeed:
    def __init__(self, url: str, admin_key: str | None = None, *,
                 on_snapshot: Callable[[str, dict], None],
                 on_link: Callable[[Link], None],
                 poll_interval: float = 1.0, backoff: tuple[float, float] = (0.5, 5.0),
                 stream_idle_timeout: float = 10.0, request_timeout: float = 5.0,
                 tls=None):
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.on_snapshot = on_snapshot
        self.on_link = on_link
        self.poll_interval = poll_interval
        self.backoff = backoff
        self.stream_idle_timeout = stream_idle_timeout
        self.timeout = aiohttp.ClientTimeout(total=request_timeout)
        self.link = Link(self.url, "connecting", since=time.time())
        self._wake = asyncio.Event()
        self._session: aiohttp.ClientSession | None = None
        self.tls = tls                  # ssl.SSLContext for https:// (None: the default)

    # ------------------------------------------------------------ public

    def refresh(self) -> None:
        """Poll now, or retry now if the daemon was unreachable."""
        self._wake.set()

    async def get_json(self, path: str, params: dict | None = None) -> dict | None:
        """GET a JSON document; None when the daemon has no such route (404)."""
        session = await self._client()
        try:
            async with session.get(self.url + path, params=params, headers=self.headers,
                                   timeout=self.timeout) as resp:
                if resp.status == 404:
                    return None
                body = await resp.read()
                if resp.status != 200:
                    raise FeedError(f"{path}: HTTP {resp.status}: {_message(body)}")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise FeedError(f"{path}: {_why(exc)}") from None
        try:
            data = json.loads(body)
        except ValueError:
            raise FeedError(f"{path}: the daemon answered something not JSON") from None
        if not isinstance(data, dict):
            raise FeedError(f"{path}: the daemon answered a {type(data).__name__}, not an object")
        return data

    async def run(self) -> None:
        """Until cancelled: stream, else poll, else wait and retry."""
        delay = self.backoff[0]
        try:
            while True:
                try:
                    started = time.monotonic()
                    if await self._stream():          # False: no stream route here
                        if time.monotonic() - started > self.backoff[1]:
                            delay = self.backoff[0]
                            continue                  # a long stream broke: again at once
                        # a stream that keeps ending at once: retry it, but not in a spin
                        # (the next attempt says "unreachable" if the daemon is gone)
                        await self._sleep(delay)
                        delay = min(delay * 2, self.backoff[1])
                        continue
                    await self._poll_forever()
                except _Unreachable as exc:
                    self._set_link("unreachable", str(exc), retry_in=delay)
                except _Refused as exc:
                    self._set_link("refused", str(exc), retry_in=delay)
                await self._sleep(delay)
                delay = min(delay * 2, self.backoff[1])
        finally:
            if self._session is not None:
                await self._session.close()

    # ------------------------------------------------------------ internals

    async def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(ssl=self.tls) if self.tls is not None else None
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    def _set_link(self, state: str, detail: str = "", retry_in: float | None = None) -> None:
        if (state, detail) != (self.link.state, self.link.detail) or retry_in != self.link.retry_in:
            since = self.link.since if state == self.link.state else time.time()
            self.link = Link(self.url, state, detail, since, retry_in)
            self.on_link(self.link)

    def _deliver(self, data: Any) -> None:
        if isinstance(data, dict):
            self.on_snapshot(self.url, data)

    async def _sleep(self, seconds: float) -> None:
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    async def _stream(self) -> bool:
        """Read SSE snapshots until the stream ends; False if the daemon has no stream."""
        session = await self._client()
        try:
            async with session.get(self.url + STREAM, headers={**self.headers,
                                                               "Accept": "text/event-stream"},
                                   timeout=aiohttp.ClientTimeout(
                                       total=None, connect=self.timeout.total,
                                       sock_read=self.stream_idle_timeout)) as resp:
                if resp.status in (404, 405):
                    return False
                if resp.status in (401, 403):
                    raise _Refused(f"HTTP {resp.status}: {_message(await resp.read())}")
                if resp.status != 200:
                    return False               # a broken stream route: polling still works
                self._set_link("streaming")
                data_lines: list[str] = []
                async for raw in resp.content:
                    line = raw.decode("utf-8", "replace").rstrip("\r\n")
                    if line.startswith("data:"):
                        data_lines.append(line[5:].lstrip())
                    elif not line and data_lines:
                        payload, data_lines = "\n".join(data_lines), []
                        try:
                            self._deliver(json.loads(payload))
                        except ValueError:
                            pass                # one bad event: wait for the next
                    # ':' comments (keep-alives) and other fields are ignored
            return True
        except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError,
                ConnectionError) as exc:
            raise _Unreachable(_why(exc)) from None
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            if self.link.state == "streaming":
                return True                     # it was working: reconnect at once
            raise _Unreachable(_why(exc)) from None

    async def _poll_forever(self) -> None:
        while True:
            started = time.monotonic()
            try:
                data = await self.get_json(STATUS)
            except FeedError as exc:
                if "HTTP 401" in str(exc) or "HTTP 403" in str(exc):
                    raise _Refused(str(exc)) from None
                raise _Unreachable(str(exc)) from None
            if data is None:
                raise _Refused(f"{STATUS}: HTTP 404 (not an applianced daemon?)")
            self._set_link("polling")
            self._deliver(data)
            await self._sleep(max(0.0, self.poll_interval - (time.monotonic() - started)))


class _Unreachable(Exception):
    pass


class _Refused(Exception):
    pass


def _why(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect ({exc.os_error.strerror or exc.os_error})" \
            if exc.os_error else "cannot connect"
    return str(exc) or type(exc).__name__


def _message(raw: bytes) -> str:
    try:
        return json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode(errors="replace").strip() or "no message"
