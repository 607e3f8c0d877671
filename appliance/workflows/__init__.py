"""Durable admin workflows (repartition, swap-model, drain, resume): a SQLite journal,
steps that reconcile against the live machine, and recovery after a crash.

Knows nothing of HTTP: the daemon implements `machine.Machine` and exposes the engine."""
from appliance.workflows.engine import WorkflowEngine, parse_faults
from appliance.workflows.journal import Journal, NotFound, Refused
from appliance.workflows.machine import Machine, ModelRef, StepFailed

__all__ = ["Journal", "Machine", "ModelRef", "NotFound", "Refused", "StepFailed",
           "WorkflowEngine", "parse_faults"]
