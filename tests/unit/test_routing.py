"""The routing policy the daemon's router and the planner's replay share."""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from appliance.routing import Rotation, least_queued, most_free

ROOT = Path(__file__).resolve().parents[2] / "appliance"


@dataclass
class W:
    name: str
    pending_prefill_tokens: int = 0
    inflight: int = 0
    free: int = 0


def test_prompt_goes_to_fewest_queued_tokens_then_fewest_in_flight():
    ws = [W("a", 300, 0), W("b", 100, 5), W("c", 100, 2)]
    assert least_queued(ws).name == "c"
    ws[2].inflight = 9
    assert least_queued(ws).name == "b"


def test_decode_goes_to_most_free_kv_then_fewest_in_flight():
    ws = [W("a", free=10, inflight=1), W("b", free=40, inflight=3), W("c", free=40, inflight=2)]
    assert most_free(ws, lambda w: w.free).name == "c"
    assert most_free(ws, lambda w: w.free - (35 if w.name != "a" else 0)).name == "a"


def test_ties_go_round_robin_per_role():
    ws = [W("a"), W("b"), W("c")]
    rot = Rotation()
    picks = [least_queued(rot.rotate(ws, "prefill")).name for _ in range(4)]
    assert picks == ["a", "b", "c", "a"]
    # Another role keeps its own turn.
    assert least_queued(rot.rotate(ws, "decode")).name == "a"


def _calls(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.func.id for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}


def test_router_and_replay_call_the_one_policy():
    """Both call the shared functions, and neither keeps a `min`/`max` of its own over
    the queue counters (a copy of the rule would drift)."""
    # (The daemon's prompt placement is in its dispatch queue, which the router calls.)
    for rels in (("daemon/router.py", "daemon/dispatch.py"), ("planner/cluster_sim.py",)):
        calls = set().union(*(_calls(ROOT / rel) for rel in rels))
        assert {"least_queued", "most_free"} <= calls, rels
        for rel in rels:
            text = (ROOT / rel).read_text()
            assert "key=lambda w: (w.pending_prefill_tokens" not in text, rel


def test_replayed_cluster_routes_by_the_policy():
    """The simulated cluster's picks follow the policy: round-robin among equals, then to
    the worker with fewer queued prompt tokens."""
    from appliance.planner.cluster_sim import VirtualCluster

    class Probe(VirtualCluster):
        def arrive(self, payload, t):
            pass

        def done(self):
            return True

    fronts = [W("p0"), W("p1")]
    for w in fronts:
        w.role = "prefill"
    c = Probe(fronts, "disagg")
    assert [c._least_queued().name for _ in range(2)] == ["p0", "p1"]
    fronts[0].pending_prefill_tokens = 50
    assert [c._least_queued().name for _ in range(2)] == ["p1", "p1"]


def test_the_policy_imports_nothing_of_the_appliance():
    tree = ast.parse((ROOT / "routing.py").read_text())
    names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {n for n in names if n and n.startswith("appliance")}
