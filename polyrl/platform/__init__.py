"""Hardware platforms (CUDA, ROCm, Ascend NPU, CPU) behind one interface.

The only package allowed to touch `torch.cuda`, device strings and communication-backend names.
Detection is lazy and cached per process; the hardware probe is injectable so every platform can
be exercised on a CPU machine (`SIMULATED_PROBES`).
"""

from polyrl.platform.base import Platform, PlatformError
from polyrl.platform.detect import (
    PLATFORMS,
    SIMULATED_PROBES,
    HardwareProbe,
    current_platform,
    detect_platform_name,
    get_platform,
    probe_hardware,
    simulated_probe,
)

__all__ = [
    "PLATFORMS",
    "SIMULATED_PROBES",
    "HardwareProbe",
    "Platform",
    "PlatformError",
    "current_platform",
    "detect_platform_name",
    "get_platform",
    "probe_hardware",
    "simulated_probe",
]
