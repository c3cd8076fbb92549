from __future__ import annotations

import pytest
import torch

from polyrl.platform import (
    SIMULATED_PROBES,
    HardwareProbe,
    PlatformError,
    detect_platform_name,
    get_platform,
    simulated_probe,
)


@pytest.mark.parametrize("hw,name,backend,dev,vis,res", [
    ("cpu", "cpu", "gloo", "cpu", (), None),
    ("h100", "cuda", "nccl", "cuda", ("CUDA_VISIBLE_DEVICES",), "GPU"),
    ("gb200", "cuda", "nccl", "cuda", ("CUDA_VISIBLE_DEVICES",), "GPU"),
    ("gb300", "cuda", "nccl", "cuda", ("CUDA_VISIBLE_DEVICES",), "GPU"),
    ("mi300x", "rocm", "nccl", "cuda",
     ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"), "GPU"),
    ("ascend910", "npu", "hccl", "npu", ("ASCEND_RT_VISIBLE_DEVICES",), "NPU"),
])
def test_simulated_hardware(hw, name, backend, dev, vis, res):
    probe = SIMULATED_PROBES[hw]
    assert detect_platform_name(probe) == name
    p = get_platform(None, probe) if hw != "cpu" else get_platform("cpu", probe)
    assert (p.name, p.dist_backend(), p.device_type, p.visible_devices_vars, p.ray_resource) == \
        (name, backend, dev, vis, res)


def test_capabilities():
    assert get_platform(None, SIMULATED_PROBES["h100"]).capability == (9, 0)
    assert get_platform(None, SIMULATED_PROBES["gb200"]).capability == (10, 0)
    assert get_platform(None, SIMULATED_PROBES["gb300"]).capability == (10, 3)
    assert get_platform("cuda", simulated_probe("cuda", (10, 3))).capability == (10, 3)


def test_smi_fallback_for_cpu_only_actor_on_gpu_node():
    # A Ray actor with num_gpus=0 sees no devices through torch, but the node has GPUs.
    assert detect_platform_name(HardwareProbe(smi_tool="nvidia-smi", smi_device_count=8)) == "cuda"
    assert detect_platform_name(HardwareProbe(smi_tool="rocm-smi", smi_device_count=8)) == "rocm"
    assert detect_platform_name(HardwareProbe(smi_tool="npu-smi", smi_device_count=8)) == "npu"
    assert detect_platform_name(HardwareProbe(smi_tool="nvidia-smi", smi_device_count=0)) == "cpu"


def test_ray_options_and_noset():
    cuda = get_platform(None, SIMULATED_PROBES["h100"])
    assert cuda.ray_actor_options(1) == {"num_cpus": 1, "num_gpus": 1}
    npu = get_platform(None, SIMULATED_PROBES["ascend910"])
    assert npu.ray_actor_options(2) == {"num_cpus": 1, "resources": {"NPU": 2}}
    rocm = get_platform(None, SIMULATED_PROBES["mi300x"])
    assert rocm.ray_noset_envvars() == {
        "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
        "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "1",
        "RAY_EXPERIMENTAL_NOSET_ROCR_VISIBLE_DEVICES": "1",
    }
    assert get_platform("cpu").ray_actor_options(0, num_cpus=2) == {"num_cpus": 2}


def test_real_machine_is_cpu_here():
    p = get_platform(None)
    assert p.name == "cpu"
    assert p.torch_device() == torch.device("cpu")


def test_env_var_choice(monkeypatch):
    monkeypatch.setenv("POLYRL_PLATFORM", "cpu")
    assert get_platform(None).name == "cpu"
    monkeypatch.setenv("POLYRL_PLATFORM", "tpu")
    with pytest.raises(PlatformError, match="unknown platform 'tpu'; registered platforms: cpu, cuda, rocm, npu"):
        get_platform(None)


def test_unavailable_platform_is_an_error_naming_detection():
    with pytest.raises(PlatformError, match="platform 'cuda' was requested but is not available here: detected 'cpu'"):
        get_platform("cuda")


def test_third_party_platform_registers():
    from polyrl.platform import PLATFORMS
    from polyrl.platform.platforms import CPUPlatform

    class Fancy(CPUPlatform):
        name = "fancy"

    PLATFORMS.register("fancy-test", Fancy)
    assert get_platform("fancy-test", SIMULATED_PROBES["cpu"]).name == "fancy"


@pytest.mark.parametrize("hw,environ,assigned,expected", [
    ("h100", {"CUDA_VISIBLE_DEVICES": "5"}, ["5"], [0]),             # Ray narrowed visibility
    ("h100", {"CUDA_VISIBLE_DEVICES": "4,5,6"}, ["6", "4"], [2, 0]),
    ("h100", {}, ["3"], [3]),                                          # whole node visible
    ("mi300x", {"HIP_VISIBLE_DEVICES": "2,3"}, ["3"], [1]),
    ("ascend910", {"ASCEND_RT_VISIBLE_DEVICES": "7"}, ["7"], [0]),
])
def test_device_index_comes_from_the_reservation(hw, environ, assigned, expected):
    # issue 15: an actor's device is the one Ray reserved for it, never a hard-coded 0
    platform = get_platform(None, SIMULATED_PROBES[hw])
    assert platform.local_device_indices(assigned, environ) == expected


def test_reserved_device_not_visible_is_an_error():
    from polyrl.platform import PlatformError

    platform = get_platform(None, SIMULATED_PROBES["h100"])
    with pytest.raises(PlatformError, match="Ray assigned device.s. 2 but this process sees only '0,1'"):
        platform.local_device_indices(["2"], {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert get_platform(None, SIMULATED_PROBES["cpu"]).reserved_devices() == []


def test_planning_imports_no_torch():
    """Planning (dry run, placement, env plans, the simulated cluster's probe actors) runs without
    importing torch: every probe actor would otherwise pay seconds of import on start-up."""
    import subprocess
    import sys

    code = ("import sys, polyrl.platform, polyrl.envplan, polyrl.placement\n"
            "from polyrl.platform import SIMULATED_PROBES, get_platform\n"
            "get_platform('rocm', SIMULATED_PROBES['mi300x']).reserved_devices()\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("hw,device_backend", [("h100", "cuda:nccl"), ("mi300x", "cuda:nccl"),
                                               ("ascend910", "npu:hccl")])
def test_group_backend_carries_cpu_tensors_on_accelerators(hw, device_backend):
    """Process groups of accelerator ranks map CPU tensors to gloo: the pickled objects, sizes,
    manifests and votes of distributed/collectives.py and the weight sync are CPU tensors, which
    an NCCL / HCCL-only group refuses (issue #28, fix 1). torch parses the string as it will at
    init_process_group / new_group."""
    from torch.distributed.distributed_c10d import BackendConfig

    p = get_platform(None, SIMULATED_PROBES[hw])
    backend = p.group_backend(p.device_type)
    assert backend == f"cpu:gloo,{device_backend}"
    mapped = BackendConfig(backend).get_device_backend_map()
    assert mapped["cpu"] == "gloo" and mapped[p.device_type] == p.dist_backend()
    assert get_platform("cpu").group_backend("cpu") == "gloo"
