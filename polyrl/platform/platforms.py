"""The four built-in platforms. Their differences are data; device calls go through torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from polyrl.platform.base import EnvDefault, Platform

if TYPE_CHECKING:
    import torch

VERL_6664 = "https://github.com/verl-project/verl/pull/6664"


class CPUPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    comm_backend = "gloo"
    visible_devices_vars = ()
    ray_resource = None

    @property
    def device_count(self) -> int:
        return 1

    def set_device(self, index: int) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def peak_memory_bytes(self) -> int:
        import resource  # max resident set size: the CPU analogue of peak device memory

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    def torch_device(self, index: int | None = 0) -> torch.device:
        import torch

        return torch.device("cpu")

    def training_attention(self, dtype: torch.dtype):
        import torch

        # SDPA's CPU flash-attention backward is ~5x slower than the math kernel in bf16
        # (123 vs 26 ms per layer at 30M params, docs/benchmarks.md); in fp32 they are equal.
        if dtype == torch.bfloat16:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            return sdpa_kernel(SDPBackend.MATH)
        return super().training_attention(dtype)


class CUDAPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    comm_backend = "nccl"
    visible_devices_vars = ("CUDA_VISIBLE_DEVICES",)
    ray_resource = "GPU"

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        import torch

        if dtype == torch.bfloat16 and self.capability is not None:
            return self.capability >= (8, 0)
        return True


class ROCmPlatform(Platform):
    name = "rocm"
    device_type = "cuda"  # HIP builds of torch expose AMD GPUs as "cuda" devices
    comm_backend = "nccl"  # RCCL, reached through torch's "nccl" backend name
    # Ray and the ROCm runtime honour all three; an empty HIP_VISIBLE_DEVICES hides every GPU.
    visible_devices_vars = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
    handoff_devices_var = "HIP_VISIBLE_DEVICES"  # Ray's AMD manager sets it (physical ids when ROCR_* is unset)
    ray_resource = "GPU"

    def job_env_defaults(self) -> list[EnvDefault]:
        return [
            EnvDefault(
                "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO",
                "0",
                "Ray clears HIP_VISIBLE_DEVICES for actors with num_gpus=0 (inference servers "
                "that manage their own GPUs); an empty value hides every GPU on ROCm",
                VERL_6664,
            )
        ]

    def rollout_env_defaults(self, backend: str) -> list[EnvDefault]:
        if backend != "sglang":
            return []
        return [
            EnvDefault(
                "SGLANG_USE_AITER",
                "1",
                "SGLang's AITER kernels are the fast, supported path on AMD GPUs",
                VERL_6664,
            )
        ]


class NPUPlatform(Platform):
    name = "npu"
    device_type = "npu"
    comm_backend = "hccl"
    visible_devices_vars = ("ASCEND_RT_VISIBLE_DEVICES",)
    ray_resource = "NPU"

    def device_module(self):
        import torch
        import torch_npu  # noqa: F401  (registers torch.npu)

        return torch.npu  # type: ignore[attr-defined]
