"""What one rank of the vision-language training tests runs (imported by gloo_world's ranks):
one GRPO update of the tiny Qwen2-VL (or another family of tests/tiny_vl.py) on its shard of an
image batch."""

from __future__ import annotations

import torch.distributed as dist

from polyrl.algorithms import AlgorithmConfig
from polyrl.algorithms.off_policy import OffPolicyConfig
from polyrl.batch import shard
from polyrl.platform import get_platform
from polyrl.training import build_engine, vlm
from polyrl.training.config import ActorConfig
from polyrl.workers.actor import PPOActor
from tests.tiny_vl import build_tiny_vl, tiny_vl_processor

ORDER = [0, 2, 1, 1]
"""Samples of test_vlm_forward.image_batch: on two ranks, rank 0 holds the image samples and
rank 1 text-only ones (the vision tower's collectives must still line up)."""


def build(strategy: str, rank: int, world_size: int, train_vision_tower: bool, horizon: int | None = 4,
          packing: str = "on", family: str = "qwen2_vl"):
    platform = get_platform("cpu")
    device = platform.torch_device(0)
    model = build_tiny_vl(seed=0, family=family)
    vlm.set_vision_training(model, train_vision_tower)
    cfg = ActorConfig(strategy=strategy, lr=1e-2, micro_batch_tokens=96, packing=packing)
    engine = build_engine(model, cfg, platform, device, rank=rank, world_size=world_size,
                          group=dist.group.WORLD if dist.is_initialized() else None, horizon=horizon)
    return engine, PPOActor(engine, cfg, AlgorithmConfig(), OffPolicyConfig().resolve(on_policy=True), device)


def train(rank: int, world_size: int, strategy: str, train_vision_tower: bool = True,
          family: str = "qwen2_vl") -> dict:
    """One update on this rank's shard; the metrics and the full weights after it."""
    from tests.training.test_vlm_forward import image_batch

    engine, actor = build(strategy, rank, world_size, train_vision_tower, family=family)
    batch = image_batch(tiny_vl_processor()).select(ORDER)
    metrics = actor.update(shard(batch, world_size)[rank], 1, False)
    weights = {k: v.detach().clone() for k, v in engine.named_weights()}
    return {"metrics": metrics, "weights": weights}
