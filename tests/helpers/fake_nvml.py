"""A stand-in for nvidia-ml-py's `pynvml` module, for tests on machines without GPUs.

Same function names, signatures, constants and error class hierarchy as the real module
(values copied from nvidia-ml-py 13.x; test_partitions checks them against the installed
pynvml so they cannot drift). Build one with `FakeNvml(...)` and pass it as the module to
`appliance.partitions.nvml.Nvml(module=...)`.
"""

from __future__ import annotations

import ctypes

import string
import sys
from collections import Counter
from dataclasses import dataclass, field

# --- constants (same names and values as pynvml) ---------------------------------------

NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1
NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1

NVML_TOPOLOGY_INTERNAL = 0
NVML_TOPOLOGY_SINGLE = 10
NVML_TOPOLOGY_MULTIPLE = 20
NVML_TOPOLOGY_HOSTBRIDGE = 30
NVML_TOPOLOGY_NODE = 40
NVML_TOPOLOGY_CPU = NVML_TOPOLOGY_NODE
NVML_TOPOLOGY_SYSTEM = 50

# NVML_P2P_CAPS_INDEX_READ is left out: nvidia-ml-py defines it as the tuple (0,) (a stray comma).
NVML_P2P_CAPS_INDEX_WRITE = 1
NVML_P2P_CAPS_INDEX_NVLINK = 2
NVML_P2P_CAPS_INDEX_ATOMICS = 3
NVML_P2P_CAPS_INDEX_PCI = 4
NVML_P2P_CAPS_INDEX_PROP = 4
NVML_P2P_CAPS_INDEX_UNKNOWN = 5

NVML_P2P_STATUS_OK = 0
NVML_P2P_STATUS_CHIPSET_NOT_SUPPORED = 1
NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED = 1
NVML_P2P_STATUS_GPU_NOT_SUPPORTED = 2
NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED = 3
NVML_P2P_STATUS_DISABLED_BY_REGKEY = 4
NVML_P2P_STATUS_NOT_SUPPORTED = 5
NVML_P2P_STATUS_UNKNOWN = 6

NVML_CLOCK_GRAPHICS = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_TEMPERATURE_GPU = 0

NVML_GPM_METRIC_GRAPHICS_UTIL = 1
NVML_GPM_METRIC_SM_UTIL = 2
NVML_GPM_METRIC_SM_OCCUPANCY = 3
NVML_GPM_METRIC_ANY_TENSOR_UTIL = 5
NVML_GPM_METRIC_DRAM_BW_UTIL = 10
NVML_GPM_METRIC_MAX = 477
NVML_GPM_METRICS_GET_VERSION = 1
NVML_GPM_SUPPORT_VERSION = 1

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_INSUFFICIENT_POWER = 8
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_OPERATING_SYSTEM = 17
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_MEMORY = 20
NVML_ERROR_UNKNOWN = 999

# --- errors: NVMLError(value) picks the subclass, like pynvml -------------------------


class NVMLError(Exception):
    _valClassMapping: dict[int, type] = {}
    _errcode_to_string = {
        NVML_ERROR_UNINITIALIZED: "Uninitialized",
        NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
        NVML_ERROR_NOT_SUPPORTED: "Not Supported",
        NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
        NVML_ERROR_ALREADY_INITIALIZED: "Already Initialized",
        NVML_ERROR_NOT_FOUND: "Not Found",
        NVML_ERROR_INSUFFICIENT_SIZE: "Insufficient Size",
        NVML_ERROR_INSUFFICIENT_POWER: "Insufficient External Power",
        NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
        NVML_ERROR_TIMEOUT: "Timeout",
        NVML_ERROR_IRQ_ISSUE: "Interrupt Request Issue",
        NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
        NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
        NVML_ERROR_CORRUPTED_INFOROM: "Corrupted infoROM",
        NVML_ERROR_GPU_IS_LOST: "GPU is lost",
        NVML_ERROR_RESET_REQUIRED: "GPU requires restart",
        NVML_ERROR_OPERATING_SYSTEM: "The operating system has blocked the request.",
        NVML_ERROR_LIB_RM_VERSION_MISMATCH: "RM has detected an NVML/RM version mismatch.",
        NVML_ERROR_MEMORY: "Insufficient Memory",
        NVML_ERROR_UNKNOWN: "Unknown Error",
    }

    def __new__(cls, value):
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __str__(self):
        return self._errcode_to_string.get(self.value, f"NVML Error with code {self.value}")

    def __eq__(self, other):
        return self.value == other.value


def _make_error_classes() -> None:
    # Same naming rule as pynvml._extractNVMLErrorsAsClasses: NVML_ERROR_GPU_IS_LOST ->
    # NVMLError_GpuIsLost.
    module = sys.modules[__name__]
    for err_name in [n for n in dir(module) if n.startswith("NVML_ERROR_")]:
        class_name = "NVMLError_" + string.capwords(err_name.replace("NVML_ERROR_", ""), "_").replace("_", "")
        value = getattr(module, err_name)

        def gen_new(val):
            def new(typ, *args):
                return NVMLError.__new__(typ, val)

            return new

        cls = type(class_name, (NVMLError,), {"__new__": gen_new(value)})
        cls.__module__ = __name__
        setattr(module, class_name, cls)
        NVMLError._valClassMapping[value] = cls


_make_error_classes()

ERROR_NAMES = sorted(n for n in dir(sys.modules[__name__]) if n.startswith("NVMLError_"))

# --- configurable fake devices ---------------------------------------------------------

GIB = 1024**3
H100_NAME = "NVIDIA H100 80GB HBM3"
H100_MEMORY = 81559 * 1024**2  # what NVML reports on an H100 SXM


@dataclass
class FakeGpu:
    name: str = H100_NAME
    memory_total: int = H100_MEMORY
    mig: bool | None = False  # None: MIG not supported (raises NotSupported)
    uuid: str | None = None
    lost_handle: bool = False  # nvmlDeviceGetHandleByIndex raises GpuIsLost
    lost_reads: bool = False  # handle ok, every read raises GpuIsLost
    # telemetry readings (units as NVML returns them)
    energy_mj: int = 5_000_000  # nvmlDeviceGetTotalEnergyConsumption: mJ since driver load
    power_mw: int = 250_000  # nvmlDeviceGetPowerUsage: milliwatts
    util_gpu: int = 0  # utilization.gpu, percent
    memory_used: int = 0
    sm_clock_mhz: int = 1980
    temp_c: int = 40
    gpm: bool = True  # nvmlGpmQueryDeviceSupport().isSupportedDevice (Hopper+)
    # GPM metric id -> value in percent; ids not listed answer NOT_SUPPORTED per metric.
    gpm_values: dict = field(default_factory=lambda: {NVML_GPM_METRIC_SM_UTIL: 0.0,
                                                      NVML_GPM_METRIC_ANY_TENSOR_UTIL: 0.0,
                                                      NVML_GPM_METRIC_DRAM_BW_UTIL: 0.0})
    unsupported: set = field(default_factory=set)  # function names raising NOT_SUPPORTED here


@dataclass
class FakeMemory:
    total: int
    free: int
    used: int


class struct_c_nvmlDevice_t(ctypes.Structure):
    """Like pynvml's: an opaque device struct; handles are pointers to it."""
    _fields_ = [("index", ctypes.c_int)]


# pynvml's handle type: `c_nvmlDevice_t = POINTER(struct_c_nvmlDevice_t)`. Its instances
# are unhashable, and every nvmlDeviceGetHandleByIndex call returns a new one (equal to
# none of the others) pointing at the same device struct.
FakeHandle = c_nvmlDevice_t = ctypes.POINTER(struct_c_nvmlDevice_t)


@dataclass
class FakeUtilization:  # c_nvmlUtilization_t
    gpu: int
    memory: int


@dataclass
class FakeGpmSupport:  # c_nvmlGpmSupport_t
    version: int
    isSupportedDevice: int


@dataclass(eq=False)
class FakeGpmSample:  # opaque c_nvmlGpmSample_t
    index: int | None = None  # device it was taken on (None: allocated, not taken)
    values: dict | None = None
    freed: bool = False


@dataclass
class FakeGpmMetric:  # c_nvmlGpmMetric_t
    metricId: int = 0
    nvmlReturn: int = 0
    value: float = 0.0


class _MetricArray:
    """c_nvmlGpmMetric_t * NVML_GPM_METRIC_MAX, zeroed; entries made when first touched
    (the real array is one C buffer, cheap to make; 477 Python objects are not)."""

    def __init__(self):
        self._items: dict[int, FakeGpmMetric] = {}

    def __len__(self):
        return NVML_GPM_METRIC_MAX

    def __getitem__(self, i: int) -> FakeGpmMetric:
        if not 0 <= i < NVML_GPM_METRIC_MAX:
            raise IndexError("invalid index")
        item = self._items.get(i)
        if item is None:
            item = self._items[i] = FakeGpmMetric()
        return item


class c_nvmlGpmMetricsGet_t:
    """Same fields as pynvml's struct: version, numMetrics, sample1, sample2, metrics[]."""

    def __init__(self):
        self.version = 0
        self.numMetrics = 0
        self.sample1 = None
        self.sample2 = None
        self.metrics = _MetricArray()


@dataclass
class Link:
    nvlink: bool
    level: int  # NVML_TOPOLOGY_* common ancestor


def two_islands(n: int = 8) -> dict[tuple[int, int], Link]:
    """Two NVLink islands of n/2 (e.g. two 4-GPU boards), joined across sockets."""
    half = n // 2
    links = {}
    for i in range(n):
        for j in range(i + 1, n):
            same = (i < half) == (j < half)
            links[(i, j)] = Link(nvlink=same, level=NVML_TOPOLOGY_NODE if same else NVML_TOPOLOGY_SYSTEM)
    return links


def all_nvlink(n: int = 8) -> dict[tuple[int, int], Link]:
    """An NVSwitch board (HGX): every pair peers over NVLink."""
    return {(i, j): Link(nvlink=True, level=NVML_TOPOLOGY_SYSTEM) for i in range(n) for j in range(i + 1, n)}


def pcie_only(n: int = 8) -> dict[tuple[int, int], Link]:
    """PCIe cards: pairs share a switch (0-1, 2-3, ...), else a host bridge or the system."""

    def level(i: int, j: int) -> int:
        if i // 2 == j // 2:
            return NVML_TOPOLOGY_SINGLE
        if i // 4 == j // 4:
            return NVML_TOPOLOGY_HOSTBRIDGE
        return NVML_TOPOLOGY_SYSTEM

    return {(i, j): Link(nvlink=False, level=level(i, j)) for i in range(n) for j in range(i + 1, n)}


@dataclass
class FakeNvml:
    """One fake NVML installation. Pass an instance where a pynvml module is expected."""

    gpus: list[FakeGpu] = field(default_factory=lambda: [FakeGpu() for _ in range(8)])
    topology: dict[tuple[int, int], Link] | None = None  # default: all_nvlink
    init_error: int | None = None  # NVML_ERROR_* raised by nvmlInit
    count_error: int | None = None  # NVML_ERROR_* raised by nvmlDeviceGetCount
    p2p_error: int | None = None  # NVML_ERROR_* raised by nvmlDeviceGetP2PStatus
    calls: Counter = field(default_factory=Counter)
    initialised: bool = False
    # Functions this driver's library lacks: pynvml raises FunctionNotFound for them.
    missing: set = field(default_factory=set)
    gpm_live: int = 0  # GPM samples allocated and not freed

    def __post_init__(self) -> None:
        if self.topology is None:
            self.topology = all_nvlink(len(self.gpus))
        # NVML's device structs: fixed for the session; handles point at them.
        self._devices = [struct_c_nvmlDevice_t(i) for i in range(len(self.gpus))]

    c_nvmlGpmMetricsGet_t = c_nvmlGpmMetricsGet_t

    def __getattr__(self, name: str):
        # Constants and error classes come from this module, as they would from pynvml.
        if name.startswith(("NVML_", "NVMLError")):
            try:
                return globals()[name]
            except KeyError:
                raise AttributeError(name) from None
        raise AttributeError(name)

    # -- helpers
    def _enter(self, fn: str) -> None:
        self.calls[fn] += 1
        if fn in self.missing:
            raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
        if not self.initialised:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)

    def _read(self, fn: str, handle: FakeHandle) -> FakeGpu:
        self._enter(fn)
        gpu = self._gpu(handle)
        if fn in gpu.unsupported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def _gpu(self, handle: FakeHandle) -> FakeGpu:
        gpu = self.gpus[handle.contents.index]
        if gpu.lost_reads:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        return gpu

    def _link(self, a: FakeHandle, b: FakeHandle) -> Link:
        i, j = sorted((a.contents.index, b.contents.index))
        if i == j:
            return Link(nvlink=False, level=NVML_TOPOLOGY_INTERNAL)
        return self.topology[(i, j)]

    # -- the pynvml API subset, same names and parameters
    def nvmlInit(self):
        self.calls["nvmlInit"] += 1
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.initialised = True

    def nvmlShutdown(self):
        self._enter("nvmlShutdown")
        self.initialised = False

    def nvmlDeviceGetCount(self):
        self._enter("nvmlDeviceGetCount")
        if self.count_error is not None:
            raise NVMLError(self.count_error)
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        if self.gpus[index].lost_handle:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        return ctypes.pointer(self._devices[index])

    def nvmlDeviceGetName(self, handle):
        self._enter("nvmlDeviceGetName")
        return self._gpu(handle).name

    def nvmlDeviceGetUUID(self, handle):
        self._enter("nvmlDeviceGetUUID")
        gpu = self._gpu(handle)
        return gpu.uuid or f"GPU-{handle.contents.index:08x}-0000-0000-0000-000000000000"

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        self._enter("nvmlDeviceGetMemoryInfo")
        gpu = self._gpu(handle)
        return FakeMemory(total=gpu.memory_total, free=gpu.memory_total - gpu.memory_used,
                          used=gpu.memory_used)

    def nvmlDeviceGetMigMode(self, device):
        self._enter("nvmlDeviceGetMigMode")
        gpu = self._gpu(device)
        if gpu.mig is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        mode = NVML_DEVICE_MIG_ENABLE if gpu.mig else NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetTopologyCommonAncestor(self, device1, device2):
        self._enter("nvmlDeviceGetTopologyCommonAncestor")
        self._gpu(device1), self._gpu(device2)
        return self._link(device1, device2).level

    def nvmlDeviceGetP2PStatus(self, device1, device2, p2pIndex):
        self._enter("nvmlDeviceGetP2PStatus")
        if self.p2p_error is not None:
            raise NVMLError(self.p2p_error)
        self._gpu(device1), self._gpu(device2)
        if p2pIndex == NVML_P2P_CAPS_INDEX_NVLINK:
            return NVML_P2P_STATUS_OK if self._link(device1, device2).nvlink else NVML_P2P_STATUS_NOT_SUPPORTED
        return NVML_P2P_STATUS_OK

    # -- telemetry
    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        return self._read("nvmlDeviceGetTotalEnergyConsumption", handle).energy_mj

    def nvmlDeviceGetPowerUsage(self, handle):
        return self._read("nvmlDeviceGetPowerUsage", handle).power_mw

    def nvmlDeviceGetUtilizationRates(self, handle):
        return FakeUtilization(gpu=self._read("nvmlDeviceGetUtilizationRates", handle).util_gpu, memory=0)

    def nvmlDeviceGetClockInfo(self, handle, type):
        gpu = self._read("nvmlDeviceGetClockInfo", handle)
        if type != NVML_CLOCK_SM:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return gpu.sm_clock_mhz

    def nvmlDeviceGetTemperature(self, handle, sensor):
        gpu = self._read("nvmlDeviceGetTemperature", handle)
        if sensor != NVML_TEMPERATURE_GPU:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return gpu.temp_c

    def nvmlGpmQueryDeviceSupport(self, device):
        gpu = self._read("nvmlGpmQueryDeviceSupport", device)
        return FakeGpmSupport(version=NVML_GPM_SUPPORT_VERSION, isSupportedDevice=int(gpu.gpm))

    def nvmlGpmSampleAlloc(self):
        self._enter("nvmlGpmSampleAlloc")
        self.gpm_live += 1
        return FakeGpmSample()

    def nvmlGpmSampleFree(self, gpmSample):
        self._enter("nvmlGpmSampleFree")
        if gpmSample.freed:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        gpmSample.freed = True
        self.gpm_live -= 1

    def nvmlGpmSampleGet(self, device, gpmSample):
        gpu = self._read("nvmlGpmSampleGet", device)
        if not gpu.gpm:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        gpmSample.index = device.contents.index
        gpmSample.values = dict(gpu.gpm_values)
        return gpmSample

    def nvmlGpmMetricsGet(self, metricsGet):
        """Fills metrics[i].value (percent) for the second sample's readings, as NVML
        computes them from the counters between the two samples."""
        self._enter("nvmlGpmMetricsGet")
        m = metricsGet
        s1, s2 = m.sample1, m.sample2
        if (m.version != NVML_GPM_METRICS_GET_VERSION or not 0 < m.numMetrics <= NVML_GPM_METRIC_MAX
                or s1 is None or s2 is None or s1.freed or s2.freed or s1.index is None
                or s1.index != s2.index):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        for i in range(m.numMetrics):
            metric = m.metrics[i]
            if metric.metricId in s2.values:
                metric.value = float(s2.values[metric.metricId])
                metric.nvmlReturn = NVML_SUCCESS
            else:
                metric.value = 0.0
                metric.nvmlReturn = NVML_ERROR_NOT_SUPPORTED
        return metricsGet
