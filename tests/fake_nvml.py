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

    def __post_init__(self) -> None:
        if self.topology is None:
            self.topology = all_nvlink(len(self.gpus))
        # NVML's device structs: fixed for the session; handles point at them.
        self._devices = [struct_c_nvmlDevice_t(i) for i in range(len(self.gpus))]

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
        if not self.initialised:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)

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
        return FakeMemory(total=gpu.memory_total, free=gpu.memory_total, used=0)

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
