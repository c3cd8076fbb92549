"""scripts/gpu_profile.py (`scripts/gpu_check.sh --profile`): its CPU form runs and prints every
field the GPU form prints; the FLOP count and the kernel table's CUDA rule."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
BLOCKER = """
import os, sys
from pathlib import Path
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("ray", "pyarrow", "vllm", "sglang", "tensorrt_llm"):
            raise ImportError(f"{name} is blocked: a lent device has none of it")
sys.meta_path.insert(0, Blocked())
Path(__file__).parent.parent.joinpath("blocked").touch()
"""


@pytest.fixture(scope="module")
def gpu_profile():
    spec = importlib.util.spec_from_file_location("gpu_profile", REPO / "scripts" / "gpu_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_training_flops_count_six_n_and_causal_attention(gpu_profile):
    # 6 N per token over 2 + 4 tokens, plus 12 L d (s^2 / 2) per sample: 12 x 2 x 4 x (2 + 8)
    assert gpu_profile.training_flops(10, 2, 4, torch.tensor([2, 4])) == 6 * 10 * 6 + 12 * 2 * 4 * 10


def test_cuda_kernel_table_counts_each_kernel_once(gpu_profile):
    """On CUDA a CPU op's self device time is its kernels' time: the table takes the device
    events only, or every kernel would count twice."""
    from torch.autograd import DeviceType

    def avg(key, device_type, self_device_ms, self_cpu_ms):
        return SimpleNamespace(key=key, device_type=device_type, count=1, self_device_time_total=self_device_ms * 1e3,
                               self_cpu_time_total=self_cpu_ms * 1e3)

    prof = SimpleNamespace(key_averages=lambda: [avg("aten::mm", DeviceType.CPU, 3.0, 0.5),
                                                 avg("sm90_xmma_gemm_bf16", DeviceType.CUDA, 3.0, 0.0),
                                                 avg("Memcpy HtoD", DeviceType.CUDA, 1.0, 0.0)])
    top, total = gpu_profile.top_kernels(prof, torch.device("cuda", 0))
    assert total == 4.0 and [r["name"] for r in top] == ["sm90_xmma_gemm_bf16", "Memcpy HtoD"]
    assert top[0]["share"] == 0.75
    top, total = gpu_profile.top_kernels(prof, torch.device("cpu"))  # CPU: ops by CPU time
    assert total == 0.5 and [r["name"] for r in top] == ["aten::mm"]


@pytest.mark.slow  # a tiny Qwen2's packed bf16 update and decode, each profiled: ~15-35 s on 2 busy cores
@pytest.mark.timeout(300)
def test_cpu_form_through_gpu_check(tmp_path):
    """Run as a lent device runs it: Ray, pyarrow and the GPU engines cannot be imported (the
    device image has torch and what scripts/gpu_carry.sh carries, none of those)."""
    out = tmp_path / "profile.json"
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--profile", "--device", "cpu", "--json", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    starts = [next(i for i, line in enumerate(lines) if line.startswith(p))
              for p in ("device: cpu", "train: ", "top training ops by CPU time:", "decode: ",
                        "top decode ops by CPU time:", "reference: ")]
    assert starts == sorted(starts)  # the GPU form's order
    train_line = lines[starts[1]]
    assert "bf16, packing on" in train_line and "MFU n/a" in train_line  # no known CPU peak
    reference = lines[starts[5]]
    assert "MFU >= 40% on H100/H200 at 0.5B-1.5B with packing: n/a" in reference
    assert "NeMo-RL (published, end to end, Llama-3.1-8B on 16 H100): 1,562 tokens/s/GPU" in reference

    summary = json.loads(out.read_text())
    assert summary == json.loads(lines[-1])
    train, decode = summary["train"], summary["decode"]
    assert train["packing"] == "on" and train["packed"] is True and train["mfu"] is None
    assert train["tokens"] > train["samples"] > 0 and train["ms_per_update"] > 0 and train["tflops"] > 0
    assert decode["tokens_per_s"] > 0 and decode["new_tokens"] == 8 and decode["prompts"] == 4
    for table in (train["top"], decode["top"]):
        assert 0 < len(table) <= 12
        assert [r["ms"] for r in table] == sorted((r["ms"] for r in table), reverse=True)
        assert 0 < sum(r["share"] for r in table) <= 1.0 + 1e-6
    assert any(r["name"] in ("aten::mm", "aten::addmm") for r in train["top"])  # the update's matmuls
    assert summary["reference"] == {"goal_mfu": 0.4, "goal": "n/a", "nemo_rl_tokens_per_s_per_gpu": 1562.0}
    assert (tmp_path / "blocked").exists()  # the blocker ran in the script's process
