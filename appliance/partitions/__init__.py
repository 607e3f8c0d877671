"""Devices and how they are split into prefill and decode workers."""

from appliance.partitions.catalogue import CATALOGUE, GpuSpec, lookup_gpu, match_nvml_name
from appliance.partitions.devices import Device, Inventory, discover, parse_sim_spec
from appliance.partitions.nvml import Nvml
from appliance.partitions.plan import PartitionPlan, PlanError, WorkerSlot, plan_partition
from appliance.partitions.report import format_devices, inventory_json

__all__ = [
    "CATALOGUE",
    "Device",
    "GpuSpec",
    "Inventory",
    "Nvml",
    "PartitionPlan",
    "PlanError",
    "WorkerSlot",
    "discover",
    "format_devices",
    "inventory_json",
    "lookup_gpu",
    "match_nvml_name",
    "parse_sim_spec",
    "plan_partition",
]
