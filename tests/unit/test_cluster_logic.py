"""The pure parts of two boxes serving as one (docs/operations/cluster.md): which decode
peer a front picks, the decode order's body (what is accepted, what is refused and how),
the cluster key check, which workers each role runs, and the KV handle a front sends."""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from appliance import config
from appliance.daemon.api_error import ApiError
from appliance.daemon.cluster_wire import (
    DecodeOrder, bearer_matches, params_json, parse_decode_order,
)
from appliance.daemon.peers import Peer, PeerUnavailable, pick_peer
from appliance.daemon.router import remote_kv
from appliance.daemon.setup import StartupError, cluster_specs
from appliance.engines.messages import GuidedDecoding, KvHandle, SamplingParams
from appliance.kv.nixl_transport import NixlKvHandle, from_json
from appliance.worker.spec import WorkerSpec


def peer(url, up=True, ready=True, role="decode", free=100, layout="L", in_flight=0):
    return Peer(url, role=role, up=up, ready=ready, free_kv_blocks=free, layout=layout,
                in_flight=in_flight)


def test_the_front_picks_the_up_decode_peer_with_most_free_kv_of_its_layout():
    peers = [peer("a", free=50), peer("b", free=90), peer("c", free=500, up=False),
             peer("d", free=900, layout="other"), peer("e", free=950, role="prefill"),
             peer("f", free=990, ready=False)]
    assert pick_peer(peers, "L").url == "b"
    assert pick_peer(peers, None).url == "d"
    # what is already on its way to a peer counts against its free KV
    peers[1].in_flight = 45
    assert pick_peer(peers, "L").url == "a"


def test_no_peer_fits_gives_none_and_ties_go_to_the_configured_order():
    assert pick_peer([peer("a", up=False), peer("b", layout="x")], "L") is None
    assert pick_peer([], "L") is None
    assert pick_peer([peer("a"), peer("b")], "L").url == "a"


def test_a_peer_row_is_the_status_contract():
    row = Peer("http://d:1", role="decode", up=True, rtt_ms=1.23456, in_flight=2,
               kv_bytes_total=10, since=5.0).status()
    assert row == {"url": "http://d:1", "role": "decode", "up": True, "rtt_ms": 1.235,
                   "in_flight": 2, "kv_bytes_total": 10, "last_error": None, "since": 5.0}


PARAMS = SamplingParams(max_tokens=7, temperature=0.5, seed=3, stop_token_ids=(1, 2),
                        logit_bias=((5, -1.5),), logprobs=2,
                        guided=GuidedDecoding("regex", "a+"), min_tokens=1)


def order(**over) -> DecodeOrder:
    base = dict(request_id="r1", tenant="t", model="m", prompt=[1, 2, 3], first_token=4,
                params=PARAMS, layout="L", kv_pool="", kv_handle="{}", weight=2.0,
                priority=1)
    return DecodeOrder(**{**base, **over})


def test_a_decode_order_round_trips_through_its_json_body():
    o = order()
    body = json.loads(json.dumps(o.to_json()))
    assert parse_decode_order(body) == o
    assert params_json(SamplingParams(max_tokens=1))["guided"] is None


@pytest.mark.parametrize("change, param", [
    (lambda b: b.pop("prompt"), "prompt"),
    (lambda b: b.update(prompt=[]), "prompt"),
    (lambda b: b.update(prompt=[1, -1]), "prompt"),
    (lambda b: b.update(first_token="x"), "first_token"),
    (lambda b: b["params"].update(max_tokens=0), "params"),
    (lambda b: b["params"].update(bogus=1), "params"),
    (lambda b: b.update(weight=0), "weight"),
    (lambda b: b.pop("kv"), "kv"),
    (lambda b: b.update(extra=1), "extra"),
])
def test_a_bad_decode_body_is_a_400_naming_the_field(change, param):
    body = order().to_json()
    change(body)
    with pytest.raises(ApiError) as err:
        parse_decode_order(body)
    assert err.value.status == 400 and err.value.param == param


def test_the_cluster_key_must_match_exactly():
    key = "k" * 24
    assert bearer_matches(f"Bearer {key}", key)
    for bad in (None, "", key, f"Bearer {key}x", f"bearer {key}", "Bearer " + "j" * 24):
        assert not bearer_matches(bad, key)
    assert not bearer_matches("Bearer ", "")        # no key configured: nobody


def _specs():
    return [WorkerSpec("prefill0", "prefill", "torch", ["cpu0"], "cpu", "/m"),
            WorkerSpec("decode0", "decode", "torch", ["cpu1"], "cpu", "/m")]


def _cfg(role, split="auto"):
    cfg = config.Config()
    cfg.cluster.role = role
    cfg.devices.split = split
    return cfg


def test_each_role_runs_its_own_workers_with_nixl():
    both = cluster_specs(_cfg("both"), "disagg", "torch", _specs())
    assert [s.worker for s in both] == ["prefill0", "decode0"] and not any(s.nixl for s in both)
    dec = cluster_specs(_cfg("decode"), "disagg", "torch", _specs())
    assert [s.worker for s in dec] == ["decode0"] and dec[0].nixl
    pre = cluster_specs(_cfg("prefill"), "disagg", "torch", _specs())
    assert [s.worker for s in pre] == ["prefill0"] and pre[0].nixl
    # an explicit split keeps the front's own decode workers (its fallback)
    assert [s.worker for s in cluster_specs(_cfg("prefill", "1+1"), "disagg", "torch",
                                            _specs())] == ["prefill0", "decode0"]
    # the simulator has no pool to register
    assert not any(s.nixl for s in cluster_specs(_cfg("decode"), "disagg", "sim", _specs()))


def test_a_workflow_on_a_decode_box_starts_no_prefill_worker():
    """A repartition's plan names both roles; on a decode box `ensure_started` starts
    only its decode slots (the start-up rule), so a prefill slot is skipped outright."""
    import asyncio

    from appliance.daemon.control import Control
    from appliance.partitions.plan import WorkerSlot

    class Pool:
        workers: dict = {}

        def add(self, spec):        # reached only for a slot the box should run
            raise AssertionError(f"started {spec.worker} on a decode box")

    refreshed = []
    ctl = Control(_cfg("decode"), SimpleNamespace(inventory=None), None, Pool(),
                  SimpleNamespace(refresh=lambda: refreshed.append(1)), None)
    slot = WorkerSlot("prefill9", "prefill", ("cpu0",))
    assert asyncio.run(ctl.ensure_started([slot], None)) == []
    assert refreshed
    with pytest.raises(AssertionError, match="started"):
        ctl.cfg.cluster.role = "both"
        ctl._spec = lambda slot, model: SimpleNamespace(worker=slot.worker)
        asyncio.run(ctl.ensure_started([slot], None))


def test_a_cluster_role_needs_disagg_and_a_worker_of_its_role():
    with pytest.raises(StartupError, match="devices.mode"):
        cluster_specs(_cfg("prefill"), "agg", "torch", _specs())
    with pytest.raises(StartupError, match="no decode worker"):
        cluster_specs(_cfg("decode"), "disagg", "torch", _specs()[:1])


def _link(nixl_pool=None, simulated=False):
    return SimpleNamespace(id="prefill0", hello=SimpleNamespace(nixl_pool=nixl_pool,
                                                                simulated=simulated))


def test_the_front_sends_the_workers_pool_and_a_wall_clock_handle():
    pool = json.dumps({"agent": "ag", "pool_id": "p1"})
    h = KvHandle("prefill0", "r1", [3, 4], 20, "L", expires_at=time.monotonic() + 10)
    sent_pool, sent = remote_kv(_link(pool), h)
    got = from_json(NixlKvHandle, sent)
    assert sent_pool == pool
    assert (got.agent, got.pool_id, got.block_ids, got.num_tokens) == ("ag", "p1", (3, 4), 20)
    assert abs(got.expires_at - (time.time() + 10)) < 1.0
    sim_pool, sim = remote_kv(_link(simulated=True), h)
    assert sim_pool == "" and from_json(NixlKvHandle, sim).agent == "sim-prefill0"
    with pytest.raises(PeerUnavailable, match="no NIXL agent"):
        remote_kv(_link(), h)
