"""The `Platform` contract. Subclasses are data plus a few device calls; nothing here runs at import."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:
    import torch
    from polyrl.platform.detect import HardwareProbe


class PlatformError(RuntimeError):
    """An unknown or unavailable platform; the message lists what is registered and detected."""


@dataclass(frozen=True)
class EnvDefault:
    """An environment variable a platform wants in some role, with why."""

    name: str
    value: str
    reason: str
    link: str = ""


class Platform:
    name: str = ""
    device_type: str = ""
    """torch device type ("cuda" on ROCm too: HIP builds reuse the cuda device type)."""
    comm_backend: str = ""
    """torch.distributed backend for device tensors."""
    visible_devices_vars: tuple[str, ...] = ()
    """Variables that restrict which devices a process sees."""

    @property
    def handoff_devices_var(self) -> str | None:
        """The variable an engine host sets to hand its engine processes their devices: the one
        Ray's accelerator manager sets for this platform (None: no devices to hand)."""
        return self.visible_devices_vars[0] if self.visible_devices_vars else None
    ray_resource: str | None = None
    """Ray resource that counts this platform's devices (None: CPU only)."""

    def __init__(self, probe: "HardwareProbe"):
        self.probe = probe

    # --- what the hardware is --------------------------------------------------------------
    @property
    def device_count(self) -> int:
        return max(self.probe.device_count, self.probe.smi_device_count)

    @property
    def capability(self) -> tuple[int, int] | None:
        return self.probe.capability

    @property
    def multi_node_nvlink(self) -> bool:
        """Whether the nodes are joined by multi-node NVLink (GB200/GB300 NVL72: NCCL needs its
        cuMem buffers there, `nccl-cumem-*` rules in polyrl/envplan/rules.py)."""
        return bool(getattr(self.probe, "multi_node_nvlink", False))

    @property
    def device_name(self) -> str | None:
        return self.probe.device_name

    def describe(self) -> str:
        cap = f", capability {self.capability[0]}.{self.capability[1]}" if self.capability else ""
        name = f" ({self.device_name})" if self.device_name else ""
        return f"{self.name}: {self.device_count} device(s){name}{cap}"

    # --- devices in this process -----------------------------------------------------------
    def device_module(self) -> Any:
        """The torch module for this device type (torch.cuda, torch.npu, torch.cpu)."""
        import torch

        return getattr(torch, self.device_type)

    def torch_device(self, index: int | None = 0) -> torch.device:
        import torch

        if index is None:
            return torch.device(self.device_type)
        return torch.device(self.device_type, index)

    def set_device(self, index: int) -> None:
        self.device_module().set_device(index)

    def synchronize(self) -> None:
        self.device_module().synchronize()

    def empty_cache(self) -> None:
        self.device_module().empty_cache()

    def peak_memory_bytes(self) -> int:
        return int(self.device_module().max_memory_allocated())

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        return True

    def training_attention(self, dtype: torch.dtype) -> Any:
        """Context manager choosing SDPA kernels for a training forward/backward."""
        return contextlib.nullcontext()

    # --- this actor's devices ----------------------------------------------------------------
    def local_device_indices(self, assigned: Sequence[str], environ: Mapping[str, str]) -> list[int]:
        """In-process indices of the devices Ray assigned (`assigned`: Ray's ids, physical on
        the node). An actor reserving devices sees only them (Ray narrowed its visible-devices
        variable: indices 0..n-1); an engine host kept whole-node visibility (RAY_EXPERIMENTAL_
        NOSET_*), where an id's index is its position in the visible list, or the id itself when
        no visibility variable is set."""
        visible = next((environ[v] for v in self.visible_devices_vars if environ.get(v)), None)
        if visible is None:
            return [int(i) for i in assigned]
        order = [x.strip() for x in visible.split(",")]
        lost = [i for i in assigned if i not in order]
        if lost:
            raise PlatformError(f"Ray assigned device(s) {', '.join(lost)} but this process sees "
                                f"only {visible!r}; a visible-devices variable was overridden")
        return [order.index(i) for i in assigned]

    def reserved_devices(self) -> list[int]:
        """In-process indices of this Ray actor's reserved devices, in Ray's order; [] outside a
        Ray actor or on a platform without devices."""
        if not self.ray_resource:
            return []
        try:
            import ray
        except ImportError:  # ray.enabled=false where Ray is not installed: no actor, no reservation
            return []
        if not ray.is_initialized():
            return []
        assigned = ray.get_runtime_context().get_accelerator_ids().get(self.ray_resource) or []
        return self.local_device_indices([str(i) for i in assigned], os.environ)

    def reserved_device(self) -> torch.device:
        """The device this actor computes on: its reservation's first device, never a
        hard-coded 0 (index 0 only for a process that reserved none, e.g. outside Ray)."""
        indices = self.reserved_devices()
        return self.torch_device(indices[0] if indices else 0)

    def claim_device(self) -> torch.device:
        """`reserved_device()`, made this process's current device (`set_device`): what a
        worker calls where it picks its device. An actor that sees more devices than it computes
        on (a TensorRT-LLM bundle keeps the whole node visible) would otherwise stay on device
        0, and whatever takes its device from the current one (FSDP2, NCCL communicators,
        `torch.empty(device="cuda")`) would land there instead of on the rank's own."""
        device = self.reserved_device()
        if device.index is not None:
            self.set_device(device.index)
        return device

    # --- distributed -----------------------------------------------------------------------
    def dist_backend(self) -> str:
        """Backend for a process group carrying this platform's tensors."""
        return self.comm_backend

    def cpu_dist_backend(self) -> str:
        """Backend for CPU-side control messages (always gloo)."""
        return "gloo"

    def group_backend(self, device_type: str) -> str:
        """Backend string for a process group of ranks computing on `device_type` devices.

        On an accelerator it maps both device types (`cpu:gloo,cuda:nccl`): device tensors
        (gradients, weight buckets) go through the platform's library, and CPU tensors (the
        pickled objects and sizes of `distributed/collectives.py`, manifests, votes) through gloo.
        A group of the platform's backend alone refuses every CPU tensor, so each disaggregated weight
        sync and replica-leader push failed on GPUs (issue #28; verl keeps a CPU group for these).
        """
        if device_type == "cpu":
            return self.cpu_dist_backend()
        return f"cpu:{self.cpu_dist_backend()},{device_type}:{self.dist_backend()}"

    # --- Ray -------------------------------------------------------------------------------
    def ray_actor_options(self, num_devices: float, num_cpus: float = 1) -> dict[str, Any]:
        """Ray actor options that reserve `num_devices` of this platform's devices."""
        options: dict[str, Any] = {"num_cpus": num_cpus}
        if self.ray_resource == "GPU":
            options["num_gpus"] = num_devices
        elif self.ray_resource:
            options["resources"] = {self.ray_resource: num_devices}
        return options

    def ray_noset_envvars(self) -> dict[str, str]:
        """Tell Ray not to rewrite our visibility variables, for actors that manage their own
        devices (inference servers with num_gpus=0): one entry per visibility variable."""
        return {f"RAY_EXPERIMENTAL_NOSET_{var}": "1" for var in self.visible_devices_vars}

    def job_env_defaults(self) -> list[EnvDefault]:
        """Variables the whole Ray job needs on this platform."""
        return []

    def rollout_env_defaults(self, backend: str) -> list[EnvDefault]:
        """Variables a rollout server of `backend` needs on this platform."""
        return []

    def __repr__(self) -> str:
        return f"<Platform {self.describe()}>"


def device_backend(group_backend: str, device_type: str) -> str:
    """Which backend of a group carries tensors of `device_type`: "nccl" for cuda in a
    "cpu:gloo,cuda:nccl" group, the backend itself for a one-backend group ("gloo")."""
    if ":" not in group_backend:
        return group_backend
    pairs = dict(part.split(":", 1) for part in group_backend.split(",") if ":" in part)
    if device_type not in pairs:
        raise PlatformError(f"a process group of backend {group_backend!r} carries no "
                            f"{device_type} tensors")
    return pairs[device_type]
