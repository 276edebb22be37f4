"""Device identity and limits.

On CUDA the driver API (cuda-python) gives the SM count, shared memory per block, L2 size
and memory clock/bus width; torch.cuda is the fallback. Everything fails softly where no
driver exists: the CPU is then described by its model name. The identity key goes into
tuning-store keys, so results never cross devices.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # "cuda" or "cpu"
    name: str
    capability: tuple[int, int] | None = None
    sm_count: int | None = None
    smem_per_block: int | None = None  # opt-in maximum, bytes
    l2_bytes: int | None = None
    mem_bandwidth: float | None = None  # bytes/s, from the memory clock and bus width

    @property
    def key(self) -> str:
        """Identity used in tuning-store keys: name, compute capability and SM count (or CPU model)."""
        if self.kind == "cpu":
            return f"cpu:{self.name}"
        major, minor = self.capability
        return f"cuda:{self.name}:sm{major}{minor}:{self.sm_count}sm"

    def describe(self) -> str:
        if self.kind == "cpu":
            return f"CPU ({self.name})"
        major, minor = self.capability
        extra = f", {self.sm_count} SMs" if self.sm_count else ""
        return f"{self.name} (sm_{major}{minor}{extra})"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _driver_attributes(ordinal: int) -> dict[str, int]:
    """Device attributes from the CUDA driver API; empty where cuda-python or a driver is missing."""
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        try:
            from cuda import cuda as cu  # cuda-python < 12.6
        except ImportError:
            return {}
    try:
        (err,) = cu.cuInit(0)
        if err != cu.CUresult.CUDA_SUCCESS:
            return {}
        err, dev = cu.cuDeviceGet(ordinal)
        if err != cu.CUresult.CUDA_SUCCESS:
            return {}
        wanted = {
            "sm_count": cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            "smem_per_block": cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            "l2_bytes": cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE,
            "mem_clock_khz": cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE,
            "bus_width_bits": cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH,
        }
        out = {}
        for name, attr in wanted.items():
            err, value = cu.cuDeviceGetAttribute(attr, dev)
            if err == cu.CUresult.CUDA_SUCCESS:
                out[name] = int(value)
        return out
    except Exception:  # a broken driver install must not break import-time device detection
        return {}


@functools.cache
def _cuda_info(ordinal: int) -> DeviceInfo:
    props = torch.cuda.get_device_properties(ordinal)
    attrs = _driver_attributes(ordinal)
    bandwidth = None
    if attrs.get("mem_clock_khz") and attrs.get("bus_width_bits"):
        bandwidth = 2 * attrs["mem_clock_khz"] * 1e3 * attrs["bus_width_bits"] / 8  # double data rate
    return DeviceInfo(
        kind="cuda",
        name=props.name,
        capability=(props.major, props.minor),
        sm_count=attrs.get("sm_count", props.multi_processor_count),
        smem_per_block=attrs.get("smem_per_block"),
        l2_bytes=attrs.get("l2_bytes", getattr(props, "L2_cache_size", None)),
        mem_bandwidth=bandwidth,
    )


@functools.cache
def _cpu_info() -> DeviceInfo:
    return DeviceInfo(kind="cpu", name=cpu_model())


def info(device: torch.device | str | None = None) -> DeviceInfo:
    """Describe `device` (default: the current CUDA device if any, else the CPU)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        return _cuda_info(device.index if device.index is not None else torch.cuda.current_device())
    if device.type == "cpu":
        return _cpu_info()
    raise ValueError(f"unsupported device type {device.type!r}; flashkern runs on CUDA and CPU")
