"""The real route lookup behind TensorRT-LLM's transceiver interface (engines/trtllm.py
`interface_towards`): on this machine a peer on loopback is reached through `lo`, and
one that does not resolve gives None with the reason, not an exception. (The unit
contract test fakes the lookup; this one opens real sockets, hence integration.)"""
from __future__ import annotations

import socket

from appliance.engines import trtllm


def test_a_loopback_peer_is_reached_through_lo():
    lo = socket.if_nameindex()
    assert any(name == "lo" for _, name in lo)
    assert trtllm.interface_towards(["http://127.0.0.1:8000"]) == ("lo", "routes to 127.0.0.1")
    iface, why = trtllm.interface_towards(["https://localhost:8443"])
    assert iface == "lo" and why == "routes to localhost"
    assert trtllm._interface_addresses()["127.0.0.1"] == "lo"


def test_a_peer_that_does_not_resolve_is_a_reason_not_a_crash():
    iface, why = trtllm.interface_towards(["http://no-such-host.invalid:8000"])
    assert iface is None and "no-such-host.invalid" in why
