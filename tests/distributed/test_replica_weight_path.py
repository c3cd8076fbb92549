"""The replica-leader weight path of standalone placement, end to end on real gloo groups.

World: 1 trainer rank + 2 rollout replicas x 2 ranks (global ranks 1,2 | 3,4), the production
`RolloutWorker` on each rollout rank with the built-in engine. The trainer sends each new
version over the run's broadcast transport; every rollout rank receives it and hands its share
to its replica's one engine through the replica leader (global rank 1 or 3, never rank 0: R5).
Each leader must then generate exactly the greedy tokens of the trainer's weights. A text model
goes in pieces of rollout.update_bucket_mb; a VLM-shaped config (`vision_config` in config.json)
makes the leader ask its engine about partial loading (the built-in engine cannot), so each
version goes in one piece.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed as dist

from gloo_world import run_world_ok

pytestmark = pytest.mark.slow  # five processes each load a model: ~20 s on 2 cores

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
VERSIONS = (1, 2)


def config(model_path: str):
    from polyrl.config import load_config
    from polyrl.job import JobConfig

    return load_config(JobConfig, overrides=[
        f"model.path={model_path}", "actor.world_size=1", "rollout.placement=standalone",
        "rollout.num_replicas=2", "rollout.tensor_parallel_size=2", "rollout.update_bucket_mb=1",
        "rollout.max_model_len=64", "ray.timeout_s=60"])


def greedy(engine) -> list[list[int]]:
    from polyrl.rollout.base import SamplingParams

    sampling = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    return [outs[0].token_ids for outs in engine.generate_batch(PROMPTS, sampling)]


def perturb(model, version: int) -> None:
    g = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)


def world(rank: int, world_size: int, model_path: str, init: str) -> dict:
    from polyrl.topology.launch_plan import role_plans
    from polyrl.workers.rollout_worker import RolloutWorker, open_transport

    cfg = config(model_path)
    roles = role_plans(cfg, num_threads=1)  # what the launch plan hands each actor
    dist.destroy_process_group()  # the production code joins its own world (init_method)
    if rank != 0:
        worker = RolloutWorker(cfg, roles["rollout"][rank - 1])
        worker.setup(init)
        out = {"leader": worker.leader, "replica": worker.replica}
        for v in VERSIONS:
            out[v] = {"version": worker.receive_weights(), "push": worker.push_stats(),
                      "tokens": greedy(worker.engine) if worker.engine is not None else None,
                      "served": worker.engine.weight_version if worker.engine is not None else None}
        return out
    from transformers import AutoModelForCausalLM

    from polyrl.distributed.layout import build_groups
    from polyrl.rollout.native.engine import NativeEngine

    trainer = roles["policy"][0]
    assert trainer.sends_weights and trainer.layout.world_size == world_size
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=world_size)
    groups = build_groups(trainer.layout, 0, backend="gloo", timeout_s=60)
    transport = open_transport(trainer, cfg.weights, group=groups.group("weight_sync"))
    model = AutoModelForCausalLM.from_pretrained(model_path)
    out = {"initial": greedy(NativeEngine.from_model(model, max_model_len=64))}
    for v in VERSIONS:
        perturb(model, v)
        transport.send([(n, p.detach()) for n, p in model.named_parameters()], v)
        out[v] = greedy(NativeEngine.from_model(model, max_model_len=64))
    return out


@pytest.fixture(scope="module")
def text_model(tmp_path_factory) -> str:
    from tiny_models import build_tiny_model

    # hidden 256: ~4 MB of weights, so each rank's share is several 1 MB pieces
    return build_tiny_model(tmp_path_factory.mktemp("text"), hidden=256)


def run(tmp_path, model_path: str) -> dict:
    out = run_world_ok(world, 5, tmp_path, args=(model_path, f"file://{tmp_path}/rendezvous"),
                       timeout_s=240, backend_timeout_s=120)
    assert [out[r]["leader"] for r in range(1, 5)] == [True, False, True, False]
    assert [out[r]["replica"] for r in range(1, 5)] == [0, 0, 1, 1]
    trainer = out[0]
    for v in VERSIONS:
        assert trainer[v] != trainer["initial"]  # each version changes what greedy decoding says
        for leader in (1, 3):
            assert out[leader][v]["tokens"] == trainer[v], (leader, v)
            assert out[leader][v]["served"] == v
        for r in range(1, 5):
            assert out[r][v]["version"] == v
    return out


def test_two_replicas_of_two_ranks_serve_every_version_through_their_leaders(tmp_path, text_model):
    out = run(tmp_path, text_model)
    for v in VERSIONS:
        pushes = {r: out[r][v]["push"] for r in range(1, 5)}
        assert all(p["partial"] for p in pushes.values())  # text model: no negotiation, pieces
        assert pushes[1]["rounds"] > 1 and pushes[3]["rounds"] > 1
        assert pushes[2]["rounds"] == pushes[4]["rounds"] == 0  # only leaders apply
        # each replica's ranks split the tensors: every tensor reaches its leader once
        assert pushes[1]["tensors"] + pushes[2]["tensors"] == pushes[3]["tensors"] + pushes[4]["tensors"]
        assert pushes[2]["tensors"] > 0


def test_vision_language_config_negotiates_and_goes_in_one_piece(tmp_path, text_model):
    vlm = tmp_path / "vlm"
    shutil.copytree(text_model, vlm)
    cfg = json.loads((vlm / "config.json").read_text())
    cfg["vision_config"] = {"depth": 2, "hidden_size": 32}  # VLM-shaped; the text tower is unchanged
    (vlm / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "world").mkdir()
    out = run(tmp_path / "world", str(vlm))
    for v in VERSIONS:
        for r in range(1, 5):
            assert out[r][v]["push"]["partial"] is False  # the leader asked; the engine said no
        assert out[1][v]["push"]["rounds"] == out[3][v]["push"]["rounds"] == 1
