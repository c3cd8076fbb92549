"""Both ends of every weight transport agree on device and backend (issue 39, item 1), and a
receiver that would stage elsewhere fails in one line instead of waiting for the watchdog.

On GPUs the standalone sync hung: receivers were built with no device and staged on cpu (gloo)
while the sender packed on its stream's cuda device (NCCL). The broadcast now takes the rank's
device on both ends (the workers pass `platform.claim_device()`), its first transfer checks on
the live ranks that they agree, and each manifest names the device its buckets were packed on.

On CPU every tensor is on cpu and every group gloo, so this file makes what a GPU run differs in
visible: real gloo ranks handed the devices a GPU run would give them (never allocated: the check
comes first), and the plan of a simulated CUDA node's hand-offs, both ends, every transport.
"""

from __future__ import annotations

import pytest
import torch

from gloo_world import DictEngine, model_weights, run_world, same_weights
from polyrl.distributed.layout import RankLayout, build_groups
from polyrl.platform import SIMULATED_PROBES, get_platform
from polyrl.platform.platforms import CUDAPlatform
from polyrl.weights import WeightSyncConfig, WeightSyncError
from polyrl.weights.broadcast import BroadcastTransport
from polyrl.weights.base import TensorSpec
from polyrl.weights.bucketing import WeightManifest, plan_buckets
from polyrl.weights.handoff import End, plan_handoffs

LAYOUT = RankLayout(num_replicas=2, tensor_parallel_size=1, trainer_world_size=1)
CUDA = torch.device("cuda", 0)
SCENARIOS = {  # each rank's device: trainer leader, replica 0, replica 1
    "gpu sender, receivers on cpu (the hang)": (CUDA, None, None),
    "one receiver on cuda": (None, None, CUDA),
    "every rank on cpu": (None, None, None),
}


class ReservedNode(CUDAPlatform):
    """A simulated CUDA node on which Ray reserved device 3 for this actor."""

    def reserved_devices(self) -> list[int]:
        return [3]

    def set_device(self, index: int) -> None:
        self.current = index


def cuda_job():
    from polyrl.config import load_config
    from polyrl.job import JobConfig

    return load_config(JobConfig, overrides=["rollout.placement=standalone", "rollout.num_replicas=2"])


def world(rank: int, world_size: int) -> dict:
    from polyrl.topology.launch_plan import role_plans
    from polyrl.workers.rollout_worker import open_transport

    groups = build_groups(LAYOUT, rank, backend="gloo", timeout_s=30)
    group, sender = groups.group("weight_sync"), groups.info.role == "trainer"
    # a transfer deadline far past run_world's 40 s: a rank waiting for the watchdog goes missing
    cfg = WeightSyncConfig(transport="broadcast", bucket_mb=0.001, timeout_s=300)
    out: dict = {}
    for scenario, devices in SCENARIOS.items():
        transport = BroadcastTransport(cfg, group=group, device=devices[rank])
        try:
            if sender:
                transport.send(model_weights(seed=1), version=1)
                out[scenario] = ("ok",)
            else:
                engine = DictEngine(model_weights(seed=0))
                out[scenario] = ("ok", transport.receive(engine), same_weights(engine.weights, model_weights(seed=1)))
        except WeightSyncError as exc:
            out[scenario] = ("WeightSyncError", str(exc))
        finally:
            transport.close()
    # a CUDA run's transports as the workers open them: each end's device from its platform claim
    job = cuda_job()
    plans = role_plans(job, 1)
    role = plans["policy"][0] if sender else plans["rollout"][rank - 1]
    platform = ReservedNode(SIMULATED_PROBES["h100"])
    transport = open_transport(role, job.weights, group=group, mailbox=None, device=platform.claim_device())
    out["cuda plan"] = (type(transport).__name__, transport.sync.device, platform.current)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_world(world, LAYOUT.world_size, tmp_path_factory.mktemp("handoff"))


def test_a_device_mismatch_fails_on_every_rank_in_one_line(ranks):
    for rank in range(3):
        assert ranks[rank][0] == "ok", ranks[rank]  # none waited for the watchdog (or died)
    gpu_sender = "gpu sender, receivers on cpu (the hang)"
    sender, r1, r2 = (ranks[r][1][gpu_sender] for r in range(3))
    assert sender[0] == "WeightSyncError" and "does not stage on cuda, where this sender packs" in sender[1]
    for rank, (kind, message) in ((1, r1), (2, r2)):
        assert kind == "WeightSyncError" and "\n" not in message
        assert f"rank {rank} stages buckets on cpu but the sender packs them on cuda" in message
    one = "one receiver on cuda"
    sender, r1, r2 = (ranks[r][1][one] for r in range(3))
    assert "does not stage on cpu, where this sender packs" in sender[1]
    assert "another receiver does not stage on cpu" in r1[1]
    assert "rank 2 stages buckets on cuda but the sender packs them on cpu" in r2[1]
    assert all("\n" not in m[1] for m in (sender, r1, r2))


def test_agreeing_ranks_still_transfer_after_a_refused_pairing(ranks):
    every = "every rank on cpu"
    assert ranks[0][1][every] == ("ok",)
    assert ranks[1][1][every] == ("ok", 1, True) and ranks[2][1][every] == ("ok", 1, True)


def test_the_workers_give_both_ends_of_a_cuda_run_the_ranks_device(ranks):
    # the policy leader and both rollout ranks, opened as PolicyWorker / RolloutWorker do
    for rank in range(3):
        assert ranks[rank][1]["cuda plan"] == ("BroadcastTransport", torch.device("cuda", 3), 3)


def test_a_manifest_names_its_device_and_a_receiver_elsewhere_refuses_it():
    manifest = plan_buckets([TensorSpec("w", (4, 4), torch.float32)], version=7, bucket_bytes=1 << 20,
                            device_type="cuda")
    assert isinstance(manifest, WeightManifest) and manifest.device_type == "cuda"
    manifest.check_device("cuda")
    with pytest.raises(WeightSyncError, match="rank 5 stages buckets on cpu but the sender packs them "
                                              "on cuda of version 7"):
        manifest.check_device("cpu", "rank 5")


@pytest.mark.parametrize("machine,name,kind,wire", [("h100", "cuda", "cuda", "nccl"),
                                                    ("gb200", "cuda", "cuda", "nccl"),
                                                    ("mi300x", "rocm", "cuda", "nccl"),  # RCCL
                                                    ("ascend910", "npu", "npu", "hccl"),
                                                    ("cpu", "cpu", "cpu", "gloo")])
def test_the_plan_of_every_transport_on_a_simulated_node(machine, name, kind, wire):
    platform = get_platform(name, SIMULATED_PROBES[machine])
    assert platform.device_type == kind
    rows = {(h.transport, h.path): h for h in plan_handoffs(platform)}
    assert all(h.agrees for h in rows.values()), rows
    assert rows["in_place", "engine.update_weights"].sender == End(kind, "none")
    assert rows["broadcast", "backend"].sender == End(kind, wire)
    assert rows["object_store", "object store"].receiver == End("cpu", "ray object store")
    # device bytes never take the shared-memory ring; the CPU's do when every rank can map it
    assert (("broadcast", "shared memory") in rows) is (kind == "cpu")
    # control messages (offer, votes, commit) ride the group's gloo side on every platform
    from polyrl.platform.base import device_backend

    assert device_backend(platform.group_backend(kind), "cpu") == "gloo"
