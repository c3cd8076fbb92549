"""Bucketed broadcast weight sync on real gloo processes: 1 trainer rank + 2 replicas x 1 rank.

Versions go through in order; a sender whose weight stream fails midway (v2: a gather raises)
or dies midway (v4) leaves every receiver serving the previous version, bit for bit.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from gloo_world import DictEngine, model_weights, run_world, same_weights
from polyrl.distributed.layout import RankLayout, build_groups
from polyrl.platform import get_platform
from polyrl.distributed.topologies import DISAGGREGATED
from polyrl.weights import WeightSyncConfig, WeightSyncError, build_transport
from polyrl.weights.base import WeightStream

LAYOUT = RankLayout(num_replicas=2, tensor_parallel_size=1, trainer_world_size=1)

MODES = {  # data path -> (shared_memory, shm_direct); ~1 KB buckets and ring slots: several each
    "direct": (True, True), "ring": (True, False), "backend-only": (False, False)}


def config(mode: str) -> WeightSyncConfig:
    shared_memory, direct = MODES[mode]
    return WeightSyncConfig(transport="broadcast", bucket_mb=0.001, timeout_s=3, shm_slot_mb=0.001,
                            shared_memory=shared_memory, shm_direct=direct)


FAILING = "model.layers.0.mlp.up_proj.weight"
"""The tensor whose gather fails (or kills the sender): the second of the stream, in bucket 1."""


def failing_stream(weights: dict, die: bool) -> WeightStream:
    """`weights` as a weight stream whose FAILING tensor cannot be produced: what a gather from
    shards looks like when it raises (or the trainer process dies in it)."""
    def produce():
        for name, tensor in weights.items():
            if name == FAILING:
                if die:
                    os._exit(3)  # the trainer process dies mid-transfer
                raise OSError("gathering a shard failed")
            yield name, tensor
    return WeightStream([(n, tuple(t.shape), t.dtype) for n, t in weights.items()], produce())


def world(rank: int, world_size: int, out_dir: str, mode: str) -> dict:
    groups = build_groups(LAYOUT, rank, backend=get_platform("cpu").dist_backend(), timeout_s=30)
    transport = build_transport(config(mode), DISAGGREGATED, group=groups.group("weight_sync"))
    if groups.info.role == "trainer":
        stats = [transport.send(model_weights(seed=1), version=1)]
        try:
            transport.send(failing_stream(model_weights(seed=2), die=False), version=2)
        except WeightSyncError as exc:
            stats.append(str(exc))
        stats.append(transport.send(model_weights(seed=3), version=3))
        stats.append(transport.uses_shared_memory)
        Path(out_dir, "sender-stats.pkl").write_bytes(pickle.dumps(stats))
        transport.send(failing_stream(model_weights(seed=4), die=True), version=4)
        return stats
    engine = DictEngine(model_weights(seed=0))
    out: dict = {"applied": []}
    for _ in range(4):
        try:
            out["applied"].append(transport.receive(engine))
        except Exception as exc:
            out["applied"].append((type(exc).__name__, str(exc)))
        out[f"after{len(out['applied'])}"] = (engine.weight_version,
                                                {k: v.clone() for k, v in engine.weights.items()})
    out["stats"] = transport.last_stats
    return out


@pytest.fixture(scope="module", params=list(MODES))
def results(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("broadcast")
    results = run_world(world, LAYOUT.world_size, tmp, args=(str(tmp), request.param))
    results["mode"] = request.param
    sender = tmp / "sender-stats.pkl"
    results["sender"] = pickle.loads(sender.read_bytes()) if sender.exists() else None
    return results


def test_versions_arrive_in_every_replica(results):
    for rank in (1, 2):
        status, out = results[rank]
        assert status == "ok", out
        assert out["applied"][0] == 1 and out["applied"][2] == 3
        version, weights = out["after3"]
        assert version == 3 and same_weights(weights, model_weights(seed=3))
        assert out["stats"].version == 3 and out["stats"].num_buckets > 3


def test_sender_reports_bytes_seconds_and_rate(results):
    assert results[0] == ("missing",)  # it died on purpose during v4
    v1, failure, v3, used_shm = results["sender"]
    assert used_shm is MODES[results["mode"]][0]
    assert not list(Path("/dev/shm").glob("polyrl-weights-*"))  # unlinked, even after the crash
    nbytes = sum(t.numel() * t.element_size() for t in model_weights(seed=1).values())
    for stats, version in ((v1, 1), (v3, 3)):
        assert stats.version == version and stats.transport == "broadcast"
        assert stats.bytes == nbytes and stats.num_tensors == 6 and stats.num_buckets > 3
        assert stats.seconds > 0 and stats.bytes_per_s == pytest.approx(stats.bytes / stats.seconds)
    # direct staging is one chunk; 1 KB ring slots: the 2 KB table fills chunks 0-1
    where = {"direct": f"chunk 0 ('{FAILING}')", "ring": f"chunk 1 ('{FAILING}')",
             "backend-only": "bucket 1"}[results["mode"]]
    assert f"failed at {where}" in failure and "gathering a shard failed" in failure, failure
    assert "keep their previous weights" in failure


def test_a_sender_failing_midway_leaves_the_previous_version_serving(results):
    for rank in (1, 2):
        out = results[rank][1]
        kind, message = out["applied"][1]
        assert kind == "WeightSyncError" and "aborted version 2" in message
        version, weights = out["after2"]
        assert version == 1 and same_weights(weights, model_weights(seed=1))


def test_a_sender_dying_midway_leaves_the_previous_version_serving(results):
    for rank in (1, 2):
        out = results[rank][1]
        kind, message = out["applied"][3]
        assert kind in ("CollectiveError", "CollectiveTimeout"), message
        # the step is the version in flight on both sides, not the watchdog's initial 0
        assert "at step 4 'weight sync v4" in message and "rank 0: step 4 'weight sync v4" in message
        version, weights = out["after4"]
        assert version == 3 and same_weights(weights, model_weights(seed=3))
