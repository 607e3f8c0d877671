"""The one door to NVML.

Every NVML call in the appliance goes through `Nvml.call`, so a flaky driver, an old
library or a GPU that fell off the bus yields a default value (shown as N/A) instead of
an exception in the middle of a poll or a discovery. Functions the library lacks, or a
device does not support, are remembered and not asked again: nvitop's lesson, since some
of these calls are slow to fail.

The pynvml module is imported lazily and can be injected, because the daemon must start
on machines without the package or the driver, and tests drive it with a fake module.
"""

from __future__ import annotations

import ctypes

from collections.abc import Hashable
from types import ModuleType
from typing import Any

# Every pynvml attribute the appliance uses. A test checks them against the installed
# nvidia-ml-py and against tests/helpers/fake_nvml.py, so neither the code nor the fake can drift
# from the real names. Add to these lists when you add a call.
USED_FUNCTIONS: tuple[str, ...] = (
    "nvmlInit",
    "nvmlShutdown",
    "nvmlDeviceGetCount",
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetName",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetMigMode",
    "nvmlDeviceGetP2PStatus",
    "nvmlDeviceGetTopologyCommonAncestor",
    # telemetry (appliance/telemetry/nvml_sampler.py)
    "nvmlDeviceGetTotalEnergyConsumption",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetClockInfo",
    "nvmlDeviceGetTemperature",
    "nvmlGpmQueryDeviceSupport",
    "nvmlGpmSampleAlloc",
    "nvmlGpmSampleGet",
    "nvmlGpmSampleFree",
    "nvmlGpmMetricsGet",
)
USED_CONSTANTS: tuple[str, ...] = (
    "NVML_DEVICE_MIG_ENABLE",
    "NVML_P2P_CAPS_INDEX_NVLINK",
    "NVML_P2P_STATUS_OK",
    "NVML_TOPOLOGY_INTERNAL",
    "NVML_TOPOLOGY_SINGLE",
    "NVML_TOPOLOGY_MULTIPLE",
    "NVML_TOPOLOGY_HOSTBRIDGE",
    "NVML_TOPOLOGY_NODE",
    "NVML_TOPOLOGY_SYSTEM",
    # telemetry
    "NVML_CLOCK_SM",
    "NVML_TEMPERATURE_GPU",
    "NVML_SUCCESS",
    "NVML_ERROR_GPU_IS_LOST",
    "NVML_GPM_METRICS_GET_VERSION",
    "NVML_GPM_METRIC_SM_UTIL",
    "NVML_GPM_METRIC_ANY_TENSOR_UTIL",
    "NVML_GPM_METRIC_DRAM_BW_UTIL",
    "c_nvmlGpmMetricsGet_t",          # the struct nvmlGpmMetricsGet fills in
)
USED_ERRORS: tuple[str, ...] = (
    "NVMLError",
    "NVMLError_LibraryNotFound",
    "NVMLError_DriverNotLoaded",
    "NVMLError_LibRmVersionMismatch",
    "NVMLError_NoPermission",
    "NVMLError_FunctionNotFound",
    "NVMLError_NotSupported",
    "NVMLError_GpuIsLost",
)

# nvmlInit failures an operator can act on, most specific first.
_INIT_REASONS: tuple[tuple[str, str], ...] = (
    ("NVMLError_LibraryNotFound", "NVML library not found (no NVIDIA driver installed?)"),
    (
        "NVMLError_DriverNotLoaded",
        "NVIDIA driver not loaded (is the nvidia kernel module loaded? try nvidia-smi)",
    ),
    (
        "NVMLError_LibRmVersionMismatch",
        "NVML library and NVIDIA kernel driver versions differ "
        "(driver upgraded without a reboot? reboot or reload the nvidia module)",
    ),
    (
        "NVMLError_NoPermission",
        "no permission to open the NVIDIA devices (check /dev/nvidia* access, or the "
        "container's GPU access)",
    ),
)

_NOT_INSTALLED = "Python package nvidia-ml-py (module pynvml) is not installed"


class Nvml:
    """NVML session: init once, call many times without raising, shut down once.

    Not thread-safe by itself; the owner (discovery, or the telemetry poller) serialises.
    """

    def __init__(self, module: ModuleType | Any | None = None) -> None:
        self._module = module
        self._initialised = False
        # Functions the library lacks: never worth calling again.
        self._missing: set[str] = set()
        # (function, args) that answered NotSupported: another GPU may support it, so this
        # is remembered per call site rather than per function.
        self._unsupported: set[tuple[str, tuple[Hashable, ...]]] = set()
        self.last_error: str | None = None
        # NVML_ERROR_* of the last call that failed with an NVMLError (None otherwise),
        # so a poller can tell a lost GPU from a reading the device does not have.
        self.last_code: int | None = None

    @property
    def initialised(self) -> bool:
        return self._initialised

    def init(self) -> str | None:
        """Start NVML; None on success, else one line saying why and what to check."""
        if self._initialised:
            return None
        if self._module is None:
            try:
                import pynvml  # noqa: PLC0415 - lazy: the daemon must start without it
            except ImportError:
                return _NOT_INSTALLED
            self._module = pynvml
        module = self._module
        base = getattr(module, "NVMLError", None)
        try:
            module.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - the boundary to a native library
            if base is None or not isinstance(exc, base):
                return f"NVML init failed: {type(exc).__name__}: {exc}"
            for class_name, reason in _INIT_REASONS:
                cls = getattr(module, class_name, None)
                if cls is not None and isinstance(exc, cls):
                    return reason
            return f"NVML init failed: {_describe(exc)}"
        self._initialised = True
        return None

    def call(self, fn_name: str, *args: Any, default: Any = None) -> Any:
        """`module.fn_name(*args)`, or `default` if NVML cannot answer; never raises NVMLError.

        The reason for the last default is kept in `last_error` for callers that show it.
        """
        self.last_code = None
        if not self._initialised or self._module is None:
            self.last_error = "NVML not initialised"
            return default
        if fn_name in self._missing:
            self.last_error = f"{fn_name} not available in this NVML"
            return default
        key = _call_key(fn_name, args)
        if key is not None and key in self._unsupported:
            self.last_error = f"{fn_name}: Not Supported"
            return default
        fn = getattr(self._module, fn_name, None)
        if fn is None:
            self._missing.add(fn_name)
            self.last_error = f"{fn_name} not available in this NVML"
            return default
        try:
            return fn(*args)
        except self._module.NVMLError as exc:
            self.last_code = getattr(exc, "value", None)
            if isinstance(exc, self._error_class("NVMLError_FunctionNotFound")):
                self._missing.add(fn_name)
            elif key is not None and isinstance(exc, self._error_class("NVMLError_NotSupported")):
                self._unsupported.add(key)
            self.last_error = f"{fn_name}: {_describe(exc)}"
            return default

    @property
    def gpu_lost(self) -> bool:
        """The last call failed because the GPU fell off the bus (or needs a reset)."""
        return self.last_code is not None and self.last_code == self.const("NVML_ERROR_GPU_IS_LOST")

    def const(self, name: str, default: Any = None) -> Any:
        """An NVML constant from the loaded module (only meaningful after `init`)."""
        if self._module is None:
            return default
        return getattr(self._module, name, default)

    def shutdown(self) -> None:
        if not self._initialised or self._module is None:
            return
        self._initialised = False
        try:
            self._module.nvmlShutdown()
        except self._module.NVMLError:
            pass  # a driver that is going away cannot be shut down any harder

    def _error_class(self, name: str) -> type[BaseException] | tuple[()]:
        # An empty tuple makes isinstance() false when a module lacks the class.
        return getattr(self._module, name, ())


def _call_key(fn_name: str, args: tuple[Any, ...]) -> tuple[str, tuple[Hashable, ...]] | None:
    """What identifies a call for the "not supported" memory. pynvml's device handles are
    ctypes pointers: unhashable, and a new object (equal to no other) on every
    nvmlDeviceGetHandleByIndex call, but they point at NVML's device struct, whose
    address is fixed for the session: the device is keyed by that address."""
    key = []
    for arg in args:
        if isinstance(arg, ctypes._Pointer):
            key.append(("device", ctypes.cast(arg, ctypes.c_void_p).value))
            continue
        try:
            hash(arg)
        except TypeError:
            return None
        key.append(arg)
    return (fn_name, tuple(key))


def _describe(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - pynvml's __str__ itself calls into the library
        text = ""
    return text or type(exc).__name__
