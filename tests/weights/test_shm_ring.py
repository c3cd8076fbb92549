"""The shared-memory data path of the broadcast transport, on real gloo processes.

1 trainer rank + 2 replicas x 1 rank. After the first transfer no collective runs at all; a
receiver that dies is noticed at once (its FIFO closes), one that stalls at the deadline, and
either way the error names the rank and nobody applies a partial version.
"""

from __future__ import annotations

import os
import select
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from gloo_world import DictEngine, model_weights, run_world, same_weights
from polyrl.distributed.layout import RankLayout, build_groups
from polyrl.distributed.watchdog import default_watchdog
from polyrl.platform import get_platform
from polyrl.distributed.topologies import DISAGGREGATED
from polyrl.weights import WeightSyncConfig, build_transport
from polyrl.weights import bucketing

LAYOUT = RankLayout(num_replicas=2, tensor_parallel_size=1, trainer_world_size=1)
CONFIG = WeightSyncConfig(transport="broadcast", bucket_mb=0.001, timeout_s=3, shm_slot_mb=0.001)
MODES = {"dies": CONFIG, "stalls": CONFIG.model_copy(update={"shm_direct": False})}
"""A dying receiver with direct staging (the default), a stalling one with the chunked ring."""


def count_collectives() -> list[int]:
    """From now on, count this process's gloo broadcasts and all-reduces."""
    calls = [0]
    for name in ("broadcast", "all_reduce"):
        real = getattr(dist, name)

        def counted(*args, _real=real, **kwargs):
            calls[0] += 1
            return _real(*args, **kwargs)

        setattr(dist, name, counted)
    return calls


def one_peer_fails(rank: int, world_size: int, how: str) -> dict:
    """v1 and v2 go through; then receiver rank 2 exits (`how="dies"`) or hangs (`how="stalls"`:
    it stays alive, holding its end of the ring, until ranks 0 and 1 have both given up on v3)
    while rank 0 sends v3."""
    groups = build_groups(LAYOUT, rank, backend=get_platform("cpu").dist_backend(), timeout_s=30)
    transport = build_transport(MODES[how], DISAGGREGATED, group=groups.group("weight_sync"))
    store = default_watchdog().store
    calls = count_collectives()
    out: dict = {"collectives": []}
    engine = DictEngine(model_weights(seed=0))
    for version in (1, 2, 3):
        before = calls[0]
        try:
            if rank == 0:
                transport.send(model_weights(seed=version), version=version)
            elif rank == 2 and version == 3:
                if how == "dies":
                    os._exit(0)
                default_watchdog().beat("scoring rollouts")
                store.wait(["gave-up-0", "gave-up-1"], timedelta(seconds=60))
                return out
            else:
                transport.receive(engine)
        except Exception as exc:
            out["error"] = (type(exc).__name__, str(exc))
            store.set(f"gave-up-{rank}", "1")
        out["collectives"].append(calls[0] - before)
        if version == 2:  # slots, and chunks through them in this version
            out["ring"] = (transport.path.ring.slots, transport.path.ring.position)
    out["engine"] = (engine.weight_version, engine.weights)
    try:
        transport.send(model_weights(seed=4), 4) if rank == 0 else transport.receive(engine)
    except Exception as exc:
        out["after"] = (type(exc).__name__, str(exc))
    return out


@pytest.fixture(scope="module", params=["dies", "stalls"])
def outcome(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"ring-{request.param}")
    return request.param, run_world(one_peer_fails, LAYOUT.world_size, tmp, args=(request.param,))


def test_after_the_first_transfer_no_collective_runs(outcome):
    _, results = outcome
    for rank in (0, 1):
        status, out = results[rank]
        assert status == "ok", out
        first, second = out["collectives"][:2]
        assert first >= 3  # manifest (length + payload) and the shared-memory check
        assert second == 0
    if outcome[0] == "stalls":  # the chunked ring wrapped around within each version
        slots, chunks = results[1][1]["ring"]
        assert chunks > slots


def test_the_sender_names_the_receiver_that_died_or_stalled(outcome):
    how, results = outcome
    kind, message = results[0][1]["error"]
    assert "at step 3" in message and "rank(s) 2" in message and "weight sync v3" in message
    if how == "dies":  # noticed when its FIFO closed (an error), not at the deadline (a timeout)
        assert kind == "CollectiveError" and "exited" in message
    else:  # rank 2 last received v2, then went on to other work
        assert kind == "CollectiveTimeout" and "rank 2: step 2 'scoring rollouts'" in message


def test_the_other_receiver_keeps_the_previous_version(outcome):
    how, results = outcome
    out = results[1][1]
    kind, message = out["error"]
    assert "rank(s) 0 did not arrive" in message and "weight sync v3" in message
    if how == "dies":  # the sender gave up at once and closed the ring
        assert kind == "CollectiveError" and "rank 0 closed its end" in message
    else:  # the sender and this receiver reach the same deadline; either may notice first
        assert kind in ("CollectiveError", "CollectiveTimeout")
    version, weights = out["engine"]
    assert version == 2 and same_weights(weights, model_weights(seed=2))
    assert not list(Path("/dev/shm").glob("polyrl-weights-*"))


def test_a_lost_peer_closes_the_ring_for_good(outcome):
    """The data path was chosen once: after a lost peer the ring is closed and later transfers
    fail at once with the cause, on both sides (no silent fallback onto a broken group)."""
    _, results = outcome
    for rank in (0, 1):
        kind, message = results[rank][1]["after"]
        assert kind == "WeightSyncError" and "ring was closed" in message and "restart" in message

def mark_packing(store) -> None:
    """From now on the sender marks in the store that it began packing the segment."""
    real = bucketing.copy_tensor  # every byte the sender writes goes through it

    def copy_tensor(*args):
        store.set("packing", "1")
        return real(*args)

    bucketing.copy_tensor = copy_tensor


def packed_within(store, window: timedelta) -> bool:
    """Whether the sender starts packing within `window`. It must not while this receiver is
    outside receive(); the window only bounds how long a wrong sender gets to show itself."""
    try:
        store.wait(["packing"], window)
        return True
    except RuntimeError:  # DistStoreError (a RuntimeError): the key never appeared
        return False


class KeepEngine:
    """Keeps the tensors it is given: views of the shared segment with direct staging."""

    weight_version = 0

    def update_weights(self, named, version):
        self.weights, self.weight_version = dict(named), version


def late_receivers(rank: int, world_size: int) -> dict:
    groups = build_groups(LAYOUT, rank, backend=get_platform("cpu").dist_backend(), timeout_s=30)
    transport = build_transport(CONFIG, DISAGGREGATED, group=groups.group("weight_sync"))
    if rank == 0:
        transport.send(model_weights(seed=1), version=1)
        mark_packing(default_watchdog().store)
        transport.send(model_weights(seed=2), version=2)  # starts while receivers still serve v1
        return {}
    engine = KeepEngine()
    transport.receive(engine)
    # serving v1 while the sender is already in send(v2): its manifest is in our FIFO
    poller = select.poll()
    poller.register(transport.path.ring.down, select.POLLIN)
    assert poller.poll(30_000), "the sender never started v2"
    out = {"packed_early": packed_within(default_watchdog().store, timedelta(seconds=1))}
    before = {k: v.clone() for k, v in engine.weights.items()}
    transport.receive(engine)
    after = {k: v.clone() for k, v in engine.weights.items()}
    return {**out, "before": before, "after": after, "version": engine.weight_version}


def test_direct_staging_only_changes_while_every_receiver_is_inside_receive(tmp_path):
    results = run_world(late_receivers, LAYOUT.world_size, tmp_path)
    for rank in (1, 2):
        status, out = results[rank]
        assert status == "ok", out
        assert not out["packed_early"]
        assert same_weights(out["before"], model_weights(seed=1))  # not overwritten early
        assert out["version"] == 2 and same_weights(out["after"], model_weights(seed=2))
