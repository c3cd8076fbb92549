"""Where a worker picks its device it makes it current, and a colocated engine wakes into memory
the trainer handed back (issue 39, items 4 and 8).

Item 4: an actor that sees more devices than it computes on (a TensorRT-LLM bundle keeps its
node's devices visible) stayed on current device 0, and FSDP2 takes its device from
`current_device()`: every rank's shards landed on cuda:0. Each worker now asks its platform to
`claim_device()` (its reservation's device, `set_device`), so a CUDA, NPU or ROCm platform is
told, here a simulated CUDA platform with reservation [3] whose device calls are recorded.

Item 8: the trainer's cached allocator blocks were never released before a hybrid engine woke
(vLLM maps weights and KV cache back in: out of memory). A real CPU policy worker with a real
colocated engine records the order of its platform's `empty_cache` and the engine's calls.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from polyrl.config import load_config
from polyrl.job import JobConfig
from polyrl.platform.platforms import CPUPlatform, CUDAPlatform
from polyrl.rollout.base import SamplingParams
from polyrl.topology.launch_plan import role_plans

PLUGIN = f"{__file__}:{{}}"


class DeviceCalls:
    """The device module of a simulated accelerator: records what a worker asks of it."""

    def __init__(self, calls: list):
        self.calls = calls

    def set_device(self, index: int) -> None:
        self.calls.append(("set_device", index))

    def empty_cache(self) -> None:
        self.calls.append(("empty_cache",))


class ReservedCUDA(CUDAPlatform):
    """A CUDA node whose Ray reservation gave this actor device 3 of those it sees."""

    def __init__(self, probe):
        super().__init__(probe)
        self.calls: list = []

    def reserved_devices(self) -> list[int]:
        return [3]

    def device_module(self):
        return DeviceCalls(self.calls)


class RecordingCPU(CPUPlatform):
    def __init__(self, probe):
        super().__init__(probe)
        self.calls: list = []

    def empty_cache(self) -> None:
        self.calls.append(("empty_cache",))


def job(platform: str, *overrides: str) -> JobConfig:
    return load_config(JobConfig, overrides=[f"platform={PLUGIN.format(platform)}",
                                             "rollout.max_model_len=64", *overrides])


def test_every_worker_makes_its_reserved_device_current():
    from polyrl.workers.policy import PolicyWorker
    from polyrl.workers.rollout_worker import RolloutWorker
    from polyrl.workers.streaming_replica import StreamingReplica
    from polyrl.workers.teacher import TeacherWorker

    hybrid = job("ReservedCUDA")
    standalone = job("ReservedCUDA", "rollout.placement=standalone")
    streaming = job("ReservedCUDA", "rollout.placement=standalone", "trainer.mode=async")
    workers = [PolicyWorker(hybrid, role_plans(hybrid, 1)["policy"][0], total_steps=1),
               PolicyWorker(standalone, role_plans(standalone, 1)["policy"][0], total_steps=1),
               RolloutWorker(standalone, role_plans(standalone, 1)["rollout"][0]),
               StreamingReplica(streaming, role_plans(streaming, 1)["rollout"][0], mailbox=None)]
    teaching = job("ReservedCUDA", "distill.teacher=builtin:tiny-arith", "distill.placement=standalone")
    workers.append(TeacherWorker(teaching, role_plans(teaching, 1)["teacher"][0]))
    for w in workers:
        assert isinstance(w.platform, CUDAPlatform) and w.platform.name == "cuda"
        assert w.device == torch.device("cuda", 3), type(w).__name__
        assert w.platform.calls == [("set_device", 3)], type(w).__name__


def test_a_cpu_worker_sets_no_device():
    platform = RecordingCPU(None)
    assert platform.claim_device() == torch.device("cpu") and platform.calls == []


@pytest.fixture(scope="module")
def hybrid_worker(tiny_model):
    from polyrl.workers.policy import PolicyWorker

    cfg = job("RecordingCPU", f"model.path={tiny_model}")
    [role] = role_plans(cfg, num_threads=1)["policy"]
    w = PolicyWorker(cfg, role, total_steps=4)
    w.setup(None)
    return w


def test_the_trainers_cached_blocks_are_released_before_the_engine_wakes(hybrid_worker, monkeypatch):
    w = hybrid_worker
    events = w.platform.calls
    engine = w.rollout_engine
    for name in ("wake_up", "sleep", "update_weights"):
        real = getattr(engine, name)
        monkeypatch.setattr(engine, name, lambda *a, _real=real, _name=name, **k: (
            events.append((_name,)), _real(*a, **k))[1])
    events.clear()
    rows = [SimpleNamespace(prompt_ids=[5, 6, 7])]
    w.generate(rows, SamplingParams(n=1, max_tokens=2, temperature=1.0), seeds=[1])
    assert events == [("empty_cache",), ("wake_up",), ("sleep",)]
    events.clear()
    w.sync_weights()  # in place: a sleeping GPU engine wakes its weights to take them
    assert events == [("empty_cache",), ("update_weights",)]
