"""The Peers panel's model and text: shown only for a cluster, a peer's GB/s from two
snapshots' kv_bytes_total, a down peer with its error, junk never raising."""
from __future__ import annotations

import pytest

from helpers.admin_fixture import contract_status, two_peers

pytest.importorskip("rich")

from appliance.tui.views.overview import (History, overview_from_status,  # noqa: E402
                                          render_overview_text)
from appliance.tui.views.peers import PeerRates, cluster_from_status, peer_lines  # noqa: E402


def test_no_panel_for_an_old_daemon_or_a_single_box():
    assert cluster_from_status(contract_status(0.5, 0.5)) is None
    assert cluster_from_status({"cluster": {"role": "both", "peers": []}}) is None
    assert "PEERS" not in render_overview_text(overview_from_status(contract_status(0.5, 0.5)))


def test_a_role_without_peers_still_shows_the_panel():
    c = cluster_from_status({"cluster": {"role": "decode", "peers": []}})
    assert c is not None and c.role == "decode" and c.peers == ()
    assert peer_lines(c) == ["PEERS  this box: decode  0 of 0 up"]


def test_gb_per_s_comes_from_kv_bytes_total_deltas():
    rates = PeerRates(window_s=10.0)
    first = {"cluster": two_peers(kv_bytes=1_000_000_000)}
    rates.observe(first, 100.0)
    c = cluster_from_status(first, rates)
    assert [p.kv_gb_per_s for p in c.peers] == [None, None]     # one snapshot: no rate yet
    rates.observe({"cluster": two_peers(kv_bytes=4_000_000_000)}, 102.0)
    c = cluster_from_status({"cluster": two_peers(kv_bytes=4_000_000_000)}, rates)
    up, down = c.peers
    assert up.kv_gb_per_s == pytest.approx(1.5)                  # 3 GB in 2 s
    assert down.kv_gb_per_s == pytest.approx(0.0)                # its counter did not move
    # a restarted box's counter starts again: no negative rate, a fresh start
    rates.observe({"cluster": two_peers(kv_bytes=10)}, 103.0)
    assert rates.gb_per_s(up.url) is None


def test_the_rate_window_slides():
    rates = PeerRates(window_s=10.0)
    for t, b in ((0.0, 0), (5.0, 5e9), (12.0, 12e9), (22.0, 32e9)):
        rates.observe({"cluster": two_peers(kv_bytes=int(b))}, t)
    # the points before the last window fell out: 20 GB over the last 10 s, not 32 over 22
    assert rates.gb_per_s("https://decode-1:8000") == pytest.approx(2.0)


def test_lines_show_up_and_down_peers_with_rtt_in_flight_and_the_error():
    status = {**contract_status(0.5, 0.5), "cluster": two_peers(kv_bytes=0)}
    h = History()
    h.observe(status, 1.0)
    ov = overview_from_status(status, h)
    assert ov.cluster.role == "prefill" and ov.cluster.down == 1
    text = render_overview_text(ov)
    lines = text.splitlines()
    i = lines.index("PEERS  this box: prefill  1 of 2 up")
    up, down, why = lines[i + 1], lines[i + 2], lines[i + 3]
    assert "https://decode-1:8000" in up and " up " in up and "rtt   0.4 ms" in up
    assert "in flight   3" in up and "KV   n/a GB/s" in up
    assert "DOWN" in down and "rtt      n/a" in down
    assert why == "    last error: connection refused"
    assert lines[i + 4:] == []


def test_junk_in_the_cluster_section_never_raises():
    for junk in ({"cluster": "x"}, {"cluster": {"peers": "x"}}, {"cluster": {"peers": [1, None]}},
                 {"cluster": {"role": 3, "peers": [{"url": 5, "up": "yes", "rtt_ms": "fast"}]}}):
        c = cluster_from_status(junk, PeerRates())
        if c is not None:
            peer_lines(c)
            assert all(not p.up for p in c.peers)        # only `true` is up
