"""The watchdog: a stalled rank turns a hang into an error naming it and its last step/phase."""

from __future__ import annotations

import queue
import re
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from gloo_world import run_world_ok
from polyrl.distributed.collectives import broadcast_from_leader, gather_to_leader
from polyrl.distributed.waits import RemoteTimeout
from polyrl.distributed.watchdog import (
    CollectiveError,
    CollectiveTimeout,
    Heartbeat,
    Watchdog,
    default_watchdog,
    queue_get,
)

STALL_TIMEOUT_S = 2.0


def stall_world(rank: int, world_size: int) -> dict:
    dog = default_watchdog()
    dog.set_step(7)
    dog.beat("generate")
    # Every rank completes one watched collective first (the counters then agree).
    broadcast_from_leader(torch.ones(2), dist.group.WORLD, timeout_s=10, phase="warm-up")
    if rank == 2:  # the stalled rank: stuck computing rewards until the others gave up on it
        dog.beat("compute rewards")
        dog.store.wait(["gave-up-0", "gave-up-1"], timedelta(seconds=60))
        return {}
    try:
        # A gather needs every rank (a broadcast root may finish without its receivers).
        gather_to_leader(rank, dist.group.WORLD, timeout_s=STALL_TIMEOUT_S, phase="sync before update")
    except CollectiveTimeout as exc:
        return {"error": str(exc), "missing": {r: (hb.step, hb.phase) if hb else None
                                               for r, hb in exc.missing.items()},
                "is_timeout": isinstance(exc, TimeoutError)}
    finally:
        dog.store.set(f"gave-up-{rank}", "1")
    return {"error": None}


@pytest.fixture(scope="module")
def stalled(tmp_path_factory):
    return run_world_ok(stall_world, 3, tmp_path_factory.mktemp("stall"))


def test_stalled_rank_is_named_with_its_step_and_phase(stalled):
    for rank in (0, 1):
        r = stalled[rank]
        assert r["error"] is not None, "the collective should have timed out"
        assert r["missing"] == {2: (7, "compute rewards")}  # rank 0 and 1 arrived: not named
        assert "rank(s) 2 did not arrive" in r["error"]
        assert "step 7 'compute rewards'" in r["error"] and "sync before update" in r["error"]
        assert r["is_timeout"]  # the deadline expired (a dead peer would be a CollectiveError)


def test_not_arrived_reads_the_side_channel():
    store = dist.HashStore()
    a, b, c = (Watchdog(store, r) for r in range(3))
    for dog in (a, b):
        dog.set_step(3)
        dog.beat("update", group_key="g")
    c.beat("rollout")
    missing = a.not_arrived([0, 1, 2], "g", seq=1)
    assert list(missing) == [2] and missing[2].phase == "rollout" and missing[2].step == 0
    assert a.not_arrived([0, 1], "g", seq=1) == {}
    assert list(a.not_arrived([0, 1], "g", seq=2)) == [0, 1]  # nobody reached a 2nd collective


def test_error_messages():
    hb = Heartbeat(rank=4, step=9, phase="reward", time=time.time() - 3)
    assert hb.describe(now=hb.time + 3.25) == "step 9 'reward' (3.2s ago)"
    err = CollectiveTimeout("broadcast", "weight sync", 9, [0, 4, 5], {4: hb, 5: None}, "no completion after 2s")
    text = str(err)
    assert "rank(s) 4, 5 did not arrive" in text and re.search(r"rank 4: step 9 'reward' \(\d+\.\ds ago\)", text)
    assert "rank 5: no heartbeat" in text and isinstance(err, TimeoutError)
    assert isinstance(err, CollectiveError) and isinstance(err, RuntimeError)
    assert "every rank entered it" in str(CollectiveError("gather", "p", 0, [0, 1], {}, "backend error"))


def test_queue_get_has_a_deadline():
    q: queue.Queue = queue.Queue()
    with pytest.raises(RemoteTimeout, match="rollout replica 1"):
        queue_get(q, phase="collect rollouts", timeout_s=0.2, source="rollout replica 1")
    q.put(3)
    assert queue_get(q, phase="collect rollouts", timeout_s=0.2, source="x") == 3
