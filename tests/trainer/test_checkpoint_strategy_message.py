"""Resuming an fsdp2 checkpoint under ddp on another world size names the strategy (issue 41,
poor 10): the message once named only actor.world_size, whose change fsdp2 allows."""

from __future__ import annotations

import pytest

from polyrl.trainer.checkpoint import CheckpointError, check_compatible


def _cfg(strategy: str, world_size: int) -> dict:
    return {"model": {"path": "m"}, "actor": {"strategy": strategy, "world_size": world_size}}


def test_fsdp2_checkpoint_under_ddp_on_another_world_size_names_the_strategy():
    with pytest.raises(CheckpointError) as info:
        check_compatible(_cfg("fsdp2", 4), _cfg("ddp", 2))
    message = str(info.value)
    assert "resume with actor.strategy=fsdp2" in message and "actor.world_size: checkpoint has" not in message


def test_fsdp2_reshards_and_ddp_still_needs_its_world_size():
    assert "actor.world_size" in check_compatible(_cfg("fsdp2", 4), _cfg("fsdp2", 2))
    with pytest.raises(CheckpointError, match="actor.world_size: checkpoint has 4, this run has 2"):
        check_compatible(_cfg("ddp", 4), _cfg("ddp", 2))
