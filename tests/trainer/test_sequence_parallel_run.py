"""`actor.sequence_parallel_size` through `polyrl train`'s own launch: the driver must hand the
same shard to both ranks of a sequence-parallel group (polyrl/topology/base.py passes the mesh
to PolicyGroup). Without it the ranks get different samples and the first update stops."""

from __future__ import annotations

import pytest

import len_reward_job
from len_reward_job import read
from polyrl.trainer.loop import Trainer

FSDP2_PACKED = ("actor.world_size=2", "actor.strategy=fsdp2", "actor.packing=on", "data.val_files=[]",
                "trainer.val_before_train=false", "algorithm.use_kl_loss=true")


@pytest.mark.slow  # two 2-rank runs
def test_two_ranks_split_over_the_sequence_train_like_two_data_ranks(ray_session, tiny_model, arith_files,
                                                                     tmp_path):
    for name, sp in (("dp", 1), ("sp", 2)):
        Trainer(len_reward_job.job(tiny_model, arith_files, tmp_path / name, *FSDP2_PACKED,
                                   f"actor.sequence_parallel_size={sp}")).fit()
    dp, sp = ([r for r in read(tmp_path / name) if "actor/loss" in r] for name in ("dp", "sp"))
    assert len(dp) == len(sp) == 2
    for a, b in zip(dp, sp):
        for key in ("actor/loss", "actor/grad_norm", "actor/kl_loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
