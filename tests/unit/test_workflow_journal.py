"""The workflow journal on a real SQLite file: durability settings, intent before result,
one active workflow per class, a process killed mid-transaction, and stable worker names
when the partition changes."""
from __future__ import annotations

import os

import pytest

from appliance.partitions import discover, plan_partition
from appliance.partitions.plan import PlanError
from appliance.workflows.engine import parse_faults
from appliance.workflows.journal import Journal, NotFound, Refused
from appliance.workflows.machine import plan_from_json, plan_to_json, replan, split_of


def test_durability_settings(tmp_path):
    j = Journal(tmp_path / "wf.db")
    assert j.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert j.db.execute("PRAGMA synchronous").fetchone()[0] == 2      # FULL


def test_intent_is_recorded_before_the_result(tmp_path):
    j = Journal(tmp_path / "wf.db")
    wf = j.create("repartition", "workers", {"split": "6+2"}, ["validate", "stop"])
    assert wf.status == "pending" and [s.status for s in wf.steps] == ["pending", "pending"]
    j.step_intent(wf.id, 1, {"workers": ["decode0"]})
    # another connection (what a restarted daemon would see) reads the intent, no result
    other = Journal(tmp_path / "wf.db")
    step = other.get(wf.id).steps[1]
    assert (step.status, step.intent, step.result, step.attempts) == \
        ("running", {"workers": ["decode0"]}, None, 1)
    j.step_result(wf.id, 1, "succeeded", {"stopped": ["decode0"]},
                  state={"partition": {"mode": "disagg"}})
    step = other.get(wf.id).steps[1]
    assert step.status == "succeeded" and step.result == {"stopped": ["decode0"]}
    assert step.finished_at >= step.started_at
    assert other.get_state("partition") == {"mode": "disagg"}
    j.step_intent(wf.id, 1, {"workers": ["decode0"]})
    assert other.get(wf.id).steps[1].attempts == 2


def test_one_active_workflow_per_class(tmp_path):
    j = Journal(tmp_path / "wf.db")
    first = j.create("repartition", "workers", {"split": "6+2"}, ["a"])
    with pytest.raises(Refused, match=f"{first.id} \\(repartition\\) is pending"):
        j.create("swap-model", "workers", {"model": "x"}, ["a"])
    j.create("drain", "admission", {}, ["a"])          # another class may run alongside
    j.set_status(first.id, "succeeded")
    assert j.get(first.id).finished_at is not None
    j.create("swap-model", "workers", {"model": "x"}, ["a"])


def test_cancel_and_compensation_bookkeeping(tmp_path):
    j = Journal(tmp_path / "wf.db")
    wf = j.create("repartition", "workers", {}, ["a", "b", "c"])
    j.step_intent(wf.id, 0, {})
    j.step_result(wf.id, 0, "succeeded", {})
    j.step_intent(wf.id, 1, {})
    assert j.request_cancel(wf.id).cancel_requested
    j.start_compensation(wf.id, ["undo_a"], "cancelled")
    wf = j.get(wf.id)
    assert wf.phase == "compensating"
    assert [(s.name, s.status) for s in wf.steps] == [
        ("a", "succeeded"), ("b", "failed"), ("c", "skipped"), ("undo_a", "pending")]
    j.set_status(wf.id, "cancelled")
    with pytest.raises(Refused, match="already cancelled"):
        j.request_cancel(wf.id)
    with pytest.raises(NotFound):
        j.get("wf-nope")


def test_worker_pids_are_recorded_and_forgotten(tmp_path):
    j = Journal(tmp_path / "wf.db")
    j.worker_started("decode0", 1234, ["sim4"])
    j.worker_started("decode1", 1235, ["sim5"])
    j.worker_stopped("decode0")
    assert j.recorded_workers() == [("decode1", 1235, ["sim5"], os.getpid())]
    j.forget_workers()
    assert j.recorded_workers() == []


def test_replan_keeps_the_names_of_workers_that_do_not_move():
    inv = discover("sim:8xH100")
    old = plan_partition(inv, split="4+4")
    new = replan(old, inv, "6+2")
    names = {s.worker: s.devices for s in new.workers()}
    assert names == {"prefill0": ("sim0",), "prefill1": ("sim1",), "prefill2": ("sim2",),
                     "prefill3": ("sim3",), "prefill4": ("sim4",), "prefill5": ("sim5",),
                     "decode2": ("sim6",), "decode3": ("sim7",)}
    assert split_of(new) == "6+2"
    back = replan(new, inv, "4+4")
    assert {s.worker: s.devices for s in back.decode} == {
        "decode0": ("sim4",), "decode1": ("sim5",), "decode2": ("sim6",), "decode3": ("sim7",)}
    assert plan_from_json(plan_to_json(back)).workers() == back.workers()
    with pytest.raises(PlanError, match="needs 10 devices"):
        replan(old, inv, "5+5")
    with pytest.raises(PlanError, match="agg mode"):
        replan(plan_partition(inv, mode="agg"), inv, "4+4")


def test_fault_specs():
    assert parse_faults("workflow:repartition:stop_affected:before, workflow:drain:persist:after") \
        == {("repartition", "stop_affected", "before"), ("drain", "persist", "after")}
    assert parse_faults("workflow:repartition:stop:during,junk,") == set()


def test_workflow_config_is_checked():
    from appliance import config
    cfg = config.parse("[workflows]\ndrain_timeout_s = 5\nmax_recoveries = 2\n")
    assert (cfg.workflows.drain_timeout_s, cfg.workflows.max_recoveries) == (5.0, 2)
    with pytest.raises(config.ConfigError, match="workflows.max_recoveries must be 1 or more"):
        config.parse("[workflows]\nmax_recoveries = 0\n")
    with pytest.raises(config.ConfigError, match="unknown key workflows.retries"):
        config.parse("[workflows]\nretries = 1\n")
