"""Byte-budget flushing and the replica-leader weight push, on real gloo process groups.

World: 2 rollout replicas x 2 ranks (global ranks 0,1 | 2,3). Replica 1's leader is global rank
2: a push that assumed rank 0 would hang replica 1 (R5). Ranks hold different amounts of weights,
so their piece counts differ and the rounds must still line up.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "distributed"))

from gloo_world import run_world_ok  # noqa: E402
from polyrl.distributed.layout import RankLayout, build_groups  # noqa: E402
from polyrl.platform import get_platform  # noqa: E402
from polyrl.rollout.base import WeightUpdateError  # noqa: E402
from polyrl.rollout.engines.weight_flush import (  # noqa: E402
    iter_flushes,
    merge_device_payloads,
    push_to_replica,
    tensor_nbytes,
)

LAYOUT = RankLayout(num_replicas=2, tensor_parallel_size=2)
BUDGET = 1000  # bytes
VLM = {"model_type": "qwen2_5_vl", "vision_config": {"depth": 2}}
TEXT = {"model_type": "qwen2"}


# --- pure -----------------------------------------------------------------------------------------

def named(*sizes: int, dtype=torch.float32):
    return [(f"w{i}", torch.zeros(n, dtype=dtype)) for i, n in enumerate(sizes)]


def test_pieces_respect_the_budget_and_keep_order():
    pieces = list(iter_flushes(named(100, 100, 50, 200, 10), budget_bytes=1000))  # 400,400,200,800,40 B
    assert [[n for n, _ in p] for p in pieces] == [["w0", "w1", "w2"], ["w3", "w4"]]
    assert all(sum(tensor_nbytes(t) for _, t in p) <= 1000 for p in pieces)


def test_a_tensor_over_budget_travels_alone_and_none_means_one_piece():
    pieces = list(iter_flushes(named(10, 1000, 10), budget_bytes=100))
    assert [[n for n, _ in p] for p in pieces] == [["w0"], ["w1"], ["w2"]]
    assert len(list(iter_flushes(named(10, 1000, 10), budget_bytes=None))) == 1
    assert list(iter_flushes([], budget_bytes=100)) == []


def test_bytes_count_the_dtype():
    pieces = list(iter_flushes(named(300, 300, dtype=torch.bfloat16), budget_bytes=1200))
    assert len(pieces) == 1  # 600 + 600 bytes


def test_bad_inputs_are_named():
    with pytest.raises(WeightUpdateError, match="parameter 'x': expected a tensor"):
        list(iter_flushes([("x", [1.0])], 100))
    with pytest.raises(ValueError, match="budget must be >= 1"):
        list(iter_flushes(named(1), 0))


def test_merge_rejects_two_ranks_on_one_device():
    assert merge_device_payloads([{"gpu-a": 1}, None, {"gpu-b": 2}]) == {"gpu-a": 1, "gpu-b": 2}
    with pytest.raises(WeightUpdateError, match="device gpu-a"):
        merge_device_payloads([{"gpu-a": 1}, {"gpu-a": 2}])


def test_single_process_replica():
    applied, finished = [], []
    result = push_to_replica(named(100, 100, 100), make_payload=lambda p: {"dev": [n for n, _ in p]},
                             apply=applied.append, finish=lambda: finished.append(1),
                             budget_bytes=800, hf_config=TEXT)
    assert applied == [{"dev": ["w0", "w1"]}, {"dev": ["w2"]}] and finished == [1]
    assert (result.rounds, result.tensors, result.bytes, result.partial) == (2, 3, 1200, True)


# --- gloo: 2 replicas x 2 ranks -------------------------------------------------------------------

class RecordingEngine:
    """What the replica leader's engine saw (a list, not an engine: the push only calls back)."""

    def __init__(self, partial: bool):
        self.partial = partial
        self.asked = 0

    def supports_partial_loading(self) -> bool:
        self.asked += 1
        return self.partial


def rank_weights(rank: int) -> list[tuple[str, torch.Tensor]]:
    # rank r holds 2 + 2r tensors of 120 floats (480 B): 1, 2, 3, 4 pieces at a 1000 B budget
    return [(f"r{rank}.w{i}", torch.full((120,), float(rank * 10 + i))) for i in range(2 + 2 * rank)]


def world(rank: int, world_size: int, hf_config, engine_partial: bool) -> dict:
    groups = build_groups(LAYOUT, rank, backend=get_platform("cpu").dist_backend(), timeout_s=30)
    replica = groups.group("replica")
    leader = groups.info.is_replica_leader
    engine = RecordingEngine(engine_partial) if leader else None
    applied: list[dict] = []
    finished: list[int] = []

    def make_payload(piece):
        return {f"dev{rank}": [(n, t.clone()) for n, t in piece]}

    result = push_to_replica(
        rank_weights(rank), make_payload=make_payload,
        apply=applied.append if leader else None, finish=(lambda: finished.append(1)) if leader else None,
        budget_bytes=BUDGET, group=replica, hf_config=hf_config, engine=engine, timeout_s=20)
    return {"leader": leader, "applied": applied, "finished": len(finished),
            "asked": engine.asked if engine else None, "result": result}


def _run(tmp_path, hf_config, engine_partial):
    return run_world_ok(world, LAYOUT.world_size, tmp_path, args=(hf_config, engine_partial))


def _received(out: dict) -> dict[str, float]:
    got: dict[str, float] = {}
    for merged in out["applied"]:
        for handles in merged.values():
            for name, tensor in handles:
                assert name not in got, f"{name} applied twice"
                got[name] = float(tensor[0])
    return got


def test_text_model_pushes_in_pieces_to_each_replica_leader(tmp_path):
    out = _run(tmp_path, TEXT, engine_partial=False)
    assert [out[r]["leader"] for r in range(4)] == [True, False, True, False]
    for leader, members in ((0, (0, 1)), (2, (2, 3))):
        expected = {n: float(t[0]) for r in members for n, t in rank_weights(r)}
        assert _received(out[leader]) == expected
        assert out[leader]["finished"] == 1
        assert out[leader]["asked"] == 0  # text model: nobody asks the engine
        # each round: per device, within budget; as many rounds as the busiest rank has pieces
        for merged in out[leader]["applied"]:
            for handles in merged.values():
                assert sum(tensor_nbytes(t) for _, t in handles) <= BUDGET
        assert len(out[leader]["applied"]) == len(rank_weights(members[1])) // 2
    for r in range(4):
        assert out[r]["result"].partial is True
        assert out[r]["result"].tensors == len(rank_weights(r))
    assert all(not out[r]["applied"] and out[r]["finished"] == 0 for r in (1, 3))


def test_vlm_without_partial_loading_sends_one_piece_after_the_leader_asks(tmp_path):
    out = _run(tmp_path, VLM, engine_partial=False)
    for leader, members in ((0, (0, 1)), (2, (2, 3))):
        assert out[leader]["asked"] == 1
        assert len(out[leader]["applied"]) == 1  # everything at once
        assert set(out[leader]["applied"][0]) == {f"dev{r}" for r in members}
        assert len(_received(out[leader])) == sum(len(rank_weights(r)) for r in members)
    assert all(out[r]["result"].partial is False for r in range(4))


def test_vlm_with_partial_loading_uses_pieces(tmp_path):
    out = _run(tmp_path, VLM, engine_partial=True)
    assert out[2]["asked"] == 1 and len(out[2]["applied"]) == 4  # rank 3: 8 tensors -> 4 pieces
    assert all(out[r]["result"].partial is True for r in range(4))
