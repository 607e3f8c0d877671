"""Live device telemetry: samplers per device kind, the hub, the EnergyMeter protocol.

Knows nothing of HTTP; the daemon feeds the hub iteration and request records and reads
its snapshot and counters through `telemetry.status` (`status_fields`, `metric_values`).
"""
from appliance.telemetry.hub import Telemetry, TelemetryDevice, TelemetryWorker
from appliance.telemetry.samples import (
    ESTIMATED, MEASURED, SIMULATED, DeviceSample, EnergyMeter, Sampler,
)
from appliance.telemetry.setup import appliance_name, build_telemetry

__all__ = ["DeviceSample", "ESTIMATED", "EnergyMeter", "MEASURED", "SIMULATED", "Sampler",
           "Telemetry", "TelemetryDevice", "TelemetryWorker", "appliance_name",
           "build_telemetry"]
