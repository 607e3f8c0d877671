"""Length-prefixed pickle frames over a socketpair between the daemon and a worker.

Pickle is safe here: both ends are this program, on a socketpair that no other
process can reach. One frame per engine iteration carries all its events."""
from __future__ import annotations

import asyncio
import pickle
import socket
import struct

HEADER = struct.Struct("!I")


def pack(obj) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def recv(sock: socket.socket):
    """Next object, or None when the peer is gone."""
    header = _recv_exact(sock, HEADER.size)
    if header is None:
        return None
    body = _recv_exact(sock, HEADER.unpack(header)[0])
    return None if body is None else pickle.loads(body)


async def recv_body_async(reader: asyncio.StreamReader) -> bytes | None:
    """Next frame's pickled body, unopened, or None when the peer is gone."""
    try:
        header = await reader.readexactly(HEADER.size)
        return await reader.readexactly(HEADER.unpack(header)[0])
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


async def recv_async(reader: asyncio.StreamReader):
    """Next object, or None when the peer is gone."""
    body = await recv_body_async(reader)
    return None if body is None else pickle.loads(body)
