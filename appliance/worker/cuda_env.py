"""The CUDA allocator settings a GPU worker must run with, whatever the operator's
environment says.

Each KV pool is exported to sibling processes through CUDA IPC. Memory from expandable
segments (``expandable_segments:True`` in the allocator config) is exported as a file
descriptor that the importer opens with pidfd_getfd, which Yama's ``ptrace_scope=1`` (the
default on Ubuntu and others) refuses between siblings; and the pools must come from plain
cudaMalloc anyway (see appliance/kv/handoff.py). So the setting is forced off in both names
torch reads (``PYTORCH_ALLOC_CONF``, and the older ``PYTORCH_CUDA_ALLOC_CONF``), keeping
every other option the operator set.
"""
from __future__ import annotations

from collections.abc import Mapping

ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
FORCED = "expandable_segments:False"


def alloc_conf(existing: str | None) -> str:
    """`existing` (comma-separated ``key:value`` options) with expandable_segments forced off."""
    kept = [opt.strip() for opt in (existing or "").split(",")
            if opt.strip() and opt.split(":", 1)[0].strip() != "expandable_segments"]
    return ",".join(kept + [FORCED])


def gpu_worker_env(base: Mapping[str, str]) -> dict[str, str]:
    """The allocator variables of a GPU worker's environment: always the CUDA one, and the
    generic one too when the operator set it (torch reads it first)."""
    out = {"PYTORCH_CUDA_ALLOC_CONF": alloc_conf(base.get("PYTORCH_CUDA_ALLOC_CONF"))}
    if "PYTORCH_ALLOC_CONF" in base:
        out["PYTORCH_ALLOC_CONF"] = alloc_conf(base["PYTORCH_ALLOC_CONF"])
    return out
