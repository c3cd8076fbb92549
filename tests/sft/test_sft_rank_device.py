"""An SFT rank takes its device as every worker does (issue 39 item 4, left over in polyrl/sft/launch.py):
the launcher narrows each rank's visible-devices variable to its own device (its reservation, as
Ray's is a worker's), and the rank claims it with `Platform.claim_device()`, the first device it
sees made current. Before, the rank called `set_device(rank)` itself. A simulated CUDA node
records the device calls (tests/workers/test_device_claim.py does the same for the workers);
the two-rank CPU run of tests/sft/test_sft_run.py goes through the same launcher."""

from __future__ import annotations

import pytest
import torch

from polyrl.platform.platforms import CPUPlatform, CUDAPlatform, ROCmPlatform
from polyrl.sft.launch import claim_rank_device, rank_visibility


class DeviceCalls:
    def __init__(self, calls: list):
        self.calls = calls

    def set_device(self, index: int) -> None:
        self.calls.append(("set_device", index))


class RecordingCUDA(CUDAPlatform):
    """A CUDA node outside Ray (no reservation: `reserved_devices()` is [])."""

    def __init__(self):
        super().__init__(None)
        self.calls: list = []

    def device_module(self):
        return DeviceCalls(self.calls)


def test_each_rank_sees_only_its_own_device():
    cuda = RecordingCUDA()
    assert [rank_visibility(cuda, r, {}) for r in range(2)] == [{"CUDA_VISIBLE_DEVICES": "0"},
                                                                 {"CUDA_VISIBLE_DEVICES": "1"}]
    # a run given devices 4 and 6: rank 1 computes on 6
    assert rank_visibility(cuda, 1, {"CUDA_VISIBLE_DEVICES": "4, 6"}) == {"CUDA_VISIBLE_DEVICES": "6"}
    # ROCm: the variable already set is the one narrowed (the others index within it)
    assert rank_visibility(ROCmPlatform(None), 1, {"ROCR_VISIBLE_DEVICES": "2,3"}) == {"ROCR_VISIBLE_DEVICES": "3"}
    assert rank_visibility(CPUPlatform(None), 3, {}) == {}


def test_a_rank_without_a_device_is_one_line():
    with pytest.raises(ValueError) as err:
        rank_visibility(RecordingCUDA(), 2, {"CUDA_VISIBLE_DEVICES": "4,6"})
    assert str(err.value) == ("actor.world_size: sft rank 2 has no device of its own (CUDA_VISIBLE_DEVICES=4,6 "
                              "shows 2); lower actor.world_size to 2 or make more devices visible")


def test_the_rank_claims_the_device_it_was_left_and_makes_it_current():
    cuda = RecordingCUDA()
    assert claim_rank_device(cuda) == torch.device("cuda", 0)
    assert cuda.calls == [("set_device", 0)]  # was set_device(rank): device `rank` of one visible


def test_a_cpu_rank_sets_no_device(monkeypatch):
    cpu = CPUPlatform(None)
    monkeypatch.setattr(cpu, "set_device", lambda index: pytest.fail("set_device on the CPU"))
    assert claim_rank_device(cpu) == torch.device("cpu")
