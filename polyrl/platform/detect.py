"""Which platform this process is on: explicit choice > POLYRL_PLATFORM > probing the hardware.

The choice is a registered name (the built-ins, or one a package registers in the
`polyrl.platforms` entry-point group) or a `Platform` subclass by import path
(`platform: mypkg.hw:MyPlatform` or `/path/to/hw.py:MyPlatform`), imported in every process that
asks, Ray workers included (docs/plugins.md).

Probing looks at the torch build (`torch.version.hip`, `torch.version.cuda`, `torch_npu`), device
count and capability, then falls back to the vendors' smi tools — a CPU-only Ray actor on a GPU
node sees no devices through torch but must still plan for the node's GPUs.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
from dataclasses import dataclass, replace

from polyrl.config.targets import is_import_path
from polyrl.platform.base import Platform, PlatformError
from polyrl.registry import Registry, RegistryError

ENTRY_POINT_GROUP = "polyrl.platforms"
PLATFORMS: Registry[type[Platform]] = Registry("platform", entry_point_group=ENTRY_POINT_GROUP, import_paths=True)
PLATFORMS.register("cpu", "polyrl.platform.platforms:CPUPlatform")
PLATFORMS.register("cuda", "polyrl.platform.platforms:CUDAPlatform")
PLATFORMS.register("rocm", "polyrl.platform.platforms:ROCmPlatform")
PLATFORMS.register("npu", "polyrl.platform.platforms:NPUPlatform")
BUILTIN_PLATFORMS = ("cpu", "cuda", "rocm", "npu")
"""The platforms detection can tell apart; a plugin platform is used only when asked for."""
DEFAULT_GPU_PLATFORM = "cuda"
"""What `--capability` alone simulates on a machine without accelerators."""


@dataclass(frozen=True)
class HardwareProbe:
    """What a process can see of its hardware. Tests build these by hand."""

    torch_cuda: str | None = None
    torch_hip: str | None = None
    has_torch_npu: bool = False
    device_count: int = 0
    capability: tuple[int, int] | None = None
    device_name: str | None = None
    smi_tool: str | None = None
    """Vendor tool found on PATH (nvidia-smi / amd-smi / rocm-smi / npu-smi)."""
    smi_device_count: int = 0
    simulated: bool = False
    multi_node_nvlink: bool = False
    """IMEX channels present (MULTI_NODE_NVLINK_MARKER): a GB200/GB300 NVL72 rack, whose NCCL
    needs cuMem buffers for NVLink across nodes."""


MULTI_NODE_NVLINK_MARKER = "/dev/nvidia-caps-imex-channels"
"""The device node multi-node NVLink communicates through (NVL72 racks); its presence is the
cheap test vLLM's own environment override uses too (NVML would be exact, and slow)."""


SIMULATED_PROBES: dict[str, HardwareProbe] = {
    "cpu": HardwareProbe(simulated=True),
    "h100": HardwareProbe(torch_cuda="12.8", device_count=8, capability=(9, 0),
                          device_name="NVIDIA H100 80GB HBM3", simulated=True),
    "gb200": HardwareProbe(torch_cuda="12.8", device_count=4, capability=(10, 0),
                           device_name="NVIDIA GB200", simulated=True, multi_node_nvlink=True),
    "gb300": HardwareProbe(torch_cuda="12.9", device_count=4, capability=(10, 3),
                           device_name="NVIDIA GB300", simulated=True, multi_node_nvlink=True),
    "mi300x": HardwareProbe(torch_hip="6.3", device_count=8, capability=(9, 4),
                            device_name="AMD Instinct MI300X", simulated=True),
    "ascend910": HardwareProbe(has_torch_npu=True, device_count=8,
                               device_name="Ascend910B", simulated=True),
}

_DEFAULT_SIMULATION = {"cpu": "cpu", "cuda": "h100", "rocm": "mi300x", "npu": "ascend910"}


def simulated_probe(platform: str, capability: tuple[int, int] | None = None) -> HardwareProbe:
    """A probe for `platform` (a name or a SIMULATED_PROBES key), optionally at a capability."""
    key = _DEFAULT_SIMULATION.get(platform, platform)
    if key not in SIMULATED_PROBES:
        raise PlatformError(
            f"cannot simulate '{platform}'; choose one of "
            f"{', '.join(sorted(set(_DEFAULT_SIMULATION) | set(SIMULATED_PROBES)))}"
        )
    probe = SIMULATED_PROBES[key]
    if capability is not None:
        probe = replace(probe, capability=capability, device_name=None)
    return probe


def _smi_count(tool: str) -> int:
    commands = {
        "nvidia-smi": [tool, "--query-gpu=name", "--format=csv,noheader"],
        "amd-smi": [tool, "list"],
        "rocm-smi": [tool, "--showid"],
        "npu-smi": [tool, "info", "-l"],
    }
    try:
        out = subprocess.run(commands[tool], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    if tool == "nvidia-smi":
        return sum(1 for line in out.splitlines() if line.strip())
    if tool == "amd-smi":
        return out.count("GPU:")
    if tool == "rocm-smi":
        return sum(1 for line in out.splitlines() if line.strip().startswith("GPU["))
    return sum(1 for line in out.splitlines() if "NPU ID" in line)


def probe_hardware() -> HardwareProbe:
    """Look at the real machine (no side effects beyond running the smi tools, if present)."""
    import torch  # here, not at import: planning with a simulated probe needs no torch

    torch_cuda = getattr(torch.version, "cuda", None)
    torch_hip = getattr(torch.version, "hip", None)
    has_npu = importlib.util.find_spec("torch_npu") is not None
    count, capability, name = 0, None, None
    if torch_cuda or torch_hip:
        count = torch.cuda.device_count()
        if count:
            capability = tuple(torch.cuda.get_device_capability(0))  # type: ignore[assignment]
            name = torch.cuda.get_device_name(0)
    elif has_npu:
        import torch_npu  # noqa: F401

        count = torch.npu.device_count()  # type: ignore[attr-defined]
        name = torch.npu.get_device_name(0) if count else None  # type: ignore[attr-defined]
    smi_tool, smi_count = None, 0
    if count == 0:
        for tool in ("nvidia-smi", "amd-smi", "rocm-smi", "npu-smi"):
            if shutil.which(tool):
                smi_tool, smi_count = tool, _smi_count(tool)
                if smi_count:
                    break
    return HardwareProbe(torch_cuda, torch_hip, has_npu, count, capability, name, smi_tool, smi_count,
                         multi_node_nvlink=os.path.exists(MULTI_NODE_NVLINK_MARKER))


@functools.lru_cache(maxsize=1)
def _real_probe() -> HardwareProbe:
    return probe_hardware()


def detect_platform_name(probe: HardwareProbe) -> str:
    if probe.device_count:
        if probe.torch_hip:
            return "rocm"
        if probe.has_torch_npu and not probe.torch_cuda:
            return "npu"
        if probe.torch_cuda:
            return "cuda"
    if probe.smi_device_count:
        return {"nvidia-smi": "cuda", "amd-smi": "rocm", "rocm-smi": "rocm", "npu-smi": "npu"}[
            probe.smi_tool or ""
        ]
    return "cpu"


def get_platform(name: str | None = None, probe: HardwareProbe | None = None) -> Platform:
    """The platform to run on.

    `name`: an explicit choice ("auto"/None means: POLYRL_PLATFORM, else detect).
    `probe`: the hardware to assume (default: the real machine, probed once per process).
    A plugin platform (entry point or import path) is trusted to be what the user asked for:
    detection knows only the built-in ones.
    """
    probe = probe or _real_probe()
    requested = name if name not in (None, "", "auto") else os.environ.get("POLYRL_PLATFORM", "")
    detected = detect_platform_name(probe)
    chosen = requested or detected
    try:
        cls = PLATFORMS.get(chosen)
    except RegistryError as exc:
        if chosen in PLATFORMS or is_import_path(chosen):  # registered or an import path: it failed to load
            raise PlatformError(str(exc)) from None
        raise PlatformError(
            f"unknown platform '{chosen}'; registered platforms: {PLATFORMS.choices()} "
            f"(detected here: {detected})"
        ) from None
    except ImportError as exc:  # an entry point's module (or what it imports) is missing
        raise PlatformError(f"platform '{chosen}': cannot import it: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, Platform)):
        raise PlatformError(f"platform '{chosen}' names {cls!r}, not a subclass of "
                            "polyrl.platform.Platform (docs/plugins.md)")
    if requested in BUILTIN_PLATFORMS and requested != "cpu" and requested != detected \
            and not probe.simulated:
        raise PlatformError(
            f"platform '{requested}' was requested but is not available here: detected "
            f"'{detected}' ({_probe_summary(probe)}). Registered platforms: "
            f"{', '.join(PLATFORMS.names())}. Unset POLYRL_PLATFORM / platform, or use "
            f"--platform with --capability to plan for hardware you do not have."
        )
    return cls(probe)


def current_platform() -> Platform:
    """The platform of this process, detected once and cached."""
    return _current()


@functools.lru_cache(maxsize=1)
def _current() -> Platform:
    return get_platform()


def _probe_summary(probe: HardwareProbe) -> str:
    parts = [f"torch cuda={probe.torch_cuda}", f"hip={probe.torch_hip}",
             f"torch_npu={'yes' if probe.has_torch_npu else 'no'}",
             f"devices={probe.device_count}"]
    if probe.smi_tool:
        parts.append(f"{probe.smi_tool} devices={probe.smi_device_count}")
    return ", ".join(parts)
