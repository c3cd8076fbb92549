"""The bug class of verl PR 5701 (R5): a replica broadcasting from global rank 0.

Two replicas of two ranks. Replica 0 is busy generating; replica 1 negotiates partial weight
loading on its own. Through the group leader (global rank 2) the answer arrives; the naive
variant, "broadcast from src=0", waits for global rank 0 (replica 0's leader, busy elsewhere)
and, instead of hanging, times out naming ranks 0 and 1 and what they were doing. So the test
setup really does catch the bug class.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from gloo_world import run_world_ok
from polyrl.distributed.collectives import negotiate_partial_loading
from polyrl.distributed.layout import RankLayout, build_groups
from polyrl.distributed.watchdog import CollectiveTimeout, default_watchdog
from polyrl.platform import get_platform

LAYOUT = RankLayout(num_replicas=2, tensor_parallel_size=2)
VLM = {"model_type": "qwen2_5_vl", "vision_config": {"depth": 2}}
NAIVE_TIMEOUT_S = 2.0


class Engine:
    def supports_partial_loading(self) -> bool:
        return True


def naive_negotiate(engine, group) -> bool:
    """The field's bug: leader and source are "rank 0" (a global rank)."""
    flag = torch.tensor([int(engine.supports_partial_loading()) if dist.get_rank() == 0 else 0])
    default_watchdog().run(lambda: dist.broadcast(flag, src=0, group=group, async_op=True),
                           group=group, phase="negotiate partial weight loading",
                           timeout_s=NAIVE_TIMEOUT_S)
    return bool(flag.item())


def world(rank: int, world_size: int) -> dict:
    groups = build_groups(LAYOUT, rank, backend=get_platform("cpu").dist_backend(), timeout_s=30)
    dog = default_watchdog()
    dog.set_step(5)
    if groups.info.replica == 0:  # busy generating until replica 1 is through with its sync
        dog.beat("generate")
        dog.store.wait([f"replica-1-done-{r}" for r in (2, 3)], timedelta(seconds=60))
        return {}
    out: dict = {}
    try:
        out.update(replica_one(groups))
    finally:
        dog.store.set(f"replica-1-done-{rank}", "1")
    return out


def replica_one(groups) -> dict:
    """Replica 1 syncs on its own while replica 0 stays busy (it waits for this to finish)."""
    out: dict = {}
    out["leader"] = negotiate_partial_loading(Engine(), VLM, groups.group("replica"), timeout_s=5)
    # src=0 inside the replica's own group: torch refuses at once (rank 0 is not a member).
    try:
        naive_negotiate(Engine(), groups.group("replica"))
    except Exception as exc:
        out["naive_in_group"] = (type(exc).__name__, str(exc))
    # src=0 over the whole world: the silent version, which would hang without a deadline.
    try:
        out["naive"] = naive_negotiate(Engine(), dist.group.WORLD)
    except CollectiveTimeout as exc:
        out["naive"] = ("timeout", str(exc), sorted(exc.missing),
                        {r: hb.phase if hb else None for r, hb in exc.missing.items()})
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_world_ok(world, LAYOUT.world_size, tmp_path_factory.mktemp("leader-bug"))


def test_broadcast_from_the_group_leader_completes(results):
    for rank in (2, 3):  # while replica 0 is still busy: it waits for replica 1 to finish
        assert results[rank]["leader"] is True


def test_broadcast_from_global_rank_zero_times_out_naming_replica_zero(results):
    for rank in (2, 3):
        kind, message, missing, phases = results[rank]["naive"]
        assert kind == "timeout"
        assert missing == [0, 1] and phases == {0: "generate", 1: "generate"}
        assert "rank(s) 0, 1 did not arrive" in message and "step 5 'generate'" in message
        assert "negotiate partial weight loading" in message


def test_src_zero_in_a_group_without_rank_zero_is_refused(results):
    for rank in (2, 3):
        kind, message = results[rank]["naive_in_group"]
        assert "not part of group" in message, (kind, message)
