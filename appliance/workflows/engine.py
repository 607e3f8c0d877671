"""Runs workflows step by step against the journal, and resumes them after a crash.

A step's life: its intent is committed, the step acts, its observed result is committed
(with any appliance state it persists, in the same transaction). A daemon killed
between the two leaves a step `running` with an intent and no result.

Recovery (`recover`, at start-up, before the daemon serves): the new daemon has started
the workers of the persisted partition; for each unfinished workflow it walks the steps
of the current phase in order and asks whether each step's goal holds in the machine
as it is now. Goals that hold are skipped (a done step stays done, an interrupted one
whose effect happened is marked `skipped`); the first goal that does not hold is where
the workflow resumes, and it and every later step are redone. It compensates instead
when the workflow was cancelled, when its parameters no longer fit the machine (a
device gone), or when it has been interrupted by `max_recoveries` daemon deaths (a step
that kills the daemon every time must not become a crash loop).
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
import uuid

from appliance.workflows.journal import FINISHED, Journal, Refused, Workflow
from appliance.workflows.kinds import KINDS, Kind, Options
from appliance.workflows.machine import Machine, StepFailed

log = logging.getLogger("applianced.workflows")

FAULT_ENV = "APPLIANCED_FAULT"
STATE_KEYS = ("partition", "model", "admission")


def parse_faults(text: str | None) -> set[tuple[str, str, str]]:
    """`workflow:<kind>:<step>:before|after[,...]` -> {(kind, step, when)}."""
    out = set()
    for item in (text or "").split(","):
        parts = item.strip().split(":")
        if len(parts) == 4 and parts[0] == "workflow" and parts[3] in ("before", "after"):
            out.add((parts[1], parts[2], parts[3]))
    return out


class WorkflowEngine:
    def __init__(self, journal: Journal, machine: Machine, options: Options | None = None,
                 max_recoveries: int = 3, faults: str | None = None):
        self.journal = journal
        self.machine = machine
        self.options = options or Options()
        self.max_recoveries = max_recoveries
        self.faults = parse_faults(faults if faults is not None else os.environ.get(FAULT_ENV))
        self.owner = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.tasks: dict[str, asyncio.Task] = {}
        self.kinds = {name: cls(self.options) for name, cls in KINDS.items()}

    # ---- the API the daemon's handlers call -------------------------------------------
    def submit(self, kind: str, params: dict) -> Workflow:
        """Validate and record a workflow, then run it. ValueError: bad input (400);
        Refused: another workflow of its class is active (409)."""
        defn = self.kinds.get(kind)
        if defn is None:
            raise ValueError(f"unknown workflow kind {kind!r} (known: {', '.join(self.kinds)})")
        if not isinstance(params, dict):
            raise ValueError("params must be a JSON object")
        ctx = defn.prepare(params, self.machine)
        wf = self.journal.create(kind, defn.exclusive, params, defn.steps, ctx)
        self._spawn(wf.id)
        return self.journal.get(wf.id)

    def cancel(self, wid: str) -> Workflow:
        wf = self.journal.request_cancel(wid)
        task = self.tasks.get(wid)
        if task is None or task.done():      # not running here: compensate now
            self._spawn(wid)
        return wf

    def summary(self) -> dict:
        counts = self.journal.counts()
        active = [{"id": w.id, "kind": w.kind, "status": w.status,
                   "step": next((s.name for s in w.steps if s.status in ("running", "pending")),
                                None)}
                  for w in self.journal.list(10, unfinished=True)]
        return {"counts": counts, "active": active}

    def persisted(self) -> dict:
        return {k: v for k in STATE_KEYS if (v := self.journal.get_state(k)) is not None}

    async def wait(self, wid: str, timeout: float | None = None) -> Workflow:
        task = self.tasks.get(wid)
        if task is not None:
            await asyncio.wait_for(asyncio.shield(task), timeout)
        return self.journal.get(wid)

    async def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    # ---- recovery ---------------------------------------------------------------------
    def recover(self) -> list[dict]:
        """Decide, for every unfinished workflow, where it resumes (see the module doc),
        and record each decision in the journal. Runs nothing; `resume_all` does."""
        decisions = []
        for wf in reversed(self.journal.list(1000, unfinished=True)):
            try:
                decisions.append(self._reconcile(wf))
            except Exception as exc:    # never let one bad record stop the daemon
                log.exception("workflow %s: cannot reconcile", wf.id)
                self.journal.set_status(wf.id, "failed", error=f"cannot reconcile after a "
                                        f"restart: {exc!r}")
                decisions.append({"id": wf.id, "decision": "failed"})
        return decisions

    def resume_all(self) -> None:
        for wf in reversed(self.journal.list(1000, unfinished=True)):
            self._spawn(wf.id)

    def _reconcile(self, wf: Workflow) -> dict:
        defn = self.kinds[wf.kind]
        if wf.status == "pending" and not any(s.attempts for s in wf.steps):
            return {"id": wf.id, "decision": "start"}
        m = self.machine
        recoveries = self.journal.note_recovery(wf.id)
        if wf.phase == "compensating" and recoveries >= 2 * self.max_recoveries:
            self.journal.set_status(wf.id, "failed", error=f"compensation interrupted by "
                                    f"{recoveries} daemon deaths; the appliance runs its "
                                    "persisted partition and model")
            return {"id": wf.id, "decision": "give up"}
        if wf.phase == "forward" and not wf.cancel_requested:
            why = defn.still_valid(wf.context, m)
            if why is None and recoveries >= self.max_recoveries:
                running = next((s.name for s in wf.steps if s.status in ("running", "pending")),
                               None)
                why = (f"interrupted by {recoveries} daemon deaths (last at step {running}): "
                       "rolled back instead of resumed (workflows.max_recoveries)")
            if why is not None:
                self.journal.start_compensation(wf.id, defn.undo_steps, why)
                log.warning("workflow %s (%s): compensating after restart: %s", wf.id, wf.kind, why)
                wf = self.journal.get(wf.id)
                decision = "compensate"
            else:
                decision = "resume"
        else:
            decision = "compensate" if wf.phase == "compensating" or wf.cancel_requested else "resume"
            if wf.phase == "forward":       # cancelled before it could compensate
                self.journal.start_compensation(wf.id, defn.undo_steps, "cancelled")
                wf = self.journal.get(wf.id)
        persisted = self.persisted()
        undo = set(defn.undo_steps)
        steps = [s for s in wf.steps if (s.name in undo) == (wf.phase == "compensating")]
        resume_at = None
        for s in steps:
            if s.status == "skipped" and s.result is None:
                continue            # a forward step compensation made moot
            holds, observed = defn.holds(s.name, wf.context, m, persisted)
            if resume_at is None and holds:
                if s.status in ("running", "pending"):
                    self.journal.step_result(wf.id, s.seq, "skipped",
                                             {"reconciled": "skip", "observed": observed})
                continue
            if resume_at is None:
                resume_at = s.name
            if s.status != "pending":
                self._reset(wf.id, s, observed)
        log.info("workflow %s (%s): after restart %s at %s", wf.id, wf.kind, decision,
                 resume_at or "the end (every step's goal holds)")
        return {"id": wf.id, "decision": decision, "resume_at": resume_at}

    def _reset(self, wid: str, step, observed: str) -> None:
        with self.journal.tx() as db:
            db.execute("UPDATE steps SET status = 'pending', result = ?, finished_at = NULL "
                       "WHERE workflow_id = ? AND seq = ?",
                       (_json({"reconciled": "redo", "observed": observed,
                               "before": step.result}), wid, step.seq))

    # ---- running ----------------------------------------------------------------------
    def _spawn(self, wid: str) -> None:
        task = self.tasks.get(wid)
        if task is not None and not task.done():
            return
        self.tasks[wid] = asyncio.get_running_loop().create_task(self._run(wid), name=f"wf-{wid}")

    async def _run(self, wid: str) -> None:
        try:
            await self._drive(wid)
        except asyncio.CancelledError:
            raise
        except Exception as exc:    # a bug must not leave the workflow silently stuck
            log.exception("workflow %s crashed", wid)
            self.journal.set_status(wid, "failed", error=f"internal error: {exc!r}")

    async def _drive(self, wid: str) -> None:
        wf = self.journal.get(wid)
        if wf.finished:
            return
        defn: Kind = self.kinds[wf.kind]
        self.journal.set_status(wid, "running", owner=self.owner)
        while True:
            wf = self.journal.get(wid)
            if wf.phase == "forward" and wf.cancel_requested:
                self.journal.start_compensation(wid, defn.undo_steps, "cancelled by the operator")
                log.info("workflow %s: cancelled; compensating", wid)
                continue
            step = next((s for s in wf.steps if s.status in ("pending", "running")), None)
            if step is None:
                if wf.phase == "forward":
                    status = "succeeded"
                else:
                    status = "cancelled" if wf.cancel_requested else "compensated"
                self.journal.set_status(wid, status)
                log.info("workflow %s (%s): %s", wid, wf.kind, status)
                return
            self.journal.step_intent(wid, step.seq, defn.intent(step.name, wf.context))
            self._fault(wf.kind, step.name, "before")
            try:
                out = await defn.run(step.name, wf.context, self.machine, wid)
            except StepFailed as exc:
                self.journal.step_result(wid, step.seq, "failed", {"error": str(exc)})
                log.warning("workflow %s (%s): step %s failed: %s", wid, wf.kind, step.name, exc)
                if wf.phase == "forward":
                    self.journal.start_compensation(wid, defn.undo_steps,
                                                    f"step {step.name} failed: {exc}")
                    continue
                self.journal.set_status(wid, "failed",
                                        error=f"compensation step {step.name} failed: {exc}")
                return
            self.journal.step_result(wid, step.seq, "succeeded", out.result, out.state)
            self._fault(wf.kind, step.name, "after")

    def _fault(self, kind: str, step: str, when: str) -> None:
        """Fault injection for tests: die here as a kill -9 (or a power cut) would."""
        if (kind, step, when) in self.faults:
            print(f"applianced: {FAULT_ENV}: killing the daemon {when} {kind}:{step}",
                  file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(10)      # pragma: no cover (never reached)


def _json(value) -> str:
    import json
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


__all__ = ["WorkflowEngine", "Refused", "FINISHED", "parse_faults"]
