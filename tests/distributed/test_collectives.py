"""Group collectives on real gloo processes: 1 trainer rank + 2 rollout replicas x 2 ranks.

Every replica's broadcast completes with its own leader's value; partial-loading negotiation
reaches every rank of each replica; gathers land on the group's leader.
"""

from __future__ import annotations

import pytest
import torch

from gloo_world import run_world_ok
from polyrl.distributed.collectives import (
    broadcast_from_leader,
    gather_to_leader,
    is_vision_language,
    negotiate_partial_loading,
)
from polyrl.distributed.layout import RankLayout, build_groups
from polyrl.platform import get_platform

LAYOUT = RankLayout(num_replicas=2, tensor_parallel_size=2, trainer_world_size=1)


class Engine:
    """Replica 0's engine can load weights in parts, replica 1's cannot."""

    def __init__(self, replica: int):
        self.replica = replica

    def supports_partial_loading(self) -> bool:
        return self.replica == 0


def world(rank: int, world_size: int) -> dict:
    groups = build_groups(LAYOUT, rank, backend=get_platform("cpu").dist_backend(), timeout_s=30)
    out: dict = {"leaders": dict(groups.leaders), "info": groups.info}
    if groups.info.role == "trainer":
        return out
    replica = groups.group("replica")
    value = {"from": rank, "replica": groups.info.replica} if groups.info.is_replica_leader else None
    out["object"] = broadcast_from_leader(value, replica, timeout_s=10, phase="test object")
    t = torch.full((3,), float(rank)) if groups.info.is_replica_leader else torch.zeros(3)
    out["tensor"] = broadcast_from_leader(t, replica, timeout_s=10, phase="test tensor").tolist()
    engine = Engine(groups.info.replica)
    vlm = {"model_type": "qwen2_5_vl", "vision_config": {"depth": 2}}
    out["partial_vlm"] = negotiate_partial_loading(engine, vlm, replica, timeout_s=10)
    out["partial_text"] = negotiate_partial_loading(engine, {"model_type": "qwen2"}, replica, timeout_s=10)
    out["gathered"] = gather_to_leader(f"rank{rank}", groups.group("dp"), timeout_s=10, phase="test gather")
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_world_ok(world, LAYOUT.world_size, tmp_path_factory.mktemp("collectives"))


def test_leaders_come_from_torch_and_match_the_layout(results):
    assert results[0]["leaders"] == {"trainer": 0, "weight_sync": 0}
    for rank in (3, 4):
        assert results[rank]["leaders"]["replica"] == 3
        assert results[rank]["leaders"]["weight_sync"] == 0
    assert results[2]["leaders"]["dp"] == 2 and results[4]["leaders"]["dp"] == 2


def test_broadcast_from_leader_completes_in_every_replica(results):
    for rank, leader in {1: 1, 2: 1, 3: 3, 4: 3}.items():
        assert results[rank]["object"] == {"from": leader, "replica": (leader - 1) // 2}
        assert results[rank]["tensor"] == [float(leader)] * 3


def test_partial_loading_answer_is_the_replica_leaders(results):
    assert [results[r]["partial_vlm"] for r in (1, 2, 3, 4)] == [True, True, False, False]
    assert all(results[r]["partial_text"] for r in (1, 2, 3, 4))


def test_gather_lands_on_the_group_leader(results):
    assert results[1]["gathered"] == ["rank1", "rank3"] and results[3]["gathered"] is None
    assert results[2]["gathered"] == ["rank2", "rank4"] and results[4]["gathered"] is None


def test_vision_language_detection():
    class Cfg:
        vision_config = object()

    assert is_vision_language(Cfg()) and is_vision_language({"vision_config": {}})
    assert not is_vision_language({"model_type": "qwen2"}) and not is_vision_language(None)
    assert not is_vision_language({"vision_config": None})


def test_text_models_answer_yes_without_a_collective(monkeypatch):
    # any rank query or collective raises here (whether or not an earlier test in this process
    # left a process group behind): a text model's answer needs neither
    from polyrl.distributed import collectives

    def no_collective(*_, **__):
        raise AssertionError("a text model's answer took a collective")

    monkeypatch.setattr(collectives.dist, "get_rank", no_collective)
    monkeypatch.setattr(collectives, "broadcast_from_leader", no_collective)
    assert negotiate_partial_loading(Engine(1), {"model_type": "qwen2"}, group=None) is True
    with pytest.raises(AssertionError, match="took a collective"):  # a VLM does ask
        negotiate_partial_loading(Engine(1), {"model_type": "qwen2_vl", "vision_config": {}}, group=None)
